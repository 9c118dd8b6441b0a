"""Triton kernels of the activation rotation (`D2 . H . D1 . x` per group of G) and of its fused
pair packing / tensor-core column order."""

from __future__ import annotations

import triton
import triton.language as tl

from .ptx import gdc_launch_dependents

# ---------------------------------------------------------------------------
# 1. activation rotation
# ---------------------------------------------------------------------------

@triton.jit
def _group_norm(x, axis: tl.constexpr):
    """L2 norms of float32 `x` along `axis`, scaled by the largest magnitude first (no overflow or underflow of
    the squares for any finite input)."""
    amax = tl.max(tl.abs(x), axis=axis)
    inv = 1.0 / tl.where(amax > 0, amax, 1.0)  # (an all-zero group: any finite factor)
    xn = x * tl.expand_dims(inv, axis)
    return amax * tl.sqrt(tl.sum(xn * xn, axis=axis))


@triton.jit
def _pair_exponent(nrm):
    """Per-group exponent e (float32, an integer) with `nrm * 2**-e <= 2**8` (0 for a zero norm): the pair
    GEMV's activations are stored as float16 times 2**-e, so no float16 value, product or chained sum can
    overflow (see `gemv_pairs`)."""
    ex = tl.where(nrm > 0, tl.ceil(tl.log2(tl.maximum(nrm, 1e-30))) - 8.0, 0.0)
    return tl.minimum(tl.maximum(ex, -120.0), 120.0)


@triton.jit
def _pair_column(col, PER_T: tl.constexpr, NUT: tl.constexpr):
    """Where column `col` of a rotated row goes in the pair layout (16-bit elements): element j of unit u at
    `(j // 2) * 2 NUT + 2 u + j % 2`, so 32-bit word `q NUT + u` holds elements 2q, 2q + 1 of unit u."""
    j = col % PER_T
    return (j // 2) * (2 * NUT) + 2 * (col // PER_T) + (j % 2)


@triton.jit
def _rotate_kernel(x_ptr, s1_ptr, s2_ptr, out_ptr, h_ptr, xs_ptr, M, K, stride_xm, stride_om, stride_sm, scale,
                   G: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr, EXACT16: tl.constexpr,
                   PER_T: tl.constexpr, NUT: tl.constexpr, PDL: tl.constexpr, MMA_KB: tl.constexpr = 0,
                   MMA_PER: tl.constexpr = 0, LANE_KB: tl.constexpr = 0, LANE_PER: tl.constexpr = 0):
    if PDL:  # the GEMV that reads this output may start its prologue now (it waits for this grid's end)
        gdc_launch_dependents()
    pid_m = tl.program_id(0)
    pid_g = tl.program_id(1)
    pid_c = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    kk = tl.arange(0, G)
    cc = pid_c * BC + tl.arange(0, BC)
    k = pid_g * G + kk
    mmask = rm < M
    x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=mmask[:, None] & (k < K)[None, :], other=0.0)
    s1 = tl.load(s1_ptr + kk)
    # the +-1 Sylvester Hadamard block (a cached (G, G) matrix in the operands' dtype: loading it costs less
    # than computing (-1)^popcount(i & j) in every program)
    h = tl.load(h_ptr + kk[:, None] * G + cc[None, :])
    if EXACT16:
        # x is bf16/fp16: sign flips and +-1 products are exact, accumulation is float32
        xs = tl.where(s1[None, :] < 0, -x, x)
        y = tl.dot(xs, h)
    else:
        xs = x.to(tl.float32) * s1[None, :]
        y = tl.dot(xs, h, input_precision="ieee")
    s2 = tl.load(s2_ptr + cc)
    y = y * scale * s2[None, :]
    col = pid_g * G + cc
    if PER_T > 0:
        # the pair GEMV's activations: float16 pairs in unit order, scaled by a power of two per group (every
        # program of the group computes the same one)
        xf = x.to(tl.float32)
        ex = _pair_exponent(_group_norm(xf, 1))
        y = y * tl.exp2(-ex)[:, None]
        if pid_c == 0:
            tl.store(xs_ptr + rm * stride_sm + pid_g, tl.exp2(ex), mask=mmask)
        col = _pair_column(col, PER_T, NUT)
    if MMA_KB > 0:  # runs of 8 columns move together: 16-byte stores
        dst = _mma_column(pid_g * G + pid_c * BC + 8 * tl.arange(0, BC // 8), MMA_KB, MMA_PER)
        optr = out_ptr + rm[:, None, None] * stride_om + dst[None, :, None] + tl.arange(0, 8)[None, None, :]
        tl.store(optr, tl.reshape(y, [BM, BC // 8, 8]).to(out_ptr.dtype.element_ty), mask=mmask[:, None, None])
    elif LANE_KB > 0:  # (BC whole blocks) permuted in registers, stored in order
        optr = out_ptr + rm[:, None] * stride_om + (pid_g * G + cc)[None, :]
        tl.store(optr, _lane_permute(y, LANE_KB, LANE_PER).to(out_ptr.dtype.element_ty), mask=mmask[:, None])
    else:
        optr = out_ptr + rm[:, None] * stride_om + col[None, :]
        tl.store(optr, y.to(out_ptr.dtype.element_ty), mask=mmask[:, None])


@triton.jit
def _hadamard_rows(x, BG: tl.constexpr, G: tl.constexpr, LG: tl.constexpr):
    """`x H` for each row of float32 `x` `[BG, G]` (H: the +-1 Sylvester Hadamard matrix of order G = 2**LG) in LG
    constant-geometry butterfly stages: each puts the sums of adjacent pairs in the first half of the row and
    their differences in the second; after LG stages entry j is sum_i (-1)^popcount(i & j) x_i."""
    for _ in tl.static_range(LG):
        a, b = tl.split(tl.reshape(x, [BG, G // 2, 2]))
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), [BG, G])
    return x


@triton.jit
def _rotate_rows_kernel(x_ptr, s1_ptr, s2_ptr, out_ptr, xs_ptr, K, NG, stride_xm, stride_om, stride_sm, scale,
                        G: tl.constexpr, LG: tl.constexpr, BG: tl.constexpr, PER_T: tl.constexpr,
                        NUT: tl.constexpr, PDL: tl.constexpr, MMA_KB: tl.constexpr = 0, MMA_PER: tl.constexpr = 0,
                        LANE_KB: tl.constexpr = 0, LANE_PER: tl.constexpr = 0):
    """`_rotate_kernel` for few activation rows: one program per row and BG groups, the Walsh-Hadamard product as
    float32 butterflies in registers (`_hadamard_rows`) instead of a 16-row tensor-core product with a (G, G)
    matrix read from memory; the same outputs (pair layout, tensor-core order or natural order), equal to its
    within float32 rounding of the sums."""
    if PDL:  # the GEMV that reads this output may start its prologue now (it waits for this grid's end)
        gdc_launch_dependents()
    m = tl.program_id(0)
    gg = tl.program_id(1) * BG + tl.arange(0, BG)
    kk = tl.arange(0, G)
    col = gg[:, None] * G + kk[None, :]
    live = gg < NG
    x = tl.load(x_ptr + m * stride_xm + col, mask=live[:, None] & (col < K), other=0.0).to(tl.float32)
    s1 = tl.load(s1_ptr + kk)
    s2 = tl.load(s2_ptr + kk)
    y = _hadamard_rows(x * s1[None, :], BG, G, LG)
    y = y * scale * s2[None, :]
    if PER_T > 0:  # the pair GEMV's activations and group scales (as `_rotate_kernel`)
        ex = _pair_exponent(_group_norm(x, 1))
        y = y * tl.exp2(-ex)[:, None]
        tl.store(xs_ptr + m * stride_sm + gg, tl.exp2(ex), mask=live)
        tl.store(out_ptr + m * stride_om + _pair_column(col, PER_T, NUT), y.to(out_ptr.dtype.element_ty),
                 mask=live[:, None])
    elif MMA_KB > 0:  # runs of 8 columns move together: 16-byte stores
        run = gg[:, None] * G + 8 * tl.arange(0, G // 8)[None, :]
        optr = out_ptr + m * stride_om + _mma_column(run, MMA_KB, MMA_PER)[:, :, None] + tl.arange(0, 8)[None, None, :]
        tl.store(optr, tl.reshape(y, [BG, G // 8, 8]).to(out_ptr.dtype.element_ty), mask=live[:, None, None])
    elif LANE_KB > 0:  # (G whole blocks) permuted in registers, stored in order
        tl.store(out_ptr + m * stride_om + col, _lane_permute(y, LANE_KB, LANE_PER).to(out_ptr.dtype.element_ty),
                 mask=live[:, None])
    else:
        tl.store(out_ptr + m * stride_om + col, y.to(out_ptr.dtype.element_ty), mask=live[:, None])


@triton.jit
def _mma_column(col, KB: tl.constexpr, PER: tl.constexpr):
    """Where the run of 8 columns starting at `col` (a multiple of 8) of a rotated row goes in the tensor-core
    GEMV's activation order (`rotate(..., mma_levels=...)`): within each block of KB columns, elements e to
    e + 7 (e a multiple of 8) of unit ub (PER elements a unit, R = KB // (4 PER) units a lane, the lane t =
    ub // R with lanes 1 and 2 swapped, r = ub % R) move from ub PER + e to ((r V + e // 8) 4 + t) 8, V =
    PER // 8, so that the four lanes of an activation row read 64 consecutive bytes per load (their 16-byte
    pieces lie 64 bytes apart in row order). (Written as a sum of multiples of 8, which keeps the stores
    16-byte vectors.)"""
    R: tl.constexpr = KB // (4 * PER)
    V: tl.constexpr = PER // 8
    kin = col % KB
    ub = kin // PER
    q = ub // R
    t = (q & 1) * 2 + (q >> 1)
    return (col // KB) * KB + (((ub % R) * V + (kin % PER) // 8) * 4 + t) * 8


@triton.jit
def _lane_permute(y, KB: tl.constexpr, PER: tl.constexpr):
    """Rows of whole blocks of KB columns `[B, C]` -> the same rows with each block in the packed-weight GEMM's
    lane order (`rotate(..., lane_unit=...)`, read by `gemm.gemm(..., lanes=True)`): element j = 2 jj + e of unit
    ub (PER elements a unit, R = KB // (4 PER) units a lane, the lane q = ub // R = 2 q1 + q0, r = ub % R) moves
    to 8 (r PER / 2 + jj) + 2 t + e with t = 2 q0 + q1 (lanes 1 and 2 swapped): the input order of wgmma's
    register operand when each lane decodes whole units. A permutation of the axes (q1, q0, r, jj, e)."""
    B: tl.constexpr = y.shape[0]
    C: tl.constexpr = y.shape[1]
    R: tl.constexpr = KB // (4 * PER)
    v = tl.reshape(y, [B, C // KB, 2, 2, R, PER // 2, 2])
    return tl.reshape(tl.permute(v, (0, 1, 4, 5, 3, 2, 6)), [B, C])
