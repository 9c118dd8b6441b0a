"""Dequantization kernels for large M: the weight decoded to a 16-bit matrix for cuBLAS (`dequantize_lut`,
`dequantize_rotated`)."""

from __future__ import annotations

import triton
import triton.language as tl

from .lut import _byte_tables, _lut8, _unit_nibbles
from .units import _codebook16, _decode_unit_values, _load_units

# ---------------------------------------------------------------------------
# 2c. prefill: the weight (or, for ternary and float32, the rotated-basis weight) into a scratch buffer, then cuBLAS
# ---------------------------------------------------------------------------

@triton.jit
def _dequant_kernel(pk_ptr, nrm_ptr, cb_ptr, out_ptr, N, NG, stride_on,
                    NLEV: tl.constexpr, G: tl.constexpr, PER: tl.constexpr, PER_P: tl.constexpr,
                    WPU: tl.constexpr, UPG: tl.constexpr, UPG_P: tl.constexpr, BN: tl.constexpr,
                    LUT_MASK: tl.constexpr, RUNTIME_LAYOUT: tl.constexpr):
    pid_n = tl.program_id(0)
    g = tl.program_id(1)
    c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15 = _codebook16(cb_ptr, NLEV)
    BK: tl.constexpr = UPG_P * PER_P
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = rn < N
    ru = tl.arange(0, UPG_P)
    col = tl.arange(0, BK)
    kin = (col // PER_P) * PER + col % PER_P
    kvalid = (col % PER_P < PER) & (kin < G)
    unit_off = (rn[:, None] * NG + g) * UPG + ru[None, :]
    w0, w1, w2 = _load_units(pk_ptr, unit_off, nmask[:, None] & (ru < UPG)[None, :], WPU, RUNTIME_LAYOUT, rn[:, None],
                              NG * UPG)
    w = _decode_unit_values(w0, w1, w2, cb_ptr, PER_P, NLEV, PER, tl.float32, LUT_MASK, RUNTIME_LAYOUT, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15)
    w = tl.reshape(w, [BN, BK])
    nr = tl.load(nrm_ptr + rn * NG + g, mask=nmask, other=0.0)
    w = w * nr[:, None]
    optr = out_ptr + rn[:, None] * stride_on + (g * G + kin)[None, :]
    tl.store(optr, w.to(out_ptr.dtype.element_ty), mask=nmask[:, None] & kvalid[None, :])


@triton.jit
def _join8(x0, x1, x2, x3, x4, x5, x6, x7):
    """Eight same-shape tensors -> one with three more axes of 2, flattened in the order x0, x1, ..., x7 (each
    `tl.join` adds the fastest axis, so the pairs are taken by the highest index bit first)."""
    return tl.join(tl.join(tl.join(x0, x4), tl.join(x2, x6)), tl.join(tl.join(x1, x5), tl.join(x3, x7)))


@triton.jit
def _lut_tile(w0, w1, w2, t0, t1, t2, t3, t4, t5, t6, t7, NLEV: tl.constexpr, RUNTIME_LAYOUT: tl.constexpr,
              USE_ASM: tl.constexpr):
    """`[R, U]` units of a 2-, 3- or 4-bit weight -> their float32 codebook values (from the `_byte_tables`,
    16-bit precision) as `[R, U, 2, ..., 2]`: flattened, value j of unit u sits at `u * PER + j`, the
    natural order of the inputs."""
    a0, a1, a2, a3, a4, a5, a6, a7 = _lut8(_unit_nibbles(w0, w1, w2, 0, NLEV, RUNTIME_LAYOUT), t0, t1, t2, t3, t4, t5, t6, t7,
                                           NLEV, USE_ASM)
    if NLEV == 16:
        out = _join8(a0, a1, a2, a3, a4, a5, a6, a7)
    else:
        b0, b1, b2, b3, b4, b5, b6, b7 = _lut8(_unit_nibbles(w0, w1, w2, 1, NLEV, RUNTIME_LAYOUT), t0, t1, t2, t3, t4, t5, t6,
                                               t7, NLEV, USE_ASM)
        if NLEV == 4:  # two chunks of eight: chunk is the slower of the two
            out = _join8(tl.join(a0, b0), tl.join(a1, b1), tl.join(a2, b2), tl.join(a3, b3),
                         tl.join(a4, b4), tl.join(a5, b5), tl.join(a6, b6), tl.join(a7, b7))
        else:  # four chunks of eight (3-bit)
            c0, c1, c2, c3, c4, c5, c6, c7 = _lut8(_unit_nibbles(w0, w1, w2, 2, NLEV, RUNTIME_LAYOUT), t0, t1, t2, t3, t4, t5,
                                                   t6, t7, NLEV, USE_ASM)
            e0, e1, e2, e3, e4, e5, e6, e7 = _lut8(_unit_nibbles(w0, w1, w2, 3, NLEV, RUNTIME_LAYOUT), t0, t1, t2, t3, t4, t5,
                                                   t6, t7, NLEV, USE_ASM)
            out = _join8(tl.join(tl.join(a0, c0), tl.join(b0, e0)), tl.join(tl.join(a1, c1), tl.join(b1, e1)),
                         tl.join(tl.join(a2, c2), tl.join(b2, e2)), tl.join(tl.join(a3, c3), tl.join(b3, e3)),
                         tl.join(tl.join(a4, c4), tl.join(b4, e4)), tl.join(tl.join(a5, c5), tl.join(b5, e5)),
                         tl.join(tl.join(a6, c6), tl.join(b6, e6)), tl.join(tl.join(a7, c7), tl.join(b7, e7)))
    return out


@triton.jit
def _dequant_lut_kernel(pk_ptr, nrm_ptr, cb_ptr, s1_ptr, s2_ptr, h_ptr, out_ptr, sel_ptr, N, K, stride_on, scale,
                        NG: tl.constexpr, NLEV: tl.constexpr, G: tl.constexpr, UPG: tl.constexpr,
                        BR: tl.constexpr, RUNTIME_LAYOUT: tl.constexpr, USE_ASM: tl.constexpr, UNROT: tl.constexpr,
                        SEL_ROWS: tl.constexpr):
    """One program per BR consecutive (row, group) pairs of a 2-, 3- or 4-bit weight: their units are one
    contiguous run, decoded with the byte-permute lookups and scaled by the group norms.

    SEL_ROWS > 0: the weight is stacked matrices of SEL_ROWS rows (experts) and output row n is row
    `n % SEL_ROWS` of matrix `sel[n // SEL_ROWS]` (only the selected matrices are read).

    UNROT False: the rotated-basis weight `norm * codebook[idx]` (out is `(N, NG*G)`).
    UNROT True: the weight itself, `D1 . H . D2 . (norm * codebook[idx]) / sqrt(G)` per group, the Walsh-Hadamard
    product on the tensor cores (the cached +-1 matrix `h_ptr`, in the operands' dtype, read once per program;
    the D2 signs applied to the values with the norms); out is `(N, K)`, so cuBLAS can multiply the activations
    as they are, with no rotation pass."""
    WPU: tl.constexpr = 3 if NLEV == 8 else 1
    NUT: tl.constexpr = NG * UPG
    t0, t1, t2, t3, t4, t5, t6, t7 = _byte_tables(cb_ptr, NLEV)
    kk = tl.arange(0, G)
    ru = tl.arange(0, UPG)
    if UNROT:  # read once per program (a weight of few blocks per program spent most of its time building it)
        h = tl.load(h_ptr + kk[:, None] * G + kk[None, :])
        cs2 = tl.load(s2_ptr + kk)
        cscale = scale * tl.load(s1_ptr + kk)
    RG = N * NG
    for blk in tl.range(tl.program_id(0), tl.cdiv(RG, BR), tl.num_programs(0)):
        r = blk * BR + tl.arange(0, BR)
        rmask = r < RG
        r = tl.minimum(r, RG - 1)  # clamped: loads stay in bounds, the extra rows are not stored
        n = (r // NG).to(tl.int64)
        g = r % NG
        if SEL_ROWS > 0:  # the source row: row n % SEL_ROWS of the selected matrix (none for a negative number)
            ex = tl.load(sel_ptr + n // SEL_ROWS).to(tl.int64)
            rmask = rmask & (ex >= 0)
            src = tl.maximum(ex, 0) * SEL_ROWS + n % SEL_ROWS
            rs = src * NG + g
            umask = rmask[:, None]
        else:
            src = n
            rs = r
            umask = None
        w0, w1, w2 = _load_units(pk_ptr, rs[:, None] * UPG + ru[None, :], umask, WPU, RUNTIME_LAYOUT, src[:, None], NUT)
        v = tl.reshape(_lut_tile(w0, w1, w2, t0, t1, t2, t3, t4, t5, t6, t7, NLEV, RUNTIME_LAYOUT, USE_ASM), [BR, G])
        v = v * tl.load(nrm_ptr + rs).to(tl.float32)[:, None]
        if UNROT:
            v = v * cs2[None, :]  # (exact: +-1)
            if USE_ASM:  # 16-bit operands (+-1 entries are exact), float32 accumulation
                y = tl.dot(v.to(out_ptr.dtype.element_ty), h)
            else:  # (the interpreter: float32 throughout)
                y = tl.dot(v, h, input_precision="ieee")
            y = y * cscale[None, :]
            col = g[:, None] * G + kk[None, :]
            tl.store(out_ptr + n[:, None] * stride_on + col, y.to(out_ptr.dtype.element_ty),
                     mask=rmask[:, None] & (col < K))
        else:
            tl.store(out_ptr + n[:, None] * stride_on + g[:, None] * G + kk[None, :],
                     v.to(out_ptr.dtype.element_ty), mask=rmask[:, None])
