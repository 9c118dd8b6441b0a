"""Inline PTX for the GEMV kernels (byte permutes, pair lookups, packed half arithmetic) and programmatic
dependent launch; under the Triton interpreter the permutes are emulated (`_prmt`, `_prmt_c`)."""

from __future__ import annotations

import triton
import triton.language as tl

try:  # programmatic dependent launch (Hopper and later; Triton >= 3.5)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _HAS_GDC = True
except ImportError:  # pragma: no cover - older Triton
    _HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@triton.jit
def _prmt(a, b, sel):
    """PTX `prmt.b32` in its default mode, written out for the interpreter, for selectors computed at run time:
    selector nibble q (below 8 here: every such selector is a table lookup) picks byte `n` of the pair (a, b) for
    output byte q. (The pair as one 64-bit word, each byte one shift: a third of the interpreted operations of a
    byte-by-byte choice.)"""
    ab = a.to(tl.uint64) | (b.to(tl.uint64) << 32)
    sel = sel.to(tl.uint64)
    out = ab & 0
    for q in tl.static_range(4):
        if q == 0:
            sh = (sel << 3) & 0x38
        else:
            sh = (sel >> (4 * q - 3)) & 0x38
        out = out | (((ab >> sh) & 0xFF) << (8 * q))
    return out.to(tl.uint32)


@triton.jit
def _prmt_c(a, b, SEL: tl.constexpr):
    """`_prmt` for a selector known at compile time, any nibble: n & 7 picks byte n & 7 of the pair (a, b); with bit
    3 set, that byte's top bit replicated (the sign-replicate mode)."""
    out = a & 0
    for q in tl.static_range(4):
        n = (SEL >> (4 * q)) & 15  # a constexpr in each unrolled step (a `tl.constexpr` annotation here would
        if (n & 7) < 4:            # redefine one name per step, which newer Tritons refuse)
            byte = (a >> (8 * (n & 3))) & 0xFF
        else:
            byte = (b >> (8 * (n & 3))) & 0xFF
        if n >= 8:
            byte = tl.where(byte >= 128, byte | 0xFF, byte & 0)
        out = out | (byte << (8 * q))
    return out


_LUT8_ASM = tl.constexpr("""{
.reg .b32 l, h, s;
prmt.b32 l, $8, $9, $12;
prmt.b32 h, $10, $11, $12;
prmt.b32 $0, l, h, 0x4040;
prmt.b32 $1, l, h, 0x5151;
prmt.b32 $2, l, h, 0x6262;
prmt.b32 $3, l, h, 0x7373;
shr.b32 s, $12, 16;
prmt.b32 l, $8, $9, s;
prmt.b32 h, $10, $11, s;
prmt.b32 $4, l, h, 0x4040;
prmt.b32 $5, l, h, 0x5151;
prmt.b32 $6, l, h, 0x6262;
prmt.b32 $7, l, h, 0x7373;
}""")


# 16 entries: two 8-entry lookups on the low three bits of every nibble, and a byte mask from the
# nibbles' top bits (the permute's sign-replicate mode: `d << 4` and `d` put bit 3 of nibble q at the top
# of a byte) choosing between them with one `lop3` for the low and one for the high bytes.
_LUT16_ASM = tl.constexpr("""{
.reg .b32 s, a, m, l, h, x, y;
and.b32 s, $8, 0x77777777;
shl.b32 a, $8, 4;
prmt.b32 l, $9, $10, s;
prmt.b32 x, $13, $14, s;
prmt.b32 h, $11, $12, s;
prmt.b32 y, $15, $16, s;
prmt.b32 m, a, $8, 0xD9C8;
lop3.b32 l, l, x, m, 0xD8;
lop3.b32 h, h, y, m, 0xD8;
prmt.b32 $0, l, h, 0x4040;
prmt.b32 $1, l, h, 0x5151;
prmt.b32 $2, l, h, 0x6262;
prmt.b32 $3, l, h, 0x7373;
shr.b32 s, s, 16;
prmt.b32 l, $9, $10, s;
prmt.b32 x, $13, $14, s;
prmt.b32 h, $11, $12, s;
prmt.b32 y, $15, $16, s;
prmt.b32 m, a, $8, 0xFBEA;
lop3.b32 l, l, x, m, 0xD8;
lop3.b32 h, h, y, m, 0xD8;
prmt.b32 $4, l, h, 0x4040;
prmt.b32 $5, l, h, 0x5151;
prmt.b32 $6, l, h, 0x6262;
prmt.b32 $7, l, h, 0x7373;
}""")


# ---------------------------------------------------------------------------
# helpers of the tensor-core GEMV (2b): codebook values decoded straight into mma operand registers
# ---------------------------------------------------------------------------
#
# `mma.sync` m16n8k16 fixes which weights a lane holds: with the weight tile as operand A (rows x k),
# lane 4g + t holds rows g and g + 8 of every 16-row tile and, in every 16-wide k step, the pairs
# k = 2t, 2t + 1 and 2t + 8, 2t + 9, each pair one 32-bit register (low half first). A lane holds a quarter
# of every row's k range, and the order of k inside a dot is free as long as the activations (operand B,
# k x m: lane 4g + t holds the same k of activation row g) are read in the same order. The GEMV picks the
# order in which a lane's registers are exactly the units it decodes: lane t decodes R whole units of
# each of its rows per block of KB = 4 R PER inputs, and value j = 2q + e of its unit r lands at
#
#     k = e + 2t + 8 (q + r PER/2),
#
# so the pair (e = 0, 1) that one byte permute assembles is an operand register and the decoded tile goes
# to `tl.dot` without moving (no shared memory, no shuffles). The activations of those units are PER
# contiguous inputs per unit: 128-bit loads, also straight into operand registers. (Triton places the
# tensors this way by itself: the loads' coalescing puts the lanes on (t, row) and the warps on the block
# axis, and the joins and reshapes keep every value in its lane; Triton 3.9's sm_90 SASS has no shared
# memory and no shuffles in the loop. Another Triton could insert layout conversions: slower, still right.)
#
# The lookups: the 16-bit patterns of the codebook entries (bfloat16, or float16 for float16 activations,
# rounded to nearest) as byte tables, low bytes of entries 0-3 and 4-7 in two registers and high bytes in
# two more (and four more for entries 8-15). Two permutes look up the low and the high bytes of four
# indices (nibbles of the selector), two more interleave them into the two pairs: four values for four
# permutes, plus a shift per eight written as `mul.hi` (an IMAD on the FMA pipe rather than a shift on the
# integer pipe, which the permutes keep busy); a 16-entry codebook takes two 8-entry lookups and a byte
# mask from the indices' top bits, as in `_lut8`; 4-entry codebooks in the runtime layout take one permute
# per pair (`_PAIR2_ASM`). Counted in sm_90 SASS (3-bit runtime layout, G = 128, BN = 32, 16 activation
# rows): ~2.2 instructions per weight per lane in the loop, ~1.3 of them on the integer pipe.

# (The pair lookups repeat the byte lookups of `_LUT8_ASM` / `_LUT16_ASM` with other operands, interleaves and shifts;
# each stays one literal PTX block, the instruction sequence that ptxas reads and the SASS counts above refer to.)
_PAIR8_ASM = tl.constexpr("""{
.reg .b32 l, h, s;
prmt.b32 l, $4, $5, $8;
prmt.b32 h, $6, $7, $8;
prmt.b32 $0, l, h, 0x5140;
prmt.b32 $1, l, h, 0x7362;
mul.hi.u32 s, $8, 65536;
prmt.b32 l, $4, $5, s;
prmt.b32 h, $6, $7, s;
prmt.b32 $2, l, h, 0x5140;
prmt.b32 $3, l, h, 0x7362;
}""")

_PAIR16_ASM = tl.constexpr("""{
.reg .b32 s, a, m, l, h, x, y;
and.b32 s, $4, 0x77777777;
shl.b32 a, $4, 4;
prmt.b32 l, $5, $6, s;
prmt.b32 x, $9, $10, s;
prmt.b32 h, $7, $8, s;
prmt.b32 y, $11, $12, s;
prmt.b32 m, a, $4, 0xD9C8;
lop3.b32 l, l, x, m, 0xD8;
lop3.b32 h, h, y, m, 0xD8;
prmt.b32 $0, l, h, 0x5140;
prmt.b32 $1, l, h, 0x7362;
mul.hi.u32 s, s, 65536;
prmt.b32 l, $5, $6, s;
prmt.b32 x, $9, $10, s;
prmt.b32 h, $7, $8, s;
prmt.b32 y, $11, $12, s;
prmt.b32 m, a, $4, 0xFBEA;
lop3.b32 l, l, x, m, 0xD8;
lop3.b32 h, h, y, m, 0xD8;
prmt.b32 $2, l, h, 0x5140;
prmt.b32 $3, l, h, 0x7362;
}""")


# 16 entries in the 4-bit runtime layout (sign-magnitude codes, `layout.runtime_codebook`: entry 8 + j is minus
# entry j): one 8-entry lookup on the low three bits, and the nibbles' top bits (a byte mask, as above) XORed
# into the sign bits of the high bytes: 15 instructions per eight values instead of 21.
_PAIR16S_ASM = tl.constexpr("""{
.reg .b32 s, a, m, l, h;
and.b32 s, $4, 0x77777777;
shl.b32 a, $4, 4;
prmt.b32 l, $5, $6, s;
prmt.b32 h, $7, $8, s;
prmt.b32 m, a, $4, 0xD9C8;
lop3.b32 h, h, m, 0x80808080, 0x78;
prmt.b32 $0, l, h, 0x5140;
prmt.b32 $1, l, h, 0x7362;
mul.hi.u32 s, s, 65536;
prmt.b32 l, $5, $6, s;
prmt.b32 h, $7, $8, s;
prmt.b32 m, a, $4, 0xFBEA;
lop3.b32 h, h, m, 0x80808080, 0x78;
prmt.b32 $2, l, h, 0x5140;
prmt.b32 $3, l, h, 0x7362;
}""")


# 3-bit runtime layout, indices 24..31: bit p of index 24 + n is the top bit of nibble n of word p. Masked,
# shifted right by 3, 2, 1 with `mul.hi` / `mad.hi` (the FMA pipe) and summed (the bits are disjoint).
_TOP3_ASM = tl.constexpr("""{
.reg .b32 a, b, c;
and.b32 a, $1, 0x88888888;
and.b32 b, $2, 0x88888888;
and.b32 c, $3, 0x88888888;
mul.hi.u32 c, c, 0x80000000;
mad.hi.u32 b, b, 0x40000000, c;
mad.hi.u32 $0, a, 0x20000000, b;
}""")

# 2-bit runtime layout: four entries fit one permute's eight source bytes as (low bytes, high bytes), so one
# `prmt` makes a pair when its selector is (i, 4 + i, i', 4 + i') for indices i, i'. With four indices in the
# bytes of x (each < 4), x * 0x11 + 0x40404040 (one IMAD) is that selector for the two in the low bytes, and
# shifted right by 16 (`mul.hi`) for the two in the high bytes. A word holds indices n and 8 + n in nibble n
# (bits 0-1 and 2-3), so masks of the word shifted by 0, 4 (and 2, 6) give indices 0, 2, 4, 6 and 1, 3, 5, 7
# (8 .. 15) one per byte, and a byte permute interleaves them: per 16 values 4 masks, 4 interleaves and 8
# lookups on the integer pipe (19 with `_unit_nibbles` and `_mma_pairs`), shifts and selectors on the FMA pipe.
_PAIR2_ASM = tl.constexpr("""{
.reg .b32 x, y, a, s;
and.b32 x, $8, 0x03030303;
mul.hi.u32 y, $8, 0x10000000;
and.b32 y, y, 0x03030303;
prmt.b32 a, x, y, 0x5140;
mad.lo.u32 s, a, 0x11, 0x40404040;
prmt.b32 $0, $9, $10, s;
mul.hi.u32 s, s, 0x10000;
prmt.b32 $1, $9, $10, s;
prmt.b32 a, x, y, 0x7362;
mad.lo.u32 s, a, 0x11, 0x40404040;
prmt.b32 $2, $9, $10, s;
mul.hi.u32 s, s, 0x10000;
prmt.b32 $3, $9, $10, s;
mul.hi.u32 x, $8, 0x40000000;
and.b32 x, x, 0x03030303;
mul.hi.u32 y, $8, 0x04000000;
and.b32 y, y, 0x03030303;
prmt.b32 a, x, y, 0x5140;
mad.lo.u32 s, a, 0x11, 0x40404040;
prmt.b32 $4, $9, $10, s;
mul.hi.u32 s, s, 0x10000;
prmt.b32 $5, $9, $10, s;
prmt.b32 a, x, y, 0x7362;
mad.lo.u32 s, a, 0x11, 0x40404040;
prmt.b32 $6, $9, $10, s;
mul.hi.u32 s, s, 0x10000;
prmt.b32 $7, $9, $10, s;
}""")
