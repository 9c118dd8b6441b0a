"""Registration of the Triton kernels as the CUDA implementations of the `turboquant` torch ops.

Importing `turboquant_hf.kernels` (this module through the package's `__init__`) registers the Triton kernels in `linear.py` and `moe.py` as the
CUDA implementations of `torch.ops.turboquant.linear` and `torch.ops.turboquant.moe_experts` (`modeling.modules`
imports it after `modeling.ops`; ops does not import it). Registration needs only that the `triton` package can be found;
triton itself is imported lazily, on the first call with CUDA tensors, so
importing this package on a machine without triton or without CUDA works and
leaves the plain-torch reference as the implementation for every device. The
reference stays the CPU implementation and the oracle in any case.

Set `TURBOQUANT_DISABLE_TRITON=1` before importing `turboquant_hf` to keep the
reference for CUDA tensors too.
"""

from __future__ import annotations

import importlib.util

import torch

__all__ = ["register", "registered"]

_registered = False
_LIB = None


def _cuda_linear(x, packed, norms, codebook, signs1, signs2, group_size, in_features):
    from . import linear

    return linear.linear(x, packed, norms, codebook, signs1, signs2, group_size, in_features)


def _cuda_hadamard_linear(x, packed, norms, codebook, signs, group_size, in_features):
    # whole-row Hadamard rotation (turboquant-mlx checkpoints) in torch, then the same codebook product
    from turboquant_hf.format import hadamard

    from . import linear

    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features)
    if x2.shape[0] == 0:
        return x.new_empty(*lead, norms.shape[0])
    x_rot = hadamard.rotate_rows(x2.float(), signs.float())
    if codebook.numel() == 8 and group_size < 32:
        # (3-bit groups of 16 are not whole units of the kernels: the reference product serves them)
        from turboquant_hf.modeling import ops

        y = ops.codebook_matmul(x_rot, packed, norms.float(), codebook.float(), group_size).to(x.dtype)
    else:
        y = linear.product(x_rot, packed, norms, codebook, group_size, x.dtype)
    return y.reshape(*lead, norms.shape[0])


def _cuda_moe_experts(hidden, top_k_index, top_k_weights, gate_up_packed, gate_up_norms, gate_up_codebook,
                      down_packed, down_norms, down_codebook, signs1, signs2, group_size, num_experts, activation,
                      gate_up_bias=None, down_bias=None, interleaved=False, alpha=1.0, limit=0.0):
    from . import moe

    return moe.moe_experts(hidden, top_k_index, top_k_weights, gate_up_packed, gate_up_norms, gate_up_codebook,
                           down_packed, down_norms, down_codebook, signs1, signs2, group_size, num_experts,
                           activation, gate_up_bias, down_bias, interleaved, alpha, limit)


def _cuda_hadamard_moe_experts(hidden, top_k_index, top_k_weights, gate_packed, gate_norms, gate_codebook,
                               gate_signs, up_packed, up_norms, up_codebook, up_signs, down_packed, down_norms,
                               down_codebook, down_signs, num_experts, activation):
    from . import moe

    return moe.hadamard_moe_experts(hidden, top_k_index, top_k_weights, gate_packed, gate_norms, gate_codebook,
                                    gate_signs, up_packed, up_norms, up_codebook, up_signs, down_packed,
                                    down_norms, down_codebook, down_signs, num_experts, activation)


def registered() -> bool:
    """True when the Triton kernels serve `torch.ops.turboquant.linear` for CUDA tensors."""
    return _registered


def register() -> bool:
    """Register the Triton kernels for the CUDA dispatch key (idempotent). Returns `registered()`."""
    global _registered
    if _registered:
        return True
    from turboquant_hf import settings

    if settings.triton_disabled():
        return False
    if importlib.util.find_spec("triton") is None:
        return False
    if not hasattr(torch.ops.turboquant, "linear"):
        # the op is defined in turboquant_hf.modeling.ops (which does not import this package)
        from turboquant_hf.modeling import ops  # noqa: F401
    global _LIB
    # (a Library's own `impl`: `torch.library.register_kernel` would put a Python wrapper in front of every call)
    _LIB = torch.library.Library("turboquant", "IMPL")
    _LIB.impl("linear", _cuda_linear, "CUDA")
    _LIB.impl("linear_nograd", _cuda_linear, "CUDA")
    _LIB.impl("moe_experts", _cuda_moe_experts, "CUDA")
    _LIB.impl("moe_experts_nograd", _cuda_moe_experts, "CUDA")
    if hasattr(torch.ops.turboquant, "hadamard_linear"):
        _LIB.impl("hadamard_linear", _cuda_hadamard_linear, "CUDA")
        _LIB.impl("hadamard_moe_experts", _cuda_hadamard_moe_experts, "CUDA")
    _registered = True
    return True


try:
    register()
except Exception as exc:  # noqa: BLE001 (never break importing the package: the reference path still works)
    import warnings

    warnings.warn(f"turboquant_hf.kernels: Triton kernels not registered ({exc!r}); using the torch reference")
