"""The TurboQuant codec in plain torch: rotation, Lloyd-Max rounding, packing.

No transformers import. Quantization runs on whatever device the weight is
on, always in float32. Tensor layout follows the tq3_native format: a weight
`W[..., out, in]` is flattened to `(rows, in)`, zero-padded on the right to a
multiple of G, and split into groups of G along the input dimension.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from . import format as fmt


@lru_cache(maxsize=None)
def _hadamard_pm1_cpu(n: int) -> torch.Tensor:
    if n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


_DEVICE_CACHE: dict = {}


def hadamard_matrix(n: int, device=None) -> torch.Tensor:
    """Sylvester Walsh-Hadamard matrix of order n with +-1 entries (not normalised)."""
    key = ("hadamard", n, str(torch.device(device) if device is not None else "cpu"))
    if key not in _DEVICE_CACHE:
        _DEVICE_CACHE[key] = _hadamard_pm1_cpu(n).to(device)
    return _DEVICE_CACHE[key]


def rotate_groups(x: torch.Tensor, signs1: torch.Tensor, signs2: torch.Tensor) -> torch.Tensor:
    """Apply y = D2 . H . D1 . x to every group (the last dim, of size G) of float32 `x`."""
    g = x.shape[-1]
    h = hadamard_matrix(g, x.device)
    return ((x * signs1) @ h) / math.sqrt(g) * signs2


def unrotate_groups(y: torch.Tensor, signs1: torch.Tensor, signs2: torch.Tensor) -> torch.Tensor:
    """Inverse of `rotate_groups`: x = D1 . H . D2 . y."""
    g = y.shape[-1]
    h = hadamard_matrix(g, y.device)
    return ((y * signs2) @ h) / math.sqrt(g) * signs1


# ---------------------------------------------------------------------------
# packing: LSB-first bit stream per group (2/3/4 bits), base-3 digits for ternary
# ---------------------------------------------------------------------------

def _pack_unit(n_levels: int) -> tuple[int, int, int]:
    """(bits per index, indices per unit, bytes per unit) for whole-byte units of the bit stream."""
    b = int(math.log2(n_levels))
    per_unit = 8 // math.gcd(b, 8)
    return b, per_unit, per_unit * b // 8


def pack_indices(indices: torch.Tensor, n_levels: int) -> torch.Tensor:
    """Pack `(n, G)` integer indices into `(n, bytes_per_group)` uint8."""
    n, g = indices.shape
    if n_levels == 3:
        width = -(-g // 5) * 5
        trits = torch.zeros(n, width, dtype=torch.int32, device=indices.device)
        trits[:, :g] = indices
        weights = torch.tensor([1, 3, 9, 27, 81], dtype=torch.int32, device=indices.device)
        return (trits.view(n, -1, 5) * weights).sum(-1).to(torch.uint8)
    b, per_unit, unit_bytes = _pack_unit(n_levels)
    idx = indices.to(torch.int32).view(n, g // per_unit, per_unit)
    shifts = torch.arange(per_unit, dtype=torch.int32, device=indices.device) * b
    words = (idx << shifts).sum(-1)  # at most 24 bits: fits int32
    byte_shifts = torch.arange(unit_bytes, dtype=torch.int32, device=indices.device) * 8
    out = (words.unsqueeze(-1) >> byte_shifts) & 0xFF
    return out.to(torch.uint8).view(n, -1)


def unpack_indices(packed: torch.Tensor, n_levels: int, group_size: int) -> torch.Tensor:
    """Inverse of `pack_indices`: `(n, bytes_per_group)` uint8 to `(n, G)` int64."""
    n = packed.shape[0]
    if n_levels == 3:
        powers = torch.tensor([1, 3, 9, 27, 81], dtype=torch.int32, device=packed.device)
        digits = (packed.to(torch.int32).unsqueeze(-1) // powers) % 3
        return digits.view(n, -1)[:, :group_size].long()
    b, per_unit, unit_bytes = _pack_unit(n_levels)
    units = packed.to(torch.int32).view(n, -1, unit_bytes)
    byte_shifts = torch.arange(unit_bytes, dtype=torch.int32, device=packed.device) * 8
    words = (units << byte_shifts).sum(-1)
    shifts = torch.arange(per_unit, dtype=torch.int32, device=packed.device) * b
    return ((words.unsqueeze(-1) >> shifts) & (n_levels - 1)).view(n, group_size).long()


def _chunk_code_table(n_levels: int, device) -> torch.Tensor:
    """Indices decoded from every possible chunk code: (codes, indices per chunk), int64.

    Chunks are whole bytes for 2/4 bits and ternary, and 12-bit halves of each 3-byte unit for 3 bits,
    so that one table lookup decodes several indices at once.
    """
    key = ("chunk_codes", n_levels, str(torch.device(device) if device is not None else "cpu"))
    if key not in _DEVICE_CACHE:
        if n_levels == 3:
            codes = torch.arange(243)
            table = torch.stack([(codes // 3**i) % 3 for i in range(5)], -1)
        else:
            b = int(math.log2(n_levels))
            chunk_bits = 12 if b == 3 else 8
            codes = torch.arange(2**chunk_bits)
            table = torch.stack([(codes >> (b * i)) & (n_levels - 1) for i in range(chunk_bits // b)], -1)
        _DEVICE_CACHE[key] = table.to(device)
    return _DEVICE_CACHE[key]


def decode_values(packed: torch.Tensor, codebook: torch.Tensor, group_size: int) -> torch.Tensor:
    """`codebook[idx]` for packed groups `(n, bytes_per_group)`: float `(n, G)`, via one table lookup per chunk."""
    n_levels = codebook.numel()
    lut = codebook[_chunk_code_table(n_levels, packed.device)]  # (codes, indices per chunk)
    n = packed.shape[0]
    if n_levels == 8:
        u = packed.view(n, -1, 3).to(torch.int32)
        word = u[..., 0] | (u[..., 1] << 8) | (u[..., 2] << 16)
        codes = torch.stack([word & 0xFFF, word >> 12], -1)
        return lut[codes.long()].view(n, group_size)
    return lut[packed.long()].view(n, -1)[:, :group_size]


# ---------------------------------------------------------------------------
# quantize / dequantize one weight tensor
# ---------------------------------------------------------------------------

# Rows per chunk keep the float32 temporaries of a large tensor to a few hundred MB.
_CHUNK_ELEMENTS = 1 << 24


def quantize_weight(
    weight: torch.Tensor,
    bits=3,
    group_size: int = 128,
    name: str = "weight",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `W[..., out, in]` to (packed uint8 `(rows*n_groups, bpg)`, norms float32 `(rows, n_groups)`).

    Runs on `weight.device` in float32. Raises ValueError naming `name` if the
    weight holds NaN or Inf.
    """
    n_levels = fmt.levels_for_bits(bits)
    group_size = fmt.check_group_size(group_size)
    if weight.dim() < 2:
        raise ValueError(f"{name}: expected a weight of at least 2 dimensions, got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point weight, got {weight.dtype}")
    in_features = weight.shape[-1]
    w2d = weight.reshape(-1, in_features)
    rows = w2d.shape[0]
    n_groups = -(-in_features // group_size)
    device = weight.device
    s1, s2 = fmt.signs(group_size, device)
    centroids = fmt.codebook(n_levels, group_size, device)
    bounds = (centroids[:-1] + centroids[1:]) / 2
    packed = torch.empty(rows * n_groups, fmt.bytes_per_group(n_levels, group_size), dtype=torch.uint8, device=device)
    norms = torch.empty(rows, n_groups, dtype=torch.float32, device=device)
    chunk_rows = max(1, _CHUNK_ELEMENTS // (n_groups * group_size))
    for start in range(0, rows, chunk_rows):
        stop = min(rows, start + chunk_rows)
        block = w2d[start:stop].to(torch.float32)
        if not torch.isfinite(block).all():
            bad = (~torch.isfinite(block)).nonzero()[0]
            raise ValueError(
                f"{name}: weight contains NaN or Inf (first at row {start + int(bad[0])}, column {int(bad[1])}); "
                "refusing to quantize it"
            )
        if n_groups * group_size != in_features:
            block = torch.nn.functional.pad(block, (0, n_groups * group_size - in_features))
        groups = block.reshape(-1, group_size)
        n = torch.linalg.vector_norm(groups, dim=1)
        unit = groups / torch.where(n > 0, n, torch.ones_like(n)).unsqueeze(1)
        y = rotate_groups(unit, s1, s2)
        idx = torch.searchsorted(bounds, y.contiguous())
        # The rotation is orthogonal, so the reconstruction norm is the norm of the chosen centroids.
        r = torch.linalg.vector_norm(centroids[idx], dim=1)
        norms[start:stop] = (n / torch.where(r > 0, r, torch.ones_like(r))).view(stop - start, n_groups)
        packed[start * n_groups : stop * n_groups] = pack_indices(idx, n_levels)
    return packed, norms


def dequantize_weight(
    packed: torch.Tensor,
    norms: torch.Tensor,
    in_features: int,
    group_size: int,
    shape: tuple | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rebuild the weight from packed indices and norms (float32 math, padding dropped)."""
    group_size = fmt.check_group_size(group_size)
    rows, n_groups = norms.shape
    n_levels = fmt.levels_from_geometry(packed.shape[1], group_size)
    device = packed.device
    s1, s2 = fmt.signs(group_size, device)
    centroids = fmt.codebook(n_levels, group_size, device)
    out = torch.empty(rows, in_features, dtype=dtype, device=device)
    chunk_rows = max(1, _CHUNK_ELEMENTS // (n_groups * group_size))
    for start in range(0, rows, chunk_rows):
        stop = min(rows, start + chunk_rows)
        values = decode_values(packed[start * n_groups : stop * n_groups], centroids, group_size)
        w = unrotate_groups(values, s1, s2) * norms[start:stop].reshape(-1, 1).float()
        out[start:stop] = w.view(stop - start, -1)[:, :in_features].to(dtype)
    return out.view(shape) if shape is not None else out


def rotated_weight(packed: torch.Tensor, norms: torch.Tensor, codebook: torch.Tensor, group_size: int) -> torch.Tensor:
    """The weight in the rotated basis, `(rows, n_groups*G)` float32: norm * codebook[idx] per group."""
    rows, n_groups = norms.shape
    values = decode_values(packed, codebook, group_size)
    return (values.view(rows, n_groups, group_size) * norms.unsqueeze(-1)).view(rows, -1)
