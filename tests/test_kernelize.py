"""TurboQuant models kernelized with Hugging Face's `kernels` library from a local kernel repository, offline.

The kernel repository is written at test time: noarch build variants `torch-cpu` and `torch-cuda` (kernels loads
the one matching the installed torch), each a `metadata.json` with a SHA-256 digest of its files, an `__init__.py`
and a `layers` module. Its layers replace the forward of transformers' `RMSNorm` and `SiLU` hub-kernel layers
(`use_kernel_forward_from_hub`) with the same computation in plain torch, and count their calls.

A tiny quantized Llama (and Qwen3-MoE) is kernelized through `kernels.kernelize` and through transformers'
`set_use_kernels`; checked: the repository's forwards ran (the expected number of calls), every TurboQuant module
is the same module with its packed integer tensors and its own forward, the logits are equal, greedy `generate`
gives the same tokens, and nothing tried to open a network connection. On the CPU (`device="cpu"`) and, with a
CUDA device, on the GPU.

Transformers' `KernelConfig` refuses the CPU (its `KERNELS_SUPPORTED_DEVICE_TYPES` has no "cpu"), so on the CPU
transformers kernelizes under `kernels.use_kernel_mapping`; on the GPU the local repository goes through
`KernelConfig(..., use_local_kernel=True)` given to `set_use_kernels`. (In transformers 5.25,
`from_pretrained(use_kernels=True, kernel_config=...)` with a local repository raises AttributeError in
`KernelConfig.create_compatible_mapping`: the mapping's values are `(repo, metadata)` tuples by then.)
"""

import base64
import hashlib
import json
import socket
import textwrap

import pytest
import torch
from conftest import spread_weights_
from transformers import AutoModelForCausalLM
from transformers.utils import is_kernels_available

from turboquant_hf import TurboQuantConfig, TurboQuantLinear
from turboquant_hf.modeling.modules import TurboQuantExperts

if not is_kernels_available():  # transformers' hub-kernel layers need a `kernels` release in its supported range
    pytest.skip("needs the `kernels` package, in the versions transformers supports", allow_module_level=True)

from kernels import (  # noqa: E402
    LocalLayerRepository,
    Mode,
    get_kernelized_layers,
    kernelize,
    use_kernel_mapping,
)

LAYERS = ("RMSNorm", "SiLU")

# The repository's `layers` module: each class has no constructor and no members beyond `forward` (what
# `kernels` accepts as a replacement) and runs on the module it replaces (its `weight`, `variance_epsilon`).
LAYERS_PY = textwrap.dedent('''
    import collections

    import torch
    from torch import nn

    CALLS = collections.Counter()


    class RMSNorm(nn.Module):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            CALLS["RMSNorm"] += 1
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return self.weight * hidden_states.to(input_dtype)


    class SiLU(nn.Module):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            CALLS["SiLU"] += 1
            return nn.functional.silu(input)
''')


@pytest.fixture(scope="module")
def kernel_repo(tmp_path_factory):
    """A local kernel repository: `build/torch-{cpu,cuda}/` with `metadata.json`, `__init__.py`, `layers.py`."""
    repo = tmp_path_factory.mktemp("tq_test_layers")
    files = {"__init__.py": "from . import layers\n", "layers.py": LAYERS_PY}
    for backend in ("cpu", "cuda"):
        variant = repo / "build" / f"torch-{backend}"
        variant.mkdir(parents=True)
        for name, text in files.items():
            (variant / name).write_text(text)
        digest = {name: base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()
                  for name, text in files.items()}
        (variant / "metadata.json").write_text(json.dumps({
            "name": "tq-test-layers", "id": f"tq_test_layers_{repo.name}_{backend}", "version": 1,
            "license": "Apache-2.0", "python-depends": [], "backend": {"type": backend},
            "digest": {"algorithm": "sha256", "files": digest},
        }))
    return repo


@pytest.fixture
def connections(monkeypatch):
    """Hub offline, and every attempt to open a connection recorded (and refused)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network access in a test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    return attempts


def mapping(repo, device: str, layers=LAYERS) -> dict:
    return {name: {device: LocalLayerRepository(repo_path=repo, layer_name=name)} for name in layers}


def quantized_modules(model) -> dict:
    return {n: m for n, m in model.named_modules() if isinstance(m, (TurboQuantLinear, TurboQuantExperts))}


def packed_buffers(module) -> list:
    return [b for n, b in module.named_buffers() if n.endswith("tq_packed")]


def run_and_compare(model, repo, kernelize_model, ids):
    """Logits and greedy tokens before and after `kernelize_model(model)`; the checks of the module docstring.
    Returns the calls of each repository layer in the kernelized forward."""
    before = quantized_modules(model)
    assert before
    buffers = {n: packed_buffers(m) for n, m in before.items()}
    with torch.no_grad():
        ref = model(ids).logits
    ref_tokens = model.generate(ids[:1], max_new_tokens=4, do_sample=False)

    kernelize_model(model)

    decorated = {n: m for n, m in model.named_modules() if getattr(type(m), "kernel_layer_name", None) in LAYERS}
    kernelized = get_kernelized_layers(model)
    assert decorated and kernelized.layers.keys() == decorated.keys() and not kernelized.funcs
    for name, m in decorated.items():  # each runs the repository's forward, bound to it
        layer = kernelized.layers[name]
        assert layer.module is m and layer.repo == LocalLayerRepository(repo_path=repo, layer_name=m.kernel_layer_name)
        assert m.forward.__self__ is m and m.forward.__func__.__module__.startswith("tq_test_layers_")
    calls = next(iter(decorated.values())).forward.__func__.__globals__["CALLS"]

    after = quantized_modules(model)
    assert after.keys() == before.keys()
    for name, m in after.items():  # the same modules, their packed tensors untouched, their own forward
        assert m is before[name] and "forward" not in m.__dict__, name
        # (packed integers: the published uint8 bytes, or on a GPU the int32 words of the runtime layout)
        assert all(b.dtype in (torch.uint8, torch.int32) for b in packed_buffers(m)) and buffers[name], name
        assert all(a is b for a, b in zip(packed_buffers(m), buffers[name])), name

    calls.clear()
    with torch.no_grad():
        out = model(ids).logits
    counted = dict(calls)
    assert torch.equal(out, ref)
    tokens = model.generate(ids[:1], max_new_tokens=4, do_sample=False)
    assert torch.equal(tokens, ref_tokens)
    assert sum(calls.values()) > sum(counted.values())  # generate ran the repository's layers too
    return counted


@pytest.fixture
def llama(tiny_llama_dir):
    def load(**kwargs):
        kwargs.setdefault("dtype", torch.float32)
        return AutoModelForCausalLM.from_pretrained(
            tiny_llama_dir, quantization_config=TurboQuantConfig(bits=4, group_size=64), use_kernels=False, **kwargs)
    return load


IDS = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(0))
LLAMA_CALLS = {"RMSNorm": 2 * 2 + 1, "SiLU": 2}  # 2 layers x (input, post-attention) + final norm; 2 MLPs


@pytest.mark.parametrize("api", ["kernels", "transformers"])
def test_kernelize_llama_on_cpu(kernel_repo, connections, llama, monkeypatch, api):
    model = llama()

    def by_kernels(m):
        with use_kernel_mapping(mapping(kernel_repo, "cpu"), inherit_mapping=False):
            kernelize(m, mode=Mode.INFERENCE, device="cpu")

    def by_transformers(m):
        monkeypatch.setenv("USE_HUB_KERNELS", "1")
        with use_kernel_mapping(mapping(kernel_repo, "cpu"), inherit_mapping=False):
            m.set_use_kernels(True, mode=Mode.INFERENCE)  # adds transformers' mapping, which has no CPU kernels
        assert m.use_kernels

    calls = run_and_compare(model, kernel_repo, by_kernels if api == "kernels" else by_transformers, IDS)
    assert calls == LLAMA_CALLS
    assert connections == []


def test_kernelize_qwen3_moe_on_cpu(kernel_repo, connections, tmp_path):
    from test_moe import qwen3_moe

    torch.manual_seed(0)
    spread_weights_(qwen3_moe()).to(torch.bfloat16).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=TurboQuantConfig(bits=4, group_size=64),
                                                 dtype=torch.float32, use_kernels=False)
    assert sum(isinstance(m, TurboQuantExperts) for m in model.modules()) == 2

    def by_kernels(m):
        with use_kernel_mapping(mapping(kernel_repo, "cpu"), inherit_mapping=False):
            kernelize(m, mode=Mode.INFERENCE, device="cpu")

    calls = run_and_compare(model, kernel_repo, by_kernels, IDS)
    # 2 layers x (input, post-attention, q, k) + final norm; the experts' activation is TurboQuantExperts' own
    assert calls == {"RMSNorm": 2 * 4 + 1}
    assert connections == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("api", ["kernels", "transformers"])
def test_kernelize_llama_on_cuda(kernel_repo, connections, llama, monkeypatch, api):
    from transformers import KernelConfig

    model = llama(device_map="cuda", dtype=torch.bfloat16)

    def by_kernels(m):
        with use_kernel_mapping(mapping(kernel_repo, "cuda"), inherit_mapping=False):
            kernelize(m, mode=Mode.INFERENCE, device="cuda")

    def by_transformers(m):
        monkeypatch.setenv("USE_HUB_KERNELS", "1")
        config = KernelConfig({name: {"cuda": f"{kernel_repo}:{name}"} for name in LAYERS}, use_local_kernel=True)
        with use_kernel_mapping({}):  # (set_use_kernels registers transformers' mapping: dropped on leaving)
            m.set_use_kernels(True, kernel_config=config, mode=Mode.INFERENCE)
        assert m.use_kernels

    calls = run_and_compare(model, kernel_repo, by_kernels if api == "kernels" else by_transformers, IDS.cuda())
    assert calls == LLAMA_CALLS
    assert connections == []
