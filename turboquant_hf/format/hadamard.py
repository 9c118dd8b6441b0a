"""Whole-row randomized Hadamard rotation (the turboquant-mlx family), in plain torch.

A row of width n is rotated as `x' = (signs * x) @ T_b / sqrt(b)` over contiguous blocks of b
columns, where b is the largest size `m * 2^k` (m in 1, 12, 20, 28) dividing n (one block when n
itself has that form), `T_b = kron(T_m, H_(2^k))`, `H` the Sylvester Walsh-Hadamard matrix and
`T_m` the order-m Hadamard matrices MLX's `hadamard_transform` uses, listed below (row j is the
transform of the j-th unit vector). The signs are stored per module in the checkpoint.

No transformers import; the tq3_native per-group rotation stays in `codec.rotate_groups`.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from . import codec

# The order-12/20/28 Hadamard matrices of MLX's `hadamard_transform` (rows, '+' = +1), as returned by
# `mx.hadamard_transform(mx.eye(m), scale=1.0)`; tests check them against MLX itself.
_HADAMARD_ROWS = {
    12: "+-++++++++++ --+-+-+-+-+- +++-++----++ +---+--+-++- +++++-++---- +-+---+--+-+ ++--+++-++-- +--++---+--+ "
        "++----+++-++ +--+-++---+- ++++----+++- +-+--+-++---",
    20: "+-----++++--++--+--+ -+---+-+++---+++-+-- --+--++-+++---+-+-+- ---+-+++-+++-----+-+ ----+++++--++--+--+- "
        "+----+----+-++---++- -+----+----+-++---++ --+----+--+-+-++---+ ---+----+-++-+-++--- ----+----+-++-+-++-- "
        "++--+-+--++----+---- +++--+-+---+----+--- -+++--+-+---+----+-- --+++--+-+---+----+- +--+++--+-----+----+ "
        "+-++-++--+-+++++---- -+-+++++--+-+++-+--- +-+-+-+++-++-++--+-- ++-+---++++++-+---+- -++-++--++++++-----+",
    28: "+--------++++--+-++-+-++--++ -+--------+++++-+-++-+-++--+ --+----+---+++-+-+-++++-++-- "
        "---+---++---+++-+-+-+-++-++- ----+--+++---+++-+-+---++-++ -----+-++++----++-+-++--++-+ "
        "------+-++++--+-++-+-++--++- ++----++------+--++---+-++-+ +++-----+------+--++-+-+-++- "
        "-+++-----+------+--++-+-+-++ --+++-----+---+--+--++-+-+-+ ---+++-----+--++--+--++-+-+- "
        "----+++-----+--++--+--++-+-+ +----++------+--++--++-++-+- +-+--+--++--+++------++----+ "
        "-+-+--++-++--+-+-----+++---- +-+-+--++-++----+-----+++--- -+-+-+--++-++----+-----+++-- "
        "--+-+-+--++-++----+-----+++- +--+-+-+--++-+-----+-----+++ -+--+-+++--++-------++----++ "
        "+--++--+-+--+---++++-+------ -+--++--+-+--+---++++-+----- --+--+++-+-+--+---+++--+---- "
        "+--+--+-+-+-+-++---++---+--- ++--+----+-+-++++---+----+-- -++--+-+--+-+-++++--------+- "
        "--++--+-+--+-+-++++--------+",
}
BASE_ORDERS = (1, 12, 20, 28)



def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def factor(n: int) -> tuple[int, int] | None:
    """(m, 2^k) with n = m * 2^k and m in (1, 12, 20, 28), or None."""
    for m in BASE_ORDERS[1:]:
        if n % m == 0 and _is_power_of_two(n // m):
            return m, n // m
    return (1, n) if _is_power_of_two(n) else None


def block_size(n: int) -> int:
    """The rotation block for a row of width n: the largest m * 2^k (m in 1, 12, 20, 28) dividing n."""
    best = 1
    for m in BASE_ORDERS:
        size = m
        while size <= n:
            if n % size == 0:
                best = max(best, size)
            size *= 2
    return best


@lru_cache(maxsize=None)
def _base_matrix_cpu(m: int) -> torch.Tensor:
    if m == 1:
        return torch.ones(1, 1)
    rows = _HADAMARD_ROWS[m].split()
    return torch.tensor([[1.0 if c == "+" else -1.0 for c in r] for r in rows])


_DEVICE_CACHE: dict = {}


def _factors_on(m: int, p: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (m, p, str(torch.device(device) if device is not None else "cpu"))
    if key not in _DEVICE_CACHE:
        _DEVICE_CACHE[key] = (_base_matrix_cpu(m).to(device), codec.hadamard_matrix(p, device))
    return _DEVICE_CACHE[key]


def transform_matrix(n: int, device=None) -> torch.Tensor:
    """The +-1 matrix T_n (n = m * 2^k) with `hadamard_transform(x) = x @ T_n / sqrt(n)` (for tests and tools)."""
    mp = factor(n)
    if mp is None:
        raise ValueError(f"{n} is not m * 2^k with m in {BASE_ORDERS}")
    t_m, h_p = _factors_on(*mp, device)
    return torch.kron(t_m, h_p)


def _blockwise(x: torch.Tensor, transpose: bool) -> torch.Tensor:
    """`x @ T_b / sqrt(b)` (or `x @ T_b.T / sqrt(b)`) on each block of b columns of float32 `x` `(..., n)`."""
    n = x.shape[-1]
    b = block_size(n)
    m, p = factor(b)
    t_m, h_p = _factors_on(m, p, x.device)
    if transpose:
        t_m = t_m.T
    # x @ kron(T_m, H_p) on a block viewed as (m, p) is T_m^T @ X @ H_p.
    xb = x.reshape(*x.shape[:-1], n // b, m, p)
    y = xb @ h_p if p > 1 else xb
    if m > 1:
        y = t_m.T @ y
    return (y / math.sqrt(b)).reshape(x.shape)


def rotate_rows(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Rotate float32 activations `(..., n)` into a module's quantized basis: `(signs * x) @ T_b / sqrt(b)`."""
    return _blockwise(x * signs, transpose=False)


def unrotate_rows(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Inverse of `rotate_rows` (T_b is orthogonal up to sqrt(b)); maps a rotated-basis weight to the original one."""
    return _blockwise(y, transpose=True) * signs
