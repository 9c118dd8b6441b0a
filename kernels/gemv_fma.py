"""The FMA GEMV kernel: weights decoded in registers, float32 products, no tensor cores."""

from __future__ import annotations

import triton
import triton.language as tl

from .units import _codebook16, _load_units, _value

# ---------------------------------------------------------------------------
# 2a. GEMV on CUDA cores (M == 1; any M for float32)
# ---------------------------------------------------------------------------

@triton.jit
def _gemv_fma_kernel(xr_ptr, pk_ptr, nrm_ptr, cb_ptr, out_ptr, idx_ptr, N, NG, stride_xm, stride_om,
                     NLEV: tl.constexpr, G: tl.constexpr, PER: tl.constexpr, WPU: tl.constexpr,
                     UPG: tl.constexpr, UPG_P: tl.constexpr, BN: tl.constexpr, GPI: tl.constexpr,
                     LUT_MASK: tl.constexpr, EVEN_N: tl.constexpr, EVEN_G: tl.constexpr,
                     EXPERTS: tl.constexpr, X_DIV: tl.constexpr, RUNTIME_LAYOUT: tl.constexpr):
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
                w0, w1, w2 = _load_units(pk_ptr, unit_off, None, WPU, RUNTIME_LAYOUT, n3, NG * UPG)
            else:
                w0, w1, w2 = _load_units(pk_ptr, unit_off, nmask[:, None, None] & gmask[None, :, None], WPU, RUNTIME_LAYOUT,
                                         n3, NG * UPG)
            for j in tl.static_range(PER):
                c = _value(w0, w1, w2, cb_ptr, j, NLEV, LUT_MASK, RUNTIME_LAYOUT, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15)
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
