"""The MLP activations of the fused experts op, by the names transformers configs use (`hidden_act`)."""

import torch

ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_pytorch_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
    "relu": torch.relu,
}
