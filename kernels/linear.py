"""Triton kernels for `torch.ops.turboquant.linear` (CUDA).

The product `y = x @ W.T` for a TurboQuant-packed weight runs in two steps,
reading the published tq3_native bytes or (ternary, 2-, 3- and 4-bit on a GPU)
the runtime layout of `turboquant_hf.layout` (ternary there as 2-bit codes, read
with a 4-entry codebook: to these kernels a 2-bit weight; 4-bit as sign-magnitude
codes, read with `layout.runtime_codebook`):

1. `rotate`: the activations, rotated per group of G (`x_rot = D2 . H . D1 . x`,
   H the normalised Walsh-Hadamard matrix), zero-padded to `n_groups * G`.
   One Triton kernel; the Hadamard product runs as a `tl.dot` with a cached
   +-1 matrix, so bf16/fp16 inputs rotate exactly (fp32 accumulation) and
   fp32 inputs use full-precision dots.
2. the codebook product, chosen by the number of activation rows M:
   - `gemv_fma` (M == 1 where the pair GEMV does not serve, and any M for float32 activations): one program per
     block of BN weight rows (and per activation row), the packed bytes of
     GPI groups per step decoded in registers, turned into codebook values
     and multiplied into float32 partial sums per group, which are scaled by
     the group norms. No tensor cores. A codebook value comes either from a
     load of the (L1-resident) codebook or from a tree of selects on the
     index bits; `LUT_MASKS` mixes the two per index position so both the
     load/store and the integer pipes work.
   - `gemv_pairs` (M <= PAIR_MAX_M = 2; 2-, 3- and 4-bit, 16-bit activations):
     the codebook looked up with byte permutes (`prmt`) in registers as
     float16 pairs, multiplied two at a time into float16 pairs of the
     activations (`fma.rn.f16x2`; each group of activations scaled by a power
     of two so nothing overflows), a unit's chain summed into float32 and
     scaled by the group norms. The rotation writes the activations in that
     pair layout directly.
   - `gemv_dot` (above that, M <= DOT_MAX_M): 2-, 3- and 4-bit weights
     (`_gemv_mma_kernel`) decoded by byte permutes straight into the
     registers of `mma.sync` operands (the order of the inputs inside a block
     chosen so that a lane's decoded pairs are its operand registers, with no
     shared-memory round trip), each block's product scaled by its group
     norm; ternary (`_gemv_dot_kernel`) decodes one group per step to a
     `[BN, G]` tile with selects. Float32 accumulation. For weights of at
     least X_ORDER_MIN values the rotation writes the activations in the
     order the tensor-core GEMV's lanes read them (`_mma_column`), so each
     row's four lanes load 64 consecutive bytes instead of 16-byte pieces
     spread over a block; 3-bit weights at G = 128 of that size take blocks
     of two groups (`mma_block`, the norms folded into the values), so a
     row's lanes load whole 32-byte sectors of its words.
   - `gemv_dot` again for 16-bit activations and 2-, 3- and 4-bit weights
     up to MID_MAX_M rows (`_mid_config`): 32 activation rows a program, so
     each decoded weight tile feeds twice as many rows before the next is
     decoded (rows of 64 weight rows from 8192 outputs up). Below that
     bound decoding every tile once per 32 rows costs less than writing and
     re-reading the whole 16-bit weight.
   - prefill (M above those): `dequantize_lut` writes the weight itself to a
     scratch `(rows, in_features)` buffer in the activations' dtype (codebook
     lookups by byte permutes, the per-group rotation undone by a +-1 matrix
     product on the tensor cores), then cuBLAS multiplies the activations as
     they are (`F.linear`), with no rotation pass; ternary and float32
     activations rotate the activations and use `dequantize_rotated`, the
     exact rotated-basis weight `norm * codebook[idx]`.

Packing (see `turboquant_hf.codec.pack_indices`): every group is an LSB-first
bit stream. The kernels read it in "units" that hold a whole number of
indices: one 32-bit word (16 two-bit or 8 four-bit indices), three words (32
three-bit indices), or one byte (5 base-3 ternary digits). Inside a unit the
index positions are compile-time constants, so extraction is a shift and a
mask (a funnel shift for the two 3-bit indices that straddle words).

Every launcher is a plain Python function over torch tensors, so the same
code runs under `TRITON_INTERPRET=1` on CPU tensors (the tests do that).
No launcher synchronises with the host or allocates anything but its output
and the intermediate activations (and, for prefill, the scratch weight).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .launch import cdiv, launch, next_power_of_2

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

# Largest M served by the tensor-core GEMV; above it: dequantize + cuBLAS.
DOT_MAX_M = 16
# Whether the tensor-core GEMV reads activations that the rotation wrote in its order (`_mma_column`, `x_order`),
# for weights of at least X_ORDER_MIN values (rows x padded inputs). H200, Triton 3.6, whole op, same run
# (`bench_linear.py --ab-x-order`): the 8B shapes 1.03-1.24x faster ordered at M = 16, 0.94-1.10x at M = 8-64 on
# the larger shapes otherwise; on 2048x1024 and 512x2048 (2M and 1M values) ordered ran up to 1.2 us slower at
# M = 8-64, so weights that small keep the natural order. Keyed on the weight shape, never on M.
X_ORDER = True
X_ORDER_MIN = 1 << 22
# Largest M served by the FMA GEMV for 16-bit activations (float32 always uses it up to DOT_MAX_M).
FMA_MAX_M = 1
# Largest M served by the tensor-core GEMV with 32 activation rows a program (DOT_MAX_M < M, 16-bit activations,
# 2-, 3- and 4-bit weights; `_mid_config`); 0: none, every M above DOT_MAX_M dequantizes for cuBLAS.
MID_MAX_M = 64


# ---------------------------------------------------------------------------
# geometry of the packed units
# ---------------------------------------------------------------------------

def unit_geometry(n_levels: int, group_size: int) -> dict:
    """Constants that describe how one group's packed bytes split into units.

    PER: indices per unit; WPU: 32-bit words per unit (0 = byte units, ternary);
    UPG: units per group; UPG_P: UPG rounded up to a power of two;
    PER_P: PER rounded up to a power of two (ternary 5 -> 8).
    """
    g = group_size
    if n_levels == 3:
        bpg = -(-g // 5)
        return dict(PER=5, PER_P=8, WPU=0, UPG=bpg, UPG_P=next_power_of_2(bpg))
    if n_levels == 4:
        per, wpu = 16, 1
    elif n_levels == 8:
        per, wpu = 32, 3
    elif n_levels == 16:
        per, wpu = 8, 1
    else:
        raise ValueError(f"unsupported codebook size {n_levels} (expected 3, 4, 8 or 16)")
    return dict(PER=per, PER_P=per, WPU=wpu, UPG=g // per, UPG_P=g // per)


# ---------------------------------------------------------------------------
# device helpers
# ---------------------------------------------------------------------------

@triton.jit
def _extract(w0, w1, w2, J: tl.constexpr, NLEV: tl.constexpr, TUNED: tl.constexpr):
    """Index number J of a unit (uint32 words w0..w2, or a byte for ternary) as int32; TUNED: the units
    are in the runtime layout (`turboquant_hf.layout`)."""
    if TUNED and NLEV == 4:
        if J < 8:
            v = (w0 >> (4 * J)) & 3
        else:
            v = (w0 >> (4 * (J - 8) + 2)) & 3
    elif TUNED and NLEV == 8:
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
def _ibit(w0, w1, w2, J: tl.constexpr, B: tl.constexpr, NB: tl.constexpr, TUNED: tl.constexpr):
    """Bit B of index number J (NB bits per index) of a unit, in the published or the runtime layout."""
    if not TUNED:
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
def _value(w0, w1, w2, cb_ptr, J: tl.constexpr, NLEV: tl.constexpr, LUT_MASK: tl.constexpr, TUNED: tl.constexpr,
           c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15):
    """float32 codebook value of index number J of every unit.

    Two ways, mixed per J by the bit mask LUT_MASK so that both pipes work: a load from the
    (L1-resident) codebook (bit J set: ~5 integer ops + one load), or a tree of selects on the
    index bits (no memory access: 3 selects for 2 bits, 7 for 3, 15 for 4, plus bit tests)."""
    if (LUT_MASK >> J) & 1:
        v = tl.load(cb_ptr + _extract(w0, w1, w2, J, NLEV, TUNED))
    elif NLEV == 3:
        d = _extract(w0, w1, w2, J, NLEV, TUNED)
        v = tl.where(d == 0, c0, tl.where(d == 1, c1, c2))
    elif NLEV == 4:
        v = _sel4(_ibit(w0, w1, w2, J, 0, 2, TUNED), _ibit(w0, w1, w2, J, 1, 2, TUNED), c0, c1, c2, c3)
    elif NLEV == 8:
        p0 = _ibit(w0, w1, w2, J, 0, 3, TUNED)
        p1 = _ibit(w0, w1, w2, J, 1, 3, TUNED)
        p2 = _ibit(w0, w1, w2, J, 2, 3, TUNED)
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
def _load_units(pk_ptr, unit_off, mask, WPU: tl.constexpr, TUNED: tl.constexpr, row, NUT):
    """Load the words (or the byte) of units at `unit_off` (in units: `row * NUT + unit in the row`);
    uint32 results. In the runtime layout (TUNED) a row's three-word units are stored as three planes
    (word p of unit u at `p * NUT + u` within the row), so each load is one coalesced sweep."""
    if WPU == 3:
        if TUNED:
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
                   MMA_PER: tl.constexpr = 0):
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
                        NUT: tl.constexpr, PDL: tl.constexpr, MMA_KB: tl.constexpr = 0, MMA_PER: tl.constexpr = 0):
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


_HADAMARD: dict = {}


def _hadamard_pm1(g: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The (G, G) Sylvester Hadamard matrix, +-1 entries, in `dtype` on `device` (built once per key)."""
    key = (g, dtype, str(device))
    if key not in _HADAMARD:
        from turboquant_hf import codec

        _HADAMARD[key] = codec.hadamard_matrix(g).to(dtype=dtype, device=device).contiguous()
    return _HADAMARD[key]


# Activation rows up to which `rotate` runs the butterfly kernel (`_rotate_rows_kernel`) rather than the
# tensor-core one. H200, bf16, device time of the rotation alone (torch.profiler), us, tensor-core -> butterflies:
# M = 1 2.20 -> 1.35 (4096 inputs), 2.34 -> 1.36 (8192), 2.72 -> 1.41 (14336); M = 16 1.95 -> 1.32, 2.15 -> 1.40,
# 2.60 -> 1.60 (the output bit for bit the same in all of them). ROWS_CONFIG, when set, overrides `_rows_config`.
ROWS_MAX_M = 16
ROWS_CONFIG = None


def _rows_config(m: int, g: int) -> tuple[int, int]:
    """(groups a program, warps) of the butterfly rotation: one warp over 256 inputs a program for one or two
    rows, over 512 for more (the fastest or within 0.1 us of it in a sweep of 1-8 groups of 128 x 1-4 warps at
    M = 1, 2, 8 and 16 on the H200: more programs of less work each lose to the launch of their blocks)."""
    return max(1, (256 if m <= 2 else 512) // g), 1


def rotate(x2: torch.Tensor, signs1: torch.Tensor, signs2: torch.Tensor, group_size: int,
           out_dtype: torch.dtype, unit: int = 0, mma_levels: int = 0, mma_block: int = 0):
    """`(M, in)` activations -> `(M, n_groups*G)` rotated, zero-padded, in `out_dtype`.

    With `unit` > 0 (`lut_unit(levels)`): the pair GEMV's activations `(x2, scales)` for weights of that
    unit instead (see `gemv_pairs`; `out_dtype` is ignored). With `mma_levels` (a codebook size for which
    `mma_order` holds): the columns in the tensor-core GEMV's order (`_mma_column`; `gemv_dot(...,
    x_order=True)` reads them), for its blocks of `mma_block` inputs (0: the default block; or the wide block,
    `wide_block`, for a row of whole pairs of groups).

    Up to ROWS_MAX_M rows the Walsh-Hadamard product runs as float32 butterflies in registers
    (`_rotate_rows_kernel`), above as a product with the +-1 matrix on the tensor cores (`_rotate_kernel`); the
    two agree within float32 rounding of the sums."""
    m, k = x2.shape
    g = group_size
    ng = -(-k // g)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    pairs = unit > 0
    if mma_block and not mma_levels:
        raise ValueError("rotate: `mma_block` without `mma_levels`")
    mkb = _check_block(mma_levels, g, ng, mma_block, True) if mma_levels else 0
    if mkb and pairs:
        raise ValueError("rotate: `unit` (the pair layout) and `mma_levels` (the tensor-core order) exclude each other")
    out = torch.empty(m, ng * g, dtype=torch.float16 if pairs else out_dtype, device=x2.device)
    xs = torch.empty(m, ng, dtype=torch.float32, device=x2.device) if pairs else out
    if m == 0:
        return (out.view(torch.int32), xs) if pairs else out
    pdl = _pdl(x2.device, ng * g, lut_levels(unit) if m == 1 else 0)  # (as the pair GEMV after it decides)
    if m <= ROWS_MAX_M:
        bg, warps = ROWS_CONFIG or _rows_config(m, g)
        launch(_rotate_rows_kernel, (m, cdiv(ng, bg)), x2, signs1, signs2, out, xs, k, ng, x2.stride(0),
               out.stride(0), xs.stride(0), 1.0 / math.sqrt(g), G=g, LG=g.bit_length() - 1, BG=bg, PER_T=unit,
               NUT=(ng * g) // unit if unit else 0, PDL=pdl, MMA_KB=mkb, MMA_PER=lut_unit(mma_levels) if mkb else 0,
               num_warps=warps)
        return (out.view(torch.int32), xs) if pairs else out
    bm = 64 if m > 16 and x2.dtype != torch.float32 else 16
    exact16 = x2.dtype in (torch.bfloat16, torch.float16) and not _interpreting()
    bc = min(g, 64 if exact16 else 32)
    grid = (cdiv(m, bm), ng, g // bc)
    hmat = _hadamard_pm1(g, x2.dtype if exact16 else torch.float32, x2.device)
    launch(_rotate_kernel, grid, x2, signs1, signs2, out, hmat, xs, m, k, x2.stride(0), out.stride(0), xs.stride(0),
           1.0 / math.sqrt(g), G=g, BM=bm, BC=bc, EXACT16=exact16, PER_T=unit,
           NUT=(ng * g) // unit if unit else 0, PDL=pdl, MMA_KB=mkb, MMA_PER=lut_unit(mma_levels) if mkb else 0,
           num_warps=4)
    return (out.view(torch.int32), xs) if pairs else out


# ---------------------------------------------------------------------------
# 2a. GEMV on CUDA cores (M == 1; any M for float32)
# ---------------------------------------------------------------------------

@triton.jit
def _gemv_fma_kernel(xr_ptr, pk_ptr, nrm_ptr, cb_ptr, out_ptr, idx_ptr, N, NG, stride_xm, stride_om,
                     NLEV: tl.constexpr, G: tl.constexpr, PER: tl.constexpr, WPU: tl.constexpr,
                     UPG: tl.constexpr, UPG_P: tl.constexpr, BN: tl.constexpr, GPI: tl.constexpr,
                     LUT_MASK: tl.constexpr, EVEN_N: tl.constexpr, EVEN_G: tl.constexpr,
                     EXPERTS: tl.constexpr, X_DIV: tl.constexpr, TUNED: tl.constexpr):
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    if EXPERTS > 0:
        # routed pairs (see `_gemv_pair_kernel`): matrix idx[m] of EXPERTS stacked ones, activation row m // X_DIV
        e = tl.load(idx_ptr + m).to(tl.int32)
        live = (e >= 0) & (e < EXPERTS)
        e = tl.where(live, e, 0).to(tl.int64)
        pk_ptr += e * N * NG * UPG * (1 if WPU == 0 else WPU)
        nrm_ptr += e * N * NG
        xrow = xr_ptr + (m // X_DIV) * stride_xm
    else:
        xrow = xr_ptr + m * stride_xm
    c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15 = _codebook16(cb_ptr, NLEV)
    rn = pid_n * BN + tl.arange(0, BN)
    if EVEN_N:
        nmask = rn >= 0
    else:
        nmask = rn < N
    rg = tl.arange(0, GPI)
    ru = tl.arange(0, UPG_P)
    n3 = rn[:, None, None]
    u3 = ru[None, None, :]
    u2 = ru[None, :]
    acc = tl.zeros([BN], dtype=tl.float32)
    g0 = 0
    while g0 < NG:  # (a while loop: Triton 3.6's interpreter cannot range() over a runtime bound)
        gg = g0 + rg
        if EVEN_G:
            gmask = rg >= 0
        else:
            gmask = gg < NG
        g3 = gg[None, :, None]
        unit_off = (n3 * NG + g3) * UPG + u3
        xbase = xrow + gg[:, None] * G + u2 * PER  # [GPI, UPG_P]
        part = tl.zeros([BN, GPI, UPG_P], dtype=tl.float32)
        if WPU == 0:
            # ternary: one byte = 5 base-3 digits, peeled off least-significant first
            wmask = nmask[:, None, None] & gmask[None, :, None] & (u3 < UPG)
            q = tl.load(pk_ptr + unit_off, mask=wmask, other=0, eviction_policy="evict_first").to(tl.uint32)
            for j in tl.static_range(PER):
                if j == PER - 1:
                    d = q
                else:
                    q3 = q // 3
                    d = q - q3 * 3
                    q = q3
                if (LUT_MASK >> j) & 1:
                    c = tl.load(cb_ptr + d.to(tl.int32))
                else:
                    c = tl.where(d == 0, c0, tl.where(d == 1, c1, c2))
                if EVEN_G:
                    xj = tl.load(xbase + j, mask=u2 * PER + j < G, other=0.0)
                else:
                    xj = tl.load(xbase + j, mask=gmask[:, None] & (u2 * PER + j < G), other=0.0)
                part += c * xj[None, :, :]
        else:
            if EVEN_N and EVEN_G:
                w0, w1, w2 = _load_units(pk_ptr, unit_off, None, WPU, TUNED, n3, NG * UPG)
            else:
                w0, w1, w2 = _load_units(pk_ptr, unit_off, nmask[:, None, None] & gmask[None, :, None], WPU, TUNED,
                                         n3, NG * UPG)
            for j in tl.static_range(PER):
                c = _value(w0, w1, w2, cb_ptr, j, NLEV, LUT_MASK, TUNED, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15)
                if EVEN_G:
                    xj = tl.load(xbase + j)
                else:
                    xj = tl.load(xbase + j, mask=gmask[:, None], other=0.0)
                part += c * xj[None, :, :]
        if EVEN_N and EVEN_G:
            nr = tl.load(nrm_ptr + rn[:, None] * NG + gg[None, :])
        else:
            nr = tl.load(nrm_ptr + rn[:, None] * NG + gg[None, :], mask=nmask[:, None] & gmask[None, :], other=0.0)
        acc += tl.sum(tl.sum(part, axis=2) * nr, axis=1)
        g0 += GPI
    if EXPERTS > 0:
        acc = tl.where(live, acc, 0.0)
    tl.store(out_ptr + m * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=nmask)


def _fma_config(n: int, ng: int, n_levels: int, g: int) -> tuple[int, int, int]:
    """(BN, GPI, num_warps) for the FMA GEMV, from the weight shape only.

    Picked from a sweep on an H200 (benchmarks/RESULTS.md): 8 rows per program below 8192 output
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


# Which index numbers j of a unit are looked up with a load from the codebook (bit j set) rather
# than a tree of selects: the mix that balances the load/store and integer pipes (the codebook
# loads cost ~4 cycles of the load/store unit per warp, the selects 3/7/15 integer ops per weight).
LUT_MASKS = {3: 0x5, 4: 0x0, 8: 0x11111111, 16: 0x55555555}


def _with_mask(cfg: tuple, n_levels: int) -> tuple:
    return tuple(cfg) if len(cfg) == 4 else (*cfg, LUT_MASKS[n_levels])


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
           EXPERTS=experts, X_DIV=x_div, TUNED=_tuned(packed, n_levels), num_warps=warps)
    return out


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
        N: tl.constexpr = (SEL >> (4 * q)) & 15
        if (N & 7) < 4:
            byte = (a >> (8 * (N & 3))) & 0xFF
        else:
            byte = (b >> (8 * (N & 3))) & 0xFF
        if N >= 8:
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
        s = d & 0x77777777
        if NLEV == 16:
            a = d << 4
            m = _prmt_c(a, d, 0xD9C8)
            lo = (_prmt(t0, t1, s) & ~m) | (_prmt(t4, t5, s) & m)
            hi = (_prmt(t2, t3, s) & ~m) | (_prmt(t6, t7, s) & m)
        else:
            lo = _prmt(t0, t1, s)
            hi = _prmt(t2, t3, s)
        v0 = _prmt_c(lo, hi, 0x4040).to(tl.float32, bitcast=True)
        v1 = _prmt_c(lo, hi, 0x5151).to(tl.float32, bitcast=True)
        v2 = _prmt_c(lo, hi, 0x6262).to(tl.float32, bitcast=True)
        v3 = _prmt_c(lo, hi, 0x7373).to(tl.float32, bitcast=True)
        s = s >> 16
        if NLEV == 16:
            m = _prmt_c(a, d, 0xFBEA)
            lo = (_prmt(t0, t1, s) & ~m) | (_prmt(t4, t5, s) & m)
            hi = (_prmt(t2, t3, s) & ~m) | (_prmt(t6, t7, s) & m)
        else:
            lo = _prmt(t0, t1, s)
            hi = _prmt(t2, t3, s)
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
def _unit_nibbles(w0, w1, w2, CH: tl.constexpr, NLEV: tl.constexpr, TUNED: tl.constexpr):
    """Chunk CH (eight indices) of a unit as the nibbles of a uint32. In the runtime layout the fields
    already sit in nibbles: 3-bit units hold indices 8p..8p+7 in the low three bits of word p's
    nibbles and indices 24..31 in their top bits (bit p of index 24+n in nibble n of word p); 2-bit
    units hold indices 0-7 in the low two bits of each nibble and 8-15 in the high two."""
    if NLEV == 16:
        d = w0  # (4-bit indices are nibbles already)
    elif not TUNED:
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


# Largest M served by the pair GEMV, which decodes the weight once for BM = 1 or 2 activation rows (above it the
# tensor-core GEMV or dequantize + cuBLAS; the kernel also takes BM = 4). Whole op on an H200 (2026-12-01 23:50
# UTC, Triton 3.6, after the tensor-core GEMV took several blocks per warp), pair vs tensor-core GEMV, us: M = 2,
# 3-bit 4096x4096 7.9 vs 9.6, 4096x14336 16.7 vs 19.9, 14336x4096 21.8 vs 22.7, 8192x28672 52.1 vs 54.8, 2048x8192
# 7.7 vs 9.3; 4-bit 8192x28672 74.2 vs 97.2 (2-bit 55.7 vs 53.7, 512->2048 4.4 vs 3.7); M = 3 and 4 the
# tensor-core GEMV was faster at every shape (3-bit 8192x28672 112.4 vs 55.7, 4096x14336 23.0 vs 20.4, 4-bit
# 4096x14336 34.0 vs 27.6).
PAIR_MAX_M = 2


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


@triton.jit
def _mma_pattern(c, F16: tl.constexpr):
    """The 16-bit pattern (uint32) of float32 `c` rounded to nearest even: bfloat16, or float16 (F16)."""
    if F16:
        p = c.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
    else:
        b = c.to(tl.uint32, bitcast=True)
        p = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return p


@triton.jit
def _mma_pairs(d, t0, t1, t2, t3, t4, t5, t6, t7, NLEV: tl.constexpr, USE_ASM: tl.constexpr,
               TUNED: tl.constexpr = 0):
    """The eight codebook values of the indices in the nibbles of uint32 `d` (3-bit fields for codebooks of
    up to 8 entries, 4-bit for 16) as four uint32 pairs of 16-bit patterns: values (0, 1), (2, 3), (4, 5),
    (6, 7), the first of each pair in the low half. TUNED with 16 entries: sign-magnitude codes (the 4-bit
    runtime layout), entries 8 .. 15 the negatives of 0 .. 7 (only t0 .. t3 are read)."""
    if NLEV == 16 and TUNED:
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
        s = d & 0x77777777
        if NLEV == 16:
            a = d << 4
            m = _prmt_c(a, d, 0xD9C8)
            lo = (_prmt(t0, t1, s) & ~m) | (_prmt(t4, t5, s) & m)
            hi = (_prmt(t2, t3, s) & ~m) | (_prmt(t6, t7, s) & m)
        else:
            lo = _prmt(t0, t1, s)
            hi = _prmt(t2, t3, s)
        p0 = _prmt_c(lo, hi, 0x5140)
        p1 = _prmt_c(lo, hi, 0x7362)
        s = s >> 16
        if NLEV == 16:
            m = _prmt_c(a, d, 0xFBEA)
            lo = (_prmt(t0, t1, s) & ~m) | (_prmt(t4, t5, s) & m)
            hi = (_prmt(t2, t3, s) & ~m) | (_prmt(t6, t7, s) & m)
        else:
            lo = _prmt(t0, t1, s)
            hi = _prmt(t2, t3, s)
        p2 = _prmt_c(lo, hi, 0x5140)
        p3 = _prmt_c(lo, hi, 0x7362)
    return p0, p1, p2, p3


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


@triton.jit
def _mma_pairs2(w, t0, t2, USE_ASM: tl.constexpr):
    """The 16 values of 2-bit units in the runtime layout (uint32 words `w`) as eight uint32 pairs (values 2q,
    2q + 1), with the lookups of `_PAIR2_ASM`."""
    if USE_ASM:
        p0, p1, p2, p3, p4, p5, p6, p7 = tl.inline_asm_elementwise(
            _PAIR2_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [w, t0, t2], dtype=(tl.uint32,) * 8, is_pure=True, pack=1)
    else:
        x = w & 0x03030303
        y = (w >> 4) & 0x03030303
        a = _prmt_c(x, y, 0x5140) * 0x11 + 0x40404040
        p0 = _prmt(t0, t2, a)
        p1 = _prmt(t0, t2, a >> 16)
        a = _prmt_c(x, y, 0x7362) * 0x11 + 0x40404040
        p2 = _prmt(t0, t2, a)
        p3 = _prmt(t0, t2, a >> 16)
        x = (w >> 2) & 0x03030303
        y = (w >> 6) & 0x03030303
        a = _prmt_c(x, y, 0x5140) * 0x11 + 0x40404040
        p4 = _prmt(t0, t2, a)
        p5 = _prmt(t0, t2, a >> 16)
        a = _prmt_c(x, y, 0x7362) * 0x11 + 0x40404040
        p6 = _prmt(t0, t2, a)
        p7 = _prmt(t0, t2, a >> 16)
    return p0, p1, p2, p3, p4, p5, p6, p7


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
               TUNED: tl.constexpr, F16: tl.constexpr, FOLD: tl.constexpr, USE_ASM: tl.constexpr):
    """Values 8 CH .. 8 CH + 7 of every unit as four uint32 pair tensors (FOLD: scaled by the norms)."""
    if NLEV == 16:
        d = w0
    elif NLEV == 8 and TUNED and CH == 3 and USE_ASM:  # the top bits of the three words, shifted on the FMA pipe
        d = tl.inline_asm_elementwise(_TOP3_ASM, "=r,r,r,r", [w0, w1, w2], dtype=tl.uint32, is_pure=True, pack=1)
    else:
        d = _unit_nibbles(w0, w1, w2, CH, NLEV, TUNED)
    p0, p1, p2, p3 = _mma_pairs(d, t0, t1, t2, t3, t4, t5, t6, t7, NLEV, USE_ASM, TUNED)
    if FOLD:
        p0 = _mma_scale(p0, nsc, F16, USE_ASM)
        p1 = _mma_scale(p1, nsc, F16, USE_ASM)
        p2 = _mma_scale(p2, nsc, F16, USE_ASM)
        p3 = _mma_scale(p3, nsc, F16, USE_ASM)
    return p0, p1, p2, p3


@triton.jit
def _mma_unit_pairs(w0, w1, w2, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV: tl.constexpr, TUNED: tl.constexpr,
                    F16: tl.constexpr, FOLD: tl.constexpr, USE_ASM: tl.constexpr):
    """Units (uint32 words w0..w2 of any shape `[...]`) -> their PER / 2 value pairs as uint32 `[..., 2, 2, ...]`:
    pair q (values 2q, 2q + 1) at index q = q0 + 2 q1 + ... of the new axes."""
    if NLEV == 4 and TUNED:
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
        a0, a1, a2, a3 = _mma_chunk(w0, w1, w2, 0, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV, TUNED, F16, FOLD,
                                    USE_ASM)
        v = _mma_join4(a0, a1, a2, a3)
    else:
        a0, a1, a2, a3 = _mma_chunk(w0, w1, w2, 0, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV, TUNED, F16, FOLD,
                                    USE_ASM)
        b0, b1, b2, b3 = _mma_chunk(w0, w1, w2, 1, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV, TUNED, F16, FOLD,
                                    USE_ASM)
        v = _mma_join8(a0, a1, a2, a3, b0, b1, b2, b3)
        if NLEV == 8:
            c0, c1, c2, c3 = _mma_chunk(w0, w1, w2, 2, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV, TUNED, F16, FOLD,
                                        USE_ASM)
            e0, e1, e2, e3 = _mma_chunk(w0, w1, w2, 3, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV, TUNED, F16, FOLD,
                                        USE_ASM)
            v = tl.join(v, _mma_join8(c0, c1, c2, c3, e0, e1, e2, e3))
    return v


@triton.jit
def _mma_words(pk_ptr, row, un, NUT: tl.constexpr, WPU: tl.constexpr, TUNED: tl.constexpr):
    """The uint32 words of units `un` (numbered along the row) of rows `row`, read once (evict first)."""
    if WPU == 3 and TUNED:  # three planes per row: word p of unit u at p * NUT + u
        base = pk_ptr + row * (3 * NUT) + un
        step = NUT
    elif WPU == 3:
        base = pk_ptr + (row * NUT + un) * 3
        step = 1
    else:
        base = pk_ptr + row * NUT + un
        step = 0
    w0 = tl.load(base, eviction_policy="evict_first").to(tl.uint32, bitcast=True)
    if WPU == 3:
        w1 = tl.load(base + step, eviction_policy="evict_first").to(tl.uint32, bitcast=True)
        w2 = tl.load(base + 2 * step, eviction_policy="evict_first").to(tl.uint32, bitcast=True)
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
# 2a''. pair GEMV (M <= PAIR_MAX_M and routed expert pairs, 16-bit activations): half-precision pair products
# ---------------------------------------------------------------------------
#
# The lookups of the tensor-core GEMV (`_mma_pairs`, `_mma_pairs2`) give two float16 codebook values per
# 32-bit register, and one `fma.rn.f16x2` multiplies them into two activations at once: per weight about
# half the instructions of assembling a float32 value for an FFMA (H200, whole op at M = 1, 3-bit: 1.3-1.4x
# faster on the large shapes, benchmarks/RESULTS.md). The activations come as float16 pairs in the order a
# unit decodes (`rotate(..., unit=...)` or `pack_pairs`: word q * NUT + u holds elements 2q, 2q + 1 of
# unit u), each group scaled by a power of two 2**-e (e per activation row and group, `_pair_exponent`)
# so that the group's L2 norm is at most 2**8. A unit's products are chained in float16 (16 per lane at 3
# bits, 8 at 2, 4 at 4); the chains of 32 consecutive indices (one 3-bit unit, two 2-bit, four 4-bit units)
# are added in float16, then summed into float32 and scaled by the weight's group norm times 2**e. By
# Cauchy-Schwarz such a sum (16 products a lane), and every partial sum on the way, is at most sqrt(16) * 2**8
# * max|codebook| in magnitude: no overflow for codebooks below 60, whatever the activations' scale. Accuracy:
# float16 keeps 11 significant bits; on random data the bfloat16 result is within 1.8e-3 (relative L2) of the
# float32 reference at every width (H200).

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
                    TUNED: tl.constexpr, NUT: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                    USE_ASM: tl.constexpr, UT: tl.constexpr = 0, GRP: tl.constexpr = 1):
    """Units `[BN, BU]` (words w0..w2), decoded once, times the activation pairs of BM (1, 2 or 4) rows at
    xr0..xr3 (those past BM unused): one float16 chain per unit and row; the chains of GRP consecutive units
    summed in float16 (`_group_chains`), then into float32 `[BN, BU / GRP]` per row (four results; rows past BM
    give zeros)."""
    h0 = w0 & 0
    h1 = h0
    h2 = h0
    h3 = h0
    if NLEV == 4 and TUNED:
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
            elif NLEV == 8 and TUNED and ch == 3 and USE_ASM:  # the top bits of the three words (FMA pipe)
                d = tl.inline_asm_elementwise(_TOP3_ASM, "=r,r,r,r", [w0, w1, w2], dtype=tl.uint32, is_pure=True,
                                              pack=1)
            else:
                d = _unit_nibbles(w0, w1, w2, ch, NLEV, TUNED)
            p0, p1, p2, p3 = _mma_pairs(d, t0, t1, t2, t3, t4, t5, t6, t7, NLEV, USE_ASM, TUNED)
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
                UPG: tl.constexpr, WPU: tl.constexpr, TUNED: tl.constexpr, EVEN_U: tl.constexpr,
                UT: tl.constexpr = 0, GRP: tl.constexpr = 1):
    """Words of units `u0 .. u0 + BU - 1` of rows `rl` `[BN]`, and the float32 group norms of their BU / GRP
    groups of GRP units (units past the row's end, when the step does not divide it: zero words and norms)."""
    r2, u2 = _pair_tile(rl, u0, BU, UT)
    unit_off = r2 * NUT + u2
    if EVEN_U:
        w0, w1, w2 = _load_units(pk_ptr, unit_off, None, WPU, TUNED, r2, NUT)
    else:
        um = (r2 >= 0) & (u2 < NUT)
        w0, w1, w2 = _load_units(pk_ptr, unit_off, um, WPU, TUNED, r2, NUT)
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
                      X_DIV: tl.constexpr, TUNED: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr = 0,
                      UT: tl.constexpr = 0, GRP: tl.constexpr = 1):
    """One program per BN weight rows and BM (1, 2 or 4) activation rows: one unit per lane and row per step,
    decoded once; each activation row's float16 pair chains (`_unit_pair_sums`; those of GRP consecutive units
    added in float16 first: `PAIR_CHAIN`) scaled by the group norms times that row's group scales into float32
    sums.

    PREFETCH: each step's words and norms are loaded during the step before (the first step's before the
    loop, and before waiting for the previous kernel: PDL), so that the loads of a program overlap its own
    decoding. UT: every `[BN, BU]` tile is held as `[BU, BN]`, for a Triton whose coalescing takes a load's
    remaining axes in ascending order (`_lanes_first`): the norms and scales then load in the words' layout
    (Triton 3.6, sm_90 SASS, 3-bit 14336x4096 config: 587 instructions a step instead of 754, no shared memory
    or barriers); the results are the same.

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
        n0, n1, n2, nrn = _pair_words(pk_ptr, nrm_ptr, rl, 0, BU, NUT, NG, UPG, WPU, TUNED, EVEN_U, UT, GRP)
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
            n0, n1, n2, nrn = _pair_words(pk_ptr, nrm_ptr, rl, u0 + BU, BU, NUT, NG, UPG, WPU, TUNED, False, UT,
                                          GRP)
        else:
            w0, w1, w2, nr = _pair_words(pk_ptr, nrm_ptr, rl, u0, BU, NUT, NG, UPG, WPU, TUNED, EVEN_U, UT, GRP)
        # (units past the row's end: zero norms and scales, activations of the last unit)
        xu = uu if EVEN_U else tl.minimum(uu, NUT - 1)
        s0, s1, s2, s3 = _unit_pair_sums(w0, w1, w2, xr0, xr1, xr2, xr3, xu, t0, t1, t2, t3, t4, t5, t6, t7, NLEV,
                                         TUNED, NUT, BN, BM, USE_ASM, UT, GRP)
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


def _pair_config(n: int, nut: int, n_levels: int) -> tuple:
    """(BN, num_warps[, maxnreg[, prefetch]]) of the pair GEMV from the weight shape (rows n, units per row nut)
    and the codebook size, from whole-op sweeps on an H200 (rotation + GEMV as CUDA-graph replays at M = 1, the
    benchmark shapes and the fused projections' shapes; benchmarks/RESULTS.md). 3-bit: rows of 14336 inputs 4
    rows of 2 warps (more programs: 13.8 us against 15.5 with 8 rows), 8192 inputs 8 rows of 2 warps, 2048 inputs
    8 rows of 2 warps loading each step's words a step ahead (what a program loads first overlaps the
    rotation), 4096 inputs 8 rows of 4 warps (ahead as well for rows of 4096 outputs); 4-bit: 8 rows of 4 warps
    and a cap of 96 registers from 4096 inputs up (14336 -> 4096: 17.5 against 23.9 us uncapped), 16 rows below.
    Weights of 2048 rows or fewer: 3- and 4-bit rows of 512 inputs or fewer 8 rows of 2 warps, a step ahead (the
    expert down projection 512 -> 2048: 3.3 against 3.55 us), 3-bit rows up to 2048 inputs 4 rows of 4 warps, a
    step ahead (2048 -> 1024: 3.85 against 4.0 us). 2-bit (and ternary, which runs its codes): 8 rows of 4 warps,
    cap 96, except rows of 2048 inputs (8 rows of 2 warps a step ahead up to 8192 rows, of 4 warps above and for
    2048 rows or fewer: 2048x8192 7.1 -> 6.2 us, 2048 -> 12352 8.6 -> 7.9, 2048 -> 1024 3.9 -> 3.7), 16 rows for
    16384 rows or more (2 warps at 4096 inputs: 4096 -> 28672 22.9 -> 22.0; 4 at 8192: 8192x28672 41.2 -> 40.6),
    4 rows of 4 warps a step ahead at 14336 inputs, where the early launch now reaches (14.7 against 14.9 us).
    Programs of 2 or 4 activation rows run uncapped (as measured)."""
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
    n_levels = codebook.numel()
    m, n, ng = _gemv_shape(x2, norms, experts, expert_index)
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
    pdl = _pdl(x2.device, 2 * x2.shape[1], n_levels if m == 1 and not experts else 0)
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
    out = torch.empty(m, n, dtype=out_dtype, device=x2.device)
    if m == 0 or n == 0:
        return out
    idx = expert_index.reshape(-1) if experts else norms  # (unused when experts == 0)
    launch(
        _gemv_pair_kernel, (cdiv(n, bn), cdiv(m, bm)),
        x2, xs, _packed_view(packed, 1), norms, _f32(codebook), out, idx, m, n, x2.stride(0), xs.stride(0),
        out.stride(0), NG=ng, NLEV=n_levels, UPG=upg, BN=bn, BU=bu, BM=bm, USE_ASM=not _interpreting(),
        EXPERTS=experts, X_DIV=x_div, TUNED=_tuned(packed, n_levels, signed=True), PDL=pdl, PREFETCH=int(bool(prefetch)),
        UT=_lanes_first(), GRP=grp, num_warps=warps, **opts)
    return out


# ---------------------------------------------------------------------------
# 2b. GEMV / small GEMM on tensor cores (2 <= M <= DOT_MAX_M, 16-bit activations)
# ---------------------------------------------------------------------------

@triton.jit
def _gemv_dot_kernel(xr_ptr, pk_ptr, nrm_ptr, cb_ptr, out_ptr, M, N, NG, stride_xm, stride_om,
                     NLEV: tl.constexpr, G: tl.constexpr, PER: tl.constexpr, PER_P: tl.constexpr,
                     WPU: tl.constexpr, UPG: tl.constexpr, UPG_P: tl.constexpr, BN: tl.constexpr,
                     BM: tl.constexpr, LUT_MASK: tl.constexpr, TUNED: tl.constexpr):
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
        w0, w1, w2 = _load_units(pk_ptr, unit_off, wmask, WPU, TUNED, rn[:, None], NG * UPG)
        xt = tl.load(xptrs + g * G, mask=xmask, other=0.0)
        w = _decode_unit_values(w0, w1, w2, cb_ptr, PER_P, NLEV, PER, DT, LUT_MASK, TUNED, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15)
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
                     BM: tl.constexpr, S: tl.constexpr, TUNED: tl.constexpr, F16: tl.constexpr,
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
        w0, w1, w2 = _mma_words(pk_ptr, row, un, NUT, WPU, TUNED)
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
                n0, n1, n2 = _mma_words(pk_ptr, row, un, NUT, WPU, TUNED)
            else:
                w0, w1, w2 = _mma_words(pk_ptr, row, un, NUT, WPU, TUNED)
        nsc = t0  # (FOLD only)
        if FOLD:  # per-unit norms, folded into the values (zero for units past the row's end)
            uf = (i * S + as_) * UPB + ub
            if PART or not EVEN:
                nf = tl.load(nrm_ptr + row * NG + tl.minimum(uf, NUT - 1) // UPG, mask=uf < NUT, other=0.0)
            else:
                nf = tl.load(nrm_ptr + row * NG + uf // UPG)
            nsc = nf.to(tl.float32)
            if USE_ASM:
                if F16:
                    nsc = tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $1, $1;", "=r,r", [nsc], dtype=tl.uint32,
                                                    is_pure=True, pack=1)
                else:
                    nsc = tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $1, $1;", "=r,r", [nsc], dtype=tl.uint32,
                                                    is_pure=True, pack=1)
        v = _mma_unit_pairs(w0, w1, w2, t0, t1, t2, t3, t4, t5, t6, t7, nsc, NLEV, TUNED, F16, FOLD, USE_ASM)
        # axes h a s l t r q0 q1 .. -> s a h l r .. q1 q0 t: rows 16 a + 8 h + l, k = e + 2t + 8 (q + r PER/2)
        # (LANES_FIRST: from t l s h a r q0 q1 ..)
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


# Triton before 3.7 orders the non-contiguous axes of a load's coalesced layout ascending, 3.7 and later from the
# last: `_gemv_mma_kernel` arranges its weight and activation tiles for the one in use (None: by version), so that
# both land in the tensor-core operand layouts without passing through shared memory (`_gemv_pair_kernel` its
# tiles the same way: UT). Triton 3.6, sm_90 SASS
# (3-bit, M = 16, one warp): 165 instructions a block instead of 338, of which 8 shared-memory stores, 8
# ldmatrix, 32 shuffles and a barrier; 66 registers instead of 109 (3.7-3.9 the same the other way round).
_LANES_FIRST: bool | None = None


def _lanes_first() -> bool:
    global _LANES_FIRST
    if _LANES_FIRST is None:
        parts = []
        for piece in triton.__version__.split(".")[:2]:
            digits = "".join(ch for ch in piece if ch.isdigit())
            parts.append(int(digits or 0))
        _LANES_FIRST = tuple(parts) < (3, 7)
    return _LANES_FIRST


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


def mma_order(n_levels: int, g: int) -> bool:
    """Whether `rotate(..., mma_levels=n_levels)` can put activations in `_gemv_mma_kernel`'s order for its
    default blocks (`_mma_block`): the kernel serves the codebook and group size, and each block lies within one
    group (G a multiple of the block). Wide blocks (`wide_block`) have an order of their own."""
    return _mma_serves(n_levels, g) and g % _mma_block(n_levels, g) == 0


# Wide blocks: 3-bit weights at G = 128 take blocks of two groups (KB = 256 inputs, each lane two consecutive units,
# the group norms folded into the 16-bit values: `FOLD`) instead of one. A lane's words are then 8 consecutive
# bytes of each of the unit's three planes, and the four lanes of a weight row read a whole 32-byte sector per
# load, where blocks of one group use half of each sector per load instruction (Nsight Compute, 3-bit
# 4096x14336, M = 16) and leave the other half to the next block's load. Measured on an H200 (Triton 3.6, `linear`
# as CUDA-graph replays, both in one process, us, one-group -> wide blocks, M = 8 / 16 / 32 / 64): 4096x14336
# 19.5 -> 16.9 / 22.7 -> 21.9 / 34.2 -> 30.2 / 61.8 -> 53.8; 14336x4096 22.8 -> 22.3 / 28.6 -> 26.4 / 47.7 -> 34.9 /
# 61.1 -> 61.8; 4096x4096 9.3 -> 7.7 / 11.0 -> 9.5 / 18.0 -> 16.5 / 22.6 -> 27.3; 2048x8192 7.9 -> 7.7 / 9.5 -> 9.1 /
# 17.9 -> 14.4 / 23.2 -> 23.0; 8192x28672 M = 32 / 64 103.6 -> 90.0 / 195.7 -> 168.0, at M <= 16 slower (62.4 ->
# 68.6 at M = 16 in an earlier run; benchmarks/RESULTS.md). Hence: weights of at least WIDE_MIN values with an
# even number of groups, below 16384 rows at M <= DOT_MAX_M, any rows up to 2 DOT_MAX_M, and from 8192 rows above
# that. The cost is precision: each value times its norm is rounded to 16 bits (relative error of the product
# 3.3e-3 against 2.6e-3 with one group a block, bfloat16, random data), about a fiftieth of the 3-bit
# quantization error itself.
WIDE = True
WIDE_MIN = 1 << 22


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
    rows_ok = n < 16384 if m <= DOT_MAX_M else (m <= 2 * DOT_MAX_M or n >= 8192)
    if WIDE and wb and ng % (wb // g) == 0 and n * ng * g >= WIDE_MIN and rows_ok:
        return wb
    return _mma_block(n_levels, g)


def uses_x_order(n: int, ng: int, n_levels: int, g: int) -> bool:
    """Whether `linear` runs the tensor-core GEMV of an `(n, ng groups of g)` weight on activations in its own order
    (`X_ORDER`, `X_ORDER_MIN`, `mma_order`); from the weight shape only."""
    return X_ORDER and n * ng * g >= X_ORDER_MIN and mma_order(n_levels, g)


def _dot_config(n: int, ng: int, n_levels: int, g: int, kb: int = 0) -> tuple:
    """Launch configuration of the tensor-core GEMV, from the weight shape only (never from M).

    2-, 3- and 4-bit (`_gemv_mma_kernel`): (BN, num_warps, num_stages, prefetch, maxnreg, blocks). Each program
    takes BN weight rows and S = num_warps x blocks of the row's KB-input blocks per step, so that many
    independent loads are in flight: S = 16 (4 warps of 4 blocks) below 8192 rows or for rows of at most 16
    blocks (one step a row; 2048x8192, M = 16, activation order: 9.1 -> 8.0 us), 8 (2 warps of 4) below 16384,
    else 4 (one warp of 4), BN = 16 below 8192 rows, else 32. 4-bit, whose two lookups a value hold more
    registers (255 a thread at 2 warps of 4 blocks, 12.5 % occupancy under ncu), takes 4 warps: of 4 blocks
    and 16 rows below 4096 rows, of 2 and 32 rows below 8192, else of 1 and 32 rows (GEMV alone at M = 16,
    H200: 4096x14336 34.7 -> 21.8 us, 8192x28672 106.9 -> 71.0, 512->2048 3.1 -> 2.5). S is halved (blocks
    first, then warps) while it exceeds the row's blocks. Prefetch 1 (the next step's words a step ahead) for
    rows of at least 16 blocks, else 2 (its activations and norms too). From a sweep on an H200 under Triton 3.6 (3-bit, G = 128, M = 8 and
    16, the benchmark shapes, 16 configurations), after the tiles were arranged for that release: at M = 16
    these were the fastest or within 4 % of it at every shape, and 1.35-1.9x faster than one block per warp and
    step (the previous choice; 1.4-2.0x at M = 8 where measured); rows of 64 over 2 warps came close on the
    longest rows. Swept again with the activation order (`X_ORDER`; 3-bit, M = 16, 36 configurations, BN 16-64,
    1-4 warps of 1-4 blocks, prefetch 1 and 2): these stayed fastest or within 9 % at the benchmark shapes. One
    stage: the loop is pipelined by hand, and Triton's pipelining would stage the operands
    through shared memory. `kb`: the block (`mma_block`; 0: `_mma_block`); with wide blocks a warp takes half as
    many blocks a step where the rule above gives 2 warps or 1 (the same inputs a step: 4096x14336, M = 16, 23.2
    -> 21.1 us), the whole rule counted in default blocks.

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
    M <= 16 configuration (more blocks per step: their grid is small). H200, Triton 3.6, 3-bit G = 128 unless
    noted, graph replays of rotation + GEMV, us at M = 32 / 64 (dequantize + cuBLAS, the previous path, 29.5 /
    28.4 at 4096x4096): 4096x4096 16.9 / 23.2; 4096x14336 32.8 / 60.6 (that path 90.0 / 90.9; 2-bit 29.1 / 53.4,
    4-bit 38.6 / 70.0, runtime ternary 28.3 / 52.5); 14336x4096 48.3 / 62.0; 8192x28672 108.3 / 209.7 (4-bit
    126.3 / 238.8; that path 343.6 / 351.9); 2048x8192 15.1 / 20.7; 2048->1024 6.3 / 7.4; 512->2048 5.0 / 6.4;
    at M = 128 the GEMV no longer wins (8192x28672 365 against 346)."""
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


def mid_m(m: int, n_levels: int, group_size: int, dtype: torch.dtype) -> bool:
    """Whether `m` rows of `dtype` activations take the tensor-core GEMV above DOT_MAX_M (`_mid_config`)."""
    return DOT_MAX_M < m <= MID_MAX_M and dtype in (torch.bfloat16, torch.float16) and _mma_serves(n_levels, group_size)


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
    kb = _check_block(n_levels, group_size, ng, block, x_order) if block or x_order else 0
    if _mma_serves(n_levels, group_size):
        kb = kb or mma_block(n_levels, group_size, n, ng, m)
        default = _dot_config(n, ng, n_levels, group_size, kb)
        bm = 8 if m <= 8 else 16
        if m > DOT_MAX_M:
            default, bm = _mid_config(n, ng, n_levels, group_size, m, kb)
        bm = mma_rows or bm
        cfg = tuple(config or default)
        bn, warps, stages = cfg[:3]
        prefetch = int(cfg[3]) if len(cfg) > 3 and cfg[3] in (0, 1, 2) else default[3]
        opts = {"maxnreg": cfg[4]} if len(cfg) > 4 and cfg[4] else {}
        blocks = cfg[5] if len(cfg) > 5 and cfg[5] else 1
        f16 = (x_rot.dtype if x_rot.dtype != torch.float32 else out_dtype) == torch.float16
        if not _interpreting() and x_rot.dtype not in (torch.bfloat16, torch.float16):
            x_rot = x_rot.to(torch.float16 if f16 else torch.bfloat16)
        if x_rot.stride(-1) != 1:
            x_rot = x_rot.contiguous()
        pdl = _pdl(x_rot.device)
        if pdl:
            opts["launch_pdl"] = True
        launch(
            _gemv_mma_kernel, (cdiv(n, bn), cdiv(m, bm)),
            x_rot, _packed_view(packed, 1), norms, codebook, out, m, n, x_rot.stride(0), out.stride(0), NG=ng,
            NLEV=n_levels, G=group_size, KB=kb, BN=bn, BM=bm, S=warps * blocks,
            TUNED=_tuned(packed, n_levels, signed=True), F16=f16, PREFETCH=prefetch, USE_ASM=not _interpreting(), PDL=pdl,
            LANES_FIRST=_lanes_first(), XORDER=bool(x_order),
            num_warps=warps, num_stages=stages, **opts)
        return out
    geo = unit_geometry(n_levels, group_size)
    bn, warps, stages, lut = _with_mask(config or _dot_config(n, ng, n_levels, group_size), n_levels)
    pk = _packed_view(packed, geo["WPU"])
    grid = (cdiv(n, bn), cdiv(m, block_m))
    launch(_gemv_dot_kernel, grid, x_rot, pk, norms, codebook, out, m, n, ng, x_rot.stride(0), out.stride(0),
           NLEV=n_levels, G=group_size, PER=geo["PER"], PER_P=geo["PER_P"], WPU=geo["WPU"],
           UPG=geo["UPG"], UPG_P=geo["UPG_P"], BN=bn, BM=block_m, LUT_MASK=lut, TUNED=_tuned(packed, n_levels),
           num_warps=warps,
           num_stages=stages)
    return out


# ---------------------------------------------------------------------------
# 2c. prefill: the weight (or, for ternary and float32, the rotated-basis weight) into a scratch buffer, then cuBLAS
# ---------------------------------------------------------------------------

@triton.jit
def _dequant_kernel(pk_ptr, nrm_ptr, cb_ptr, out_ptr, N, NG, stride_on,
                    NLEV: tl.constexpr, G: tl.constexpr, PER: tl.constexpr, PER_P: tl.constexpr,
                    WPU: tl.constexpr, UPG: tl.constexpr, UPG_P: tl.constexpr, BN: tl.constexpr,
                    LUT_MASK: tl.constexpr, TUNED: tl.constexpr):
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
    w0, w1, w2 = _load_units(pk_ptr, unit_off, nmask[:, None] & (ru < UPG)[None, :], WPU, TUNED, rn[:, None],
                              NG * UPG)
    w = _decode_unit_values(w0, w1, w2, cb_ptr, PER_P, NLEV, PER, tl.float32, LUT_MASK, TUNED, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15)
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
def _lut_tile(w0, w1, w2, t0, t1, t2, t3, t4, t5, t6, t7, NLEV: tl.constexpr, TUNED: tl.constexpr,
              USE_ASM: tl.constexpr):
    """`[R, U]` units of a 2-, 3- or 4-bit weight -> their float32 codebook values (from the `_byte_tables`,
    16-bit precision) as `[R, U, 2, ..., 2]`: flattened, value j of unit u sits at `u * PER + j`, the
    natural order of the inputs."""
    a0, a1, a2, a3, a4, a5, a6, a7 = _lut8(_unit_nibbles(w0, w1, w2, 0, NLEV, TUNED), t0, t1, t2, t3, t4, t5, t6, t7,
                                           NLEV, USE_ASM)
    if NLEV == 16:
        out = _join8(a0, a1, a2, a3, a4, a5, a6, a7)
    else:
        b0, b1, b2, b3, b4, b5, b6, b7 = _lut8(_unit_nibbles(w0, w1, w2, 1, NLEV, TUNED), t0, t1, t2, t3, t4, t5, t6,
                                               t7, NLEV, USE_ASM)
        if NLEV == 4:  # two chunks of eight: chunk is the slower of the two
            out = _join8(tl.join(a0, b0), tl.join(a1, b1), tl.join(a2, b2), tl.join(a3, b3),
                         tl.join(a4, b4), tl.join(a5, b5), tl.join(a6, b6), tl.join(a7, b7))
        else:  # four chunks of eight (3-bit)
            c0, c1, c2, c3, c4, c5, c6, c7 = _lut8(_unit_nibbles(w0, w1, w2, 2, NLEV, TUNED), t0, t1, t2, t3, t4, t5,
                                                   t6, t7, NLEV, USE_ASM)
            e0, e1, e2, e3, e4, e5, e6, e7 = _lut8(_unit_nibbles(w0, w1, w2, 3, NLEV, TUNED), t0, t1, t2, t3, t4, t5,
                                                   t6, t7, NLEV, USE_ASM)
            out = _join8(tl.join(tl.join(a0, c0), tl.join(b0, e0)), tl.join(tl.join(a1, c1), tl.join(b1, e1)),
                         tl.join(tl.join(a2, c2), tl.join(b2, e2)), tl.join(tl.join(a3, c3), tl.join(b3, e3)),
                         tl.join(tl.join(a4, c4), tl.join(b4, e4)), tl.join(tl.join(a5, c5), tl.join(b5, e5)),
                         tl.join(tl.join(a6, c6), tl.join(b6, e6)), tl.join(tl.join(a7, c7), tl.join(b7, e7)))
    return out


@triton.jit
def _dequant_lut_kernel(pk_ptr, nrm_ptr, cb_ptr, s1_ptr, s2_ptr, h_ptr, out_ptr, sel_ptr, N, K, stride_on, scale,
                        NG: tl.constexpr, NLEV: tl.constexpr, G: tl.constexpr, UPG: tl.constexpr,
                        BR: tl.constexpr, TUNED: tl.constexpr, USE_ASM: tl.constexpr, UNROT: tl.constexpr,
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
        w0, w1, w2 = _load_units(pk_ptr, rs[:, None] * UPG + ru[None, :], umask, WPU, TUNED, src[:, None], NUT)
        v = tl.reshape(_lut_tile(w0, w1, w2, t0, t1, t2, t3, t4, t5, t6, t7, NLEV, TUNED, USE_ASM), [BR, G])
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


def dequantize_lut(packed: torch.Tensor, norms: torch.Tensor, codebook: torch.Tensor, group_size: int,
                   dtype: torch.dtype, signs1: torch.Tensor | None = None, signs2: torch.Tensor | None = None,
                   in_features: int | None = None, block_rows: int = 64, warps: int = 4,
                   programs: int = 0, select: torch.Tensor | None = None, select_rows: int = 0) -> torch.Tensor:
    """A 2-, 3- or 4-bit weight decoded with the byte-permute lookups (codebook values at 16-bit precision) into
    a 16-bit `dtype` (float32 in the interpreter): with `signs1`/`signs2` the weight itself, `(rows,
    in_features)` (= `codec.dequantize_weight` within 16-bit rounding), without them the rotated-basis weight
    `(rows, n_groups*G)` (= `codec.rotated_weight`).

    `select` (int tensor of S matrix numbers) with `select_rows` = R: the weight is stacked matrices of R rows
    each (experts) and only the selected ones are decoded, into `(S*R, width)` in the order given; the rows of a
    negative number are neither read nor written."""
    n, ng = norms.shape
    if select is not None:
        n = select.numel() * select_rows
    n_levels = codebook.numel()
    per = lut_unit(n_levels, group_size)
    if not per:
        raise ValueError(f"the lookup dequantization serves 4-, 8- and 16-entry codebooks, not {n_levels}")
    unrot = signs1 is not None
    width = in_features if unrot else ng * group_size
    out = torch.empty(n, width, dtype=dtype, device=packed.device)
    if n == 0 or ng == 0:
        return out
    interp = _interpreting()
    if unrot:
        signs1, signs2 = _f32(signs1), _f32(signs2)
        hmat = _hadamard_pm1(group_size, torch.float32 if interp else dtype, packed.device)
    else:
        signs1 = signs2 = hmat = norms  # (unused)
    pk = _packed_view(packed, 1)
    # two programs an SM, each looping over blocks: H200, 3-bit, the rotation undone, us, 4 -> 2 an SM: 4096x4096
    # 26.2 -> 22.3, 4096x14336 68.3 -> 57.9, 14336x4096 70.5 -> 59.5, 2048x8192 26.8 -> 22.3 (2- and 4-bit alike;
    # 8 an SM or one program a block were slower, as were 128 rows a block or 8 warps)
    grid = (min(cdiv(n * ng, block_rows), programs or _sm_count(packed.device) * 2),)
    sel = select.reshape(-1) if select is not None else norms  # (unused without a selection)
    launch(_dequant_lut_kernel, grid, pk, norms.contiguous(), _f32(codebook), signs1, signs2, hmat, out, sel, n, width,
           out.stride(0), 1.0 / math.sqrt(group_size), NG=ng, NLEV=n_levels, G=group_size,
           UPG=group_size // per, BR=block_rows, TUNED=_tuned(packed, n_levels),
           USE_ASM=not interp, UNROT=unrot, SEL_ROWS=select_rows if select is not None else 0,
           num_warps=warps)
    return out


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
           UPG=geo["UPG"], UPG_P=geo["UPG_P"], BN=bn, LUT_MASK=LUT_MASKS[n_levels], TUNED=_tuned(packed, n_levels),
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


# Longest rotated row (n_groups * G) whose rotation and GEMV use programmatic dependent launch. Measured on an
# H200 (3-bit, CUDA graphs): rows of 4096 gain 0.6 us a call at M = 1 (4096x4096 8.3 -> 7.7 us, 4096->1024
# 5.1 -> 4.5); rows of 14336 and 28672 lose 2 and 6 us, and rows of 8192 (8192->28672) ran 15 us over the
# rotation plus the GEMV at M = 1 and 80 us at M = 2 (the GEMV's first wave, placed while the rotation still
# holds SMs, ends unevenly). Those were the kernels of the time; the 3- and 4-bit pair GEMV of one activation row,
# in its current configurations (`_pair_config`), gains with it on rows up to 14336 (3-bit 14336->4096 14.6 ->
# 13.8 us, 8192->28672 37.2 -> 36.6; 4-bit 14336->4096 17.9 -> 17.5): PDL_MAX_K_PAIRS applies there, at M = 1 only
# (M = 2 was not measured again).
PDL_MAX_K = 4096
PDL_MAX_K_PAIRS = 16384
PDL_PAIR_LEVELS = (4, 8, 16)  # the codebook sizes PDL_MAX_K_PAIRS applies to


def _pdl(device: torch.device, k: int = 0, n_levels: int = 0) -> bool:
    """Whether the rotation and the pair GEMV after it use programmatic dependent launch on `device` for rows of
    `k` rotated inputs: the GEMV's launch and prologue overlap the rotation's run (CUDA, compute capability
    >= 9.0, a Triton with the intrinsics, not the interpreter, k <= PDL_MAX_K, or PDL_MAX_K_PAIRS for the pair
    GEMV of a codebook size in PDL_PAIR_LEVELS; `TURBOQUANT_PDL=0` turns it off)."""
    limit = PDL_MAX_K_PAIRS if n_levels in PDL_PAIR_LEVELS else PDL_MAX_K  # (callers pass n_levels for M = 1 only)
    if device.type != "cuda" or not _HAS_GDC or k > limit or _interpreting():
        return False
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _PDL_DEVICES:
        import os

        _PDL_DEVICES[key] = (torch.cuda.get_device_capability(key)[0] >= 9
                             and os.environ.get("TURBOQUANT_PDL", "1") != "0")
    return _PDL_DEVICES[key]


def _interpreting() -> bool:
    """True when this module's kernels were built by Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return type(_rotate_kernel).__name__ == "InterpretedFunction"


def _tuned(packed: torch.Tensor, n_levels: int, signed: bool = False) -> bool:
    """Whether a kernel reads `packed` as the runtime layout (int32 words, `turboquant_hf.layout`) rather than
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


def product(x_rot: torch.Tensor, packed: torch.Tensor, norms: torch.Tensor, codebook: torch.Tensor,
            group_size: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Already-rotated activations `(M, n_groups*G)` times the packed weight -> `(M, rows)` in `out_dtype`.

    The codebook product alone (the CUDA side of `turboquant_hf.ops.codebook_matmul`): any rotation of
    the activations (per-group WHT, whole-row Hadamard, ...) can feed it. `norms` are per-group scales
    and `codebook` the values they multiply, both tensors, so per-module codebooks work unchanged."""
    m = x_rot.shape[0]
    sixteen = out_dtype in (torch.bfloat16, torch.float16)
    unit = lut_unit(codebook.numel(), group_size)
    if m <= PAIR_MAX_M and sixteen and unit:
        x2, xs = pack_pairs(x_rot, unit, group_size)
        return gemv_pairs(x2, xs, packed, norms, codebook, group_size, out_dtype)
    norms = norms.contiguous()  # (float16 norms are read as they are)
    codebook = _f32(codebook)
    if m <= FMA_MAX_M or (m <= DOT_MAX_M and not sixteen):
        return gemv_fma(_f32(x_rot), packed, norms, codebook, group_size, out_dtype)
    if m <= DOT_MAX_M or mid_m(m, codebook.numel(), group_size, out_dtype):
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
    """The whole op through the Triton kernels (same contract as `turboquant_hf.ops.turboquant_linear`)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features)
    m = x2.shape[0]
    s1, s2 = _f32(signs1), _f32(signs2)
    n, ng = norms.shape
    if m == 0:
        return x.new_empty(*lead, n)
    dt = x.dtype
    sixteen = dt in (torch.bfloat16, torch.float16)
    unit = lut_unit(codebook.numel(), group_size)
    if m <= PAIR_MAX_M and sixteen and unit:
        xp, xs = rotate(x2, s1, s2, group_size, dt, unit=unit)
        return gemv_pairs(xp, xs, packed, norms, codebook, group_size, dt).reshape(*lead, n)
    norms = norms.contiguous()  # (float16 norms are read as they are)
    codebook = _f32(codebook)
    if m <= FMA_MAX_M or (m <= DOT_MAX_M and not sixteen):
        x_rot = rotate(x2, s1, s2, group_size, torch.float32)
        y = gemv_fma(x_rot, packed, norms, codebook, group_size, dt)
    elif m <= DOT_MAX_M or mid_m(m, codebook.numel(), group_size, dt):
        # (the interpreter gets 16-bit dots wrong: it runs this path in float32)
        nl = codebook.numel()
        order = uses_x_order(n, ng, nl, group_size)
        kb = mma_block(nl, group_size, n, ng, m)
        x_rot = rotate(x2, s1, s2, group_size, torch.float32 if _interpreting() else dt,
                       mma_levels=nl if order else 0, mma_block=kb if order else 0)
        y = gemv_dot(x_rot, packed, norms, codebook, group_size, dt, x_order=order, block=kb)
    elif sixteen and unit:
        # prefill: the weight itself into a scratch buffer (its rotation undone on the tensor cores), then cuBLAS
        # on the activations as they are: one kernel fewer than rotating them
        w = dequantize_lut(packed, norms, codebook, group_size, torch.float32 if _interpreting() else dt, s1, s2,
                           in_features)
        y = torch.nn.functional.linear(x2 if not _interpreting() else x2.float(), w).to(dt)
    else:
        x_rot = rotate(x2, s1, s2, group_size, dt if sixteen else torch.float32)
        w = dequantize_rotated(packed, norms, codebook, group_size, x_rot.dtype)
        y = torch.nn.functional.linear(x_rot, w)
        if y.dtype != dt:
            y = y.to(dt)
    return y.reshape(*lead, n)
