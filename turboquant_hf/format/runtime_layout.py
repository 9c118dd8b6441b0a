"""The runtime layout of packed ternary, 2-, 3- and 4-bit indices: the same indices, rearranged for the GPU kernels.

Checkpoints always hold the published tq3_native layout (`codec.pack_indices`: every group an LSB-first
bit stream of uint8, or base-3 digits for ternary). On a CUDA device the packed tensors of 2-, 3- and 4-bit
weights are rearranged once, losslessly and without changing their size (ternary: below), into int32 words that
the decode GEMV reads with fewer instructions and fully coalesced loads; the dtype (int32 instead of uint8)
says which layout a tensor is in, so every kernel and the reference path accept both.
`save_pretrained` / `state_dict()` and moving a module off the GPU give the published bytes back
(`TurboQuantWeight`).

Ternary weights take the 2-bit runtime layout (digits 0, 1, 2 as 2-bit codes, read with the codebook
`pairs_codebook`: -c, 0, +c and an unused 0), so every 2-bit kernel serves them. That costs memory: 2 bits
per weight instead of the published 1.625 (32 instead of 26 bytes per group of 128, +23 %), in exchange for
the 2-bit kernels' speed (base-3 digits need divisions to decode). `TURBOQUANT_COMPACT_TERNARY=1` keeps
ternary weights in their published bytes on the GPU (slower kernels, less memory).

4-bit weights keep their nibbles where they are (index n of a unit of 8 in nibble n of one word) but store each
index in sign-magnitude form: codebook entry i (ascending, symmetric: entry i is minus entry 15 - i) as i - 8
for the upper half and 8 + (7 - i) for the lower, read with `runtime_codebook` (the 8 positive entries, then
their negatives). The GPU kernels then look up 8 entries and set the sign from the nibble's top bit instead of
looking up two halves of 16 and choosing between them.

Units (the same as the kernels'): 8 indices (one word) at 4 bits, 16 indices (one word) at 2 bits, 32 indices
(three words) at 3 bits, numbered along the row (all groups of a row, in order).

- 2 bits (and ternary digits): nibble n of the word holds index n in its low two bits and index 8+n in its high two bits.
- 3 bits: nibble n of word p holds index 8p+n in its low three bits; its top bit is bit p of index 24+n.
  A row's units are stored as three planes: word p of unit u at `p * units_per_row + u` within the row.

Both turn into byte-permute selectors (one nibble per index) with a mask, or for indices 24..31 three
shifts and masks, where the published layout needs about four operations per index.
"""

from __future__ import annotations

import torch

from .. import settings
from . import codec
from . import constants as fmt

# codebook size -> indices per unit (one word at 2 and 4 bits, three at 3 bits; ternary digits as 2-bit codes)
UNITS = {3: 16, 4: 16, 8: 32, 16: 8}

_CHUNK_INDICES = 1 << 24  # indices converted at a time (bounds the temporaries)


def supports(n_levels: int, group_size: int) -> bool:
    """Whether weights of this codebook size and group size have a runtime layout."""
    return n_levels in UNITS and group_size % UNITS[n_levels] == 0


def wanted(n_levels: int, group_size: int) -> bool:
    """Whether such weights take the runtime layout on a GPU: those that have one, except ternary weights
    while `TURBOQUANT_COMPACT_TERNARY` is set (to anything but 0)."""
    if n_levels == 3 and settings.compact_ternary():
        return False
    return supports(n_levels, group_size)


def pairs_codebook(codebook: torch.Tensor) -> torch.Tensor:
    """A ternary codebook `(3,)` as the 4-entry codebook of its runtime layout: the same entries and an
    unused zero, in the same dtype and on the same device."""
    if codebook.numel() != 3:
        raise ValueError(f"expected a ternary codebook (3 entries), got {codebook.numel()}")
    return torch.cat([codebook.reshape(3), codebook.new_zeros(1)])


def _signed_order(inverse: bool = False) -> torch.Tensor:
    """Runtime code of each published 4-bit index (i - 8 for the upper half, 15 - i for the lower), or with
    `inverse` the published index of each code (c + 8 for codes below 8, 15 - c for the others)."""
    i = torch.arange(16)
    if inverse:
        return torch.where(i < 8, i + 8, 15 - i)
    return torch.where(i >= 8, i - 8, 15 - i)


def runtime_codebook(codebook: torch.Tensor) -> torch.Tensor:
    """The codebook that packed indices in the runtime layout are read with: ternary `pairs_codebook`; for 16
    entries the upper half, then the lower half reversed (entry `8 + j` is minus entry `j` for the format's
    symmetric codebooks, which the kernels rely on); any other codebook as it is."""
    n = codebook.numel()
    if n == 3:
        return pairs_codebook(codebook)
    if n == 16:
        c = codebook.reshape(16)
        return torch.cat([c[8:], c[:8].flip(0)])
    return codebook


def is_runtime(packed: torch.Tensor) -> bool:
    return packed.dtype == torch.int32


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) as the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _row_chunks(packed: torch.Tensor, n_groups: int, group_size: int):
    rows = packed.shape[0] // n_groups
    step = max(1, _CHUNK_INDICES // (n_groups * group_size))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        yield packed[r0 * n_groups:r1 * n_groups], r1 - r0


def runtime_width(n_levels: int, group_size: int) -> int:
    """int32 words per group in the runtime layout."""
    return group_size * {3: 2, 4: 2, 8: 3, 16: 4}[n_levels] // 32


def gpu_bytes_per_group(n_levels: int, group_size: int, settings: bool = True) -> int:
    """Packed bytes per group as a CUDA device holds them: the runtime layout's where the weight takes it
    (`wanted`; with `settings=False` the default, ignoring TURBOQUANT_COMPACT_TERNARY), else the published."""
    if wanted(n_levels, group_size) if settings else supports(n_levels, group_size):
        return 4 * runtime_width(n_levels, group_size)
    return fmt.bytes_per_group(n_levels, group_size)


def to_runtime(packed: torch.Tensor, n_levels: int, group_size: int, n_groups: int) -> torch.Tensor:
    """Published uint8 `(rows*n_groups, bytes_per_group)` -> runtime int32 `(rows*n_groups, words_per_group)`
    (`bytes_per_group / 4` words; ternary `G / 16`)."""
    if not supports(n_levels, group_size):
        raise ValueError(f"no runtime layout for {n_levels}-entry codebooks with group size {group_size}")
    if packed.dtype != torch.uint8:
        raise TypeError(f"expected published uint8 packed indices, got {packed.dtype}")
    per = UNITS[n_levels]
    sh = torch.arange(8, device=packed.device) * 4  # the nibbles' bit offsets
    out = []
    for chunk, rows in _row_chunks(packed, n_groups, group_size):
        idx = codec.unpack_indices(chunk, n_levels, group_size).view(rows, -1, per)  # (rows, units, per)
        if n_levels == 16:
            words = (_signed_order().to(idx.device)[idx] << sh).sum(-1)  # (rows, units)
        elif n_levels in (3, 4):
            words = ((idx[..., :8] << sh) | (idx[..., 8:] << (sh + 2))).sum(-1)  # (rows, units)
        else:
            planes = []
            for p in range(3):
                low = (idx[..., 8 * p:8 * p + 8] << sh).sum(-1)
                top = (((idx[..., 24:] >> p) & 1) << (sh + 3)).sum(-1)
                planes.append(low | top)
            words = torch.stack(planes, 1)  # (rows, 3, units)
        out.append(_to_int32(words).reshape(rows * n_groups, -1))
    if not out:
        return packed.new_empty((packed.shape[0], runtime_width(n_levels, group_size)), dtype=torch.int32)
    return torch.cat(out) if len(out) != 1 else out[0]


def to_published(packed: torch.Tensor, n_levels: int, group_size: int, n_groups: int) -> torch.Tensor:
    """Inverse of `to_runtime` (a uint8 tensor is returned as it is)."""
    if packed.dtype == torch.uint8:
        return packed
    if not supports(n_levels, group_size) or packed.dtype != torch.int32:
        raise ValueError(f"not a runtime-layout tensor for {n_levels}-entry codebooks, group size {group_size}")
    sh = torch.arange(8, device=packed.device) * 4
    out = []
    for chunk, rows in _row_chunks(packed, n_groups, group_size):
        words = chunk.reshape(rows, -1).to(torch.int64) & 0xFFFFFFFF
        if n_levels == 16:
            idx = _signed_order(inverse=True).to(words.device)[(words.unsqueeze(-1) >> sh) & 15]
        elif n_levels in (3, 4):
            w = words.unsqueeze(-1)  # (rows, units, 1)
            idx = torch.cat([(w >> sh) & 3, (w >> (sh + 2)) & 3], -1)
            if n_levels == 3 and bool((idx == 3).any()):
                raise ValueError("runtime-layout ternary weight holds the code 3, which is not a base-3 digit")
        else:
            w = words.view(rows, 3, -1).unsqueeze(-1)  # (rows, 3, units, 1)
            low = (w >> sh) & 7  # (rows, 3, units, 8)
            top = (w >> (sh + 3)) & 1
            tail = top[:, 0] | (top[:, 1] << 1) | (top[:, 2] << 2)  # (rows, units, 8)
            idx = torch.cat([low[:, 0], low[:, 1], low[:, 2], tail], -1)
        out.append(codec.pack_indices(idx.reshape(rows * n_groups, group_size), n_levels))
    if not out:
        return packed.new_empty((packed.shape[0], fmt.bytes_per_group(n_levels, group_size)), dtype=torch.uint8)
    return torch.cat(out) if len(out) != 1 else out[0]


def published(packed: torch.Tensor, n_levels: int, group_size: int, n_groups: int) -> torch.Tensor:
    """The published uint8 bytes of `packed`, whichever layout it is in."""
    return to_published(packed, n_levels, group_size, n_groups) if is_runtime(packed) else packed


def codes(packed: torch.Tensor, n_levels: int, group_size: int, n_groups: int) -> torch.Tensor:
    """Published-style uint8 bytes whose indices are the codes the op's codebook is read with: the published
    bytes, except for a 4-bit runtime-layout tensor, whose words already hold its sign-magnitude codes as
    little-endian nibbles (read with `runtime_codebook`)."""
    if n_levels == 16 and is_runtime(packed):
        return packed.contiguous().view(torch.uint8)
    return published(packed, n_levels, group_size, n_groups)
