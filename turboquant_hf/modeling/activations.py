"""The MLP activations of the fused experts op, by the names transformers configs use (`hidden_act`), and the gated
product `act(gate) * up` of a gate/up projection in each layout transformers stores (gate rows then up rows, or
interleaved), including gpt-oss's clamped SwiGLU."""

import torch

ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_pytorch_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
    "relu": torch.relu,
}

# gpt-oss's experts: `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with `g = clamp(gate, max=limit)`
# (transformers has no `hidden_act` name for it: the experts' `_apply_gate` computes it)
CLAMPED_SWIGLU = "clamped_swiglu"

# every activation the experts op computes
EXPERT_ACTIVATIONS = (*ACTIVATIONS, CLAMPED_SWIGLU)


def check_activation(activation: str, limit: float) -> None:
    """Raise ValueError for an activation the experts op does not compute, or a clamped SwiGLU without a positive
    limit."""
    if activation not in EXPERT_ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not supported (supported: {', '.join(EXPERT_ACTIVATIONS)})")
    if activation == CLAMPED_SWIGLU and not limit > 0:
        raise ValueError(f"{CLAMPED_SWIGLU} needs a positive limit, got {limit!r}")


def split_gate_up(gate_up: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) columns of a `(rows, 2I)` gate/up product: the first and second halves, or with `interleaved`
    the even and odd columns."""
    if interleaved:
        return gate_up[..., 0::2], gate_up[..., 1::2]
    inter = gate_up.shape[-1] // 2
    return gate_up[..., :inter], gate_up[..., inter:]


def gated(gate_up: torch.Tensor, activation: str, interleaved: bool = False, alpha: float = 1.0,
          limit: float = 0.0) -> torch.Tensor:
    """`act(gate) * up` of a `(rows, 2I)` gate/up product -> `(rows, I)` (see `split_gate_up`); for
    `CLAMPED_SWIGLU`, gpt-oss's clamped form with its `alpha` and `limit`."""
    gate, up = split_gate_up(gate_up, interleaved)
    if activation == CLAMPED_SWIGLU:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return ACTIVATIONS[activation](gate) * up
