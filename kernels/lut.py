"""Byte-table lookup decoding: the codebook as byte tables, indices looked up four at a time with byte
permutes (`_lut8`), nibble extraction of the packed units."""

from __future__ import annotations

import triton
import triton.language as tl

from .ptx import _LUT8_ASM, _LUT16_ASM, _prmt, _prmt_c

# ---------------------------------------------------------------------------
# 2a'. codebook lookups with byte permutes (the pair GEMV, the tensor-core GEMV, the lookup dequantization)
# ---------------------------------------------------------------------------
#
# A codebook of up to 8 entries fits in four 32-bit registers as byte tables: the low bytes of the
# entries' 16-bit patterns (two registers) and their high bytes (two more). One `prmt` (byte permute)
# looks up four indices at once, given them as the four nibbles of its selector; more permutes assemble
# the values from a low and a high byte: two 16-bit values per register (the pair and tensor-core GEMVs,
# `_mma_pairs`), or the float32 word `(P << 16) | P` per value (`_lut8`, the lookup dequantization), P the
# 16-bit pattern whose float32 reading of `(P << 16) | P` is nearest to the codebook entry (bfloat16
# precision: relative error below 2^-8 per entry, far below the quantization error). The packed
# indices are spread from 3-bit (or 2-bit) fields to nibbles with shifts and masks, eight at a time
# (in the runtime layout they already sit in nibbles).

@triton.jit
def _pattern(c):
    """16-bit pattern P (uint32) with float32((P << 16) | P) nearest to the float32 scalar c."""
    bits = c.to(tl.uint32, bitcast=True)
    hi = bits >> 16
    best = hi
    err = tl.abs(((hi << 16) | hi).to(tl.float32, bitcast=True) - c)
    for d in tl.static_range(2):
        if d == 0:
            p = (hi - 1) & 0xFFFF
        else:
            p = (hi + 1) & 0xFFFF
        e = tl.abs(((p << 16) | p).to(tl.float32, bitcast=True) - c)
        take = e < err
        best = tl.where(take, p, best)
        err = tl.where(take, e, err)
    return best


@triton.jit
def _entry_pattern(c, PAIRS: tl.constexpr):
    if PAIRS == 0:
        p = _pattern(c)
    else:
        p = _mma_pattern(c, PAIRS == 2)
    return p


@triton.jit
def _byte_tables(cb_ptr, NLEV: tl.constexpr, PAIRS: tl.constexpr = 0):
    """The codebook (NLEV <= 16 entries) as eight uint32 byte tables: low bytes of entries 0-3, 4-7, high
    bytes of entries 0-3, 4-7, then the same for entries 8-15 (missing entries are zero). The 16-bit pattern
    of an entry: PAIRS 0, the P with float32((P << 16) | P) nearest to it (`_lut8`'s float32 values);
    1, its bfloat16 and 2, its float16 encoding (the tensor-core and pair GEMVs' 16-bit pairs)."""
    t0 = _entry_pattern(tl.load(cb_ptr).to(tl.float32), PAIRS)
    t1 = t0 & 0
    t2 = t0 >> 8
    t3 = t1
    t4 = t1
    t5 = t1
    t6 = t1
    t7 = t1
    t0 = t0 & 0xFF
    for i in tl.static_range(1, 16):
        if i < NLEV:
            p = _entry_pattern(tl.load(cb_ptr + i).to(tl.float32), PAIRS)
            lo = (p & 0xFF) << (8 * (i % 4))
            hi = (p >> 8) << (8 * (i % 4))
            if i < 4:
                t0 = t0 | lo
                t2 = t2 | hi
            elif i < 8:
                t1 = t1 | lo
                t3 = t3 | hi
            elif i < 12:
                t4 = t4 | lo
                t6 = t6 | hi
            else:
                t5 = t5 | lo
                t7 = t7 | hi
    return t0, t1, t2, t3, t4, t5, t6, t7


@triton.jit
def _lookup_bytes(d, t0, t1, t2, t3, t4, t5, t6, t7, NLEV: tl.constexpr, HALF: tl.constexpr):
    """The permutes of `_LUT8_ASM` / `_LUT16_ASM` written out (the interpreter's path of `_lut8` and `_mma_pairs`):
    the low and the high bytes of the codebook entries of indices 4 HALF .. 4 HALF + 3, the nibbles of uint32 `d`.
    With 16 entries, the tables of entries 8-15 (t4-t7) where an index's top bit is set (a byte mask from the
    sign-replicate permute of `d << 4` and `d`)."""
    s = d & 0x77777777
    if HALF:
        s = s >> 16
    if NLEV == 16:
        if HALF:
            m = _prmt_c(d << 4, d, 0xFBEA)
        else:
            m = _prmt_c(d << 4, d, 0xD9C8)
        lo = _prmt(t0, t1, s) ^ ((_prmt(t0, t1, s) ^ _prmt(t4, t5, s)) & m)  # (a select by mask, no `~`: the
        hi = _prmt(t2, t3, s) ^ ((_prmt(t2, t3, s) ^ _prmt(t6, t7, s)) & m)  # interpreter's uint32 -1 overflows)
    else:
        lo = _prmt(t0, t1, s)
        hi = _prmt(t2, t3, s)
    return lo, hi


@triton.jit
def _lut8(d, t0, t1, t2, t3, t4, t5, t6, t7, NLEV: tl.constexpr, USE_ASM: tl.constexpr):
    """Eight float32 codebook values from eight indices held as the nibbles of uint32 `d` (3-bit indices
    for codebooks of up to 8 entries, 4-bit for 16)."""
    if USE_ASM and NLEV == 16:
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            _LUT16_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", [d, t0, t1, t2, t3, t4, t5, t6, t7],
            dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    elif USE_ASM:
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            _LUT8_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r", [t0, t1, t2, t3, d],
            dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    else:
        lo, hi = _lookup_bytes(d, t0, t1, t2, t3, t4, t5, t6, t7, NLEV, 0)
        v0 = _prmt_c(lo, hi, 0x4040).to(tl.float32, bitcast=True)
        v1 = _prmt_c(lo, hi, 0x5151).to(tl.float32, bitcast=True)
        v2 = _prmt_c(lo, hi, 0x6262).to(tl.float32, bitcast=True)
        v3 = _prmt_c(lo, hi, 0x7373).to(tl.float32, bitcast=True)
        lo, hi = _lookup_bytes(d, t0, t1, t2, t3, t4, t5, t6, t7, NLEV, 1)
        v4 = _prmt_c(lo, hi, 0x4040).to(tl.float32, bitcast=True)
        v5 = _prmt_c(lo, hi, 0x5151).to(tl.float32, bitcast=True)
        v6 = _prmt_c(lo, hi, 0x6262).to(tl.float32, bitcast=True)
        v7 = _prmt_c(lo, hi, 0x7373).to(tl.float32, bitcast=True)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _nibbles(c, NLEV: tl.constexpr):
    """Eight consecutive b-bit fields at the bottom of uint32 `c` (b = 3 or 2) spread to nibbles."""
    if NLEV == 8:
        a = (c & 0xFFF) | ((c << 4) & 0x0FFF0000)
        a = (a & 0x003F003F) | ((a << 2) & 0x3F003F00)
        a = (a & 0x07070707) | ((a << 1) & 0x70707070)
    else:
        a = (c & 0xFF) | ((c << 8) & 0x00FF0000)
        a = (a & 0x000F000F) | ((a << 4) & 0x0F000F00)
        a = (a & 0x03030303) | ((a << 2) & 0x30303030)
    return a


@triton.jit
def _chunk(w0, w1, w2, CH: tl.constexpr, NLEV: tl.constexpr):
    """Chunk CH (eight indices) of a unit: 3-bit units are 3 words / 32 indices (chunks at bits 0, 24,
    48, 72), 2-bit units one word / 16 indices."""
    if NLEV == 8:
        if CH == 0:
            c = w0
        elif CH == 1:
            c = (w0 >> 24) | (w1 << 8)
        elif CH == 2:
            c = (w1 >> 16) | (w2 << 16)
        else:
            c = w2 >> 8
    else:
        if CH == 0:
            c = w0
        else:
            c = w0 >> 16
    return c


@triton.jit
def _unit_nibbles(w0, w1, w2, CH: tl.constexpr, NLEV: tl.constexpr, RUNTIME_LAYOUT: tl.constexpr):
    """Chunk CH (eight indices) of a unit as the nibbles of a uint32. In the runtime layout the fields
    already sit in nibbles: 3-bit units hold indices 8p..8p+7 in the low three bits of word p's
    nibbles and indices 24..31 in their top bits (bit p of index 24+n in nibble n of word p); 2-bit
    units hold indices 0-7 in the low two bits of each nibble and 8-15 in the high two."""
    if NLEV == 16:
        d = w0  # (4-bit indices are nibbles already)
    elif not RUNTIME_LAYOUT:
        d = _nibbles(_chunk(w0, w1, w2, CH, NLEV), NLEV)
    elif NLEV == 8:
        if CH == 0:
            d = w0 & 0x77777777
        elif CH == 1:
            d = w1 & 0x77777777
        elif CH == 2:
            d = w2 & 0x77777777
        else:
            d = ((w0 >> 3) & 0x11111111) | ((w1 >> 2) & 0x22222222) | ((w2 >> 1) & 0x44444444)
    elif CH == 0:
        d = w0 & 0x33333333
    else:
        d = (w0 >> 2) & 0x33333333
    return d


@triton.jit
def _mma_pattern(c, F16: tl.constexpr):
    """The 16-bit pattern (uint32) of float32 `c` rounded to nearest even: bfloat16, or float16 (F16)."""
    if F16:
        p = c.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
    else:
        b = c.to(tl.uint32, bitcast=True)
        p = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return p
