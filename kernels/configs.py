"""The GEMV kernels' unit geometry and launch configurations, chosen from the weight shape (and for the tensor-core
GEMV above DOT_MAX_M, from the bucket of M): pure functions of shapes, kept apart from the launchers in `linear.py`
that use them. The sweeps behind the numbers: benchmarks/RESULTS.md."""

from __future__ import annotations

from .launch import next_power_of_2


def unit_geometry(n_levels: int, group_size: int) -> dict:
    """Constants that describe how one group's packed bytes split into units.

    PER: indices per unit; WPU: 32-bit words per unit (0 = byte units, ternary);
    UPG: units per group; UPG_P: UPG rounded up to a power of two;
    PER_P: PER rounded up to a power of two (ternary 5 -> 8).
    """
    g = group_size
    if n_levels == 3:
        bpg = -(-g // 5)
        return {"PER": 5, "PER_P": 8, "WPU": 0, "UPG": bpg, "UPG_P": next_power_of_2(bpg)}
    if n_levels == 4:
        per, wpu = 16, 1
    elif n_levels == 8:
        per, wpu = 32, 3
    elif n_levels == 16:
        per, wpu = 8, 1
    else:
        raise ValueError(f"unsupported codebook size {n_levels} (expected 3, 4, 8 or 16)")
    return {"PER": per, "PER_P": per, "WPU": wpu, "UPG": g // per, "UPG_P": g // per}


def _rows_config(m: int, g: int) -> tuple[int, int]:
    """(groups a program, warps) of the butterfly rotation: one warp over 256 inputs a program for one or two
    rows, over 512 for more (more programs of less work each lose to the launch of their blocks)."""
    return max(1, (256 if m <= 2 else 512) // g), 1


def _fma_config(n: int, ng: int, n_levels: int, g: int) -> tuple[int, int, int]:
    """(BN, GPI, num_warps) for the FMA GEMV, from the weight shape only.

    From a sweep (benchmarks/RESULTS.md): 8 rows per program below 8192 output
    rows, 16 above; GPI (groups per step) gives each thread 128 weights per step (256 for 2- and
    4-bit with 16 rows); ternary does best with 2 groups per step."""
    geo = unit_geometry(n_levels, g)
    g_eff = geo["UPG_P"] * geo["PER"]  # decoded slots per group (ternary pads 26 bytes to 32)
    if n >= 8192:
        bn, warps, per_thread = (16, 4, 128) if n_levels in (3, 8) else (16, 2, 256)
    else:
        bn, warps, per_thread = 8, 2, 128
    if n_levels == 3 and n >= 8192:
        gpi = max(1, 256 // g)
    else:
        gpi = max(1, (per_thread * 32 * warps) // (bn * g_eff))
        gpi = 1 << (gpi.bit_length() - 1)
    gpi = min(gpi, next_power_of_2(ng))
    return bn, gpi, warps


_LUT_UNITS = {16: 8, 8: 32, 4: 16}  # codebook size -> indices a unit


def lut_unit(n_levels: int, group_size: int | None = None) -> int:
    """Indices per unit of the byte-permute kernels (pair GEMV, lookup dequantization; 0: that codebook size,
    or a group smaller than a unit, does not use them)."""
    unit = _LUT_UNITS.get(n_levels, 0)
    return 0 if group_size is not None and unit and group_size % unit else unit


def lut_levels(unit: int) -> int:
    """The codebook size whose indices come `unit` to a unit in the byte-permute kernels (the inverse of
    `lut_unit`; 0 for any other unit, including 0)."""
    return next((lv for lv, u in _LUT_UNITS.items() if u == unit and unit), 0)


def _pair_config(n: int, nut: int, n_levels: int) -> tuple:
    """(BN, num_warps[, maxnreg[, prefetch]]) of the pair GEMV from the weight shape (rows n, units per row nut)
    and the codebook size, from whole-op sweeps (benchmarks/RESULTS.md). 3-bit: rows of 14336 inputs 4 rows of 2
    warps, 8192 inputs 8 rows of 2 warps, 2048 inputs 8 rows of 2 warps loading each step's words a step ahead
    (what a program loads first overlaps the rotation), 4096 inputs 8 rows of 4 warps (ahead as well for rows of
    4096 outputs); 4-bit: 8 rows of 4 warps and a cap of 96 registers from 4096 inputs up, 16 rows below.
    Weights of 2048 rows or fewer: 3- and 4-bit rows of 512 inputs or fewer 8 rows of 2 warps, a step ahead, 3-bit
    rows up to 2048 inputs 4 rows of 4 warps, a step ahead. 2-bit (and ternary, which runs its codes): 8 rows of 4
    warps, cap 96, except rows of 2048 inputs (8 rows of 2 warps a step ahead up to 8192 rows, of 4 warps above and
    for 2048 rows or fewer), 16 rows for 16384 rows or more (2 warps at 4096 inputs, 4 at 8192), 4 rows of 4 warps
    a step ahead at 14336 inputs. Programs of 2 or 4 activation rows run uncapped."""
    k = nut * lut_unit(n_levels)
    if n <= 2048:
        if n_levels in (8, 16) and k <= 512:
            return 8, 2, 128, 1
        if n_levels == 8 and k <= 2048:
            return 4, 4, 96, 1
        if n_levels == 4 and 512 < k <= 2048:
            return 8, 4, 96, 1
        return (8, 4, 96) if k <= 512 else (4, 8, 64)
    if n_levels == 16:
        return (16, 4) if k <= 2048 else (8, 4, 96)
    if n_levels == 8:
        if k > 8192:
            return 4, 2, 128
        if k > 4096:
            return 8, 2, 128
        if k <= 2048:
            return 8, 2, 128, 1
        return (8, 4, 96, 1) if n <= 4096 else (8, 4, 96)
    if n_levels == 4:
        if k <= 2048:
            return (8, 2, 128, 1) if n <= 8192 else (8, 4, 96, 1)
        if k > 8192:
            return 4, 4, 96, 1
        if n >= 16384:
            return (16, 2, 128) if k <= 4096 else (16, 4, 96)
    return 8, 4, 96


def _mma_block(n_levels: int, g: int) -> int:
    """Inputs per dot (KB) of `_gemv_mma_kernel`: four lanes x R units, 128 (64 for G = 64 at 2 and 4 bits).
    Smaller groups (3-bit units, 32 indices, at G = 64; any codebook below 64) make blocks of several groups,
    the norms folded into the values; the kernel serves group sizes that divide KB or that KB divides."""
    return 64 if g == 64 and n_levels != 8 else 128


def _mma_serves(n_levels: int, g: int) -> bool:
    """Whether `_gemv_mma_kernel` serves this codebook size and group size: a byte-permute lookup unit, and
    groups that divide its block of inputs or that it divides."""
    kb = _mma_block(n_levels, g)
    return bool(lut_unit(n_levels, g)) and (g % kb == 0 or kb % g == 0)


def _dot_config(n: int, ng: int, n_levels: int, g: int, kb: int = 0) -> tuple:
    """Launch configuration of the tensor-core GEMV, from the weight shape only (never from M).

    2-, 3- and 4-bit (`_gemv_mma_kernel`): (BN, num_warps, num_stages, prefetch, maxnreg, blocks). Each program
    takes BN weight rows and S = num_warps x blocks of the row's KB-input blocks per step, so that many
    independent loads are in flight: S = 16 (4 warps of 4 blocks) below 8192 rows or for rows of at most 16
    blocks (one step a row), 8 (2 warps of 4) below 16384,
    else 4 (one warp of 4), BN = 16 below 8192 rows, else 32. 4-bit, whose two lookups a value hold more
    registers (255 a thread at 2 warps of 4 blocks, 12.5 % occupancy under ncu), takes 4 warps: of 4 blocks
    and 16 rows below 4096 rows, of 2 and 32 rows below 8192, else of 1 and 32 rows. S is halved (blocks
    first, then warps) while it exceeds the row's blocks. Prefetch 1 (the next step's words a step ahead) for
    rows of at least 16 blocks, else 2 (its activations and norms too); sweeps: benchmarks/RESULTS.md. One
    stage: the loop is pipelined by hand, and Triton's pipelining would stage the operands
    through shared memory. `kb`: the block (`mma_block`; 0: `_mma_block`); with wide blocks a warp takes half as
    many blocks a step where the rule above gives 2 warps or 1 (the same inputs a step), the whole rule counted in default blocks.

    Ternary (`_gemv_dot_kernel`): (BN, num_warps, num_stages); one stage: software pipelining would route
    every codebook lookup through shared memory."""
    base = _mma_block(n_levels, g)
    kb = kb or base
    if _mma_serves(n_levels, g):
        nblk = -(-ng * g // kb)
        if n_levels == 16:  # its lookups hold more registers: fewer blocks per warp, 4 warps
            bn, warps, blocks = (16, 4, 4) if n < 4096 else (32, 4, 2) if n < 8192 else (32, 4, 1)
        else:
            bn = 16 if n < 8192 else 32
            short = nblk * kb <= 16 * base  # (rows of at most 16 default blocks)
            warps, blocks = (4, 4) if n < 8192 or short else (2, 4) if n < 16384 else (1, 4)
            if kb > base and not (n < 8192 or short):
                blocks //= 2  # wide blocks: the same inputs a step
        while warps * blocks > nblk and blocks > 1:
            blocks //= 2
        while warps * blocks > nblk and warps > 1:
            warps //= 2
        return bn, warps, 1, 1 if nblk >= 16 else 2, 0, blocks
    geo = unit_geometry(n_levels, g)
    bk = geo["UPG_P"] * geo["PER_P"]
    bn = min(64 if n >= 8192 else 32, 8192 // bk)
    return max(16, bn), 4, 1


def _mid_config(n: int, ng: int, n_levels: int, g: int, m: int, kb: int = 0) -> tuple[tuple, int]:
    """(configuration, activation rows a program) of `_gemv_mma_kernel` for DOT_MAX_M < M <= MID_MAX_M, from the
    weight shape and that bucket of M only: 32 rows a program (16 up to 32 rows for fewer than 4096 outputs),
    4 warps of one block and 64 weight rows a program from 8192 outputs, 32 from 4096; fewer outputs keep the
    M <= 16 configuration (more blocks per step: their grid is small); sweeps: benchmarks/RESULTS.md."""
    base = _mma_block(n_levels, g)
    kb = kb or base
    if kb > base:  # wide blocks (`mma_block`): 2 blocks a warp, 4 warps of 16 rows below 8192 outputs, else 32 rows
        # over 2 warps (4 for rows of at most 2048 inputs)
        bn, warps = (16, 4) if n < 8192 else (32, 4) if ng * g <= 2048 else (32, 2)
        return (bn, warps, 1, 1, 0, 2), 32
    if n >= 4096:
        warps, nblk = 4, -(-ng * g // base)
        while warps > nblk and warps > 1:
            warps //= 2
        return (64 if n >= 8192 else 32, warps, 1, 1, 0, 1), 32
    return _dot_config(n, ng, n_levels, g, kb), 16 if m <= 32 else 32
