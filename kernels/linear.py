"""Dispatch of `torch.ops.turboquant.linear` on CUDA: `rotate`, then the codebook product chosen by M.

`rotate` (`rotation.py`) rotates the activations per group of G (`D2 . H . D1 . x`, zero-padded to
`n_groups * G`). The product, by the number of activation rows M:
- `gemv_fma` (`gemv_fma.py`): M == 1 where the pair GEMV does not serve, any M for float32 activations;
- `gemv_pairs` (`gemv_pairs.py`): M <= PAIR_MAX_M, 2-, 3- and 4-bit weights, 16-bit activations;
- `gemv_dot` (`gemv_mma.py`): M <= DOT_MAX_M on the tensor cores, and up to MID_MAX_M with 32 activation rows a
  program (`_mid_config`) for 16-bit activations and 2-, 3- and 4-bit weights;
- above: `dequantize_lut` / `dequantize_rotated` (`prefill.py`) write the weight for cuBLAS.

The kernels read the packed indices (`turboquant_hf.format.codec.pack_indices`, or the runtime layout of
`format.runtime_layout`) in units holding a whole number of indices (`unit_geometry`). Every launcher is a plain
Python function over torch tensors, so the same code runs under `TRITON_INTERPRET=1` on CPU tensors; none
synchronises with the host or allocates more than its output, the intermediate activations and (prefill) the
scratch weight.
"""

from __future__ import annotations

import math

import torch
import triton

from . import gemm, tuning
from .configs import (  # noqa: F401
    _dot_config,
    _fma_config,
    _mid_config,
    _mma_block,
    _mma_serves,
    _pair_config,
    _rows_config,
    lut_levels,
    lut_unit,
    unit_geometry,
)
from .gemv_fma import _gemv_fma_kernel
from .gemv_mma import _gemv_dot_kernel, _gemv_mma_kernel
from .gemv_pairs import _gemv_pair_kernel, _pack_pairs_kernel
from .launch import bind, cdiv, launch, memo, next_power_of_2, triton_version
from .prefill import _dequant_kernel, _dequant_lut_kernel
from .ptx import _HAS_GDC
from .rotation import _rotate_kernel, _rotate_rows_kernel

# ---------------------------------------------------------------------------
# the rotation of the activations
# ---------------------------------------------------------------------------

_HADAMARD: dict = {}


def _hadamard_pm1(g: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The (G, G) Sylvester Hadamard matrix, +-1 entries, in `dtype` on `device` (built once per key)."""
    key = (g, dtype, str(device))
    if key not in _HADAMARD:
        from turboquant_hf.format import codec

        _HADAMARD[key] = codec.hadamard_matrix(g).to(dtype=dtype, device=device).contiguous()
    return _HADAMARD[key]


def rotate(x2: torch.Tensor, signs1: torch.Tensor, signs2: torch.Tensor, group_size: int,
           out_dtype: torch.dtype, unit: int = 0, mma_levels: int = 0, mma_block: int = 0, lane_unit: int = 0,
           lane_block: int = 128):
    """`(M, in)` activations -> `(M, n_groups*G)` rotated, zero-padded, in `out_dtype`.

    With `unit` > 0 (`lut_unit(levels)`): the pair GEMV's activations `(x2, scales)` for weights of that
    unit instead (see `gemv_pairs`; `out_dtype` is ignored). With `mma_levels` (a codebook size for which
    `mma_order` holds): the columns in the tensor-core GEMV's order (`_mma_column`; `gemv_dot(...,
    x_order=True)` reads them), for its blocks of `mma_block` inputs (0: the default block; or the wide block,
    `wide_block`, for a row of whole pairs of groups). With `lane_unit` (indices a unit: 32 at 3 bits, 16 at 2,
    8 at 4): the columns in the packed-weight GEMM's lane order for blocks of `lane_block` inputs
    (`rotation._lane_permute`; `gemm.gemm(..., lanes=True)` reads them).

    Up to ROWS_MAX_M rows the Walsh-Hadamard product runs as float32 butterflies in registers
    (`_rotate_rows_kernel`), above as a product with the +-1 matrix on the tensor cores (`_rotate_kernel`); the
    two agree within float32 rounding of the sums."""
    m, k = x2.shape
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    width, ng, dtype, pairs, rows, grid, bound, hmat = _rotate_plan(
        m, k, group_size, x2.dtype, out_dtype, unit, mma_levels, mma_block, lane_unit, lane_block, x2.device)
    out = torch.empty(m, width, dtype=dtype, device=x2.device)
    xs = torch.empty(m, ng, dtype=torch.float32, device=x2.device) if pairs else out
    if m:
        scale = 1.0 / math.sqrt(group_size)
        if rows:
            bound(grid, x2, signs1, signs2, out, xs, k, ng, x2.stride(0), out.stride(0), xs.stride(0), scale)
        else:
            bound(grid, x2, signs1, signs2, out, hmat, xs, m, k, x2.stride(0), out.stride(0), xs.stride(0), scale)
    return (out.view(torch.int32), xs) if pairs else out


@memo
def _rotate_plan(m: int, k: int, g: int, x_dtype: torch.dtype, out_dtype: torch.dtype, unit: int, mma_levels: int,
                 mma_block: int, lane_unit: int, lane_block: int, device: torch.device) -> tuple:
    """`rotate`'s launch for these shapes and options: (padded width, groups, output dtype, pair layout, whether
    the butterfly kernel runs, grid, bound kernel, the +-1 matrix of the tensor-core kernel or None)."""
    ng = -(-k // g)
    pairs = unit > 0
    if mma_block and not mma_levels:
        raise ValueError("rotate: `mma_block` without `mma_levels`")
    mkb = _check_block(mma_levels, g, ng, mma_block, True) if mma_levels else 0
    if (mkb and pairs) or (lane_unit and (pairs or mkb)):
        raise ValueError("rotate: `unit` (the pair layout), `mma_levels` (the tensor-core order) and `lane_unit` "
                         "(the GEMM's lane order) exclude each other")
    if lane_unit and (g % lane_block or lane_block % (4 * lane_unit)):
        raise ValueError(f"rotate: blocks of {lane_block} inputs in lane order need groups that are a multiple of "
                         f"them (G = {g}) and four lanes of whole units of {lane_unit}")
    lkb, lper = (lane_block, lane_unit) if lane_unit else (0, 0)
    dtype = torch.float16 if pairs else out_dtype
    pdl = _pdl(device, ng * g, lut_levels(unit) if m == 1 else 0)  # (as the pair GEMV after it decides)
    common = dict(PER_T=unit, NUT=(ng * g) // unit if unit else 0, PDL=pdl, MMA_KB=mkb,
                  MMA_PER=lut_unit(mma_levels) if mkb else 0, LANE_KB=lkb, LANE_PER=lper)
    if m <= tuning.ROWS_MAX_M:
        bg, warps = tuning.ROWS_CONFIG or _rows_config(m, g)
        bound = bind(_rotate_rows_kernel, G=g, LG=g.bit_length() - 1, BG=bg, **common, num_warps=warps)
        return ng * g, ng, dtype, pairs, True, (m, cdiv(ng, bg)), bound, None
    bm = tuning.ROTATE_BM or (64 if m > 16 and x_dtype != torch.float32 else 16)
    exact16 = x_dtype in (torch.bfloat16, torch.float16) and not _interpreting()
    bc = lkb if lkb else min(g, 64 if exact16 else 32)  # (the lane order: whole blocks, permuted in registers)
    hmat = _hadamard_pm1(g, x_dtype if exact16 else torch.float32, device)
    bound = bind(_rotate_kernel, G=g, BM=bm, BC=bc, EXACT16=exact16, **common, num_warps=4)
    return ng * g, ng, dtype, pairs, False, (cdiv(m, bm), ng, g // bc), bound, hmat


def _with_mask(cfg: tuple, n_levels: int) -> tuple:
    return tuple(cfg) if len(cfg) == 4 else (*cfg, tuning.LUT_MASKS[n_levels])


def _gemv_shape(x: torch.Tensor, norms: torch.Tensor, experts: int, expert_index) -> tuple[int, int, int]:
    """(output rows M, weight rows N, groups per row) of a GEMV: M activation rows, or with `experts` = E > 0 one
    output row per routed pair over E stacked matrices."""
    if experts:
        return expert_index.numel(), norms.shape[0] // experts, norms.shape[1]
    return x.shape[0], norms.shape[0], norms.shape[1]


def gemv_fma(x_rot: torch.Tensor, packed: torch.Tensor, norms: torch.Tensor, codebook: torch.Tensor,
             group_size: int, out_dtype: torch.dtype, config=None, experts: int = 0,
             expert_index: torch.Tensor | None = None, x_div: int = 1) -> torch.Tensor:
    """`(M, n_groups*G)` float32 rotated activations times the packed weight -> `(M, rows)` in out_dtype.

    `experts`, `expert_index`, `x_div`: routed pairs over stacked matrices, as in `gemv_pairs`."""
    m, n, ng = _gemv_shape(x_rot, norms, experts, expert_index)
    n_levels = codebook.numel()
    geo = unit_geometry(n_levels, group_size)
    bn, gpi, warps, lut = _with_mask(config or _fma_config(n, ng, n_levels, group_size), n_levels)
    out = torch.empty(m, n, dtype=out_dtype, device=x_rot.device)
    if m == 0 or n == 0:
        return out
    pk = _packed_view(packed, geo["WPU"])
    grid = (cdiv(n, bn), m)
    idx = expert_index.reshape(-1) if experts else norms  # (unused when experts == 0)
    launch(_gemv_fma_kernel, grid, x_rot, pk, norms, codebook, out, idx, n, ng, x_rot.stride(0), out.stride(0),
           NLEV=n_levels, G=group_size, PER=geo["PER"], WPU=geo["WPU"], UPG=geo["UPG"],
           UPG_P=geo["UPG_P"], BN=bn, GPI=gpi, LUT_MASK=lut, EVEN_N=n % bn == 0, EVEN_G=ng % gpi == 0,
           EXPERTS=experts, X_DIV=x_div, RUNTIME_LAYOUT=_runtime_layout(packed, n_levels), num_warps=warps)
    return out


def pack_pairs(x_rot: torch.Tensor, unit: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated activations `(M, n_groups*G)` (any float dtype; a shorter row is zero-padded) -> the pair
    GEMV's `(x2, scales)`: int32 `(M, n_groups*G/2)` float16 pairs in unit order and float32 `(M, n_groups)`
    powers of two (what `rotate(..., unit=unit)` writes in one pass)."""
    m, k = x_rot.shape
    g = group_size
    ng = -(-k // g)
    if x_rot.stride(-1) != 1:
        x_rot = x_rot.contiguous()
    out = torch.empty(m, ng * g, dtype=torch.float16, device=x_rot.device)
    xs = torch.empty(m, ng, dtype=torch.float32, device=x_rot.device)
    if m and ng:
        launch(_pack_pairs_kernel, (m, ng), x_rot, out, xs, k, x_rot.stride(0), out.stride(0), xs.stride(0), G=g,
               GP=next_power_of_2(g), PER_T=unit, NUT=ng * g // unit, num_warps=4)
    return out.view(torch.int32), xs


# The pair GEMV adds the float16 chains of GRP = PAIR_CHAIN / unit consecutive units (one 3-bit unit, two 2-bit,
# four 4-bit ones) before converting them to float32 and scaling them, so that the conversion, the scaling and the
# norm and scale loads come once per PAIR_CHAIN weights at every width (`_group_chains`). Groups smaller than
# PAIR_CHAIN (turboquant-mlx modules: G = 8 to 24 at 2 and 4 bits) take the largest power of two of units that
# divides a group, since the chains added together share one norm.
PAIR_CHAIN = 32


def gemv_pairs(x2: torch.Tensor, xs: torch.Tensor, packed: torch.Tensor, norms: torch.Tensor,
               codebook: torch.Tensor, group_size: int, out_dtype: torch.dtype, config=None, experts: int = 0,
               expert_index: torch.Tensor | None = None, x_div: int = 1) -> torch.Tensor:
    """Pair-layout activations (`rotate(..., unit=lut_unit(levels))` or `pack_pairs`: int32 `x2`,
    float32 group scales `xs`) times a 2-, 3- or 4-bit packed weight -> `(M, rows)` in out_dtype.

    With `experts` = E > 0 the weight is E stacked matrices (norms `(E*rows, n_groups)`) and the result has
    one row per entry p of `expert_index` (flat, int): matrix `expert_index[p]` times activation row
    `p // x_div`; entries outside [0, E) give zero rows. `config`: (BN, num_warps[, maxnreg[, prefetch[,
    BU]]]): a maxnreg of 0 sets no cap; prefetch 1 loads each step's words during the step before; BU, the
    units a row takes per step, defaults to one per lane (32 * num_warps, at most the row, at least the units of
    32 indices); a power of two of at least the units of 32 indices (2 at 2 bits, 4 at 4 bits: the kernel adds
    their chains)."""
    m, n, ng = _gemv_shape(x2, norms, experts, expert_index)
    bound, grid = _pair_plan(m, n, ng, codebook.numel(), group_size, None if config is None else tuple(config),
                             experts, x_div, packed.dtype, x2.shape[1], x2.device, _lanes_first())
    out = torch.empty(m, n, dtype=out_dtype, device=x2.device)
    if m == 0 or n == 0:
        return out
    idx = expert_index.reshape(-1) if experts else norms  # (unused when experts == 0)
    bound(grid, x2, xs, _packed_view(packed, 1), norms, _f32(codebook), out, idx, m, n, x2.stride(0), xs.stride(0),
          out.stride(0))
    return out


@memo
def _pair_plan(m: int, n: int, ng: int, n_levels: int, group_size: int, config, experts: int, x_div: int,
               packed_dtype: torch.dtype, x_width: int, device: torch.device, lanes_first: bool) -> tuple:
    """`gemv_pairs`' launch for these shapes and options: (bound kernel, grid)."""
    per = lut_unit(n_levels)
    if not per:
        raise ValueError(f"the pair GEMV serves 4-, 8- and 16-entry codebooks, not {n_levels}")
    upg = group_size // per
    nut = ng * upg
    bn, warps, *extra = tuple(config or _pair_config(n, nut, n_levels))
    extra += [0] * (3 - len(extra))
    cap, prefetch, bu = extra[:3]
    bm = 1 if experts or m <= 1 else (2 if m == 2 else 4)
    if bm > 1 and config is None:
        cap = 0  # (more accumulators: no register cap)
    opts = {"maxnreg": cap} if cap else {}
    pdl = _pdl(device, 2 * x_width, n_levels if m == 1 and not experts else 0)
    if pdl:
        opts["launch_pdl"] = True
    grp = PAIR_CHAIN // per
    while upg % grp:  # a chain group stays within one quantization group (one norm): G below 32 takes fewer units
        grp //= 2
    # (at least a chain group: a row of fewer than 32 indices takes one step, its missing units masked off)
    bu = bu or max(grp, min(32 * warps, next_power_of_2(nut)))
    if bu < grp or bu & (bu - 1):
        raise ValueError(f"the pair GEMV's units a step must be a power of two of at least {grp} for a "
                         f"{n_levels}-entry codebook at G = {group_size}, not {bu}")
    runtime = packed_dtype == torch.int32  # (`_runtime_layout`, signed)
    bound = bind(_gemv_pair_kernel, NG=ng, NLEV=n_levels, UPG=upg, BN=bn, BU=bu, BM=bm, USE_ASM=not _interpreting(),
                 EXPERTS=experts, X_DIV=x_div, RUNTIME_LAYOUT=runtime, PDL=pdl, PREFETCH=int(bool(prefetch)),
                 UT=lanes_first, GRP=grp, num_warps=warps, **opts)
    return bound, (cdiv(n, bn), cdiv(m, bm))


# Triton before 3.7 orders the non-contiguous axes of a load's coalesced layout ascending, 3.7 and later from the
# last: `_gemv_mma_kernel` arranges its weight and activation tiles for the one in use (None: by version), so that
# both land in the tensor-core operand layouts without passing through shared memory (`_gemv_pair_kernel` its
# tiles the same way: UT); arranged for the other order they need shared-memory stores, ldmatrix and shuffles.
_LANES_FIRST: bool | None = None


def _lanes_first() -> bool:
    global _LANES_FIRST
    if _LANES_FIRST is None:
        _LANES_FIRST = triton_version() < (3, 7)
    return _LANES_FIRST


def mma_order(n_levels: int, g: int) -> bool:
    """Whether `rotate(..., mma_levels=n_levels)` can put activations in `_gemv_mma_kernel`'s order for its
    default blocks (`_mma_block`): the kernel serves the codebook and group size, and each block lies within one
    group (G a multiple of the block). Wide blocks (`wide_block`) have an order of their own."""
    return _mma_serves(n_levels, g) and g % _mma_block(n_levels, g) == 0


def wide_block(n_levels: int, g: int) -> int:
    """The wide block (inputs) of this codebook and group size, or 0 where there is none (see `WIDE`)."""
    return 2 * g if n_levels == 8 and g == 128 else 0


def mma_block(n_levels: int, g: int, n: int, ng: int, m: int) -> int:
    """Inputs per block of `_gemv_mma_kernel` for an `(n, ng groups of g)` weight and M activation rows: the wide
    block where `WIDE` says so (from the weight shape and M's bucket: up to DOT_MAX_M, to 2 DOT_MAX_M, above), else
    `_mma_block`; 0 for codebooks and group sizes that kernel does not serve (ternary runs `_gemv_dot_kernel`)."""
    if not _mma_serves(n_levels, g):
        return 0
    wb = wide_block(n_levels, g)
    rows_ok = n < 16384 if m <= tuning.DOT_MAX_M else (m <= 2 * tuning.DOT_MAX_M or n >= 8192)
    if tuning.WIDE and wb and ng % (wb // g) == 0 and n * ng * g >= tuning.WIDE_MIN and rows_ok:
        return wb
    return _mma_block(n_levels, g)


def uses_x_order(n: int, ng: int, n_levels: int, g: int) -> bool:
    """Whether `linear` runs the tensor-core GEMV of an `(n, ng groups of g)` weight on activations in its own order
    (`X_ORDER`, `X_ORDER_MIN`, `mma_order`); from the weight shape only."""
    return tuning.X_ORDER and n * ng * g >= tuning.X_ORDER_MIN and mma_order(n_levels, g)


def mid_m(m: int, n_levels: int, group_size: int, dtype: torch.dtype) -> bool:
    """Whether `m` rows of `dtype` activations take the tensor-core GEMV above DOT_MAX_M (`_mid_config`)."""
    sixteen = dtype in (torch.bfloat16, torch.float16)
    return tuning.DOT_MAX_M < m <= tuning.MID_MAX_M and sixteen and _mma_serves(n_levels, group_size)


def _check_block(n_levels: int, g: int, ng: int, block: int, ordered: bool) -> int:
    """`block` (0: the default block) if `_gemv_mma_kernel` can run blocks of that many inputs on this codebook,
    group size and row of `ng` groups, with the activations in its order when `ordered`; else ValueError naming
    why."""
    base = _mma_block(n_levels, g)
    kb = block or base
    if ordered and kb == base and not mma_order(n_levels, g):
        raise ValueError(f"no tensor-core activation order for {n_levels} levels at G = {g}")
    if not _mma_serves(n_levels, g):  # (ternary: the select GEMV, no blocks)
        raise ValueError(f"no tensor-core blocks of {kb} inputs for {n_levels} levels at G = {g}")
    if kb == base:
        return kb
    if kb != wide_block(n_levels, g):
        raise ValueError(f"no tensor-core blocks of {kb} inputs for {n_levels} levels at G = {g} (blocks of {base}"
                         + (f" or {wide_block(n_levels, g)})" if wide_block(n_levels, g) else ")"))
    if ng % (kb // g):
        raise ValueError(f"blocks of {kb} inputs need whole pairs of groups: the row has {ng} groups of {g}")
    return kb


def gemv_dot(x_rot: torch.Tensor, packed: torch.Tensor, norms: torch.Tensor, codebook: torch.Tensor,
             group_size: int, out_dtype: torch.dtype, config=None, block_m: int = 16, mma_rows: int = 0,
             x_order: bool = False, block: int = 0) -> torch.Tensor:
    """`(M, n_groups*G)` rotated activations (bf16/fp16; float32 in the interpreter) times the packed
    weight on the tensor cores -> `(M, rows)` in out_dtype.

    2-, 3- and 4-bit codebooks: `_gemv_mma_kernel`, the codebook values rounded to the activations' 16-bit
    type (bfloat16; float16 when the activations, or in the interpreter out_dtype, are float16), activation
    tiles of 8 rows for M <= 8, 16 up to DOT_MAX_M, above it as `_mid_config` says (`mma_rows`: 8, 16, 32 or 64
    instead). `config`: (BN, num_warps, num_stages[, prefetch[, maxnreg[,
    blocks]]]) as `_dot_config` returns it (BN = 16, 32, 64 or 128; maxnreg 0: no cap; blocks: the blocks of KB
    inputs each warp takes per step, 1 by default, so S = num_warps * blocks); a fourth field that is not a
    bool (the select kernel's lookup mask) is ignored. `x_order`: `x_rot` comes from `rotate(...,
    mma_levels=...)`, in the kernel's activation order for blocks of `block` inputs. `block`: the inputs per
    block, `_mma_block` or the wide block (`wide_block`); 0: as `mma_block` chooses for this weight and M, or with
    `x_order` the default block (what `rotate(..., mma_levels=...)` orders for by default). Ternary:
    `_gemv_dot_kernel`, config (BN, num_warps, num_stages[, LUT mask]), `block_m` activation rows per program."""
    m = x_rot.shape[0]
    n, ng = norms.shape
    n_levels = codebook.numel()
    out = torch.empty(m, n, dtype=out_dtype, device=x_rot.device)
    if m == 0 or n == 0:
        return out
    if _mma_serves(n_levels, group_size):
        f16 = (x_rot.dtype if x_rot.dtype != torch.float32 else out_dtype) == torch.float16
        if not _interpreting() and x_rot.dtype not in (torch.bfloat16, torch.float16):
            x_rot = x_rot.to(torch.float16 if f16 else torch.bfloat16)
        if x_rot.stride(-1) != 1:
            x_rot = x_rot.contiguous()
        bound, grid = _dot_plan(m, n, ng, n_levels, group_size, None if config is None else tuple(config), mma_rows,
                                bool(x_order), block, f16, packed.dtype, x_rot.device, _lanes_first())
        bound(grid, x_rot, _packed_view(packed, 1), norms, codebook, out, m, n, x_rot.stride(0), out.stride(0))
        return out
    if block or x_order:
        _check_block(n_levels, group_size, ng, block, x_order)  # (raises: no blocks for this codebook)
    geo = unit_geometry(n_levels, group_size)
    bn, warps, stages, lut = _with_mask(config or _dot_config(n, ng, n_levels, group_size), n_levels)
    pk = _packed_view(packed, geo["WPU"])
    grid = (cdiv(n, bn), cdiv(m, block_m))
    launch(_gemv_dot_kernel, grid, x_rot, pk, norms, codebook, out, m, n, ng, x_rot.stride(0), out.stride(0),
           NLEV=n_levels, G=group_size, PER=geo["PER"], PER_P=geo["PER_P"], WPU=geo["WPU"],
           UPG=geo["UPG"], UPG_P=geo["UPG_P"], BN=bn, BM=block_m, LUT_MASK=lut, RUNTIME_LAYOUT=_runtime_layout(packed, n_levels),
           num_warps=warps,
           num_stages=stages)
    return out


@memo
def _dot_plan(m: int, n: int, ng: int, n_levels: int, group_size: int, config, mma_rows: int, x_order: bool,
              block: int, f16: bool, packed_dtype: torch.dtype, device: torch.device, lanes_first: bool) -> tuple:
    """The tensor-core GEMV's launch (`gemv_dot`, 2-, 3- and 4-bit) for these shapes and options: (bound kernel,
    grid)."""
    kb = _check_block(n_levels, group_size, ng, block, x_order) if block or x_order else 0
    kb = kb or mma_block(n_levels, group_size, n, ng, m)
    default = _dot_config(n, ng, n_levels, group_size, kb)
    bm = 8 if m <= 8 else 16
    if m > tuning.DOT_MAX_M:
        default, bm = _mid_config(n, ng, n_levels, group_size, m, kb)
    bm = mma_rows or bm
    cfg = tuple(config or default)
    bn, warps, stages = cfg[:3]
    prefetch = int(cfg[3]) if len(cfg) > 3 and cfg[3] in (0, 1, 2) else default[3]
    opts = {"maxnreg": cfg[4]} if len(cfg) > 4 and cfg[4] else {}
    blocks = cfg[5] if len(cfg) > 5 and cfg[5] else 1
    pdl = _pdl(device)
    if pdl:
        opts["launch_pdl"] = True
    bound = bind(_gemv_mma_kernel, NG=ng, NLEV=n_levels, G=group_size, KB=kb, BN=bn, BM=bm, S=warps * blocks,
                 RUNTIME_LAYOUT=packed_dtype == torch.int32, F16=f16, PREFETCH=prefetch, USE_ASM=not _interpreting(),
                 PDL=pdl, LANES_FIRST=lanes_first, XORDER=x_order, num_warps=warps, num_stages=stages, **opts)
    return bound, (cdiv(n, bn), cdiv(m, bm))


def dequantize_lut(packed: torch.Tensor, norms: torch.Tensor, codebook: torch.Tensor, group_size: int,
                   dtype: torch.dtype, signs1: torch.Tensor | None = None, signs2: torch.Tensor | None = None,
                   in_features: int | None = None, block_rows: int = 64, warps: int = 4,
                   programs: int = 0, select: torch.Tensor | None = None, select_rows: int = 0,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """A 2-, 3- or 4-bit weight decoded with the byte-permute lookups (codebook values at 16-bit precision) into
    a 16-bit `dtype` (float32 in the interpreter): with `signs1`/`signs2` the weight itself, `(rows,
    in_features)` (= `codec.dequantize_weight` within 16-bit rounding), without them the rotated-basis weight
    `(rows, n_groups*G)` (= `codec.rotated_weight`).

    `select` (int tensor of S matrix numbers) with `select_rows` = R: the weight is stacked matrices of R rows
    each (experts) and only the selected ones are decoded, into `(S*R, width)` in the order given; the rows of a
    negative number are neither read nor written. `out`: a tensor of that shape and dtype, rows contiguous, to write
    into (returned) instead of a new one."""
    n, ng = norms.shape
    if select is not None:
        n = select.numel() * select_rows
    n_levels = codebook.numel()
    per = lut_unit(n_levels, group_size)
    if not per:
        raise ValueError(f"the lookup dequantization serves 4-, 8- and 16-entry codebooks, not {n_levels}")
    unrot = signs1 is not None
    width = in_features if unrot else ng * group_size
    if out is None:
        out = torch.empty(n, width, dtype=dtype, device=packed.device)
    elif out.shape != (n, width) or out.dtype != dtype or out.stride(-1) != 1:
        raise ValueError(f"dequantize_lut: `out` must be ({n}, {width}) {dtype} with contiguous rows, not "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if n == 0 or ng == 0:
        return out
    interp = _interpreting()
    if unrot:
        signs1, signs2 = _f32(signs1), _f32(signs2)
        hmat = _hadamard_pm1(group_size, torch.float32 if interp else dtype, packed.device)
    else:
        signs1 = signs2 = hmat = norms  # (unused)
    pk = _packed_view(packed, 1)
    # two programs an SM, each looping over blocks (faster than 4 or 8 an SM or one program a block)
    grid = (min(cdiv(n * ng, block_rows), programs or _sm_count(packed.device) * 2),)
    sel = select.reshape(-1) if select is not None else norms  # (unused without a selection)
    launch(_dequant_lut_kernel, grid, pk, norms.contiguous(), _f32(codebook), signs1, signs2, hmat, out, sel, n, width,
           out.stride(0), 1.0 / math.sqrt(group_size), NG=ng, NLEV=n_levels, G=group_size,
           UPG=group_size // per, BR=block_rows, RUNTIME_LAYOUT=_runtime_layout(packed, n_levels),
           USE_ASM=not interp, UNROT=unrot, SEL_ROWS=select_rows if select is not None else 0,
           num_warps=warps)
    return out


def prefill(x2: torch.Tensor, packed: torch.Tensor, norms: torch.Tensor, codebook: torch.Tensor, signs1: torch.Tensor,
            signs2: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    """`(M, in)` 16-bit activations times a 2-, 3- or 4-bit weight by cuBLAS: the weight decoded into a scratch
    buffer with its rotation undone (`dequantize_lut`), then multiplied with the activations as they are (one
    kernel fewer than rotating them). `norms` contiguous, `codebook` float32."""
    interp = _interpreting()  # (the interpreter multiplies in float32)
    w = dequantize_lut(packed, norms, codebook, group_size, torch.float32 if interp else x2.dtype, signs1, signs2,
                       in_features)
    return torch.nn.functional.linear(x2.float() if interp else x2, w).to(x2.dtype)


def dequantize_rotated(packed: torch.Tensor, norms: torch.Tensor, codebook: torch.Tensor, group_size: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """The weight in the rotated basis, `(rows, n_groups*G)` in `dtype` (= `codec.rotated_weight`)."""
    n, ng = norms.shape
    n_levels = codebook.numel()
    geo = unit_geometry(n_levels, group_size)
    out = torch.empty(n, ng * group_size, dtype=dtype, device=packed.device)
    if n == 0 or ng == 0:
        return out
    pk = _packed_view(packed, geo["WPU"])
    bn = 32
    grid = (cdiv(n, bn), ng)
    launch(_dequant_kernel, grid, pk, norms, codebook, out, n, ng, out.stride(0),
           NLEV=n_levels, G=group_size, PER=geo["PER"], PER_P=geo["PER_P"], WPU=geo["WPU"],
           UPG=geo["UPG"], UPG_P=geo["UPG_P"], BN=bn, LUT_MASK=tuning.LUT_MASKS[n_levels],
           RUNTIME_LAYOUT=_runtime_layout(packed, n_levels),
           num_warps=4)
    return out


# ---------------------------------------------------------------------------
# the op
# ---------------------------------------------------------------------------

_PDL_DEVICES: dict = {}
_SM_COUNTS: dict = {}


def _sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA `device` (8 elsewhere: the interpreter)."""
    if device.type != "cuda":
        return 8
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SM_COUNTS:
        _SM_COUNTS[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SM_COUNTS[key]


def _pdl(device: torch.device, k: int = 0, n_levels: int = 0) -> bool:
    """Whether the rotation and the pair GEMV after it use programmatic dependent launch on `device` for rows of
    `k` rotated inputs: the GEMV's launch and prologue overlap the rotation's run (CUDA, compute capability
    >= 9.0, a Triton with the intrinsics, not the interpreter, k <= PDL_MAX_K, or PDL_MAX_K_PAIRS for the pair
    GEMV of a codebook size in PDL_PAIR_LEVELS; `TURBOQUANT_PDL=0` turns it off)."""
    # (callers pass n_levels for M = 1 only)
    limit = tuning.PDL_MAX_K_PAIRS if n_levels in tuning.PDL_PAIR_LEVELS else tuning.PDL_MAX_K
    if device.type != "cuda" or not _HAS_GDC or k > limit or _interpreting():
        return False
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _PDL_DEVICES:
        from turboquant_hf import settings

        _PDL_DEVICES[key] = torch.cuda.get_device_capability(key)[0] >= 9 and settings.dependent_launch()
    return _PDL_DEVICES[key]


def _interpreting() -> bool:
    """True when this module's kernels were built by Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return type(_rotate_kernel).__name__ == "InterpretedFunction"


def _runtime_layout(packed: torch.Tensor, n_levels: int, signed: bool = False) -> bool:
    """Whether a kernel reads `packed` as the runtime layout (int32 words, `format.runtime_layout`) rather than
    the published byte layout (uint8). 4-bit words keep their nibbles where the published bytes have them and
    hold sign-magnitude codes: only kernels whose lookups take the sign from the top bit (`signed`: the
    tensor-core and pair GEMVs) treat them differently; the others read their nibbles with the runtime codebook
    like published indices."""
    return packed.dtype == torch.int32 and (n_levels != 16 or signed)


def _packed_view(packed: torch.Tensor, wpu: int) -> torch.Tensor:
    """The packed bytes as a flat tensor of units' storage: int32 words (2/3/4-bit) or uint8 (ternary)."""
    if not packed.is_contiguous():
        packed = packed.contiguous()
    flat = packed.reshape(-1)
    if wpu == 0 or packed.dtype == torch.int32:
        return flat
    if flat.storage_offset() % 4:
        flat = flat.clone()
    return flat.view(torch.int32)


def _f32(t: torch.Tensor) -> torch.Tensor:
    t = t if t.dtype == torch.float32 else t.float()
    return t if t.is_contiguous() else t.contiguous()


def path(m: int, n_levels: int, group_size: int, dtype: torch.dtype, packed: torch.Tensor | None = None) -> str:
    """The product for M activation rows in `dtype` (the one dispatch table of `product` and `linear`): "pairs"
    (`gemv_pairs`, M <= PAIR_MAX_M, 16-bit, a lookup unit), "fma" (`gemv_fma`, M <= FMA_MAX_M, or float32 up to
    DOT_MAX_M), "gemm" (`gemm.gemm`, GEMM_MIN_M <= M <= GEMM_MAX_M, 16-bit, a weight `gemm.dispatched` routes to
    it), "dot" (`gemv_dot`, M <= DOT_MAX_M or `mid_m`), else "prefill" (dequantize, then cuBLAS)."""
    sixteen = dtype in (torch.bfloat16, torch.float16)
    if m <= tuning.PAIR_MAX_M and sixteen and lut_unit(n_levels, group_size):
        return "pairs"
    if m <= tuning.FMA_MAX_M or (m <= tuning.DOT_MAX_M and not sixteen):
        return "fma"
    if sixteen and tuning.GEMM_MIN_M <= m <= tuning.GEMM_MAX_M and gemm.dispatched(n_levels, group_size, packed):
        return "gemm"
    if m <= tuning.DOT_MAX_M or mid_m(m, n_levels, group_size, dtype):
        return "dot"
    return "prefill"


def product(x_rot: torch.Tensor, packed: torch.Tensor, norms: torch.Tensor, codebook: torch.Tensor,
            group_size: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Already-rotated activations `(M, n_groups*G)` times the packed weight -> `(M, rows)` in `out_dtype`.

    The codebook product alone (the CUDA side of `turboquant_hf.modeling.ops.codebook_matmul`): any rotation of
    the activations (per-group WHT, whole-row Hadamard, ...) can feed it. `norms` are per-group scales
    and `codebook` the values they multiply, both tensors, so per-module codebooks work unchanged."""
    m = x_rot.shape[0]
    sixteen = out_dtype in (torch.bfloat16, torch.float16)
    unit = lut_unit(codebook.numel(), group_size)
    route = path(m, codebook.numel(), group_size, out_dtype, packed)
    if route == "pairs":
        x2, xs = pack_pairs(x_rot, unit, group_size)
        return gemv_pairs(x2, xs, packed, norms, codebook, group_size, out_dtype)
    norms = norms.contiguous()  # (float16 norms are read as they are)
    codebook = _f32(codebook)
    if route == "gemm":  # (activations rotated elsewhere, in the natural order)
        cfg = gemm.gemm_config(m, norms.shape[0], norms.shape[1], codebook.numel(), group_size, lanes=False)
        interp = _interpreting()  # (the interpreter runs the GEMM in float32)
        return gemm.gemm(x_rot.to(torch.float32 if interp else out_dtype), packed, norms, codebook, group_size,
                         out_dtype, config=cfg, runtime_layout=packed.dtype == torch.int32, use_asm=not interp,
                         lanes_first=_lanes_first())
    if route == "fma":
        return gemv_fma(_f32(x_rot), packed, norms, codebook, group_size, out_dtype)
    if route == "dot":
        xr = x_rot.float().contiguous() if _interpreting() else x_rot.to(out_dtype).contiguous()
        return gemv_dot(xr, packed, norms, codebook, group_size, out_dtype)
    xr = x_rot.to(out_dtype if sixteen else torch.float32).contiguous()
    if sixteen and unit and not _interpreting():
        w = dequantize_lut(packed, norms, codebook, group_size, xr.dtype)
    else:
        w = dequantize_rotated(packed, norms, codebook, group_size, xr.dtype)
    y = torch.nn.functional.linear(xr, w)
    return y if y.dtype == out_dtype else y.to(out_dtype)


def linear(x: torch.Tensor, packed: torch.Tensor, norms: torch.Tensor, codebook: torch.Tensor,
           signs1: torch.Tensor, signs2: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    """The whole op through the Triton kernels (same contract as `turboquant_hf.modeling.ops.turboquant_linear`)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features)
    m = x2.shape[0]
    s1, s2 = _f32(signs1), _f32(signs2)
    n, ng = norms.shape
    if m == 0:
        return x.new_empty(*lead, n)
    dt = x.dtype
    route, unit, order, kb, cfg = _linear_route(m, n, ng, codebook.numel(), group_size, dt, packed.dtype)
    if route == "pairs":
        xp, xs = rotate(x2, s1, s2, group_size, dt, unit=unit)
        return gemv_pairs(xp, xs, packed, norms, codebook, group_size, dt).reshape(*lead, n)
    if route == "dot":
        # (the interpreter gets 16-bit dots wrong: it runs this path in float32)
        x_rot = rotate(x2, s1, s2, group_size, torch.float32 if _interpreting() else dt,
                       mma_levels=codebook.numel() if order else 0, mma_block=kb if order else 0)
        return gemv_dot(x_rot, packed, norms.contiguous(), _f32(codebook), group_size, dt, x_order=order,
                        block=kb).reshape(*lead, n)
    sixteen = dt in (torch.bfloat16, torch.float16)
    norms = norms.contiguous()  # (float16 norms are read as they are)
    codebook = _f32(codebook)
    if route == "gemm":
        interp = _interpreting()  # (the interpreter runs the GEMM in float32)
        x_rot = rotate(x2, s1, s2, group_size, torch.float32 if interp else dt,
                       lane_unit=gemm.lane_unit(codebook.numel()) if cfg[5] else 0, lane_block=cfg[2])
        y = gemm.gemm(x_rot, packed, norms, codebook, group_size, dt, config=cfg,
                      runtime_layout=packed.dtype == torch.int32, use_asm=not interp, lanes_first=_lanes_first())
        return y.reshape(*lead, n)
    if route == "fma":
        x_rot = rotate(x2, s1, s2, group_size, torch.float32)
        y = gemv_fma(x_rot, packed, norms, codebook, group_size, dt)
    elif sixteen and unit:
        y = prefill(x2, packed, norms, codebook, s1, s2, group_size, in_features)
    else:
        x_rot = rotate(x2, s1, s2, group_size, dt if sixteen else torch.float32)
        w = dequantize_rotated(packed, norms, codebook, group_size, x_rot.dtype)
        y = torch.nn.functional.linear(x_rot, w)
        if y.dtype != dt:
            y = y.to(dt)
    return y.reshape(*lead, n)


@memo
def _linear_route(m: int, n: int, ng: int, n_levels: int, group_size: int, dtype: torch.dtype,
                  packed_dtype: torch.dtype) -> tuple:
    """`linear`'s choices for M rows of `dtype` times an `(n, ng groups)` weight: (route as `path` names it, the
    pair GEMV's unit, the tensor-core GEMV's activation order and block, the GEMM's configuration)."""
    probe = torch.empty(0, dtype=packed_dtype)  # (`path` looks at the packed tensor's dtype only)
    route = path(m, n_levels, group_size, dtype, probe)
    unit = lut_unit(n_levels, group_size)
    order, kb, cfg = False, 0, None
    if route == "dot":
        order = uses_x_order(n, ng, n_levels, group_size)
        kb = mma_block(n_levels, group_size, n, ng, m)
    elif route == "gemm":
        cfg = gemm.gemm_config(m, n, ng, n_levels, group_size)
    return route, unit, order, kb, cfg
