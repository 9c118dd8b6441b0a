"""Constants of the tq3_native checkpoint format, defined once.

Everything that must match the published checkpoints byte for byte lives
here: the seed-42 sign vectors, the float32 Lloyd-Max codebooks, the packing
geometry and the tensor-name suffixes. The codec, the modules, the writer and
the readers import these; nothing else hard-codes them.
"""

from __future__ import annotations

import math
import struct
from functools import lru_cache

import torch

FORMAT_NAME = "tq3_native"
QUANTIZER_SEED = 42
TQ_CONFIG_NAME = "tq_config.json"
PACKED_SUFFIX = ".tq_packed"
NORMS_SUFFIX = ".tq_norms"

GROUP_SIZES = (64, 128, 256)
# The checkpoint layout of modules rotated over whole rows (turboquant-mlx; `quantization_config.format`), and
# its group sizes (turboquant-mlx writes 16 to 128; the group only sets how many weights share a scale).
HADAMARD_FORMAT = "tq_hadamard"
HADAMARD_GROUP_SIZES = (16, 32, 64, 128, 256)
TERNARY = 1.58
BITS = (TERNARY, 2, 3, 4)
# Lloyd-Max level for N(0, 1) with three levels; the codebook is {-c, 0, +c} / sqrt(G).
TERNARY_LEVEL = 1.224006

# Little-endian float32 hex of the ascending codebooks for N(0, 1/G). The 4-bit
# rows list the negative half; the positive half is its mirror.
_CODEBOOK_HEX = {
    (64, 2): "ae4741be 9eef67bd 9eef673d ae47413e",
    (64, 3): "77b989be 31052cbe 8689c1bd e9f9fabc e9f9fa3c 8689c13d 31052c3e 77b9893e",
    (64, 4): "92e5adbe 654c83be f9d24cbe f6a31ebe 7480edbd 963ea5bd 930943bd 6bfc80bc",
    (128, 2): "6bab08be e70024bd e700243d 6bab083e",
    (128, 3): "96c542be ff45f3bd fad988bd 8c77b1bc 8c77b13c fad9883d ff45f33d 96c5423e",
    (128, 4): "5aed75be 1aaf39be 20d510be fc59e0bd 6af0a7bd e4b069bd 8be909bd ec6936bc",
    (256, 2): "ae47c1bd 9eefe7bc 9eefe73c ae47c13d",
    (256, 3): "77b909be 3105acbd 868941bd e9f97abc e9f97a3c 8689413d 3105ac3d 77b9093e",
    (256, 4): "92e52dbe 654c03be f9d2ccbd f6a39ebd 74806dbd 963e25bd 9309c3bc 6bfc00bc",
}


def check_bits(bits) -> float | int:
    """Return `bits` normalised (2, 3, 4 or TERNARY) or raise a ValueError naming the allowed values."""
    for allowed in BITS:
        if isinstance(bits, (int, float)) and not isinstance(bits, bool) and bits == allowed:
            return allowed
    if isinstance(bits, str) and bits.lower() in ("ternary", "1.58"):
        return TERNARY
    raise ValueError(f"bits must be one of 2, 3, 4 or 1.58 (ternary), got {bits!r}")


def check_group_size(group_size) -> int:
    if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size!r}")
    return int(group_size)


def levels_for_bits(bits) -> int:
    """Number of codebook entries: 3 for ternary, 2**bits otherwise."""
    bits = check_bits(bits)
    return 3 if bits == TERNARY else 2**bits


def bits_for_levels(n_levels: int) -> float | int:
    return {3: TERNARY, 4: 2, 8: 3, 16: 4}[n_levels]


def bytes_per_group(n_levels: int, group_size: int) -> int:
    """Packed bytes per group: b*G/8 for 2/3/4 bits, ceil(G/5) for ternary (5 trits a byte)."""
    if n_levels == 3:
        return -(-group_size // 5)
    return group_size * int(math.log2(n_levels)) // 8


def default_norms_dtype(n_levels: int) -> torch.dtype:
    """dtype of `.tq_norms` written for a new tensor: float16 for the ternary tier (measured: identical
    reconstruction error to 6 digits, and 0.125 bits per weight less at G = 128), float32 for 2/3/4 bits as
    in the published format. Readers take each tensor's norms dtype from the file."""
    return torch.float16 if n_levels == 3 else torch.float32


NORMS_DTYPES = {"F32": torch.float32, "F16": torch.float16}


def levels_from_geometry(bytes_per_group_: int, group_size: int) -> int:
    """Recover the codebook size of a tensor from its packed width (unique for a given G)."""
    for n_levels in (3, 4, 8, 16):
        if bytes_per_group(n_levels, group_size) == bytes_per_group_:
            return n_levels
    raise ValueError(
        f"{bytes_per_group_} bytes per group matches no TurboQuant bit width at group_size {group_size} "
        f"(expected one of {sorted(bytes_per_group(n, group_size) for n in (3, 4, 8, 16))})"
    )


def padded_width(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size) * group_size


@lru_cache(maxsize=None)
def _codebook_values(n_levels: int, group_size: int) -> tuple[float, ...]:
    check_group_size(group_size)
    if n_levels == 3:
        c = struct.unpack("<f", struct.pack("<f", TERNARY_LEVEL / math.sqrt(group_size)))[0]
        return (-c, 0.0, c)
    bits = int(math.log2(n_levels))
    words = _CODEBOOK_HEX[(group_size, bits)].split()
    values = [struct.unpack("<f", bytes.fromhex(w))[0] for w in words]
    if bits == 4:
        values = values + [-v for v in reversed(values)]
    return tuple(values)


def codebook(n_levels: int, group_size: int, device=None) -> torch.Tensor:
    """The float32 codebook (ascending) for `n_levels` entries at group size G."""
    return torch.tensor(_codebook_values(n_levels, group_size), dtype=torch.float32, device=device)


def boundaries(n_levels: int, group_size: int, device=None) -> torch.Tensor:
    """float32 midpoints between consecutive centroids (the middle one is exactly 0)."""
    c = codebook(n_levels, group_size, device)
    return (c[:-1] + c[1:]) / 2


@lru_cache(maxsize=None)
def _signs_cpu(group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator("cpu").manual_seed(QUANTIZER_SEED)
    s1 = (torch.randint(0, 2, (group_size,), generator=gen) * 2 - 1).float()
    s2 = (torch.randint(0, 2, (group_size,), generator=gen) * 2 - 1).float()
    return s1, s2


def signs(group_size: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The two +-1 float32 sign vectors (D1, D2) shared by every tensor of the model."""
    check_group_size(group_size)
    s1, s2 = _signs_cpu(group_size)
    return s1.to(device), s2.to(device)
