"""The tensor-core GEMV kernels (`tl.dot`; also the mid-M path with 32 activation rows a program) and their
weight decoding into 16-bit pairs."""

from __future__ import annotations

import triton
import triton.language as tl

from .lut import _byte_tables, _lookup_bytes, _mma_pattern, _unit_nibbles
from .ptx import (
    _PAIR2_ASM,
    _PAIR8_ASM,
    _PAIR16_ASM,
    _PAIR16S_ASM,
    _TOP3_ASM,
    _prmt,
    _prmt_c,
    gdc_wait,
)
from .units import _codebook16, _decode_unit_values, _load_units


@triton.jit
def _mma_pairs(d, t0, t1, t2, t3, t4, t5, t6, t7, NLEV: tl.constexpr, USE_ASM: tl.constexpr,
               RUNTIME_LAYOUT: tl.constexpr = 0):
    """The eight codebook values of the indices in the nibbles of uint32 `d` (3-bit fields for codebooks of
    up to 8 entries, 4-bit for 16) as four uint32 pairs of 16-bit patterns: values (0, 1), (2, 3), (4, 5),
    (6, 7), the first of each pair in the low half. RUNTIME_LAYOUT with 16 entries: sign-magnitude codes (the 4-bit
    runtime layout), entries 8 .. 15 the negatives of 0 .. 7 (only t0 .. t3 are read)."""
    if NLEV == 16 and RUNTIME_LAYOUT:
        if USE_ASM:
            p0, p1, p2, p3 = tl.inline_asm_elementwise(
                _PAIR16S_ASM, "=r,=r,=r,=r,r,r,r,r,r", [d, t0, t1, t2, t3], dtype=(tl.uint32,) * 4, is_pure=True,
                pack=1)
        else:
            s = d & 0x77777777
            a = d << 4
            m = _prmt_c(a, d, 0xD9C8) & 0x80808080
            p0 = _prmt_c(_prmt(t0, t1, s), _prmt(t2, t3, s) ^ m, 0x5140)
            p1 = _prmt_c(_prmt(t0, t1, s), _prmt(t2, t3, s) ^ m, 0x7362)
            s = s >> 16
            m = _prmt_c(a, d, 0xFBEA) & 0x80808080
            p2 = _prmt_c(_prmt(t0, t1, s), _prmt(t2, t3, s) ^ m, 0x5140)
            p3 = _prmt_c(_prmt(t0, t1, s), _prmt(t2, t3, s) ^ m, 0x7362)
    elif USE_ASM and NLEV == 16:
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            _PAIR16_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", [d, t0, t1, t2, t3, t4, t5, t6, t7],
            dtype=(tl.uint32,) * 4, is_pure=True, pack=1)
    elif USE_ASM:
        p0, p1, p2, p3 = tl.inline_asm_elementwise(_PAIR8_ASM, "=r,=r,=r,=r,r,r,r,r,r", [t0, t1, t2, t3, d],
                                                   dtype=(tl.uint32,) * 4, is_pure=True, pack=1)
    else:
        lo, hi = _lookup_bytes(d, t0, t1, t2, t3, t4, t5, t6, t7, NLEV, 0)
        p0 = _prmt_c(lo, hi, 0x5140)
        p1 = _prmt_c(lo, hi, 0x7362)
        lo, hi = _lookup_bytes(d, t0, t1, t2, t3, t4, t5, t6, t7, NLEV, 1)
        p2 = _prmt_c(lo, hi, 0x5140)
        p3 = _prmt_c(lo, hi, 0x7362)
    return p0, p1, p2, p3


@triton.jit
def _mma_pairs2(w, t0, t2, USE_ASM: tl.constexpr):
    """The 16 values of 2-bit units in the runtime layout (uint32 words `w`) as eight uint32 pairs (values 2q,
    2q + 1), with the lookups of `_PAIR2_ASM`."""
    if USE_ASM:
        p0, p1, p2, p3, p4, p5, p6, p7 = tl.inline_asm_elementwise(
            _PAIR2_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [w, t0, t2], dtype=(tl.uint32,) * 8, is_pure=True, pack=1)
    else:
        p0, p1, p2, p3 = _pair2_lookups(w, t0, t2, 0)
        p4, p5, p6, p7 = _pair2_lookups(w, t0, t2, 2)
    return p0, p1, p2, p3, p4, p5, p6, p7


@triton.jit
def _pair2_lookups(w, t0, t2, SHIFT: tl.constexpr):
    """Half of `_PAIR2_ASM` written out (the interpreter's path of `_mma_pairs2`): the four pairs of indices 0-7
    (SHIFT 0: the low two bits of each nibble of `w`) or 8-15 (SHIFT 2: the high two bits)."""
    x = (w >> SHIFT) & 0x03030303
    y = (w >> (SHIFT + 4)) & 0x03030303
    a = _prmt_c(x, y, 0x5140) * 0x11 + 0x40404040
    b = _prmt_c(x, y, 0x7362) * 0x11 + 0x40404040
    return _prmt(t0, t2, a), _prmt(t0, t2, a >> 16), _prmt(t0, t2, b), _prmt(t0, t2, b >> 16)


@triton.jit
def _mma_scale(p, nsc, F16: tl.constexpr, USE_ASM: tl.constexpr):
    """uint32 pairs times the norms (3-bit, G = 64: a block spans two groups), rounded to 16 bits: `nsc` is the
    norm's 16-bit pattern twice (`mul.rn.bf16x2` / `f16x2`) on the GPU, the float32 norm in the interpreter."""
    if USE_ASM:
        if F16:
            out = tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [p, nsc], dtype=tl.uint32,
                                            is_pure=True, pack=1)
        else:
            out = tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [p, nsc], dtype=tl.uint32,
                                            is_pure=True, pack=1)
    else:
        lo = p & 0xFFFF
        hi = p >> 16
        if F16:
            lo = _mma_pattern(lo.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * nsc, True)
            hi = _mma_pattern(hi.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * nsc, True)
        else:
            lo = _mma_pattern((lo << 16).to(tl.float32, bitcast=True) * nsc, False)
            hi = _mma_pattern((hi << 16).to(tl.float32, bitcast=True) * nsc, False)
        out = lo | (hi << 16)
    return out


@triton.jit
def _norm_pattern(nr, F16: tl.constexpr, USE_ASM: tl.constexpr):
    """float32 norms -> what `_mma_scale` multiplies by: the 16-bit pattern twice on the GPU, float32 otherwise."""
    if USE_ASM:
        if F16:
            out = tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $1, $1;", "=r,r", [nr], dtype=tl.uint32,
                                            is_pure=True, pack=1)
        else:
            out = tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $1, $1;", "=r,r", [nr], dtype=tl.uint32,
                                            is_pure=True, pack=1)
    else:
        out = nr
    return out


@triton.jit
def _mma_values(p, F16: tl.constexpr, USE_ASM: tl.constexpr):
    """uint32 pairs `[...]` -> their values `[..., 2]` (the low half first): on the GPU the 16-bit type of the
    activations, the register taken as it is (a `mov` that ptxas drops); float32 in the interpreter.

    The `mov` is declared with side effects on purpose: Triton sizes the dot operand's k-width from the
    narrowest load and the joins it finds walking back from the dot, and must not walk past this point (the
    joins before it would make it pick 4 consecutive k per lane instead of the pairs laid out here)."""
    if USE_ASM:
        if F16:
            out = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [tl.join(p, p)], dtype=tl.float16,
                                            is_pure=False, pack=2)
        else:
            out = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [tl.join(p, p)], dtype=tl.bfloat16,
                                            is_pure=False, pack=2)
    else:
        h = tl.join(p & 0xFFFF, p >> 16)
        if F16:
            out = h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        else:
            out = (h << 16).to(tl.float32, bitcast=True)
    return out


@triton.jit
def _mma_join4(a, b, c, d):
    """Four same-shape tensors -> `[..., 2, 2]`, a, b, c, d at index i0 + 2 i1 of the two new axes."""
    return tl.join(tl.join(a, b), tl.join(c, d))


@triton.jit
def _mma_join8(a0, a1, a2, a3, a4, a5, a6, a7):
    """Eight same-shape tensors -> `[..., 2, 2, 2]`, a_q at index i0 + 2 i1 + 4 i2 of the three new axes."""
    return tl.join(_mma_join4(a0, a1, a2, a3), _mma_join4(a4, a5, a6, a7))


@triton.jit
def _mma_chunk(w0, w1, w2, CH: tl.constexpr, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV: tl.constexpr,
               RUNTIME_LAYOUT: tl.constexpr, F16: tl.constexpr, FOLD: tl.constexpr, USE_ASM: tl.constexpr):
    """Values 8 CH .. 8 CH + 7 of every unit as four uint32 pair tensors (FOLD: scaled by the norms)."""
    if NLEV == 16:
        d = w0
    elif NLEV == 8 and RUNTIME_LAYOUT and CH == 3 and USE_ASM:  # the top bits of the three words, shifted on the FMA pipe
        d = tl.inline_asm_elementwise(_TOP3_ASM, "=r,r,r,r", [w0, w1, w2], dtype=tl.uint32, is_pure=True, pack=1)
    else:
        d = _unit_nibbles(w0, w1, w2, CH, NLEV, RUNTIME_LAYOUT)
    p0, p1, p2, p3 = _mma_pairs(d, t0, t1, t2, t3, t4, t5, t6, t7, NLEV, USE_ASM, RUNTIME_LAYOUT)
    if FOLD:
        p0 = _mma_scale(p0, nsc, F16, USE_ASM)
        p1 = _mma_scale(p1, nsc, F16, USE_ASM)
        p2 = _mma_scale(p2, nsc, F16, USE_ASM)
        p3 = _mma_scale(p3, nsc, F16, USE_ASM)
    return p0, p1, p2, p3


@triton.jit
def _mma_unit_pairs(w0, w1, w2, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV: tl.constexpr, RUNTIME_LAYOUT: tl.constexpr,
                    F16: tl.constexpr, FOLD: tl.constexpr, USE_ASM: tl.constexpr):
    """Units (uint32 words w0..w2 of any shape `[...]`) -> their PER / 2 value pairs as uint32 `[..., 2, 2, ...]`:
    pair q (values 2q, 2q + 1) at index q = q0 + 2 q1 + ... of the new axes."""
    if NLEV == 4 and RUNTIME_LAYOUT:
        a0, a1, a2, a3, b0, b1, b2, b3 = _mma_pairs2(w0, t0, t2, USE_ASM)
        if FOLD:  # (groups of 32 inputs)
            a0 = _mma_scale(a0, nsc, F16, USE_ASM)
            a1 = _mma_scale(a1, nsc, F16, USE_ASM)
            a2 = _mma_scale(a2, nsc, F16, USE_ASM)
            a3 = _mma_scale(a3, nsc, F16, USE_ASM)
            b0 = _mma_scale(b0, nsc, F16, USE_ASM)
            b1 = _mma_scale(b1, nsc, F16, USE_ASM)
            b2 = _mma_scale(b2, nsc, F16, USE_ASM)
            b3 = _mma_scale(b3, nsc, F16, USE_ASM)
        v = _mma_join8(a0, a1, a2, a3, b0, b1, b2, b3)
    elif NLEV == 16:
        a0, a1, a2, a3 = _mma_chunk(w0, w1, w2, 0, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV, RUNTIME_LAYOUT, F16, FOLD,
                                    USE_ASM)
        v = _mma_join4(a0, a1, a2, a3)
    else:
        a0, a1, a2, a3 = _mma_chunk(w0, w1, w2, 0, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV, RUNTIME_LAYOUT, F16, FOLD,
                                    USE_ASM)
        b0, b1, b2, b3 = _mma_chunk(w0, w1, w2, 1, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV, RUNTIME_LAYOUT, F16, FOLD,
                                    USE_ASM)
        v = _mma_join8(a0, a1, a2, a3, b0, b1, b2, b3)
        if NLEV == 8:
            c0, c1, c2, c3 = _mma_chunk(w0, w1, w2, 2, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV, RUNTIME_LAYOUT, F16, FOLD,
                                        USE_ASM)
            e0, e1, e2, e3 = _mma_chunk(w0, w1, w2, 3, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV, RUNTIME_LAYOUT, F16, FOLD,
                                        USE_ASM)
            v = tl.join(v, _mma_join8(c0, c1, c2, c3, e0, e1, e2, e3))
    return v


@triton.jit
def _mma_words(pk_ptr, row, un, NUT: tl.constexpr, WPU: tl.constexpr, RUNTIME_LAYOUT: tl.constexpr,
               EVICT: tl.constexpr = True):
    """The uint32 words of units `un` (numbered along the row) of rows `row`, read once (EVICT: evict first; the
    GEMM, whose programs share weight tiles in L2, keeps the default policy)."""
    POLICY: tl.constexpr = "evict_first" if EVICT else ""
    if WPU == 3 and RUNTIME_LAYOUT:  # three planes per row: word p of unit u at p * NUT + u
        base = pk_ptr + row * (3 * NUT) + un
        step = NUT
    elif WPU == 3:
        base = pk_ptr + (row * NUT + un) * 3
        step = 1
    else:
        base = pk_ptr + row * NUT + un
        step = 0
    w0 = tl.load(base, eviction_policy=POLICY).to(tl.uint32, bitcast=True)
    if WPU == 3:
        w1 = tl.load(base + step, eviction_policy=POLICY).to(tl.uint32, bitcast=True)
        w2 = tl.load(base + 2 * step, eviction_policy=POLICY).to(tl.uint32, bitcast=True)
    else:
        w1 = w0
        w2 = w0
    return w0, w1, w2


@triton.jit
def _mma_norm_load(p, mask):
    """float32 norms at `p` (mask None: all in bounds)."""
    if mask is None:
        nr = tl.load(p)
    else:
        nr = tl.load(p, mask=mask, other=0.0)
    return nr.to(tl.float32)


@triton.jit
def _mma_norm16(p, rows, N, mask, NG: tl.constexpr, A0: tl.constexpr):
    return _mma_norm_load(p + tl.minimum(rows + 16 * A0, N - 1) * NG, mask)


@triton.jit
def _mma_norms16(p, rows, N, mask, NG: tl.constexpr, A: tl.constexpr, A0: tl.constexpr):
    """Norms of rows `rows` + 16 (A0 + a), a < A (1, 2 or 4; rows clamped to N - 1), as `[S, 16, 2, ...]` (the
    new axes: bits of a)."""
    nr = _mma_norm16(p, rows, N, mask, NG, A0)
    if A >= 2:
        nr = tl.join(nr, _mma_norm16(p, rows, N, mask, NG, A0 + 1))
    if A == 4:
        nr = tl.join(nr, tl.join(_mma_norm16(p, rows, N, mask, NG, A0 + 2), _mma_norm16(p, rows, N, mask, NG, A0 + 3)))
    return nr


@triton.jit
def _mma_norm_rows(p, rows, N, mask, NG: tl.constexpr, A: tl.constexpr):
    """`[S, 16 A]` norms of rows `rows` + 16 a (`rows` `[1, 16]`, each load clamped to row N - 1) at column
    pointers `p` `[S, 1]`: A loads of 16 rows each (a load that small is read straight in the layout of the
    product's rows, with no conversion)."""
    S: tl.constexpr = p.shape[0]
    if A == 1:
        nr = _mma_norms16(p, rows, N, mask, NG, 1, 0)
    elif A == 2:
        nr = tl.reshape(tl.permute(_mma_norms16(p, rows, N, mask, NG, 2, 0), (0, 2, 1)), [S, 32])
    elif A == 4:
        nr = tl.reshape(tl.permute(_mma_norms16(p, rows, N, mask, NG, 4, 0), (0, 3, 2, 1)), [S, 64])
    else:
        nr = tl.join(_mma_norms16(p, rows, N, mask, NG, 4, 0), _mma_norms16(p, rows, N, mask, NG, 4, 4))
        nr = tl.reshape(tl.permute(nr, (0, 4, 3, 2, 1)), [S, 128])
    return nr


@triton.jit
def _mma_x(xrow, blk, xub, UPB: tl.constexpr, NUT: tl.constexpr, PER: tl.constexpr, EVEN: tl.constexpr,
           PART: tl.constexpr, XORDER: tl.constexpr = 0, KB: tl.constexpr = 0):
    """The activations of blocks `blk` (clamped to the last unless EVEN) as the flat tile of `_gemv_mma_kernel`
    (XORDER: read from the kernel's activation order, whole blocks only)."""
    NBLK: tl.constexpr = (NUT + UPB - 1) // UPB
    if not EVEN:
        blk = tl.minimum(blk, NBLK - 1)
    if XORDER:
        return tl.load(xrow + blk * KB)
    xun = blk * UPB + xub
    if PART:
        xun = tl.minimum(xun, NUT - 1)
    return tl.load(xrow + xun * PER)


@triton.jit
def _mma_block_norms(nrm_ptr, nb, nrow, N, NBLK: tl.constexpr, UPB: tl.constexpr, UPG: tl.constexpr,
                     NG: tl.constexpr, A: tl.constexpr, EVEN: tl.constexpr):
    """`[S, BN]` norms of blocks `nb` `[S, 1]` (zero past the row's end unless EVEN) of rows `nrow` + 16 a."""
    if EVEN:
        nr = _mma_norm_rows(nrm_ptr + (nb * UPB) // UPG, nrow, N, None, NG, A)
    else:
        nr = _mma_norm_rows(nrm_ptr + (nb * UPB) // UPG, nrow, N, nb < NBLK, NG, A)
    return nr


# ---------------------------------------------------------------------------
# 2b. GEMV / small GEMM on tensor cores (2 <= M <= DOT_MAX_M, 16-bit activations)
# ---------------------------------------------------------------------------

@triton.jit
def _gemv_dot_kernel(xr_ptr, pk_ptr, nrm_ptr, cb_ptr, out_ptr, M, N, NG, stride_xm, stride_om,
                     NLEV: tl.constexpr, G: tl.constexpr, PER: tl.constexpr, PER_P: tl.constexpr,
                     WPU: tl.constexpr, UPG: tl.constexpr, UPG_P: tl.constexpr, BN: tl.constexpr,
                     BM: tl.constexpr, LUT_MASK: tl.constexpr, RUNTIME_LAYOUT: tl.constexpr):
    """Ternary weights (and any codebook, if called so): one group per step decoded with select trees
    (`_decode_unit_values`) into a `[BN, G]` tile in the activations' dtype, one `tl.dot` per group."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15 = _codebook16(cb_ptr, NLEV)
    DT: tl.constexpr = xr_ptr.dtype.element_ty
    BK: tl.constexpr = UPG_P * PER_P
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = rn < N
    rm = pid_m * BM + tl.arange(0, BM)
    mmask = rm < M
    ru = tl.arange(0, UPG_P)
    col = tl.arange(0, BK)
    if PER == PER_P:
        kin = col
        xmask = mmask[None, :]
    else:
        kin = (col // PER_P) * PER + col % PER_P
        xmask = ((col % PER_P < PER) & (kin < G))[:, None] & mmask[None, :]
    wmask = nmask[:, None] & (ru < UPG)[None, :]
    xptrs = xr_ptr + rm[None, :] * stride_xm + kin[:, None]
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    g = 0
    while g < NG:
        unit_off = (rn[:, None] * NG + g) * UPG + ru[None, :]
        w0, w1, w2 = _load_units(pk_ptr, unit_off, wmask, WPU, RUNTIME_LAYOUT, rn[:, None], NG * UPG)
        xt = tl.load(xptrs + g * G, mask=xmask, other=0.0)
        w = _decode_unit_values(w0, w1, w2, cb_ptr, PER_P, NLEV, PER, DT, LUT_MASK, RUNTIME_LAYOUT, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15)
        w = tl.reshape(w, [BN, BK])
        part = tl.dot(w, xt)
        nr = tl.load(nrm_ptr + rn * NG + g, mask=nmask, other=0.0)
        acc += part * nr[:, None]
        g += 1
    optr = out_ptr + rm[None, :] * stride_om + rn[:, None]
    tl.store(optr, acc.to(out_ptr.dtype.element_ty), mask=nmask[:, None] & mmask[None, :])


@triton.jit
def _gemv_mma_kernel(xr_ptr, pk_ptr, nrm_ptr, cb_ptr, out_ptr, M, N, stride_xm, stride_om,
                     NG: tl.constexpr, NLEV: tl.constexpr, G: tl.constexpr, KB: tl.constexpr, BN: tl.constexpr,
                     BM: tl.constexpr, S: tl.constexpr, RUNTIME_LAYOUT: tl.constexpr, F16: tl.constexpr,
                     PREFETCH: tl.constexpr, USE_ASM: tl.constexpr, PDL: tl.constexpr, LANES_FIRST: tl.constexpr = 0,
                     XORDER: tl.constexpr = 0):
    """2-, 3- and 4-bit weights on the tensor cores: one program per BN weight rows x BM (8 or 16) activation
    rows, S block lanes (S a multiple of num_warps) splitting the row's blocks of KB inputs (lane s takes
    blocks s, s + S, ...; a batched `tl.dot` over the S axis keeps every warp on its own S / num_warps lanes, so
    a warp has that many blocks' loads in flight a step); the S partial products are summed at the end. Per block a
    warp decodes its `[BN, KB]` tile in operand order (see the helpers above), reads the matching `[KB, BM]`
    activations and runs one dot (float32 accumulation), scaled by the group norms per block (KB <= G), or, when a
    block spans two groups (3-bit, G = 64), with the norms folded into the 16-bit values before the dot. PREFETCH (1
    or 2): the next block's words (2: and its activations and norms) are loaded before this block is decoded (the
    first block's words, as with a single block per warp, before waiting for the previous kernel: PDL). LANES_FIRST:
    the tiles' axes arranged for a Triton whose coalescing takes a load's remaining axes in ascending order
    (`_lanes_first`); the results are the same. (A 3-D dot is lowered to `mma.sync`, both operands in registers; a
    2-D one would take wgmma on sm_90, which reads B from shared memory and waits for each group's result.)

    Rows past N and activation rows past M read row N-1 / M-1 (their results are not stored); blocks past
    the row's end (when S does not divide the block count) read the last block with zero norms."""
    PER: tl.constexpr = 32 if NLEV == 8 else (8 if NLEV == 16 else 16)
    WPU: tl.constexpr = 3 if NLEV == 8 else 1
    UPG: tl.constexpr = G // PER
    NUT: tl.constexpr = NG * UPG
    R: tl.constexpr = KB // (4 * PER)
    UPB: tl.constexpr = KB // PER
    NBLK: tl.constexpr = (NUT + UPB - 1) // UPB
    ITERS: tl.constexpr = (NBLK + S - 1) // S
    FOLD: tl.constexpr = KB > G
    PART: tl.constexpr = NBLK * UPB != NUT  # (FOLD with an odd number of groups: the last block is half a block)
    EVEN: tl.constexpr = NBLK % S == 0
    A: tl.constexpr = BN // 16
    MH: tl.constexpr = BM // 8
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    t0, t1, t2, t3, t4, t5, t6, t7 = _byte_tables(cb_ptr, NLEV, 2 if F16 else 1)
    # weight tile axes (h, a, s, l, t, r): row 16 a + 8 h + l, block i S + s, unit ub of the block. Lanes 1
    # and 2 swap units, so that no lane holds two consecutive units' words (no vector load across lanes).
    # LANES_FIRST (see `_lanes_first`): the axes in the order (t, l, s, h, a, r), and (t, mg, s, v, mh, r, c) for
    # the activations below, so that a coalescing order that takes the remaining axes ascending also puts the
    # lanes on t and l (mg) and the warps on s
    if LANES_FIRST:
        at = tl.arange(0, 4)[:, None, None, None, None, None]
        al = tl.arange(0, 8)[None, :, None, None, None, None]
        as_ = tl.arange(0, S)[None, None, :, None, None, None]
        ah = tl.arange(0, 2)[None, None, None, :, None, None]
        aa = tl.arange(0, A)[None, None, None, None, :, None]
    else:
        ah = tl.arange(0, 2)[:, None, None, None, None, None]
        aa = tl.arange(0, A)[None, :, None, None, None, None]
        as_ = tl.arange(0, S)[None, None, :, None, None, None]
        al = tl.arange(0, 8)[None, None, None, :, None, None]
        at = tl.arange(0, 4)[None, None, None, None, :, None]
    ar = tl.arange(0, R)[None, None, None, None, None, :]
    ub = ((at & 1) * 2 + (at >> 1)) * R + ar
    row = tl.minimum(pid_n * BN + 16 * aa + 8 * ah + al, N - 1)
    # activation tile axes (v, mh, r, s, mg, t, c): activation row 8 mh + mg, input ub * PER + 8 v + c of the
    # block. One load: the coalescing order (c, then the other axes from the last) puts the lanes on t and mg
    # and the warps on s, as in the dot operand.
    if LANES_FIRST:
        xt = tl.arange(0, 4)[:, None, None, None, None, None, None]
        xg = tl.arange(0, 8)[None, :, None, None, None, None, None]
        xs = tl.arange(0, S)[None, None, :, None, None, None, None]
        xv = tl.arange(0, PER // 8)[None, None, None, :, None, None, None]
        xh = tl.arange(0, MH)[None, None, None, None, :, None, None]
        xr = tl.arange(0, R)[None, None, None, None, None, :, None]
    else:
        xv = tl.arange(0, PER // 8)[:, None, None, None, None, None, None]
        xh = tl.arange(0, MH)[None, :, None, None, None, None, None]
        xr = tl.arange(0, R)[None, None, :, None, None, None, None]
        xs = tl.arange(0, S)[None, None, None, :, None, None, None]
        xg = tl.arange(0, 8)[None, None, None, None, :, None, None]
        xt = tl.arange(0, 4)[None, None, None, None, None, :, None]
    xc = tl.arange(0, 8)[None, None, None, None, None, None, :]
    xub = ((xt & 1) * 2 + (xt >> 1)) * R + xr
    if XORDER:  # activations in this kernel's order (`_mma_column`): block b at b KB, piece (r, v, t) at its offset
        xrow = xr_ptr + tl.minimum(pid_m * BM + 8 * xh + xg, M - 1) * stride_xm + ((xr * (PER // 8) + xv) * 4 + xt) * 8 + xc
    else:
        xrow = xr_ptr + tl.minimum(pid_m * BM + 8 * xh + xg, M - 1) * stride_xm + 8 * xv + xc
    # norms (per block): [S, BN] as A loads of [S, 16]
    nrow = pid_n * BN + tl.arange(0, 16)[None, :]  # (rows 16 a + i: clamped per load)
    ns = tl.arange(0, S)[:, None]
    acc = tl.zeros([S, BN, BM], dtype=tl.float32)
    AHEAD: tl.constexpr = PREFETCH or ITERS == 1  # the first block's words are read before the loop
    if AHEAD:  # (and before waiting for the previous kernel: the weights are not its output)
        bw = as_
        if not EVEN:
            bw = tl.minimum(bw, NBLK - 1)
        un = bw * UPB + ub
        if PART:
            un = tl.minimum(un, NUT - 1)
        w0, w1, w2 = _mma_words(pk_ptr, row, un, NUT, WPU, RUNTIME_LAYOUT)
    if PDL:  # launched early (programmatic dependent launch): the activations are the previous kernel's output
        gdc_wait()
    XAHEAD: tl.constexpr = PREFETCH == 2  # activations and norms also a block ahead
    if XAHEAD:
        xn = _mma_x(xrow, tl.minimum(xs, NBLK - 1), xub, UPB, NUT, PER, True, PART, XORDER, KB)
        nrn = tl.zeros([S, BN], dtype=tl.float32)  # (FOLD: unused)
        if not FOLD:
            nrn = _mma_block_norms(nrm_ptr, tl.minimum(ns, NBLK - 1), nrow, N, NBLK, UPB, UPG, NG, A, True)
    for i in range(ITERS):
        if not AHEAD or ITERS > 1:
            if AHEAD:
                bw = tl.minimum((i + 1) * S + as_, NBLK - 1)
            else:
                bw = i * S + as_
                if not EVEN:
                    bw = tl.minimum(bw, NBLK - 1)
            un = bw * UPB + ub
            if PART:
                un = tl.minimum(un, NUT - 1)
            if AHEAD:
                n0, n1, n2 = _mma_words(pk_ptr, row, un, NUT, WPU, RUNTIME_LAYOUT)
            else:
                w0, w1, w2 = _mma_words(pk_ptr, row, un, NUT, WPU, RUNTIME_LAYOUT)
        nsc = t0  # (FOLD only)
        if FOLD:  # per-unit norms, folded into the values (zero for units past the row's end)
            uf = (i * S + as_) * UPB + ub
            if PART or not EVEN:
                nf = tl.load(nrm_ptr + row * NG + tl.minimum(uf, NUT - 1) // UPG, mask=uf < NUT, other=0.0)
            else:
                nf = tl.load(nrm_ptr + row * NG + uf // UPG)
            nsc = _norm_pattern(nf.to(tl.float32), F16, USE_ASM)
        v = _mma_unit_pairs(w0, w1, w2, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV, RUNTIME_LAYOUT, F16, FOLD, USE_ASM)
        # axes h a s l t r q0 q1 .. -> s a h l r .. q1 q0 t: rows 16 a + 8 h + l, k = e + 2t + 8 (q + r PER/2)
        # (LANES_FIRST: from t l s h a r q0 q1 ..); one literal order per unit size: the order is a compile-time tuple
        if LANES_FIRST:
            if NLEV == 8:
                v = tl.permute(v, (2, 4, 3, 1, 5, 9, 8, 7, 6, 0))
            elif NLEV == 4:
                v = tl.permute(v, (2, 4, 3, 1, 5, 8, 7, 6, 0))
            else:
                v = tl.permute(v, (2, 4, 3, 1, 5, 7, 6, 0))
        elif NLEV == 8:
            v = tl.permute(v, (2, 1, 0, 3, 5, 9, 8, 7, 6, 4))
        elif NLEV == 4:
            v = tl.permute(v, (2, 1, 0, 3, 5, 8, 7, 6, 4))
        else:
            v = tl.permute(v, (2, 1, 0, 3, 5, 7, 6, 4))
        w = tl.reshape(_mma_values(tl.reshape(v, [S, BN, KB // 2]), F16, USE_ASM), [S, BN, KB])
        if XAHEAD:  # this block's activations and norms were read during the previous one
            xa = xn
            nr = nrn
            if ITERS > 1:
                xn = _mma_x(xrow, tl.minimum((i + 1) * S + xs, NBLK - 1), xub, UPB, NUT, PER, True, PART, XORDER, KB)
                if not FOLD:
                    nrn = _mma_block_norms(nrm_ptr, tl.minimum((i + 1) * S + ns, NBLK - 1), nrow, N, NBLK, UPB, UPG,
                                           NG, A, True)
        else:
            xa = _mma_x(xrow, i * S + xs, xub, UPB, NUT, PER, EVEN, PART, XORDER, KB)
        # axes (v, mh, r, s, mg, t, c) -> c = 2 q' + e, q = q' + 4 v -> s mh mg r v q' t e
        if LANES_FIRST:  # axes (t, mg, s, v, mh, r, q', e) -> s mh mg r v q' t e
            xa = tl.reshape(xa, [4, 8, S, PER // 8, MH, R, 4, 2])
            xa = tl.permute(xa, (2, 4, 1, 5, 3, 6, 0, 7))
        else:
            xa = tl.reshape(xa, [PER // 8, MH, R, S, 8, 4, 4, 2])
            xa = tl.permute(xa, (3, 1, 4, 2, 0, 6, 5, 7))
        xk = tl.permute(tl.reshape(xa, [S, BM, KB]), (0, 2, 1))
        if FOLD:
            acc = tl.dot(w, xk, acc)
        else:
            part = tl.dot(w, xk)
            if not XAHEAD:
                nr = _mma_block_norms(nrm_ptr, i * S + ns, nrow, N, NBLK, UPB, UPG, NG, A, EVEN)
            elif not EVEN:  # (the block read ahead was clamped to the last: blocks past the end get zero norms)
                nr = tl.where(i * S + ns < NBLK, nr, 0.0)
            acc += part * nr[:, :, None]
        if AHEAD and ITERS > 1:
            w0 = n0
            w1 = n1
            w2 = n2
    y = tl.sum(acc, axis=0)
    rn = pid_n * BN + tl.arange(0, BN)
    om = pid_m * BM + tl.arange(0, BM)
    optr = out_ptr + om[None, :] * stride_om + rn[:, None]
    tl.store(optr, y.to(out_ptr.dtype.element_ty), mask=(rn < N)[:, None] & (om < M)[None, :])
