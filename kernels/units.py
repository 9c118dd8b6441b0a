"""Decoding packed units in the kernels: index extraction from the packed words, codebook values by
load or select trees, and the loads of a program's units."""

from __future__ import annotations

import triton
import triton.language as tl

# ---------------------------------------------------------------------------
# device helpers
# ---------------------------------------------------------------------------

@triton.jit
def _extract(w0, w1, w2, J: tl.constexpr, NLEV: tl.constexpr, RUNTIME_LAYOUT: tl.constexpr):
    """Index number J of a unit (uint32 words w0..w2, or a byte for ternary) as int32; RUNTIME_LAYOUT: the units
    are in the runtime layout (`turboquant_hf.format.runtime_layout`)."""
    if RUNTIME_LAYOUT and NLEV == 4:
        if J < 8:
            v = (w0 >> (4 * J)) & 3
        else:
            v = (w0 >> (4 * (J - 8) + 2)) & 3
    elif RUNTIME_LAYOUT and NLEV == 8:
        if J < 24:
            if J // 8 == 0:
                w = w0
            elif J // 8 == 1:
                w = w1
            else:
                w = w2
            v = (w >> (4 * (J % 8))) & 7
        else:
            S: tl.constexpr = 4 * (J - 24) + 3
            v = ((w0 >> S) & 1) | (((w1 >> S) & 1) << 1) | (((w2 >> S) & 1) << 2)
    elif NLEV == 4:
        v = (w0 >> (2 * J)) & 3
    elif NLEV == 16:
        v = (w0 >> (4 * J)) & 15
    elif NLEV == 8:
        BIT: tl.constexpr = 3 * J
        OFF: tl.constexpr = BIT % 32
        if BIT // 32 == 0:
            lo = w0
            hi = w1
        elif BIT // 32 == 1:
            lo = w1
            hi = w2
        else:
            lo = w2
            hi = w2
        if OFF <= 29:
            v = (lo >> OFF) & 7
        else:
            v = ((lo >> OFF) | (hi << (32 - OFF))) & 7
    else:
        # ternary: digit J of a base-3 byte, least-significant digit first
        POW: tl.constexpr = 3**J
        if POW == 1:
            q = w0
        else:
            q = w0 // POW
        if J == 4:
            v = q
        else:
            v = q - (q // 3) * 3
    return v.to(tl.int32)


@triton.jit
def _bit(w0, w1, w2, B: tl.constexpr):
    """Bit B of a unit's bit stream (uint32 words w0, w1, w2) as a boolean tensor."""
    if B // 32 == 0:
        w = w0
    elif B // 32 == 1:
        w = w1
    else:
        w = w2
    if B % 32 == 31:
        p = (w >> 31) != 0
    else:
        p = (w & (1 << (B % 32))) != 0
    return p


@triton.jit
def _ibit(w0, w1, w2, J: tl.constexpr, B: tl.constexpr, NB: tl.constexpr, RUNTIME_LAYOUT: tl.constexpr):
    """Bit B of index number J (NB bits per index) of a unit, in the published or the runtime layout."""
    if not RUNTIME_LAYOUT:
        p = _bit(w0, w1, w2, NB * J + B)
    elif NB == 2:
        if J < 8:
            p = _bit(w0, w1, w2, 4 * J + B)
        else:
            p = _bit(w0, w1, w2, 4 * (J - 8) + 2 + B)
    elif J < 24:
        p = _bit(w0, w1, w2, 32 * (J // 8) + 4 * (J % 8) + B)
    else:
        p = _bit(w0, w1, w2, 32 * B + 4 * (J - 24) + 3)
    return p


@triton.jit
def _sel4(p0, p1, c0, c1, c2, c3):
    return tl.where(p1, tl.where(p0, c3, c2), tl.where(p0, c1, c0))


@triton.jit
def _codebook16(cb_ptr, NLEV: tl.constexpr):
    """The codebook as 16 scalars (entries past NLEV repeat entry 0), loaded once per program."""
    c0 = tl.load(cb_ptr)
    c1 = tl.load(cb_ptr + 1)
    c2 = tl.load(cb_ptr + 2)
    c3 = c0
    c4 = c0
    c5 = c0
    c6 = c0
    c7 = c0
    c8 = c0
    c9 = c0
    c10 = c0
    c11 = c0
    c12 = c0
    c13 = c0
    c14 = c0
    c15 = c0
    if NLEV >= 4:
        c3 = tl.load(cb_ptr + 3)
    if NLEV >= 8:
        c4 = tl.load(cb_ptr + 4)
        c5 = tl.load(cb_ptr + 5)
        c6 = tl.load(cb_ptr + 6)
        c7 = tl.load(cb_ptr + 7)
    if NLEV >= 16:
        c8 = tl.load(cb_ptr + 8)
        c9 = tl.load(cb_ptr + 9)
        c10 = tl.load(cb_ptr + 10)
        c11 = tl.load(cb_ptr + 11)
        c12 = tl.load(cb_ptr + 12)
        c13 = tl.load(cb_ptr + 13)
        c14 = tl.load(cb_ptr + 14)
        c15 = tl.load(cb_ptr + 15)
    return c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15


@triton.jit
def _value(w0, w1, w2, cb_ptr, J: tl.constexpr, NLEV: tl.constexpr, LUT_MASK: tl.constexpr, RUNTIME_LAYOUT: tl.constexpr,
           c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15):
    """float32 codebook value of index number J of every unit.

    Two ways, mixed per J by the bit mask LUT_MASK so that both pipes work: a load from the
    (L1-resident) codebook (bit J set: ~5 integer ops + one load), or a tree of selects on the
    index bits (no memory access: 3 selects for 2 bits, 7 for 3, 15 for 4, plus bit tests)."""
    if (LUT_MASK >> J) & 1:
        v = tl.load(cb_ptr + _extract(w0, w1, w2, J, NLEV, RUNTIME_LAYOUT))
    elif NLEV == 3:
        d = _extract(w0, w1, w2, J, NLEV, RUNTIME_LAYOUT)
        v = tl.where(d == 0, c0, tl.where(d == 1, c1, c2))
    elif NLEV == 4:
        v = _sel4(_ibit(w0, w1, w2, J, 0, 2, RUNTIME_LAYOUT), _ibit(w0, w1, w2, J, 1, 2, RUNTIME_LAYOUT), c0, c1, c2, c3)
    elif NLEV == 8:
        p0 = _ibit(w0, w1, w2, J, 0, 3, RUNTIME_LAYOUT)
        p1 = _ibit(w0, w1, w2, J, 1, 3, RUNTIME_LAYOUT)
        p2 = _ibit(w0, w1, w2, J, 2, 3, RUNTIME_LAYOUT)
        v = tl.where(p2, _sel4(p0, p1, c4, c5, c6, c7), _sel4(p0, p1, c0, c1, c2, c3))
    else:
        p0 = _bit(w0, w1, w2, 4 * J)
        p1 = _bit(w0, w1, w2, 4 * J + 1)
        p2 = _bit(w0, w1, w2, 4 * J + 2)
        p3 = _bit(w0, w1, w2, 4 * J + 3)
        lo = tl.where(p2, _sel4(p0, p1, c4, c5, c6, c7), _sel4(p0, p1, c0, c1, c2, c3))
        hi = tl.where(p2, _sel4(p0, p1, c12, c13, c14, c15), _sel4(p0, p1, c8, c9, c10, c11))
        v = tl.where(p3, hi, lo)
    return v


@triton.jit
def _leaf(w0, w1, w2, cb_ptr, J: tl.constexpr, NLEV: tl.constexpr, PER: tl.constexpr, DT: tl.constexpr,
          LUT_MASK: tl.constexpr, TU: tl.constexpr, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15):
    if J < PER:
        out = _value(w0, w1, w2, cb_ptr, J, NLEV, LUT_MASK, TU, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15).to(DT)
    else:
        out = (w0 & 0).to(DT)  # padding slot (ternary units hold 5 of 8)
    return out


# The codebook values of indices J0, J0+ST, J0+2ST, ... of every unit, joined so that the last joined
# dim is the lowest bit of the index number: reshaping `[..., 2, ..., 2]` row-major then gives the
# natural order j = 0..SPAN-1. One function per level (no recursion in Triton functions).
@triton.jit
def _tree2(w0, w1, w2, cb_ptr, J0: tl.constexpr, ST: tl.constexpr, NLEV: tl.constexpr, PER: tl.constexpr,
           DT: tl.constexpr, LM: tl.constexpr, TU: tl.constexpr, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15):
    return tl.join(_leaf(w0, w1, w2, cb_ptr, J0, NLEV, PER, DT, LM, TU, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15),
                   _leaf(w0, w1, w2, cb_ptr, J0 + ST, NLEV, PER, DT, LM, TU, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15))


@triton.jit
def _tree4(w0, w1, w2, cb_ptr, J0: tl.constexpr, ST: tl.constexpr, NLEV: tl.constexpr, PER: tl.constexpr,
           DT: tl.constexpr, LM: tl.constexpr, TU: tl.constexpr, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15):
    return tl.join(_tree2(w0, w1, w2, cb_ptr, J0, 2 * ST, NLEV, PER, DT, LM, TU, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15),
                   _tree2(w0, w1, w2, cb_ptr, J0 + ST, 2 * ST, NLEV, PER, DT, LM, TU, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15))


@triton.jit
def _tree8(w0, w1, w2, cb_ptr, J0: tl.constexpr, ST: tl.constexpr, NLEV: tl.constexpr, PER: tl.constexpr,
           DT: tl.constexpr, LM: tl.constexpr, TU: tl.constexpr, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15):
    return tl.join(_tree4(w0, w1, w2, cb_ptr, J0, 2 * ST, NLEV, PER, DT, LM, TU, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15),
                   _tree4(w0, w1, w2, cb_ptr, J0 + ST, 2 * ST, NLEV, PER, DT, LM, TU, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15))


@triton.jit
def _tree16(w0, w1, w2, cb_ptr, J0: tl.constexpr, ST: tl.constexpr, NLEV: tl.constexpr, PER: tl.constexpr,
            DT: tl.constexpr, LM: tl.constexpr, TU: tl.constexpr, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15):
    return tl.join(_tree8(w0, w1, w2, cb_ptr, J0, 2 * ST, NLEV, PER, DT, LM, TU, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15),
                   _tree8(w0, w1, w2, cb_ptr, J0 + ST, 2 * ST, NLEV, PER, DT, LM, TU, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15))


@triton.jit
def _decode_unit_values(w0, w1, w2, cb_ptr, PER_P: tl.constexpr, NLEV: tl.constexpr, PER: tl.constexpr,
                        DT: tl.constexpr, LM: tl.constexpr, TU: tl.constexpr, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15):
    """`[..., UPG_P]` units -> `[..., UPG_P, 2, ..., 2]` codebook values (PER_P of them per unit) in DT."""
    if PER_P == 32:
        out = tl.join(_tree16(w0, w1, w2, cb_ptr, 0, 2, NLEV, PER, DT, LM, TU, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15),
                      _tree16(w0, w1, w2, cb_ptr, 1, 2, NLEV, PER, DT, LM, TU, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15))
    elif PER_P == 16:
        out = _tree16(w0, w1, w2, cb_ptr, 0, 1, NLEV, PER, DT, LM, TU, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15)
    else:
        out = _tree8(w0, w1, w2, cb_ptr, 0, 1, NLEV, PER, DT, LM, TU, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15)
    return out


@triton.jit
def _load_units(pk_ptr, unit_off, mask, WPU: tl.constexpr, RUNTIME_LAYOUT: tl.constexpr, row, NUT):
    """Load the words (or the byte) of units at `unit_off` (in units: `row * NUT + unit in the row`);
    uint32 results. In the runtime layout (RUNTIME_LAYOUT) a row's three-word units are stored as three planes
    (word p of unit u at `p * NUT + u` within the row), so each load is one coalesced sweep."""
    if WPU == 3:
        if RUNTIME_LAYOUT:
            base = pk_ptr + unit_off + row * (2 * NUT)
            step = NUT
        else:
            base = pk_ptr + unit_off * 3
            step = 1
        if mask is None:
            w0 = tl.load(base, eviction_policy="evict_first").to(tl.uint32, bitcast=True)
            w1 = tl.load(base + step, eviction_policy="evict_first").to(tl.uint32, bitcast=True)
            w2 = tl.load(base + 2 * step, eviction_policy="evict_first").to(tl.uint32, bitcast=True)
        else:
            w0 = tl.load(base, mask=mask, other=0, eviction_policy="evict_first").to(tl.uint32, bitcast=True)
            w1 = tl.load(base + step, mask=mask, other=0, eviction_policy="evict_first").to(tl.uint32, bitcast=True)
            w2 = tl.load(base + 2 * step, mask=mask, other=0, eviction_policy="evict_first").to(tl.uint32, bitcast=True)
    else:
        if mask is None:
            w0 = tl.load(pk_ptr + unit_off, eviction_policy="evict_first")
        else:
            w0 = tl.load(pk_ptr + unit_off, mask=mask, other=0, eviction_policy="evict_first")
        if WPU == 0:
            w0 = w0.to(tl.uint32)
        else:
            w0 = w0.to(tl.uint32, bitcast=True)
        w1 = w0
        w2 = w0
    return w0, w1, w2
