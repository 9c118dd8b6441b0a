"""The TurboQuant matrix product as one torch custom op.

`torch.ops.turboquant.linear(x, packed, norms, codebook, signs1, signs2, group_size, in_features)`
computes `x @ W.T` for a weight stored as packed codebook indices and per-group
norms, without rebuilding W:

    <w_group, x_group> = norm * <codebook[idx], D2 . H . D1 . x_group>

so the activations are rotated once per group (`rotate_groups`) and then
multiplied by the codebook values (`codebook_matmul`). The plain-torch
implementation below is the CPU path and the oracle for the GPU kernels,
which register themselves for CUDA under the same op name. The codebook and
the signs are tensors, not constants, so other rotations and per-module
codebooks fit the same product.
"""

from __future__ import annotations

import torch

from . import codec

# Bound on the float32 weight block the reference materialises per step.
_REFERENCE_BLOCK_ELEMENTS = 1 << 22


def rotate_activations(x: torch.Tensor, signs1: torch.Tensor, signs2: torch.Tensor, group_size: int) -> torch.Tensor:
    """`(M, in)` activations to `(M, n_groups*G)` float32, zero-padded and rotated per group."""
    m, in_features = x.shape
    padded = -(-in_features // group_size) * group_size
    xf = x.to(torch.float32)
    if padded != in_features:
        xf = torch.nn.functional.pad(xf, (0, padded - in_features))
    return codec.rotate_groups(xf.view(m, -1, group_size), signs1, signs2).view(m, padded)


def codebook_matmul(
    x_rot: torch.Tensor, packed: torch.Tensor, norms: torch.Tensor, codebook: torch.Tensor, group_size: int
) -> torch.Tensor:
    """`(M, n_groups*G)` rotated activations times the packed weight: `(M, rows)` float32."""
    rows, n_groups = norms.shape
    out = torch.empty(x_rot.shape[0], rows, dtype=torch.float32, device=x_rot.device)
    block = max(1, _REFERENCE_BLOCK_ELEMENTS // (n_groups * group_size))
    for start in range(0, rows, block):
        stop = min(rows, start + block)
        w = codec.rotated_weight(
            packed[start * n_groups : stop * n_groups], norms[start:stop], codebook, group_size
        )
        out[:, start:stop] = x_rot @ w.T
    return out


@torch.library.custom_op("turboquant::linear", mutates_args=())
def turboquant_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    norms: torch.Tensor,
    codebook: torch.Tensor,
    signs1: torch.Tensor,
    signs2: torch.Tensor,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    """`x[..., in_features] @ W.T` -> `[..., rows]` in x's dtype (float32 accumulation)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features)
    x_rot = rotate_activations(x2, signs1.float(), signs2.float(), group_size)
    y = codebook_matmul(x_rot, packed, norms.float(), codebook.float(), group_size)
    return y.to(x.dtype).reshape(*lead, norms.shape[0])


@turboquant_linear.register_fake
def _(x, packed, norms, codebook, signs1, signs2, group_size, in_features):
    return x.new_empty(*x.shape[:-1], norms.shape[0])


from . import kernels as _kernels  # noqa: E402,F401  (registers the Triton CUDA kernels for this op)
