"""The pair GEMV kernel: 16-bit activation pairs times looked-up weight pairs in packed half arithmetic
(`HFMA2` chains), for small M."""

from __future__ import annotations

import triton
import triton.language as tl

from .gemv_mma import _mma_pairs, _mma_pairs2
from .lut import _byte_tables, _unit_nibbles
from .ptx import _TOP3_ASM, gdc_wait
from .rotation import _group_norm, _pair_column, _pair_exponent
from .units import _load_units

# ---------------------------------------------------------------------------
# 2a''. pair GEMV (M <= PAIR_MAX_M and routed expert pairs, 16-bit activations): half-precision pair products
# ---------------------------------------------------------------------------
#
# The lookups of the tensor-core GEMV (`_mma_pairs`, `_mma_pairs2`) give two float16 codebook values per
# 32-bit register, and one `fma.rn.f16x2` multiplies them into two activations at once: per weight about
# half the instructions of assembling a float32 value for an FFMA. The activations come as float16 pairs in the order a
# unit decodes (`rotate(..., unit=...)` or `pack_pairs`: word q * NUT + u holds elements 2q, 2q + 1 of
# unit u), each group scaled by a power of two 2**-e (e per activation row and group, `_pair_exponent`)
# so that the group's L2 norm is at most 2**8. A unit's products are chained in float16 (16 per lane at 3
# bits, 8 at 2, 4 at 4); the chains of 32 consecutive indices (one 3-bit unit, two 2-bit, four 4-bit units)
# are added in float16, then summed into float32 and scaled by the weight's group norm times 2**e. By
# Cauchy-Schwarz such a sum (16 products a lane), and every partial sum on the way, is at most sqrt(16) * 2**8
# * max|codebook| in magnitude: no overflow for codebooks below 60, whatever the activations' scale. Accuracy:
# float16 keeps 11 significant bits; on random data the bfloat16 result is within 1.8e-3 (relative L2) of the
# float32 reference at every width.

@triton.jit
def _f16_lo(h):
    return (h & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16_hi(h):
    return (h >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16_bits(v):
    return v.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)


@triton.jit
def _hfma2(p, x, h, USE_ASM: tl.constexpr):
    """Two float16 products and sums at once (uint32 pairs): `p * x + h` per half (`fma.rn.f16x2`; in the
    interpreter float32 arithmetic rounded to float16)."""
    if USE_ASM:
        out = tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [p, x, h], dtype=tl.uint32,
                                        is_pure=True, pack=1)
    else:
        lo = _f16_lo(p) * _f16_lo(x) + _f16_lo(h)
        hi = _f16_hi(p) * _f16_hi(x) + _f16_hi(h)
        out = _f16_bits(lo) | (_f16_bits(hi) << 16)
    return out


@triton.jit
def _units_tile(v, BN: tl.constexpr, UT: tl.constexpr):
    """A `[BU]` vector over a step's units repeated for the BN weight rows: `[BN, BU]`, or `[BU, BN]` with UT
    (the pair GEMV's tiles, see `_gemv_pair_kernel`)."""
    if UT:
        t = tl.broadcast_to(v[:, None], (v.shape[0], BN))
    else:
        t = tl.broadcast_to(v[None, :], (BN, v.shape[0]))
    return t


@triton.jit
def _xpair(xrow, q: tl.constexpr, NUT: tl.constexpr, xu, BN: tl.constexpr, UT: tl.constexpr = 0):
    """Activation pair word q of units `xu` `[BU]`, broadcast over the BN weight rows (UT: `[BU, BN]`)."""
    return tl.load(_units_tile(xrow + q * NUT + xu, BN, UT)).to(tl.uint32, bitcast=True)


@triton.jit
def _chain4(p0, p1, p2, p3, q0: tl.constexpr, xrow, NUT: tl.constexpr, xu, BN: tl.constexpr, h, USE_ASM: tl.constexpr,
            UT: tl.constexpr = 0):
    """The float16 chain `h` plus four value pairs times activation pair words q0 .. q0 + 3 of one row."""
    h = _hfma2(p0, _xpair(xrow, q0, NUT, xu, BN, UT), h, USE_ASM)
    h = _hfma2(p1, _xpair(xrow, q0 + 1, NUT, xu, BN, UT), h, USE_ASM)
    h = _hfma2(p2, _xpair(xrow, q0 + 2, NUT, xu, BN, UT), h, USE_ASM)
    h = _hfma2(p3, _xpair(xrow, q0 + 3, NUT, xu, BN, UT), h, USE_ASM)
    return h


@triton.jit
def _hadd2(a, b, USE_ASM: tl.constexpr):
    """Two float16 sums at once (uint32 pairs, `add.rn.f16x2`; in the interpreter float32 sums rounded to
    float16)."""
    if USE_ASM:
        out = tl.inline_asm_elementwise("add.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.uint32, is_pure=True,
                                        pack=1)
    else:
        out = _f16_bits(_f16_lo(a) + _f16_lo(b)) | (_f16_bits(_f16_hi(a) + _f16_hi(b)) << 16)
    return out


@triton.jit
def _pair_halves(h, UT: tl.constexpr):
    """A `[BU, BN]` tile (UT; else `[BN, BU]`) -> its even and odd units, `[BU / 2, BN]` each."""
    if UT:
        a, b = tl.split(tl.permute(tl.reshape(h, [h.shape[0] // 2, 2, h.shape[1]]), (0, 2, 1)))
    else:
        a, b = tl.split(tl.reshape(h, [h.shape[0], h.shape[1] // 2, 2]))
    return a, b


@triton.jit
def _group_chains(h, GRP: tl.constexpr, UT: tl.constexpr, USE_ASM: tl.constexpr):
    """The float16 chains of GRP (1, 2 or 4) consecutive units summed in float16: `[BU / GRP, BN]` (UT)."""
    if GRP > 1:
        a, b = _pair_halves(h, UT)
        h = _hadd2(a, b, USE_ASM)
    if GRP > 2:
        a, b = _pair_halves(h, UT)
        h = _hadd2(a, b, USE_ASM)
    return h


@triton.jit
def _unit_pair_sums(w0, w1, w2, xr0, xr1, xr2, xr3, xu, t0, t1, t2, t3, t4, t5, t6, t7, NLEV: tl.constexpr,
                    RUNTIME_LAYOUT: tl.constexpr, NUT: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                    USE_ASM: tl.constexpr, UT: tl.constexpr = 0, GRP: tl.constexpr = 1):
    """Units `[BN, BU]` (words w0..w2), decoded once, times the activation pairs of BM (1, 2 or 4) rows at
    xr0..xr3 (those past BM unused): one float16 chain per unit and row; the chains of GRP consecutive units
    summed in float16 (`_group_chains`), then into float32 `[BN, BU / GRP]` per row (four results; rows past BM
    give zeros)."""
    h0 = w0 & 0
    h1 = h0
    h2 = h0
    h3 = h0
    if NLEV == 4 and RUNTIME_LAYOUT:
        p0, p1, p2, p3, p4, p5, p6, p7 = _mma_pairs2(w0, t0, t2, USE_ASM)
        h0 = _chain4(p4, p5, p6, p7, 4, xr0, NUT, xu, BN, _chain4(p0, p1, p2, p3, 0, xr0, NUT, xu, BN, h0, USE_ASM, UT),
                     USE_ASM, UT)
        if BM > 1:
            h1 = _chain4(p4, p5, p6, p7, 4, xr1, NUT, xu, BN,
                         _chain4(p0, p1, p2, p3, 0, xr1, NUT, xu, BN, h1, USE_ASM, UT), USE_ASM, UT)
        if BM > 2:
            h2 = _chain4(p4, p5, p6, p7, 4, xr2, NUT, xu, BN,
                         _chain4(p0, p1, p2, p3, 0, xr2, NUT, xu, BN, h2, USE_ASM, UT), USE_ASM, UT)
            h3 = _chain4(p4, p5, p6, p7, 4, xr3, NUT, xu, BN,
                         _chain4(p0, p1, p2, p3, 0, xr3, NUT, xu, BN, h3, USE_ASM, UT), USE_ASM, UT)
    else:
        PER: tl.constexpr = 32 if NLEV == 8 else (8 if NLEV == 16 else 16)
        for ch in tl.static_range(PER // 8):
            if NLEV == 16:
                d = w0
            elif NLEV == 8 and RUNTIME_LAYOUT and ch == 3 and USE_ASM:  # the top bits of the three words (FMA pipe)
                d = tl.inline_asm_elementwise(_TOP3_ASM, "=r,r,r,r", [w0, w1, w2], dtype=tl.uint32, is_pure=True,
                                              pack=1)
            else:
                d = _unit_nibbles(w0, w1, w2, ch, NLEV, RUNTIME_LAYOUT)
            p0, p1, p2, p3 = _mma_pairs(d, t0, t1, t2, t3, t4, t5, t6, t7, NLEV, USE_ASM, RUNTIME_LAYOUT)
            h0 = _chain4(p0, p1, p2, p3, 4 * ch, xr0, NUT, xu, BN, h0, USE_ASM, UT)
            if BM > 1:
                h1 = _chain4(p0, p1, p2, p3, 4 * ch, xr1, NUT, xu, BN, h1, USE_ASM, UT)
            if BM > 2:
                h2 = _chain4(p0, p1, p2, p3, 4 * ch, xr2, NUT, xu, BN, h2, USE_ASM, UT)
                h3 = _chain4(p0, p1, p2, p3, 4 * ch, xr3, NUT, xu, BN, h3, USE_ASM, UT)
    h0 = _group_chains(h0, GRP, UT, USE_ASM)
    if BM > 1:
        h1 = _group_chains(h1, GRP, UT, USE_ASM)
    else:
        h1 = h0 & 0
    if BM > 2:
        h2 = _group_chains(h2, GRP, UT, USE_ASM)
        h3 = _group_chains(h3, GRP, UT, USE_ASM)
    else:
        h2 = h1
        h3 = h1
    return (_f16_lo(h0) + _f16_hi(h0), _f16_lo(h1) + _f16_hi(h1), _f16_lo(h2) + _f16_hi(h2),
            _f16_lo(h3) + _f16_hi(h3))


@triton.jit
def _pair_row(x2_ptr, xs_ptr, m, M, stride_xm, stride_sm):
    """Pointers to activation row m (clamped to M - 1: a row past the end is read, its result not stored) and to
    its group scales."""
    r = tl.minimum(m, M - 1)
    return x2_ptr + r * stride_xm, xs_ptr + r * stride_sm


@triton.jit
def _store_pair_row(out_ptr, acc, m, M, stride_om, rn, N, UT: tl.constexpr = 0):
    y = tl.sum(acc, axis=0 if UT else 1)
    tl.store(out_ptr + m * stride_om + rn, y.to(out_ptr.dtype.element_ty), mask=(rn < N) & (rn * 0 + m < M))


@triton.jit
def _pair_tile(rl, u0, BU: tl.constexpr, UT: tl.constexpr = 0):
    """Rows `rl` `[BN]` and units u0 .. u0 + BU - 1 as the broadcastable axes of a step's `[BU, BN]` tile (UT;
    else `[BN, BU]`)."""
    uu = u0 + tl.arange(0, BU)
    if UT:
        r2 = rl[None, :]
        u2 = uu[:, None]
    else:
        r2 = rl[:, None]
        u2 = uu[None, :]
    return r2, u2


@triton.jit
def _pair_words(pk_ptr, nrm_ptr, rl, u0, BU: tl.constexpr, NUT: tl.constexpr, NG: tl.constexpr,
                UPG: tl.constexpr, WPU: tl.constexpr, RUNTIME_LAYOUT: tl.constexpr, EVEN_U: tl.constexpr,
                UT: tl.constexpr = 0, GRP: tl.constexpr = 1):
    """Words of units `u0 .. u0 + BU - 1` of rows `rl` `[BN]`, and the float32 group norms of their BU / GRP
    groups of GRP units (units past the row's end, when the step does not divide it: zero words and norms)."""
    r2, u2 = _pair_tile(rl, u0, BU, UT)
    unit_off = r2 * NUT + u2
    if EVEN_U:
        w0, w1, w2 = _load_units(pk_ptr, unit_off, None, WPU, RUNTIME_LAYOUT, r2, NUT)
    else:
        um = (r2 >= 0) & (u2 < NUT)
        w0, w1, w2 = _load_units(pk_ptr, unit_off, um, WPU, RUNTIME_LAYOUT, r2, NUT)
    return w0, w1, w2, _pair_norms(nrm_ptr, rl, u0, BU, NUT, NG, UPG, EVEN_U, UT, GRP)


@triton.jit
def _pair_norms(nrm_ptr, rl, u0, BU: tl.constexpr, NUT: tl.constexpr, NG: tl.constexpr, UPG: tl.constexpr,
                EVEN_U: tl.constexpr, UT: tl.constexpr = 0, GRP: tl.constexpr = 1):
    """The float32 group norms of units u0 .. u0 + BU - 1 of rows `rl` (zero past the row's end), one per GRP
    units (`_group_firsts`)."""
    r2, u2 = _pair_tile(rl, u0, BU, UT)
    if EVEN_U:
        nr = tl.load(nrm_ptr + r2 * NG + u2 // UPG)
    else:
        um = (r2 >= 0) & (u2 < NUT)
        nr = tl.load(nrm_ptr + r2 * NG + u2 // UPG, mask=um, other=0.0)
    return _group_firsts(nr.to(tl.float32), GRP, UT)


@triton.jit
def _group_firsts(v, GRP: tl.constexpr, UT: tl.constexpr):
    """The first of each GRP consecutive units of a `[BU, BN]` tile (UT): `[BU / GRP, BN]` in the layout that
    `_group_chains` gives (loaded per unit, in the words' layout, then taken apart the same way: a load in the
    grouped layout would pass through shared memory)."""
    if GRP > 1:
        v, _ = _pair_halves(v, UT)
    if GRP > 2:
        v, _ = _pair_halves(v, UT)
    return v


@triton.jit
def _gemv_pair_kernel(x2_ptr, xs_ptr, pk_ptr, nrm_ptr, cb_ptr, out_ptr, idx_ptr, M, N, stride_xm, stride_sm,
                      stride_om, NG: tl.constexpr, NLEV: tl.constexpr, UPG: tl.constexpr, BN: tl.constexpr,
                      BU: tl.constexpr, BM: tl.constexpr, USE_ASM: tl.constexpr, EXPERTS: tl.constexpr,
                      X_DIV: tl.constexpr, RUNTIME_LAYOUT: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr = 0,
                      UT: tl.constexpr = 0, GRP: tl.constexpr = 1):
    """One program per BN weight rows and BM (1, 2 or 4) activation rows: one unit per lane and row per step,
    decoded once; each activation row's float16 pair chains (`_unit_pair_sums`; those of GRP consecutive units
    added in float16 first: `PAIR_CHAIN`) scaled by the group norms times that row's group scales into float32
    sums.

    PREFETCH: each step's words and norms are loaded during the step before (the first step's before the
    loop, and before waiting for the previous kernel: PDL), so that the loads of a program overlap its own
    decoding. UT: every `[BN, BU]` tile is held as `[BU, BN]`, for a Triton whose coalescing takes a load's
    remaining axes in ascending order (`_lanes_first`): the norms and scales then load in the words' layout
    (fewer instructions, no shared memory or barriers); the results are the same.

    EXPERTS > 0 (BM == 1): the weight is EXPERTS stacked matrices of N rows, and output row p is matrix `idx[p]`
    times activation row `p // X_DIV` (routed (token, slot) pairs); an index outside [0, EXPERTS) gives a zero
    row. Only the routed matrices are read."""
    WPU: tl.constexpr = 3 if NLEV == 8 else 1
    NUT: tl.constexpr = NG * UPG
    EVEN_U: tl.constexpr = NUT % BU == 0
    pid_n = tl.program_id(0)
    m0 = tl.program_id(1) * BM
    t0, t1, t2, t3, t4, t5, t6, t7 = _byte_tables(cb_ptr, NLEV, 2)
    rn = pid_n * BN + tl.arange(0, BN)
    rl = tl.minimum(rn, N - 1)  # clamped rows: loads stay in bounds, their sums are not stored
    if EXPERTS > 0:
        e = tl.load(idx_ptr + m0).to(tl.int32)
        live = (e >= 0) & (e < EXPERTS)
        e = tl.where(live, e, 0).to(tl.int64)
        pk_ptr += e * (N * NUT * WPU)
        nrm_ptr += e * (N * NG)
        xr0 = x2_ptr + (m0 // X_DIV) * stride_xm
        sr0 = xs_ptr + (m0 // X_DIV) * stride_sm
    else:
        xr0, sr0 = _pair_row(x2_ptr, xs_ptr, m0, M, stride_xm, stride_sm)
    xr1, sr1 = _pair_row(x2_ptr, xs_ptr, m0 + 1, M, stride_xm, stride_sm)
    xr2, sr2 = _pair_row(x2_ptr, xs_ptr, m0 + 2, M, stride_xm, stride_sm)
    xr3, sr3 = _pair_row(x2_ptr, xs_ptr, m0 + 3, M, stride_xm, stride_sm)
    ru = tl.arange(0, BU)
    acc0 = tl.zeros([BU // GRP, BN] if UT else [BN, BU // GRP], dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    if PREFETCH:
        n0, n1, n2, nrn = _pair_words(pk_ptr, nrm_ptr, rl, 0, BU, NUT, NG, UPG, WPU, RUNTIME_LAYOUT, EVEN_U, UT, GRP)
    if PDL:  # launched early (programmatic dependent launch): the activations are the previous kernel's output
        gdc_wait()
    for u0 in tl.range(0, NUT, BU):
        uu = u0 + ru
        if PREFETCH:
            w0 = n0
            w1 = n1
            w2 = n2
            nr = nrn
            # (the step after the last: masked off, which keeps the loads vectorized where clamped addresses
            # would not)
            n0, n1, n2, nrn = _pair_words(pk_ptr, nrm_ptr, rl, u0 + BU, BU, NUT, NG, UPG, WPU, RUNTIME_LAYOUT, False, UT,
                                          GRP)
        else:
            w0, w1, w2, nr = _pair_words(pk_ptr, nrm_ptr, rl, u0, BU, NUT, NG, UPG, WPU, RUNTIME_LAYOUT, EVEN_U, UT, GRP)
        # (units past the row's end: zero norms and scales, activations of the last unit)
        xu = uu if EVEN_U else tl.minimum(uu, NUT - 1)
        s0, s1, s2, s3 = _unit_pair_sums(w0, w1, w2, xr0, xr1, xr2, xr3, xu, t0, t1, t2, t3, t4, t5, t6, t7, NLEV,
                                         RUNTIME_LAYOUT, NUT, BN, BM, USE_ASM, UT, GRP)
        acc0 += s0 * (nr * _group_firsts(_pair_scales(sr0, uu, UPG, NUT, EVEN_U, BN, UT), GRP, UT))
        if BM > 1:
            acc1 += s1 * (nr * _group_firsts(_pair_scales(sr1, uu, UPG, NUT, EVEN_U, BN, UT), GRP, UT))
        if BM > 2:
            acc2 += s2 * (nr * _group_firsts(_pair_scales(sr2, uu, UPG, NUT, EVEN_U, BN, UT), GRP, UT))
            acc3 += s3 * (nr * _group_firsts(_pair_scales(sr3, uu, UPG, NUT, EVEN_U, BN, UT), GRP, UT))
    if EXPERTS > 0:
        acc0 = tl.where(live, acc0, 0.0)
        _store_pair_row(out_ptr, acc0, m0, m0 + 1, stride_om, rn, N, UT)
    else:
        _store_pair_row(out_ptr, acc0, m0, M, stride_om, rn, N, UT)
        if BM > 1:
            _store_pair_row(out_ptr, acc1, m0 + 1, M, stride_om, rn, N, UT)
        if BM > 2:
            _store_pair_row(out_ptr, acc2, m0 + 2, M, stride_om, rn, N, UT)
            _store_pair_row(out_ptr, acc3, m0 + 3, M, stride_om, rn, N, UT)


@triton.jit
def _pair_scales(srow, uu, UPG: tl.constexpr, NUT: tl.constexpr, EVEN_U: tl.constexpr, BN: tl.constexpr,
                 UT: tl.constexpr = 0):
    """Group scales of units `uu` of one activation row (zero past the row's end), broadcast over the BN weight
    rows: loaded as a `[BN, BU]` tile of repeated addresses, which lands in the accumulators' layout (a `[BU]`
    vector broadcast afterwards would pass through shared memory, with two barriers a step)."""
    p = _units_tile(srow + uu // UPG, BN, UT)
    if EVEN_U:
        xs = tl.load(p)
    else:
        xs = tl.load(p, mask=_units_tile(uu < NUT, BN, UT), other=0.0)
    return xs


@triton.jit
def _pack_pairs_kernel(x_ptr, out_ptr, xs_ptr, K, stride_xm, stride_om, stride_sm, G: tl.constexpr,
                       GP: tl.constexpr, PER_T: tl.constexpr, NUT: tl.constexpr):
    """One program per (row, group): rotated activations -> the pair layout and the group's scale."""
    m = tl.program_id(0)
    g = tl.program_id(1)
    kk = tl.arange(0, GP)
    col = g * G + kk
    inside = (kk < G) & (col < K)
    x = tl.load(x_ptr + m * stride_xm + col, mask=inside, other=0.0).to(tl.float32)
    ex = _pair_exponent(_group_norm(x, 0))
    y = x * tl.exp2(-ex)
    tl.store(out_ptr + m * stride_om + _pair_column(col, PER_T, NUT), y.to(tl.float16), mask=kk < G)
    tl.store(xs_ptr + m * stride_sm + g, tl.exp2(ex))
