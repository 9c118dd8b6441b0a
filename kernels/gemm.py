"""The packed-weight GEMM: rotated activations times a 2-, 3- or 4-bit weight on the tensor cores (wgmma on
sm_90), the weight decoded tile by tile in registers and never written to memory.

Each program computes a `[BM, BN]` tile of the output (BM activation rows, BN weight rows) over a range of the
row's blocks of BK inputs (all of them, or one of SPLIT ranges: split-K). Per block it loads the packed words of
its BN rows and their group norms, decodes them with the byte-permute lookups into 16-bit pairs scaled by the
norms (`mul.rn.bf16x2`), and runs one `tl.dot` with the `[BM, BK]` activations, float32 accumulation. SWAP puts
the weight on the left (`[BN, BM]` accumulator: the decoded tile is the operand that wgmma can take from
registers, and BM can be as small as 16); otherwise the activations are on the left. With SPLIT > 1 every
program writes its float32 partial tile to a workspace and counts itself in a per-tile counter; the last one adds
the partials, writes the output and resets the counter to zero, so the kernel needs no zeroed buffer per call
and no second launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuning
from .gemv_mma import (
    _mma_pairs,
    _mma_pairs2,
    _mma_scale,
    _mma_values,
    _mma_words,
    _norm_pattern,
)
from .launch import bind, cdiv, launch, memo, next_power_of_2, triton_version
from .lut import _byte_tables, _unit_nibbles
from .ptx import _TOP3_ASM


@triton.jit
def _nat4(a, b, c, d):
    """Four same-shape tensors -> `[..., 2, 2]` that flattens to a, b, c, d (each `tl.join` adds the fastest
    axis, so the lowest bit of the position is joined last)."""
    return tl.join(tl.join(a, c), tl.join(b, d))


@triton.jit
def _nat8(x0, x1, x2, x3, x4, x5, x6, x7):
    """Eight same-shape tensors -> `[..., 2, 2, 2]` that flattens to x0, x1, ..., x7."""
    return tl.join(_nat4(x0, x2, x4, x6), _nat4(x1, x3, x5, x7))


@triton.jit
def _nat16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    """Sixteen same-shape tensors -> `[..., 2, 2, 2, 2]` that flattens to x0, x1, ..., x15."""
    return tl.join(_nat8(x0, x2, x4, x6, x8, x10, x12, x14), _nat8(x1, x3, x5, x7, x9, x11, x13, x15))


@triton.jit
def _scaled4(p0, p1, p2, p3, nsc, F16: tl.constexpr, USE_ASM: tl.constexpr):
    return (_mma_scale(p0, nsc, F16, USE_ASM), _mma_scale(p1, nsc, F16, USE_ASM),
            _mma_scale(p2, nsc, F16, USE_ASM), _mma_scale(p3, nsc, F16, USE_ASM))


@triton.jit
def _chunk_pairs(w0, w1, w2, CH: tl.constexpr, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV: tl.constexpr,
                 RUNTIME_LAYOUT: tl.constexpr, F16: tl.constexpr, USE_ASM: tl.constexpr):
    """Values 8 CH .. 8 CH + 7 of every unit as four uint32 pairs (values 2i, 2i + 1 of the chunk), times the
    norms."""
    if NLEV == 16:
        d = w0
    elif NLEV == 8 and RUNTIME_LAYOUT and CH == 3 and USE_ASM:
        d = tl.inline_asm_elementwise(_TOP3_ASM, "=r,r,r,r", [w0, w1, w2], dtype=tl.uint32, is_pure=True, pack=1)
    else:
        d = _unit_nibbles(w0, w1, w2, CH, NLEV, RUNTIME_LAYOUT)
    p0, p1, p2, p3 = _mma_pairs(d, t0, t1, t2, t3, t4, t5, t6, t7, NLEV, USE_ASM, RUNTIME_LAYOUT)
    return _scaled4(p0, p1, p2, p3, nsc, F16, USE_ASM)


@triton.jit
def _unit_pairs(w0, w1, w2, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV: tl.constexpr, RUNTIME_LAYOUT: tl.constexpr,
                F16: tl.constexpr, USE_ASM: tl.constexpr):
    """Units (uint32 words w0..w2, any shape `[...]`) -> their PER / 2 value pairs (uint32: values 2q, 2q + 1, the
    first in the low half) times the norms `nsc` (the 16-bit pattern twice, float32 in the interpreter; the shape
    of w0), as `[..., 2, ..., 2]` that flattens to q = 0, 1, ... (the first new axis the highest bit of q)."""
    if NLEV == 4 and RUNTIME_LAYOUT:
        a0, a1, a2, a3, b0, b1, b2, b3 = _mma_pairs2(w0, t0, t2, USE_ASM)
        a0, a1, a2, a3 = _scaled4(a0, a1, a2, a3, nsc, F16, USE_ASM)
        b0, b1, b2, b3 = _scaled4(b0, b1, b2, b3, nsc, F16, USE_ASM)
        v = _nat8(a0, a1, a2, a3, b0, b1, b2, b3)
    elif NLEV == 16:
        a0, a1, a2, a3 = _chunk_pairs(w0, w1, w2, 0, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV, RUNTIME_LAYOUT, F16,
                                      USE_ASM)
        v = _nat4(a0, a1, a2, a3)
    elif NLEV == 4:
        a0, a1, a2, a3 = _chunk_pairs(w0, w1, w2, 0, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV, RUNTIME_LAYOUT, F16,
                                      USE_ASM)
        b0, b1, b2, b3 = _chunk_pairs(w0, w1, w2, 1, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV, RUNTIME_LAYOUT, F16,
                                      USE_ASM)
        v = _nat8(a0, a1, a2, a3, b0, b1, b2, b3)
    else:
        a0, a1, a2, a3 = _chunk_pairs(w0, w1, w2, 0, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV, RUNTIME_LAYOUT, F16,
                                      USE_ASM)
        b0, b1, b2, b3 = _chunk_pairs(w0, w1, w2, 1, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV, RUNTIME_LAYOUT, F16,
                                      USE_ASM)
        c0, c1, c2, c3 = _chunk_pairs(w0, w1, w2, 2, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV, RUNTIME_LAYOUT, F16,
                                      USE_ASM)
        e0, e1, e2, e3 = _chunk_pairs(w0, w1, w2, 3, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV, RUNTIME_LAYOUT, F16,
                                      USE_ASM)
        v = _nat16(a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, e0, e1, e2, e3)
    return v


@triton.jit
def _unit_values(w0, w1, w2, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV: tl.constexpr, RUNTIME_LAYOUT: tl.constexpr,
                 F16: tl.constexpr, USE_ASM: tl.constexpr):
    """Units `[R, U]` -> `[R, U * PER]` 16-bit values times the norms, in the natural order of the inputs."""
    PER: tl.constexpr = 32 if NLEV == 8 else (8 if NLEV == 16 else 16)
    R: tl.constexpr = w0.shape[0]
    U: tl.constexpr = w0.shape[1]
    v = _unit_pairs(w0, w1, w2, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV, RUNTIME_LAYOUT, F16, USE_ASM)
    return tl.reshape(_mma_values(tl.reshape(v, [R, U * PER // 2]), F16, USE_ASM), [R, U * PER])


@triton.jit
def _lane_values(w0, w1, w2, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV: tl.constexpr, RUNTIME_LAYOUT: tl.constexpr,
                 F16: tl.constexpr, USE_ASM: tl.constexpr, LANES_FIRST: tl.constexpr):
    """Units as the 6-D tile of `_gemm_kernel` (axes (t, l, w, h, a, r), or (h, a, w, l, t, r) without
    LANES_FIRST) -> `[BN, BK]` 16-bit values times the norms in the lane order: row 16 (w + W a) + 8 h + l, input
    k = 8 (r PER/2 + q) + 2 t + e for value 2q + e of the unit. Each lane decodes whole units, and the result is
    already in the layout of wgmma's register operand (no shared-memory round trip)."""
    PER: tl.constexpr = 32 if NLEV == 8 else (8 if NLEV == 16 else 16)
    R: tl.constexpr = w0.shape[5]
    BN: tl.constexpr = w0.shape[0] * w0.shape[1] * w0.shape[2] * w0.shape[3] * w0.shape[4] // 4
    BK: tl.constexpr = 4 * R * PER
    v = _unit_pairs(w0, w1, w2, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV, RUNTIME_LAYOUT, F16, USE_ASM)
    # axes -> (a, w, h, l, r, q..., t); one literal order per unit size and axis order
    if LANES_FIRST:  # from (t, l, w, h, a, r, q...)
        if NLEV == 8:
            v = tl.permute(v, (4, 2, 3, 1, 5, 6, 7, 8, 9, 0))
        elif NLEV == 16:
            v = tl.permute(v, (4, 2, 3, 1, 5, 6, 7, 0))
        else:
            v = tl.permute(v, (4, 2, 3, 1, 5, 6, 7, 8, 0))
    else:  # from (h, a, w, l, t, r, q...)
        if NLEV == 8:
            v = tl.permute(v, (1, 2, 0, 3, 5, 6, 7, 8, 9, 4))
        elif NLEV == 16:
            v = tl.permute(v, (1, 2, 0, 3, 5, 6, 7, 4))
        else:
            v = tl.permute(v, (1, 2, 0, 3, 5, 6, 7, 8, 4))
    return tl.reshape(_mma_values(tl.reshape(v, [BN, BK // 2]), F16, USE_ASM), [BN, BK])


@triton.jit
def _block_words(pk_ptr, wrow, wun, nptr, b, NUT: tl.constexpr, WPU: tl.constexpr, UPB: tl.constexpr,
                 BPG: tl.constexpr, RUNTIME_LAYOUT: tl.constexpr):
    """The packed words (units `wun` of block b of rows `wrow`) and the norms (at `nptr`) of block b."""
    w0, w1, w2 = _mma_words(pk_ptr, wrow, b * UPB + wun, NUT, WPU, RUNTIME_LAYOUT, False)
    return w0, w1, w2, tl.load(nptr + b // BPG)


@triton.jit
def _tile_acc(x_ptr, xsrc, stride_xm, pk_ptr, nrm_ptr, wbase, n0, N, b0, t0, t1, t2, t3, t4, t5, t6, t7,
              NG: tl.constexpr, KSTEPS: tl.constexpr, NLEV: tl.constexpr, G: tl.constexpr, BK: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, SWAP: tl.constexpr, RUNTIME_LAYOUT: tl.constexpr,
              F16: tl.constexpr, USE_ASM: tl.constexpr, LANES: tl.constexpr, WARPS: tl.constexpr,
              LANES_FIRST: tl.constexpr, PREFETCH: tl.constexpr = 0):
    """The float32 product of activation rows `xsrc` (`[BM]` row numbers of x) with weight rows `wbase + n0 ...
    wbase + n0 + BN - 1` (clamped to `wbase + N - 1`) over blocks b0 ... b0 + KSTEPS - 1 of BK inputs: `[BN, BM]`
    with SWAP, else `[BM, BN]` (see `_gemm_kernel` for SWAP and LANES). PREFETCH: the packed words and norms of
    block b + 1 are loaded into registers before block b is decoded (the software pipeline stages only the
    activations, which go through shared memory)."""
    PER: tl.constexpr = 32 if NLEV == 8 else (8 if NLEV == 16 else 16)
    WPU: tl.constexpr = 3 if NLEV == 8 else 1
    UPB: tl.constexpr = BK // PER
    NUT: tl.constexpr = NG * (G // PER)
    BPG: tl.constexpr = G // BK  # blocks a group
    rn = wbase + tl.minimum(n0 + tl.arange(0, BN), N - 1)
    ub = tl.arange(0, UPB)[None, :]
    kk = tl.arange(0, BK)[None, :]
    xrow = x_ptr + xsrc[:, None] * stride_xm + kk
    nrow = nrm_ptr + rn * NG
    if LANES:
        R: tl.constexpr = UPB // 4
        A: tl.constexpr = BN // (16 * WARPS)
        if LANES_FIRST:
            lt = tl.arange(0, 4)[:, None, None, None, None, None]
            ll = tl.arange(0, 8)[None, :, None, None, None, None]
            lh = tl.arange(0, 2)[None, None, None, :, None, None]
            la = tl.arange(0, A)[None, None, None, None, :, None]
        else:
            lh = tl.arange(0, 2)[:, None, None, None, None, None]
            la = tl.arange(0, A)[None, :, None, None, None, None]
            ll = tl.arange(0, 8)[None, None, None, :, None, None]
            lt = tl.arange(0, 4)[None, None, None, None, :, None]
        lw = tl.arange(0, WARPS)[None, None, :, None, None, None]
        lr = tl.arange(0, R)[None, None, None, None, None, :]
        ub6 = ((lt & 1) * 2 + (lt >> 1)) * R + lr
        rn6 = wbase + tl.minimum(n0 + 16 * (lw + WARPS * la) + 8 * lh + ll, N - 1)
    if SWAP:
        acc = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    if LANES:
        wrow = rn6
        wun = ub6
        nptr = nrm_ptr + (rn6 + 0 * lt) * NG  # (every lane t of a row loads the norm: it arrives in the words' layout)
    else:
        wrow = rn[:, None]
        wun = ub
        nptr = nrow
    if PREFETCH:
        c0, c1, c2, cn = _block_words(pk_ptr, wrow, wun, nptr, b0, NUT, WPU, UPB, BPG, RUNTIME_LAYOUT)
    for i in range(KSTEPS):
        b = b0 + i
        if PREFETCH:
            w0, w1, w2, nr = c0, c1, c2, cn
            c0, c1, c2, cn = _block_words(pk_ptr, wrow, wun, nptr, b0 + tl.minimum(i + 1, KSTEPS - 1), NUT, WPU,
                                          UPB, BPG, RUNTIME_LAYOUT)
        else:
            w0, w1, w2, nr = _block_words(pk_ptr, wrow, wun, nptr, b, NUT, WPU, UPB, BPG, RUNTIME_LAYOUT)
        nsc = _norm_pattern(nr.to(tl.float32), F16, USE_ASM)
        if LANES:
            nsc = tl.broadcast_to(nsc, w0.shape)
            w = _lane_values(w0, w1, w2, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV, RUNTIME_LAYOUT, F16, USE_ASM,
                             LANES_FIRST)
        else:
            nsc = tl.broadcast_to(nsc[:, None], [BN, UPB])
            w = _unit_values(w0, w1, w2, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV, RUNTIME_LAYOUT, F16, USE_ASM)
        xt = tl.load(xrow + b * BK)
        if SWAP:
            acc = tl.dot(w, tl.trans(xt), acc)
        else:
            acc = tl.dot(xt, tl.trans(w), acc)
    return acc


@triton.jit
def _gemm_kernel(x_ptr, pk_ptr, nrm_ptr, cb_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_xm, stride_om, SPLIT,
                 NG: tl.constexpr, KSTEPS: tl.constexpr, NLEV: tl.constexpr, G: tl.constexpr, BK: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, SWAP: tl.constexpr, GROUP: tl.constexpr,
                 RUNTIME_LAYOUT: tl.constexpr, F16: tl.constexpr, USE_ASM: tl.constexpr, LANES: tl.constexpr = 0,
                 WARPS: tl.constexpr = 4, LANES_FIRST: tl.constexpr = 1, PREFETCH: tl.constexpr = 0):
    """`out[M, N] = x[M, NG*G] @ W^T`, W the packed weight (see the module docstring). Grid: (tiles, SPLIT), the
    tiles in groups of GROUP activation-row tiles per weight-row tile (neighbouring programs share weight tiles
    in L2); program k of a tile takes blocks k KSTEPS .. (k + 1) KSTEPS - 1 (SPLIT KSTEPS = the row's blocks). Rows
    past M and N read row M-1 / N-1 (not stored).

    LANES (with SWAP; BN a multiple of 16 WARPS, WARPS = num_warps): the weight tile is loaded as a 6-D tile --
    four lanes t over the units of a row (lanes 1 and 2 swapped, so that no lane's words continue its neighbour's
    and the load is not vectorized across lanes), eight lanes l and the warps w over rows, registers h, a over
    rows and r over a lane's units -- and decoded with `_lane_values` straight into wgmma's register-operand
    layout; the activations must be in the lane order (`rotate(..., lane_unit=PER)`). The axes are (t, l, w, h,
    a, r) with LANES_FIRST (a Triton whose coalescing orders a load's non-contiguous axes ascending, before
    3.7), else (h, a, w, l, t, r): either way the coalesced load puts the lanes on t and l and the warps on w
    (`linear._lanes_first`)."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    width = GROUP * grid_n
    first_m = (pid // width) * GROUP
    gsize = tl.minimum(grid_m - first_m, GROUP)
    pid_m = first_m + (pid % width) % gsize
    pid_n = (pid % width) // gsize
    t0, t1, t2, t3, t4, t5, t6, t7 = _byte_tables(cb_ptr, NLEV, 2 if F16 else 1)
    rm = tl.minimum(pid_m * BM + tl.arange(0, BM), M - 1).to(tl.int64)
    acc = _tile_acc(x_ptr, rm, stride_xm, pk_ptr, nrm_ptr, 0, pid_n * BN, N, pid_k * KSTEPS,
                    t0, t1, t2, t3, t4, t5, t6, t7, NG, KSTEPS, NLEV, G, BK, BM, BN, SWAP, RUNTIME_LAYOUT, F16,
                    USE_ASM, LANES, WARPS, LANES_FIRST, PREFETCH)
    if SWAP:
        acc = tl.trans(acc)
    om = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    on = pid_n * BN + tl.arange(0, BN)
    omask = (om < M)[:, None] & (on < N)[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + om[:, None] * stride_om + on[None, :], acc.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        # partial tiles in a [SPLIT, M, N] float32 workspace; the last program of the tile adds them up
        wsp = ws_ptr + om[:, None] * N + on[None, :]
        tl.store(wsp + pid_k.to(tl.int64) * M * N, acc, mask=omask)
        tl.debug_barrier()
        seen = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel")
        if seen == SPLIT - 1:
            tot = tl.zeros([BM, BN], dtype=tl.float32)
            s = 0
            while s < SPLIT:
                tot += tl.load(wsp + s.to(tl.int64) * M * N, mask=omask, other=0.0, cache_modifier=".cg")
                s += 1
            tl.store(out_ptr + om[:, None] * stride_om + on[None, :], tot.to(out_ptr.dtype.element_ty), mask=omask)
            tl.atomic_xchg(cnt_ptr + pid, 0, sem="relaxed")


@triton.jit
def _routed_block(offs_ptr, E: tl.constexpr, EP: tl.constexpr, BM: tl.constexpr):
    """Block `program_id(0)` of the routed products (`_routed_gemm_kernel`, `moe._routed_lut_mm_kernel`): blocks of
    BM rows inside each expert's group, group e ending at `offs[e]`, numbered group after group. Returns (its
    expert, E for a block past the last group; its rows, clamped into the group; which of them are in it)."""
    b = tl.program_id(0)
    ee = tl.arange(0, EP)
    ends = tl.load(offs_ptr + ee, mask=ee < E, other=0)
    starts = tl.load(offs_ptr + ee - 1, mask=(ee > 0) & (ee < E), other=0)
    blocks = (tl.maximum(ends - starts, 0) + BM - 1) // BM
    last = tl.cumsum(blocks, 0)  # (blocks of groups 0..e)
    ex = tl.sum((last <= b).to(tl.int32), 0)
    pick = ee == ex
    row0 = tl.sum(tl.where(pick, starts + (b - (last - blocks)) * BM, 0), 0)
    end = tl.sum(tl.where(pick, ends, 0), 0)
    rows = row0 + tl.arange(0, BM)
    rmask = rows < end
    return ex, tl.minimum(rows, end - 1), rmask


@triton.jit
def _routed_gemm_kernel(x_ptr, xrow_ptr, offs_ptr, pk_ptr, nrm_ptr, cb_ptr, out_ptr, N, stride_xm, stride_om,
                        E: tl.constexpr, EP: tl.constexpr, NG: tl.constexpr, NLEV: tl.constexpr, G: tl.constexpr,
                        BK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SWAP: tl.constexpr,
                        RUNTIME_LAYOUT: tl.constexpr, F16: tl.constexpr, USE_ASM: tl.constexpr, GATHER: tl.constexpr,
                        LANES: tl.constexpr = 0, WARPS: tl.constexpr = 4, LANES_FIRST: tl.constexpr = 1,
                        PREFETCH: tl.constexpr = 0):
    """Rows grouped by expert (group e ends at `offs[e]`) times their experts' packed matrices (E stacked `[N,
    NG*G]` weights): `out[r] = x[src(r)] @ W_e(r)^T`, the tiles as `_gemm_kernel`'s (`_tile_acc`).

    Program (b, j): block b of BM rows inside one expert's group (the block's expert is found from the group
    sizes, so the grid is a bound known without the counts: blocks past the last group return at once), weight
    rows j*BN ... of that expert. GATHER: row r reads x row `xrow[r]` (the routed pairs' tokens), else row r."""
    ex, rows, rmask = _routed_block(offs_ptr, E, EP, BM)
    if ex >= E:
        return
    if GATHER:
        src = tl.load(xrow_ptr + rows).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    n0 = tl.program_id(1) * BN
    t0, t1, t2, t3, t4, t5, t6, t7 = _byte_tables(cb_ptr, NLEV, 2 if F16 else 1)
    acc = _tile_acc(x_ptr, src, stride_xm, pk_ptr, nrm_ptr, ex.to(tl.int64) * N, n0, N, 0,
                    t0, t1, t2, t3, t4, t5, t6, t7, NG, NG * G // BK, NLEV, G, BK, BM, BN, SWAP, RUNTIME_LAYOUT,
                    F16, USE_ASM, LANES, WARPS, LANES_FIRST, PREFETCH)
    if SWAP:
        acc = tl.trans(acc)
    on = n0 + tl.arange(0, BN)
    optr = out_ptr + rows.to(tl.int64)[:, None] * stride_om + on[None, :]
    tl.store(optr, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & (on < N)[None, :])


# ---------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------

_COUNTERS: dict = {}


def _counters(device: torch.device):
    """The per-tile arrival counters of split-K on `device` (int32, zero between launches: the last program of
    each tile resets its own), made on first use; None while a CUDA graph is being captured and none exists yet
    (an allocation then would belong to the graph's private pool)."""
    key = str(device)
    cnt = _COUNTERS.get(key)
    if cnt is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        cnt = _COUNTERS[key] = torch.zeros(tuning.GEMM_COUNTERS, dtype=torch.int32, device=device)
    return cnt


def lane_unit(n_levels: int) -> int:
    """Indices a unit of the runtime layout (what `rotate(..., lane_unit=...)` takes for this codebook size)."""
    return {4: 16, 8: 32, 16: 8}[n_levels]


def serves(n_levels: int, group_size: int) -> bool:
    """Whether `gemm` serves weights of this codebook size and group size: a byte-permute unit (4, 8 or 16
    entries) and groups of 64 inputs or a multiple of 128."""
    return n_levels in (4, 8, 16) and (group_size == 64 or group_size % 128 == 0)


def dispatched(n_levels: int, group_size: int, packed: torch.Tensor | None = None) -> bool:
    """Whether the dispatch routes a weight of this codebook size, group size and packed form to the GEMM (its
    rows aside): one it serves, of the tiers `tuning.GEMM_LEVELS` and groups a multiple of
    `tuning.GEMM_GROUP_MULTIPLE`, in the runtime layout or (2- and 3-bit) the published bytes."""
    return (n_levels in tuning.GEMM_LEVELS and group_size % tuning.GEMM_GROUP_MULTIPLE == 0
            and serves(n_levels, group_size) and (packed is None or packed.dtype == torch.int32 or n_levels != 16))


def gemm_config(m: int, n: int, ng: int, n_levels: int, group_size: int, lanes: bool = True) -> tuple:
    """(BM, BN, BK, SPLIT, SWAP, LANES, GROUP, num_warps, num_stages) for M activation rows and an `(n, ng
    groups)` weight: the bucket of M from `tuning.GEMM_CONFIGS`, BK the group size up to 128, SPLIT raised until the
    tiles fill the GPU's multiprocessors twice (at most the bucket's and `tuning.GEMM_MAX_SPLIT`, each split at least 4
    blocks). LANES where the table says so and the geometry allows it (`lanes` False: never, for activations in
    the natural order)."""
    bk = min(group_size, 128)
    for top, cfg in tuning.GEMM_CONFIGS:
        if m <= top:
            break
    bm, bn, swap, use_lanes, group, warps, stages, max_split = cfg
    lanes = bool(lanes and use_lanes and swap and bn % (16 * warps) == 0 and bk % (4 * lane_unit(n_levels)) == 0)
    tiles = cdiv(m, bm) * cdiv(n, bn)
    nblk = ng * group_size // bk
    split = 1
    while (split * 2 <= min(max_split, tuning.GEMM_MAX_SPLIT) and tiles * split < 2 * tuning.GEMM_SMS
           and nblk % (split * 2) == 0 and nblk // (split * 2) >= 4):
        split *= 2
    return bm, bn, bk, split, swap, lanes, group, warps, stages


@memo
def _gemm_plan(m: int, n: int, ng: int, n_levels: int, group_size: int, config: tuple, runtime_layout: bool,
               use_asm: bool, lanes_first: bool, f16: bool) -> tuple:
    """`gemm`'s launch for these shapes and options: (tiles, split, the kernel bound for that split, the kernel
    bound without split-K: for a launch with no counters)."""
    bm, bn, bk, split, swap, lanes, group, warps, stages = config
    if lanes and (not swap or bn % (16 * warps) or bk % (4 * lane_unit(n_levels))):
        raise ValueError(f"the lane order needs SWAP, BN a multiple of 16 num_warps and blocks of four lanes' units, "
                         f"not {config}")
    if group_size % bk or (ng * group_size // bk) % split:
        raise ValueError(f"blocks of {bk} inputs must divide the group ({group_size}), and the split ({split}) "
                         f"the row's {ng * group_size // bk} blocks")
    tiles = cdiv(m, bm) * cdiv(n, bn)
    if tiles > tuning.GEMM_COUNTERS:
        split = 1

    def bound(s: int):
        return bind(_gemm_kernel, NG=ng, KSTEPS=ng * group_size // bk // s, NLEV=n_levels, G=group_size, BK=bk,
                    BM=bm, BN=bn, SWAP=bool(swap), GROUP=group, RUNTIME_LAYOUT=runtime_layout, F16=f16,
                    USE_ASM=use_asm, LANES=bool(lanes), WARPS=warps, LANES_FIRST=lanes_first,
                    PREFETCH=tuning.GEMM_PREFETCH, num_warps=warps, num_stages=stages)

    return tiles, split, bound(split), bound(1) if split > 1 else None


def gemm(x_rot: torch.Tensor, packed: torch.Tensor, norms: torch.Tensor, codebook: torch.Tensor, group_size: int,
         out_dtype: torch.dtype, config=None, runtime_layout: bool = True, use_asm: bool = True,
         lanes_first: bool | None = None) -> torch.Tensor:
    """`(M, n_groups*G)` rotated 16-bit activations (float32 in the interpreter) times the packed weight ->
    `(M, rows)` in `out_dtype`. `config`: as `gemm_config` returns it. `runtime_layout`: `packed` is in the
    runtime layout (int32 words); `use_asm`: the inline-PTX decode (False: the interpreter's). With LANES in the
    configuration the activations must be in the lane order (`linear.rotate(..., lane_unit=lane_unit(levels),
    lane_block=BK)`). `lanes_first`: the 6-D tile's axis order (`linear._lanes_first`; None: by the Triton
    version)."""
    m = x_rot.shape[0]
    n, ng = norms.shape
    n_levels = codebook.numel()
    if not serves(n_levels, group_size):
        raise ValueError(f"the packed-weight GEMM serves 4-, 8- and 16-entry codebooks at G = 64 or a multiple of "
                         f"128, not {n_levels} entries at G = {group_size}")
    out = torch.empty(m, n, dtype=out_dtype, device=x_rot.device)
    if m == 0 or n == 0:
        return out
    f16 = (x_rot.dtype if x_rot.dtype != torch.float32 else out_dtype) == torch.float16
    tiles, split, kernel, unsplit = _gemm_plan(
        m, n, ng, n_levels, group_size, tuple(config or gemm_config(m, n, ng, n_levels, group_size)),
        runtime_layout, use_asm, triton_version() < (3, 7) if lanes_first is None else bool(lanes_first), f16)
    if x_rot.stride(-1) != 1:
        x_rot = x_rot.contiguous()
    cnt = _counters(x_rot.device) if split > 1 else None
    if cnt is None and split > 1:  # (no counters yet while a CUDA graph is captured)
        split, kernel = 1, unsplit
    ws = torch.empty(split, m, n, dtype=torch.float32, device=x_rot.device) if split > 1 else out
    flat = packed.reshape(-1)
    if packed.dtype != torch.int32:
        flat = flat.view(torch.int32)
    kernel((tiles, split), x_rot, flat, norms, codebook, out, ws, cnt if cnt is not None else norms, m, n,
           x_rot.stride(0), out.stride(0), split)
    return out


def routed_block_rows(pairs: int, experts: int) -> int:
    """Rows a block of the routed products (`routed_gemm`, `moe.routed_lut_mm`) takes for `pairs` rows over `experts`
    groups: twice the mean group size rounded up to a power of two, 16 to 128 (a group seldom spans two blocks, so
    each routed expert's tiles are decoded about once)."""
    mean = max(1, -(-pairs // experts))
    return max(16, min(128, next_power_of_2(2 * mean)))


def routed_config(pairs: int, experts: int, n: int, n_levels: int, group_size: int) -> tuple:
    """(BM, BN, BK, SWAP, LANES, num_warps, num_stages) of `routed_gemm` for `pairs` rows over `experts` groups:
    blocks of `routed_block_rows`, the weight on the left."""
    bm = routed_block_rows(pairs, experts)
    bn, warps = (64, 4) if bm <= 32 or n <= 1024 else (128, 4 if bm <= 64 else 8)
    bk = min(group_size, 128)
    lanes = bn % (16 * warps) == 0 and bk % (4 * lane_unit(n_levels)) == 0
    return bm, bn, bk, True, lanes, warps, 3


def routed_gemm(x_rot: torch.Tensor, offs: torch.Tensor, packed: torch.Tensor, norms: torch.Tensor,
                codebook: torch.Tensor, group_size: int, num_experts: int, out_dtype: torch.dtype,
                xrow: torch.Tensor | None = None, config=None, runtime_layout: bool = True, use_asm: bool = True,
                lanes_first: bool | None = None) -> torch.Tensor:
    """Rows grouped by expert times their experts' packed matrices on the tensor cores (no scratch buffer, no
    host synchronisation): `(P, rows per expert)` in `out_dtype`.

    `x_rot`: rotated activations `(T, n_groups*G)` (16-bit; float32 in the interpreter), in the lane order when
    the configuration has LANES (`linear.rotate(..., lane_unit=lane_unit(levels), lane_block=BK)`); `xrow` (int32
    `(P,)`): row r reads x row `xrow[r]` (default: row r, and then P = T); `offs` (int32 `(E,)`): the groups'
    end offsets, rows `offs[e-1] ... offs[e]` belong to expert e (rows past `offs[-1]` are not written).
    `packed`/`norms`: E stacked matrices. `config`: as `routed_config` returns it."""
    rows, ng = norms.shape
    n = rows // num_experts
    p = xrow.numel() if xrow is not None else x_rot.shape[0]
    n_levels = codebook.numel()
    if not serves(n_levels, group_size):
        raise ValueError(f"the packed-weight GEMM serves 4-, 8- and 16-entry codebooks at G = 64 or a multiple of "
                         f"128, not {n_levels} entries at G = {group_size}")
    if x_rot.shape[1] != ng * group_size:
        raise ValueError(f"activations of width {x_rot.shape[1]} for a weight of {ng} groups of {group_size}")
    out = torch.empty(p, n, dtype=out_dtype, device=x_rot.device)
    if p == 0 or n == 0:
        return out
    bm, bn, bk, swap, lanes, warps, stages = config or routed_config(p, num_experts, n, n_levels, group_size)
    if lanes and (not swap or bn % (16 * warps) or bk % (4 * lane_unit(n_levels))):
        raise ValueError(f"the lane order needs SWAP, BN a multiple of 16 warps and BK of 4 units, not "
                         f"{(bm, bn, bk, swap, lanes, warps, stages)}")
    if x_rot.stride(-1) != 1:
        x_rot = x_rot.contiguous()
    f16 = (x_rot.dtype if x_rot.dtype != torch.float32 else out_dtype) == torch.float16
    flat = packed.reshape(-1)
    if packed.dtype != torch.int32:
        flat = flat.view(torch.int32)
    ep = 1
    while ep < num_experts:
        ep *= 2
    grid = (min(num_experts, p) + p // bm, cdiv(n, bn))
    launch(_routed_gemm_kernel, grid, x_rot, xrow if xrow is not None else offs, offs, flat, norms.contiguous(),
           codebook, out, n, x_rot.stride(0), out.stride(0), E=num_experts, EP=ep, NG=ng, NLEV=n_levels,
           G=group_size, BK=bk, BM=bm, BN=bn, SWAP=bool(swap), RUNTIME_LAYOUT=runtime_layout, F16=f16,
           USE_ASM=use_asm, GATHER=xrow is not None, LANES=bool(lanes), WARPS=warps,
           LANES_FIRST=triton_version() < (3, 7) if lanes_first is None else bool(lanes_first),
           PREFETCH=tuning.GEMM_PREFETCH, num_warps=warps, num_stages=stages)
    return out
