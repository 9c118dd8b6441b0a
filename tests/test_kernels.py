"""Tests of the Triton kernels behind `torch.ops.turboquant.linear` (turboquant_hf.kernels.linear).

On any machine: the kernels run under Triton's interpreter (TRITON_INTERPRET=1)
on CPU tensors, called through the launcher functions directly, and are
compared with the plain-torch reference in `turboquant_hf.modeling.ops` for every bit
width (ternary, 2, 3, 4), G = 64 and 128, `in_features` not a multiple of G,
M = 1 and M >= 17. A private copy of `linear.py` is loaded for that, with
TRITON_INTERPRET=1 set while it is imported and while these tests run, so the
real module (compiled kernels, used for CUDA tensors) is left alone.

With CUDA: `test_cuda_op_matches_reference` runs this file as a script in a
fresh process (no interpreter) that checks `torch.ops.turboquant.linear` on CUDA
tensors (bf16, fp16, fp32) against the CPU reference, poisoned outputs, a CUDA
graph capture, and `TurboQuantLinear`. It is skipped where CUDA is absent.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import os
import subprocess
import sys

# Triton decides at import time whether its own library functions are interpreted: set the flag first.
_PREV_INTERPRET = os.environ.get("TRITON_INTERPRET")
if "triton" not in sys.modules and "--cuda-check" not in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    import triton
except ImportError:  # pragma: no cover - triton is an optional dependency
    triton = None
finally:
    if _PREV_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _PREV_INTERPRET

import pytest
import torch

# Whether this process can run the interpreter tests (False when an earlier module imported triton).
_INTERPRETED = triton is not None and type(triton.language.zeros).__name__ == "InterpretedFunction"

from turboquant_hf.kernels import tuning as T

from turboquant_hf.format import codec
from turboquant_hf.format import constants as fmt
from turboquant_hf.format import runtime_layout as layout
from turboquant_hf.modeling import ops

BITS = (fmt.TERNARY, 2, 3, 4)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.double().cpu()
    b = b.double().cpu()
    assert torch.isfinite(a).all(), "non-finite output"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _kcb(pk: torch.Tensor, cb: torch.Tensor) -> torch.Tensor:
    """The codebook the kernels read `pk` with: `layout.runtime_codebook` for the runtime layout."""
    return layout.runtime_codebook(cb) if layout.is_runtime(pk) else cb


def _weight(n: int, k: int, bits, g: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    packed, norms = codec.quantize_weight(w, bits, g)
    nl = fmt.levels_for_bits(bits)
    s1, s2 = fmt.signs(g)
    return packed, norms, fmt.codebook(nl, g), s1, s2


# ---------------------------------------------------------------------------
# interpreter tests (CPU)
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def L():
    """An interpreted copy of turboquant_hf.kernels.linear (TRITON_INTERPRET=1 while loading and testing)."""
    if triton is None:
        pytest.skip("triton is not installed")
    if not _INTERPRETED:
        pytest.fail("the interpreter tests need TRITON_INTERPRET=1 set before Python starts (transformers imports "
                    "triton first): TRITON_INTERPRET=1 python -m pytest -m interpreter tests/test_kernels.py")
    import turboquant_hf.kernels as kpkg

    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        path = os.path.join(os.path.dirname(kpkg.__file__), "linear.py")
        spec = importlib.util.spec_from_file_location("turboquant_hf.kernels._linear_interpreted", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # Triton's interpreter resolves helpers through the module
        spec.loader.exec_module(mod)
        assert mod._interpreting()
        yield mod
    finally:
        sys.modules.pop("turboquant_hf.kernels._linear_interpreted", None)
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def _prmt_by_definition(a: int, b: int, sel: int) -> int:
    """PTX `prmt.b32`, default mode, from its definition: output byte q is byte `n & 7` of the eight bytes of
    (a, b) for selector nibble n = `sel >> 4q & 15`, or that byte's top bit replicated when n has bit 3 set."""
    src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    out = 0
    for q in range(4):
        n = (sel >> 4 * q) & 15
        byte = src[n & 7] if n < 8 else (0xFF if src[n & 7] & 0x80 else 0)
        out |= byte << 8 * q
    return out


_PRMT_MOD = None  # (turboquant_hf.kernels.ptx, interpreted: set by the test below)


def _prmt_probe(a_ptr, b_ptr, s_ptr, out_ptr, out_c_ptr, SEL):
    tl = triton.language
    i = tl.arange(0, 64)
    a = tl.load(a_ptr + i).to(tl.uint32, bitcast=True)
    b = tl.load(b_ptr + i).to(tl.uint32, bitcast=True)
    s = tl.load(s_ptr + i).to(tl.uint32, bitcast=True)
    tl.store(out_ptr + i, _PRMT_MOD._prmt(a, b, s).to(tl.int32, bitcast=True))
    tl.store(out_c_ptr + i, _PRMT_MOD._prmt_c(a, b, SEL).to(tl.int32, bitcast=True))


def test_prmt_emulation_matches_ptx_definition(L):
    """Every interpreter test decodes through the emulated byte permute: `_prmt` (run-time selectors, nibbles
    below 8: the table lookups) and `_prmt_c` (compile-time selectors, sign-replicating nibbles included) give
    the PTX definition's bytes on random words, for the selectors the kernels use and others."""
    global _PRMT_MOD
    from turboquant_hf.kernels import ptx

    _PRMT_MOD = ptx
    probe = triton.jit(_prmt_probe)  # (decorated here: the fixture has TRITON_INTERPRET=1 set)
    gen = torch.Generator().manual_seed(9)
    for sel in (0x5140, 0x7362, 0x4040, 0x5151, 0x6262, 0x7373, 0xD9C8, 0xFBEA, 0x3210, 0x8F0E):
        a, b, s = (torch.randint(-2**31, 2**31 - 1, (64,), generator=gen, dtype=torch.int32) for _ in range(3))
        s &= 0x77777777
        out, out_c = torch.empty(64, dtype=torch.int32), torch.empty(64, dtype=torch.int32)
        probe[(1,)](a, b, s, out, out_c, SEL=sel)
        u = lambda t: [v & 0xFFFFFFFF for v in t.tolist()]  # noqa: E731
        for x, y, z, got, got_c in zip(u(a), u(b), u(s), u(out), u(out_c)):
            assert got == _prmt_by_definition(x, y, z), (hex(x), hex(y), hex(z), hex(got))
            assert got_c == _prmt_by_definition(x, y, sel), (hex(sel), hex(got_c))


@pytest.mark.parametrize("g", [64, 128])
@pytest.mark.parametrize("m", [3, 20])  # the butterfly kernel (up to ROWS_MAX_M rows) and the tensor-core one
def test_rotate(L, g, m):
    k = 200  # not a multiple of G
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    s1, s2 = fmt.signs(g)
    assert (m <= T.ROWS_MAX_M) == (m == 3)
    got = L.rotate(x, s1, s2, g, torch.float32)
    ref = ops.rotate_activations(x, s1, s2, g)
    assert got.shape == ref.shape
    assert _rel(got, ref) < 1e-6


@pytest.mark.parametrize("g", [64, 128, 256])
def test_rotate_butterflies_match_tensor_core_rotation(L, g, monkeypatch):
    """The butterfly rotation (`_rotate_rows_kernel`, up to ROWS_MAX_M rows) writes what the tensor-core one
    writes, in each of its layouts: natural order, the pair GEMV's float16 pairs and group scales (the scales
    bit for bit: both take them from the unrotated group norms), the tensor-core GEMV's order for its default
    and wide blocks; for 1, 2 and 5 rows, K not a multiple of G (zero-padded groups), 1, 2 and 4 groups a
    program (the last program's groups past the row masked); within float32 rounding of the sums."""
    gen = torch.Generator().manual_seed(g)
    s1, s2 = fmt.signs(g)
    k = 5 * g - 40
    layouts = [{}, {"unit": L.lut_unit(8)}, {"unit": L.lut_unit(4)}]
    layouts += [{"mma_levels": nl} for nl in (4, 8, 16) if L.mma_order(nl, g)]
    if g == 128:
        layouts.append({"mma_levels": 8, "mma_block": 256})
    for m in (1, 2, 5):
        x = torch.randn(m, k, generator=gen)
        for kw in layouts:
            xx = torch.randn(m, 6 * g, generator=gen) if "mma_block" in kw else x  # (wide blocks: pairs of groups)
            monkeypatch.setattr(T, "ROWS_MAX_M", 0)
            want = L.rotate(xx, s1, s2, g, torch.float32, **kw)
            for cfg in (None, (2, 1), (4, 2)):
                monkeypatch.setattr(T, "ROWS_MAX_M", 16)
                monkeypatch.setattr(T, "ROWS_CONFIG", cfg)
                got = L.rotate(xx, s1, s2, g, torch.float32, **kw)
                if "unit" in kw:
                    assert torch.equal(got[1], want[1]), (m, kw, cfg)
                    a, b = got[0].view(torch.float16).float(), want[0].view(torch.float16).float()
                    assert a.shape == b.shape and (a - b).abs().max() <= 2e-3 * b.abs().max(), (m, kw, cfg)
                else:
                    assert got.shape == want.shape and _rel(got, want) < 1e-6, (m, kw, cfg)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("g", [64, 128])
def test_kernels_match_reference(L, bits, g):
    n, k = 20, 330  # rows not a multiple of BN, in_features not a multiple of G (n_groups 6 / 3)
    packed, norms, cb, s1, s2 = _weight(n, k, bits, g, seed=int(10 * float(bits)) + g)
    ng = norms.shape[1]

    # dequantization to the rotated basis is exact
    assert torch.equal(L.dequantize_rotated(packed, norms, cb, g, torch.float32), codec.rotated_weight(packed, norms, cb, g))

    gen = torch.Generator().manual_seed(7)
    for m in (1, 17):
        x = torch.randn(m, k, generator=gen)
        ref = ops.turboquant_linear(x, packed, norms, cb, s1, s2, g, k)
        x_rot = L.rotate(x, s1, s2, g, torch.float32)
        # FMA GEMV (the M=1 path): default config, and one with partial row blocks and partial group steps
        if m == 1:
            assert ng % 4 != 0 and n % 8 != 0
            # the default mixes codebook loads and select trees (2-bit: selects only); the last field of a
            # config says which index numbers use a load: here all of them
            for cfg in (None, (8, 4, 2, 0xFFFFFFFF)):
                y = L.gemv_fma(x_rot, packed, norms, cb, g, torch.float32, config=cfg)
                assert _rel(y, ref) < 1e-5, (m, cfg)
        # tensor-core GEMV (float32 operands in the interpreter); M=17 takes two M tiles. Ternary: select trees,
        # exact; 2-4 bits: byte-permute lookups of the codebook rounded to bfloat16 (see test_mma_gemv_*)
        exact = bits == fmt.TERNARY
        for cfg in ((16, 4, 1),) if m > 1 else ((16, 4, 1), (16, 4, 1, 0xFFFFFFFF)):
            y = L.gemv_dot(x_rot, packed, norms, cb, g, torch.float32, config=cfg)
            assert _rel(y, ref) < (1e-5 if exact else 6e-3), (m, cfg, _rel(y, ref))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_op_paths(L, bits, dtype, monkeypatch):
    """The whole op (`linear`) on every path: M=1 and 2 (the pair GEMV, 1 and 2 rows a program, for 16-bit 2-, 3-
    and 4-bit, else FMA), M=3, 4 and 5 (tensor cores for 16-bit, FMA for fp32), M=17, 40 and 65 (16-bit 2- and
    3-bit: the packed-weight GEMM; 16-bit 4-bit published bytes: the tensor-core GEMV with 16 and 32 activation
    rows a program up to 64, else dequantize + matmul), with 3-D activations; the weight is dequantized exactly
    where the dispatch says, and the GEMM runs exactly where it says."""
    g, n, k = 64, 24, 200
    packed, norms, cb, s1, s2 = _weight(n, k, bits, g, seed=3)
    gen = torch.Generator().manual_seed(11)
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    for key, value in dict(T.GEMM_OPEN, GEMM_MIN_M=17).items():  # (as TURBOQUANT_GEMM_MIN_M=17 sets it)
        monkeypatch.setattr(T, key, value)
    dequantized, gemms = [], []
    for name in ("dequantize_lut", "dequantize_rotated"):
        monkeypatch.setattr(L, name, lambda *a, _f=getattr(L, name), **kw: dequantized.append(1) or _f(*a, **kw))
    monkeypatch.setattr(L.gemm, "gemm", lambda *a, _f=L.gemm.gemm, **kw: gemms.append(1) or _f(*a, **kw))
    mid = dtype == torch.bfloat16 and bits != fmt.TERNARY  # (the published ternary bytes have no lookup unit)
    for lead in ((1,), (2,), (3,), (2, 2), (5,), (1, 17), (40,), (5, 13)):
        m = math.prod(lead)
        assert L.mid_m(m, cb.numel(), g, dtype) == (mid and 16 < m <= 64)
        route = L.path(m, cb.numel(), g, dtype, packed)
        assert (route == "gemm") == (dtype == torch.bfloat16 and m > 16 and bits in (2, 3)), (lead, route)
        dequantized.clear()
        gemms.clear()
        x = torch.randn(*lead, k, generator=gen).to(dtype)
        ref = ops.turboquant_linear(x.float(), packed, norms, cb, s1, s2, g, k)
        y = L.linear(x, packed, norms, cb, s1, s2, g, k)
        assert y.dtype == dtype and y.shape == (*lead, n)
        assert _rel(y, ref) < tol, (lead, _rel(y, ref))
        assert bool(dequantized) == (route == "prefill"), (lead, dequantized)
        assert bool(gemms) == (route == "gemm"), (lead, gemms)


def _pairs_by_hand(x_rot: torch.Tensor, unit: int, g: int):
    """The pair layout built with torch: float16 `x_rot * 2**-e` per group (e = ceil(log2 |group|) - 8), element
    j of unit u at 16-bit position (j // 2) * 2 NUT + 2 u + j % 2, and the scales 2**e."""
    m, k = x_rot.shape
    nut = k // unit
    nrm = x_rot.double().view(m, k // g, g).norm(dim=2)
    e = torch.where(nrm > 0, torch.ceil(torch.log2(nrm.clamp_min(1e-300))) - 8, torch.zeros_like(nrm))
    xs = torch.exp2(e).float()
    scaled = (x_rot / xs.repeat_interleave(g, dim=1)).view(m, nut, unit // 2, 2).permute(0, 2, 1, 3)
    return scaled.to(torch.float16).contiguous().view(torch.int32).view(m, k // 2), xs


@pytest.mark.parametrize("bits,g", [(2, 128), (3, 64), (3, 128), (4, 64)])
def test_pair_gemv_matches_reference(L, bits, g):
    """The pair GEMV (byte-permute lookups to float16 pairs, `fma.rn.f16x2` chains; 2-, 3- and 4-bit, both
    layouts): the rotation's pair layout and group scales against a torch construction and against
    `pack_pairs`; M = 1, 2, 3 and 5 (activation rows decoded once for 1, 2 or 4 rows a program, rows past M
    masked), the default config, one whose unit step does not divide the row, and the prefetching loop (each
    step's words loaded during the step before) with steps that do and do not divide the row; activations
    from 1e-30 to 1e30 and a zero group (the power-of-two scales keep float16 in range, so the error does not
    move); against the float32 reference within ~2e-3 (float16 codebook values and activations, float16 chains;
    `fma.rn.f16x2` and `prmt` are emulated here, the PTX runs on the GPU)."""
    n, k = 20, 330
    packed, norms, cb, s1, s2 = _weight(n, k, bits, g, seed=5 * bits + g)
    nl = cb.numel()
    unit = L.lut_unit(nl)
    layouts = [packed] + ([layout.to_runtime(packed, nl, g, norms.shape[1])] if layout.wanted(nl, g) else [])
    gen = torch.Generator().manual_seed(3)
    for m, scale in ((1, 1.0), (3, 1e30), (1, 1e-30), (2, 1.0), (5, 1.0)):
        x = torch.randn(m, k, generator=gen, dtype=torch.float64) * scale
        x[:, g:2 * g] = 0  # a zero group: scale 1
        x = x.float()
        ref = ops.turboquant_linear(x.double(), packed, norms.double(), cb.double(), s1.double(), s2.double(), g, k)
        x2, xs = L.rotate(x, s1, s2, g, torch.float32, unit=unit)
        x_rot = L.rotate(x, s1, s2, g, torch.float32)
        want2, want_s = _pairs_by_hand(x_rot, unit, g)
        assert torch.equal(xs, want_s) and torch.equal(xs[:, 1], torch.ones(m)), (m, scale)
        assert (x2.view(torch.float16).float() - want2.view(torch.float16).float()).abs().max() <= 2.0**-3
        p2, ps = L.pack_pairs(x_rot, unit, g)
        assert torch.equal(ps, xs) and torch.equal(p2, x2)
        for pk in layouts if scale == 1.0 else layouts[-1:]:  # (the extreme scales: one layout, default config)
            ys = []
            launch = ((4, 1, 0, 1), (8, 1, 0, 1, 4)) if scale == 1.0 and m <= 2 else ()
            for cfg in ((None, (4, 1)) if scale == 1.0 else (None,)) + launch:
                y = L.gemv_pairs(x2, xs, pk, norms, _kcb(pk, cb), g, torch.float32, config=cfg)
                err = _rel(y, ref)
                assert 1e-5 < err < 2e-3, (m, scale, cfg, pk.dtype, err)  # > 1e-5: float16 really in use
                ys.append(y)
            if launch:
                assert torch.equal(ys[2], ys[1])  # (the same sums, loaded a step earlier)
    # the product alone, from the natural layout, in bf16
    x = torch.randn(1, k, generator=gen)
    ref = ops.turboquant_linear(x, packed, norms, cb, s1, s2, g, k)
    y = L.product(L.rotate(x, s1, s2, g, torch.float32), packed, norms, cb, g, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and _rel(y, ref) < 1e-2


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_pair_gemv_units_first(L, bits):
    """The pair GEMV with its tiles held units-first (the arrangement for Triton before 3.7, `_lanes_first`):
    M = 1 (the default config, the prefetching one, a step that does not divide the row) and 5 (four activation
    rows a program and a fifth), and the routed expert pairs; the same results as rows-first within float32
    summation order."""
    n, k, g = 20, 330, 128
    packed, norms, cb, s1, s2 = _weight(n, k, bits, g, seed=11 * bits)
    nl = cb.numel()
    pk = layout.to_runtime(packed, nl, g, norms.shape[1]) if layout.wanted(nl, g) else packed
    gen = torch.Generator().manual_seed(4)
    try:
        for m in (1, 5):
            x = torch.randn(m, k, generator=gen)
            ref = ops.turboquant_linear(x, packed, norms, cb, s1, s2, g, k)
            x2, xs = L.rotate(x, s1, s2, g, torch.float32, unit=L.lut_unit(nl))
            for cfg in (None, (8, 1, 0, 1), (4, 1, 0, 0, 4)) if m == 1 else (None,):
                ys = []
                for lanes_first in (False, True):
                    L._LANES_FIRST = lanes_first
                    ys.append(L.gemv_pairs(x2, xs, pk, norms, _kcb(pk, cb), g, torch.float32, config=cfg))
                assert _rel(ys[1], ref) < 2e-3 and _rel(ys[1], ys[0]) < 1e-6, (m, cfg)
        idx = torch.tensor([[0, -1], [0, 0]])  # (one expert: the weight itself; -1 gives zeros)
        x = torch.randn(2, k, generator=gen)
        x2, xs = L.rotate(x, s1, s2, g, torch.float32, unit=L.lut_unit(nl))
        outs = []
        for lanes_first in (False, True):
            L._LANES_FIRST = lanes_first
            outs.append(L.gemv_pairs(x2, xs, pk, norms, _kcb(pk, cb), g, torch.float32, experts=1, expert_index=idx,
                                     x_div=2))
        assert torch.equal(outs[1][1], torch.zeros(n)) and _rel(outs[1], outs[0]) < 1e-6
    finally:
        L._LANES_FIRST = None


def test_pair_gemv_refuses_steps_below_a_chain_group(L):
    """The pair GEMV adds the float16 chains of 32 consecutive indices (two 2-bit units, four 4-bit ones) within a
    lane's units: a configuration whose step holds fewer units, or not a power of two, is refused by name before
    anything is launched; the smallest allowed step runs."""
    n, k, g = 8, 256, 128
    gen = torch.Generator().manual_seed(6)
    for bits, smallest in ((2, 2), (4, 4), (3, 1)):
        packed, norms, cb, s1, s2 = _weight(n, k, bits, g, seed=60 + bits)
        x2, xs = L.rotate(torch.randn(1, k, generator=gen), s1, s2, g, torch.float32, unit=L.lut_unit(cb.numel()))
        for bad in ([smallest // 2] if smallest > 1 else []) + [3 * smallest]:
            with pytest.raises(ValueError, match=f"power of two of at least {smallest}.*not {bad}"):
                L.gemv_pairs(x2, xs, packed, norms, cb, g, torch.float32, config=(8, 1, 0, 0, bad))
        ref = L.gemv_pairs(x2, xs, packed, norms, cb, g, torch.float32)
        y = L.gemv_pairs(x2, xs, packed, norms, cb, g, torch.float32, config=(8, 1, 0, 0, smallest))
        assert _rel(y, ref) < 1e-6, bits


def test_pair_gemv_groups_below_a_chain(L):
    """turboquant-mlx modules bring groups smaller than the 32 indices whose float16 chains the pair GEMV adds
    before scaling them by one norm (2-bit G = 16, 4-bit G = 8, 16 and 24): the chains added together must stay
    within one group, and rows of fewer than 32 inputs must still run (one step, its missing units masked off).
    Random codebooks and norms, M = 1 and 2, against the float32 reference product; a step below the chain group
    that such a group allows is refused by name."""
    gen = torch.Generator().manual_seed(9)
    for nl, g, k in ((4, 16, 16), (4, 16, 80), (16, 8, 8), (16, 16, 16), (16, 16, 64), (16, 24, 72)):
        n = 7
        idx = torch.randint(0, nl, (n * (k // g), g), generator=gen)
        packed = codec.pack_indices(idx, nl)
        norms = torch.rand(n, k // g, generator=gen) + 0.5
        cb = torch.randn(nl, generator=gen)
        for m in (1, 2):
            x_rot = torch.randn(m, k, generator=gen)
            ref = ops.codebook_matmul(x_rot, packed, norms, cb, g)
            x2, xs = L.pack_pairs(x_rot, L.lut_unit(nl, g), g)
            y = L.gemv_pairs(x2, xs, packed, norms, cb, g, torch.float32)
            assert 1e-5 < _rel(y, ref) < 2e-3, (nl, g, k, m, _rel(y, ref))
    packed = codec.pack_indices(torch.randint(0, 16, (4, 16), generator=gen), 16)
    x2, xs = L.pack_pairs(torch.randn(1, 32, generator=gen), 8, 16)
    with pytest.raises(ValueError, match="power of two of at least 2 .* at G = 16, not 1"):
        L.gemv_pairs(x2, xs, packed, torch.ones(2, 2), torch.randn(16, generator=gen), 16, torch.float32,
                     config=(8, 1, 0, 0, 1))


def test_pair_codebook_values(L):
    """The codebook values the pair GEMV multiplies are the entries rounded to float16 (relative error below
    2^-11), for the format's codebooks and for arbitrary ones (turboquant-mlx modules carry their own; 16
    entries take two 8-entry lookups and a mask from the indices' top bits): one-hot activations read every
    index of a group once through the (emulated) permutes."""
    gen = torch.Generator().manual_seed(4)
    for nl in (4, 8, 16):
        for g in (128, "random"):  # (the random codebook in groups of 64)
            cb = fmt.codebook(nl, g) if g != "random" else torch.randn(nl, generator=gen) * 3
            g = 64 if g == "random" else g
            per = L.lut_unit(nl)
            idx = torch.arange(g) % nl
            packed = codec.pack_indices(idx.view(1, g), nl)
            x2, xs = L.pack_pairs(torch.eye(g), per, g)
            vals = L.gemv_pairs(x2, xs, packed, torch.ones(1, 1), cb, g, torch.float32)[:, 0]
            assert torch.equal(vals, cb[idx].half().float()), (nl, g)
            assert 0 < ((vals - cb[idx]).abs() / cb[idx].abs()).max().item() < 2.0**-11, (nl, g)


def test_pair_gemv_experts(L):
    """Routed pairs: row p = expert idx[p] times activation row p // x_div; out-of-range indices give zeros."""
    e, n, k, g = 5, 24, 200, 64
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(e, n, k, generator=gen)
    packed, norms = codec.quantize_weight(w, 3, g)
    cb = fmt.codebook(8, g)
    s1, s2 = fmt.signs(g)
    x = torch.randn(3, k, generator=gen)
    idx = torch.tensor([[4, 0], [2, -1], [5, 1]])  # -1 and 5 (= E) are not experts
    x2, xs = L.rotate(x, s1, s2, g, torch.float32, unit=L.lut_unit(8))
    y = L.gemv_pairs(x2, xs, packed, norms, cb, g, torch.float32, experts=e, expert_index=idx, x_div=2)
    ng = norms.shape[1]
    for p, ex in enumerate(idx.reshape(-1).tolist()):
        if not 0 <= ex < e:
            assert torch.equal(y[p], torch.zeros(n)), p
            continue
        ref = ops.turboquant_linear(x[p // 2 : p // 2 + 1], packed[ex * n * ng : (ex + 1) * n * ng],
                                    norms[ex * n : (ex + 1) * n], cb, s1, s2, g, k)[0]
        assert _rel(y[p], ref) < 2e-3, p


def _mma_case(L, bits, g, n, k, m, runtime, f16=False, cfgs=(None,), seed=0, rows=0):
    """The tensor-core GEMV of 2-, 3- and 4-bit weights against the rotated-basis product with the codebook
    rounded to 16 bits (bfloat16, or float16 for float16 outputs): the lanes' k order and the activations'
    matching gather are exact (1e-5; float16 outputs add their own rounding), and against the float32
    reference within 16-bit rounding. 3-bit G=64 blocks span two groups and round norm * value to 16 bits."""
    packed, norms, cb, s1, s2 = _weight(n, k, bits, g, seed=seed)
    nl, ng = cb.numel(), norms.shape[1]
    pk = layout.to_runtime(packed, nl, g, ng) if runtime else packed
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=gen)
    ref = ops.turboquant_linear(x, packed, norms, cb, s1, s2, g, k)
    x_rot = L.rotate(x, s1, s2, g, torch.float32)
    dt = torch.float16 if f16 else torch.float32
    cb16 = cb.to(torch.float16 if f16 else torch.bfloat16).float()
    ref16 = x_rot.double() @ codec.rotated_weight(packed, norms, cb16, g).double().T
    fold = bits == 3 and g == 64
    tol16 = 4e-3 if fold else (1e-3 if f16 else 1e-5)
    outs = []
    for cfg in cfgs:
        y = L.gemv_dot(x_rot, pk, norms, _kcb(pk, cb), g, dt, config=cfg, mma_rows=rows)
        assert y.dtype == dt and y.shape == (m, n)
        err, err16 = _rel(y, ref), _rel(y, ref16)
        assert err16 < tol16 and 1e-5 < err < 6e-3, (bits, g, runtime, m, f16, cfg, err, err16)
        outs.append(y)
    return outs


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("g", [64, 128])
def test_mma_gemv_matches_reference(L, bits, g):
    """`_gemv_mma_kernel`: both layouts (2 and 3 bits), M = 3 and 13 (8- and 16-row activation tiles), rows not
    a multiple of BN, block counts not a multiple of the warps (and, 3-bit G=64, half a last block), prefetch
    on and off, and (2) for the activations and norms too, BN = 16 and 32 (the norms of rows past the last read
    clamped), 1 to 4 warps, one warp taking 2 or 4 blocks a step; float16 tables; both arrangements of the
    weight and activation tiles (`_lanes_first`)."""
    n, k = 40, 300 if g == 64 else 330  # 5 / 3 groups
    try:
        for lanes_first in (False, True):  # (both tile arrangements, whichever this Triton would pick)
            L._LANES_FIRST = lanes_first
            for runtime in (False, True):
                for m, cfgs in ((3, (None, (32, 2, 1, True), (16, 1, 1, 1, 0, 2))),
                                (13, ((16, 4, 1, False), (16, 1, 1, 2), (16, 1, 1, 2, 0, 4)))):
                    if lanes_first:  # (fewer configs: the arrangement, not the launch options, is under test)
                        cfgs = cfgs[-1:]
                    outs = _mma_case(L, bits, g, n, k, m, runtime, cfgs=cfgs, seed=7 * bits + g + m)
                    for y in outs[1:]:
                        assert _rel(y, outs[0]) < 1e-6  # (the warps split the sum differently)
        L._LANES_FIRST = None
        _mma_case(L, bits, g, n, k, 5, True, f16=True, seed=3)
        # above DOT_MAX_M (`_mid_config`): 32 activation rows a program (two programs, the second partial), with
        # the default configuration, 64 weight rows over 2 warps, and 64 activation rows a program
        outs = _mma_case(L, bits, g, n, k, 37, True, cfgs=(None, (64, 2, 1, 1, 0, 1)), seed=5)
        outs += _mma_case(L, bits, g, n, k, 37, True, cfgs=((16, 4, 1, 1, 0, 1),), seed=5, rows=64)
        for y in outs[1:]:
            assert _rel(y, outs[0]) < 1e-6
    finally:
        L._LANES_FIRST = None


@pytest.mark.parametrize("bits,g", [(2, 64), (4, 64), (3, 128), (3, 256)])
def test_mma_activation_order(L, bits, g, monkeypatch):
    """`rotate(..., mma_levels=...)` writes the rotated activations in the tensor-core GEMV's order: within each
    block of KB inputs, the same permutation of runs of 8 for every row and block, and `gemv_dot(...,
    x_order=True)` on them gives the natural order's output bit for bit (M = 3, 13 and 37 with 32 rows a
    program, rows not a multiple of BN, K not a multiple of G, prefetch 1 and 2, 1 and 2 warps of 2 and 4
    blocks); `linear` takes that path for weights of X_ORDER_MIN values or more, with the same output."""
    n, k = 40, g + 56
    packed, norms, cb, s1, s2 = _weight(n, k, bits, g, seed=bits + g)
    nl, ng = cb.numel(), norms.shape[1]
    pk = layout.to_runtime(packed, nl, g, ng) if layout.wanted(nl, g) else packed
    kcb = _kcb(pk, cb)
    kb = L._mma_block(nl, g)
    assert L.mma_order(nl, g) and (ng * g) % kb == 0
    gen = torch.Generator().manual_seed(g + bits)
    for m, cfgs, rows in ((3, (None,), 0), (13, ((16, 1, 1, 2, 0, 4), (32, 2, 1, 1, 0, 2)), 0), (37, (None,), 32)):
        x = torch.randn(m, k, generator=gen)
        nat = L.rotate(x, s1, s2, g, torch.float32)
        ordered = L.rotate(x, s1, s2, g, torch.float32, mma_levels=nl)
        assert ordered.shape == nat.shape and not torch.equal(ordered, nat)
        # runs of 8: each ordered run is one natural run of its block, the same one for every row and block
        a = ordered.view(m, -1, kb // 8, 8)
        b = nat.view(m, -1, kb // 8, 8)
        match = (a[:, :, :, None, :] == b[:, :, None, :, :]).all(-1)  # [m, blocks, ordered run, natural run]
        assert (match.sum(-1) == 1).all() and (match.sum(-2) == 1).all()
        perm = match.float().argmax(-1)
        assert (perm == perm[0, 0]).all() and sorted(perm[0, 0].tolist()) == list(range(kb // 8))
        for cfg in cfgs:
            want = L.gemv_dot(nat, pk, norms, kcb, g, torch.float32, config=cfg, mma_rows=rows)
            got = L.gemv_dot(ordered, pk, norms, kcb, g, torch.float32, config=cfg, mma_rows=rows, x_order=True)
            assert torch.equal(got, want), (m, cfg, _rel(got, want))
    # the whole op: ordered only from X_ORDER_MIN weight values, the output unchanged
    x = torch.randn(2, 5, k, generator=gen).to(torch.bfloat16)
    levels = []
    monkeypatch.setattr(L, "rotate", lambda *a, _f=L.rotate, **kw: levels.append(kw.get("mma_levels", 0)) or _f(*a, **kw))
    natural = L.linear(x, pk, norms, kcb, s1, s2, g, k)
    assert levels == [0] and n * ng * g < T.X_ORDER_MIN
    monkeypatch.setattr(T, "X_ORDER_MIN", n * ng * g)
    assert torch.equal(L.linear(x, pk, norms, kcb, s1, s2, g, k), natural) and levels == [0, nl]


def test_mma_activation_order_refused(L):
    """No activation order where the tensor-core GEMV's blocks span several groups (3-bit G = 64: blocks of two
    groups) or where it does not serve the codebook (ternary): both halves say so; the rotation writes one layout at a time."""
    x = torch.randn(2, 128)
    for nl, g in ((8, 64), (3, 128)):
        assert not L.mma_order(nl, g)
        s1, s2 = fmt.signs(g)
        with pytest.raises(ValueError, match=f"no tensor-core activation order for {nl} levels at G = {g}"):
            L.rotate(x, s1, s2, g, torch.float32, mma_levels=nl)
    s1, s2 = fmt.signs(128)
    with pytest.raises(ValueError, match="exclude each other"):
        L.rotate(x, s1, s2, 128, torch.float32, unit=L.lut_unit(8), mma_levels=8)
    packed, norms, cb, s1, s2 = _weight(16, 128, 3, 64, seed=1)
    with pytest.raises(ValueError, match="no tensor-core activation order for 8 levels at G = 64"):
        L.gemv_dot(L.rotate(x, s1, s2, 64, torch.float32), packed, norms, cb, 64, torch.float32, x_order=True)


def test_mma_wide_blocks(L, monkeypatch):
    """3-bit G = 128: blocks of two groups (`wide_block`, the norms folded into the values) give the product within
    bfloat16 rounding of the reference, in natural and in activation order bit for bit, at 8 / 16 / 32 activation
    rows a program; `mma_block` picks them only for weights of WIDE_MIN values with whole pairs of groups and as
    its rows rule says, and `linear` then orders the activations for them; any other block, or a row of an odd
    number of groups, is refused naming the cause."""
    g = 128
    n, k = 40, 512
    packed, norms, cb, s1, s2 = _weight(n, k, 3, g, seed=11)
    nl, ng = cb.numel(), norms.shape[1]
    pk = layout.to_runtime(packed, nl, g, ng)
    kcb = _kcb(pk, cb)
    ref_w = codec.rotated_weight(packed, norms, cb.bfloat16().float(), g).double()
    assert L.wide_block(nl, g) == 256 and L.wide_block(nl, 64) == 0 and L.wide_block(16, 128) == 0
    gen = torch.Generator().manual_seed(5)
    for m, cfg in ((5, None), (13, (16, 1, 1, 2, 0, 2)), (37, None)):
        x = torch.randn(m, k, generator=gen)
        nat = L.rotate(x, s1, s2, g, torch.float32)
        ref = nat.double() @ ref_w.T
        base = L.gemv_dot(nat, pk, norms, kcb, g, torch.float32, config=cfg, block=128)
        wide = L.gemv_dot(nat, pk, norms, kcb, g, torch.float32, config=cfg, block=256)
        assert _rel(base, ref) < 1e-5 and 2e-4 < _rel(wide, ref) < 4e-3, (m, _rel(base, ref), _rel(wide, ref))
        ordered = L.rotate(x, s1, s2, g, torch.float32, mma_levels=nl, mma_block=256)
        assert not torch.equal(ordered, nat)
        assert torch.equal(L.gemv_dot(ordered, pk, norms, kcb, g, torch.float32, config=cfg, x_order=True, block=256),
                           wide), m
    # rows not a multiple of BN and a last group past the row's end (440 inputs: 4 groups, the fourth zero-padded)
    p2, n2, cb2, _, _ = _weight(24, 440, 3, g, seed=12)
    pk2 = layout.to_runtime(p2, nl, g, n2.shape[1])
    x = torch.randn(7, 440, generator=gen)
    nat = L.rotate(x, s1, s2, g, torch.float32)
    ref = nat.double() @ codec.rotated_weight(p2, n2, cb2.bfloat16().float(), g).double().T
    wide = L.gemv_dot(nat, pk2, n2, _kcb(pk2, cb2), g, torch.float32, block=256)
    assert 2e-4 < _rel(wide, ref) < 4e-3, _rel(wide, ref)
    ordered = L.rotate(x, s1, s2, g, torch.float32, mma_levels=nl, mma_block=256)
    assert torch.equal(L.gemv_dot(ordered, pk2, n2, _kcb(pk2, cb2), g, torch.float32, x_order=True, block=256), wide)
    # the choice: by weight size, whole pairs of groups, rows and M's bucket
    assert L.mma_block(nl, g, n, ng, 5) == 128  # (below WIDE_MIN)
    assert L.mma_block(nl, g, 4096, 32, 16) == 256 and L.mma_block(nl, g, 4096, 32, 17) == 256
    assert L.mma_block(nl, g, 4096, 32, 48) == 128 and L.mma_block(nl, g, 8192, 32, 48) == 256
    assert L.mma_block(nl, g, 16384, 64, 16) == 128 and L.mma_block(nl, g, 16384, 64, 32) == 256
    assert L.mma_block(nl, g, 4096, 33, 16) == 128  # (an odd number of groups)
    assert L.mma_block(16, g, 4096, 32, 16) == 128 and L.mma_block(nl, 64, 4096, 64, 16) == 128
    assert L.mma_block(3, g, 4096, 32, 16) == 0  # (ternary: not the tensor-core GEMV's)
    monkeypatch.setattr(T, "WIDE", False)
    assert L.mma_block(nl, g, 4096, 32, 16) == 128
    monkeypatch.undo()
    # linear: wide blocks and their activation order once the weight is large enough
    monkeypatch.setattr(T, "WIDE_MIN", n * ng * g)
    monkeypatch.setattr(T, "X_ORDER_MIN", n * ng * g)
    calls = []
    monkeypatch.setattr(L, "rotate", lambda *a, _f=L.rotate, **kw: calls.append(kw.get("mma_block", 0)) or _f(*a, **kw))
    x = torch.randn(2, 3, k, generator=gen).to(torch.bfloat16)
    y = L.linear(x, pk, norms, kcb, s1, s2, g, k)
    assert calls == [256]
    xo = L.rotate(x.reshape(6, k), s1, s2, g, torch.float32, mma_levels=nl, mma_block=256)
    want = L.gemv_dot(xo, pk, norms, kcb, g, torch.bfloat16, x_order=True, block=256)
    assert torch.equal(y.reshape(6, n), want)
    monkeypatch.undo()
    for bad in (384, 64):
        with pytest.raises(ValueError, match=f"no tensor-core blocks of {bad} inputs for 8 levels at G = 128"):
            L.gemv_dot(nat, pk, norms, kcb, g, torch.float32, block=bad)
    with pytest.raises(ValueError, match="whole pairs of groups: the row has 3 groups of 128"):
        L.rotate(torch.randn(2, 384), s1, s2, g, torch.float32, mma_levels=nl, mma_block=256)
    with pytest.raises(ValueError, match="without `mma_levels`"):
        L.rotate(torch.randn(2, 256), s1, s2, g, torch.float32, mma_block=256)


def test_lanes_first_by_triton_version(L, monkeypatch):
    """The tensor-core GEMV's tile arrangement follows the Triton release: lanes-first axes before 3.7 (whose
    coalescing orders the remaining axes ascending), the original order from 3.7 on; read once and cached."""
    for version, want in (("3.2.0", True), ("3.6.0", True), ("3.7.1", False), ("3.9.0+git5a1b", False),
                          ("4.0.0", False)):
        monkeypatch.setattr(L, "_LANES_FIRST", None)
        monkeypatch.setattr(L.triton, "__version__", version)
        assert L._lanes_first() is want, version
        monkeypatch.setattr(L.triton, "__version__", "3.6.0" if not want else "3.9.0")
        assert L._lanes_first() is want, version  # (cached)


def test_mma_gemv_group_256(L):
    """G = 256: two blocks of 128 inputs per group share its norm."""
    for bits in (2, 3, 4):
        _mma_case(L, bits, 256, 24, 600, 9, bits in (2, 3), cfgs=(None, (16, 2, 1, True)), seed=bits)


def test_mma_gemv_small_groups(L):
    """Groups smaller than a lane's units (the format has none; a module's own packing could): a G=64 weight read
    as groups of 32 with every norm twice is the same product, with the norms folded into the values."""
    for bits in (2, 3, 4):
        packed, norms, cb, s1, s2 = _weight(24, 320, bits, 64, seed=20 + bits)
        nl, ng = cb.numel(), norms.shape[1]
        pk = layout.to_runtime(packed, nl, 64, ng) if bits in (2, 3) else packed
        x_rot = torch.randn(6, ng * 64, generator=torch.Generator().manual_seed(bits))
        ref16 = x_rot.double() @ codec.rotated_weight(packed, norms, cb.bfloat16().float(), 64).double().T
        y = L.gemv_dot(x_rot, pk, norms.repeat_interleave(2, dim=1), cb, 32, torch.float32, config=(16, 2, 1, True))
        assert _rel(y, ref16) < 4e-3, (bits, _rel(y, ref16))


@pytest.mark.parametrize("bits,g", [(2, 64), (3, 64), (3, 128), (4, 128)])
def test_runtime_layout_kernels(L, bits, g, monkeypatch):
    """Every kernel reads the runtime layout (int32, `format.runtime_layout`, with `layout.runtime_codebook`)
    and gives exactly what it gives for the published bytes: the pair GEMV (M = 1 and 3), the select GEMV,
    the tensor-core GEMV, the dequantization, the whole op at M = 1, 5, 17 (bit for bit where both take the same
    path), and the routed-expert mode (4-bit:
    sign-magnitude codes, whose lookups in the pair and tensor-core GEMVs set the sign from the top bit)."""
    n, k = 20, 330
    packed, norms, cb, s1, s2 = _weight(n, k, bits, g, seed=40 + bits + g)
    nl, ng = cb.numel(), norms.shape[1]
    for key, value in dict(T.GEMM_OPEN, GEMM_MIN_M=17).items():  # (as TURBOQUANT_GEMM_MIN_M=17 sets it)
        monkeypatch.setattr(T, key, value)
    rt, cbr = layout.to_runtime(packed, nl, g, ng), layout.runtime_codebook(cb)
    assert rt.dtype == torch.int32 and not torch.equal(rt.view(torch.uint8).view(packed.shape), packed)
    gen = torch.Generator().manual_seed(2)
    assert torch.equal(L.dequantize_rotated(rt, norms, cbr, g, torch.float32), codec.rotated_weight(packed, norms, cb, g))
    for m in (1, 3):
        x = torch.randn(m, k, generator=gen)
        x2, xs = L.rotate(x, s1, s2, g, torch.float32, unit=L.lut_unit(nl))
        x_rot = L.rotate(x, s1, s2, g, torch.float32)
        assert torch.equal(L.gemv_pairs(x2, xs, rt, norms, cbr, g, torch.float32),
                           L.gemv_pairs(x2, xs, packed, norms, cb, g, torch.float32)), m
        assert torch.equal(L.gemv_fma(x_rot, rt, norms, cbr, g, torch.float32),
                           L.gemv_fma(x_rot, packed, norms, cb, g, torch.float32)), m
        assert torch.equal(L.gemv_dot(x_rot, rt, norms, cbr, g, torch.float32, config=(16, 4, 1)),
                           L.gemv_dot(x_rot, packed, norms, cb, g, torch.float32, config=(16, 4, 1))), m
    for lead in ((1,), (5,), (17,)):
        x = torch.randn(*lead, k, generator=gen).to(torch.bfloat16)
        ref = ops.turboquant_linear(x.float(), packed, norms, cb, s1, s2, g, k)
        y = L.linear(x, rt, norms, cbr, s1, s2, g, k)
        y_pub = L.linear(x, packed, norms, cb, s1, s2, g, k)
        m = lead[0]
        if L.path(m, nl, g, x.dtype, rt) == L.path(m, nl, g, x.dtype, packed):
            assert torch.equal(y, y_pub), lead
        else:  # (4-bit M = 17: the GEMM reads the runtime layout only; the published bytes take the GEMV)
            assert _rel(y_pub, ref) < 1.5e-2, lead
        assert _rel(y, ref) < 1.5e-2, lead
        # the reference accepts the runtime layout too (a module moved between devices keeps working; the published
        # bytes of up to 16 rows take the compiled CPU kernel, which sums in its own order)
        assert _rel(ops.turboquant_linear(x.float(), rt, norms, cbr, s1, s2, g, k), ref) < 1e-6, lead
    # routed experts: stacked matrices, the runtime layout row by row
    e = 3
    w = torch.randn(e, n, k, generator=gen)
    pe, ne = codec.quantize_weight(w, bits, g)
    re_ = layout.to_runtime(pe, nl, g, ng)
    idx = torch.tensor([2, 0, -1, 1])
    x2, xs = L.rotate(torch.randn(2, k, generator=gen), s1, s2, g, torch.float32, unit=L.lut_unit(nl))
    assert torch.equal(L.gemv_pairs(x2, xs, re_, ne, cbr, g, torch.float32, experts=e, expert_index=idx, x_div=2),
                       L.gemv_pairs(x2, xs, pe, ne, cb, g, torch.float32, experts=e, expert_index=idx, x_div=2))


def test_ternary_runtime_layout_kernels(L):
    """A ternary weight in its runtime layout (2-bit codes, `layout.pairs_codebook`) runs the 2-bit kernels:
    the whole op at M = 1 (pair GEMV), 5 (tensor-core GEMV) and 17 (dequantize + matmul) and the routed-expert
    pair GEMV, against the reference product of the published base-3 bytes."""
    n, k, g = 20, 200, 64
    packed, norms, cb, s1, s2 = _weight(n, k, fmt.TERNARY, g, seed=47)
    ng = norms.shape[1]
    rt, pairs = layout.to_runtime(packed, 3, g, ng), layout.pairs_codebook(cb)
    assert L.lut_unit(pairs.numel(), g) == 16
    gen = torch.Generator().manual_seed(3)
    for lead in ((1,), (5,), (17,)):
        x = torch.randn(*lead, k, generator=gen).to(torch.bfloat16)
        ref = ops.turboquant_linear(x.float(), packed, norms, cb, s1, s2, g, k)
        assert _rel(L.linear(x, rt, norms, pairs, s1, s2, g, k), ref) < 1.5e-2, lead
    e = 3
    pe, ne = codec.quantize_weight(torch.randn(e, n, k, generator=gen), fmt.TERNARY, g)
    re_ = layout.to_runtime(pe, 3, g, ng)
    idx = torch.tensor([2, 0, -1, 1])
    x = torch.randn(2, k, generator=gen)
    x2, xs = L.rotate(x, s1, s2, g, torch.float32, unit=16)
    y = L.gemv_pairs(x2, xs, re_, ne, pairs, g, torch.float32, experts=e, expert_index=idx, x_div=2)
    x_rot = ops.rotate_activations(x, s1, s2, g)
    for p, ex in enumerate(idx.tolist()):
        want = torch.zeros(n) if ex < 0 else ops.codebook_matmul(
            x_rot[p // 2:p // 2 + 1], pe[ex * n * ng:(ex + 1) * n * ng], ne[ex * n:(ex + 1) * n], cb, g)[0]
        assert _rel(y[p], want) < 4e-3 if ex >= 0 else torch.equal(y[p], want), (p, _rel(y[p], want))


@pytest.fixture(scope="module")
def M(L):
    """An interpreted copy of turboquant_hf.kernels.moe that uses the interpreted linear kernels."""
    import turboquant_hf.kernels as kpkg

    path = os.path.join(os.path.dirname(kpkg.__file__), "moe.py")
    spec = importlib.util.spec_from_file_location("turboquant_hf.kernels._moe_interpreted", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.L = L
    mod.gemm = L.gemm
    return mod


@pytest.mark.parametrize("bits,runtime", [(3, True), (4, False), (4, True), (fmt.TERNARY, False), (fmt.TERNARY, True)])
def test_moe_experts_kernel_paths(L, M, bits, runtime, monkeypatch):
    """The CUDA implementation of the MoE op (run under the interpreter) against the torch reference:
    the pair path (few tokens: the pair GEMV for 3-bit, 4-bit and ternary in the runtime layout, the select GEMV
    for ternary bytes, with float16 norms) and the grouped path (many tokens: the routed experts decoded
    in chunks of two, or for ternary bytes a product per expert)."""
    e, h, inter, g = 6, 128, 64, 64
    gen = torch.Generator().manual_seed(int(bits * 100))
    gu_p, gu_n = codec.quantize_weight(torch.randn(e, 2 * inter, h, generator=gen), bits, g)
    d_p, d_n = codec.quantize_weight(torch.randn(e, h, inter, generator=gen), bits, g)
    if bits == fmt.TERNARY:
        gu_n, d_n = gu_n.half(), d_n.half()  # as TurboQuantWeight stores the ternary tier
    nl = fmt.levels_for_bits(bits)
    cb = fmt.codebook(nl, g)
    s1, s2 = fmt.signs(g)
    gu_k, d_k, cb_k = gu_p, d_p, cb  # what the kernels get: the layout TurboQuantExperts holds on a GPU
    if runtime:
        gu_k, d_k = layout.to_runtime(gu_p, nl, g, h // g), layout.to_runtime(d_p, nl, g, inter // g)
        cb_k = layout.runtime_codebook(cb)
    monkeypatch.setattr(T, "PAIR_MAX_ROWS", 8)  # 2 tokens x top-3 take the pair path, 4 tokens the grouped one
    chunked = 2 * (3 * inter * h) * 4  # two experts' float32 weights a chunk (the host-synchronised path)
    # the prefill paths: the fused routed products, then decoded into the scratch buffer in chunks, then every
    # expert at once (routing on the device), rotated basis or not
    fused = 1 << 62
    # (the pair path on the 4-bit and ternary tiers, cheaper to interpret; the 3-bit pair GEMV has its own tests)
    settings = ([(None, True, fused, False)] if bits != 3 else []) + (
        [(chunked, True, fused, True)] if runtime else []) + [
        (chunked, True, fused, False), (chunked, True, 0, False), (1 << 30, True, 0, False)] + (
        [(1 << 30, False, 0, False)] if bits == 3 else [])
    routed_gemm = L.gemm.routed_gemm
    for scratch, rotated, fused_max, on_gemm in settings:
        t = 2 if scratch is None else 4
        for key, value in dict(T.GEMM_OPEN, ROUTED_GEMM_MIN_PAIRS=2 if on_gemm else 1 << 62).items():
            monkeypatch.setattr(T, key, value)  # (the grouped products on the GEMM, or not)
        gemms = []
        monkeypatch.setattr(L.gemm, "routed_gemm", lambda *a, **kw: gemms.append(1) or routed_gemm(*a, **kw))
        monkeypatch.setattr(T, "PREFILL_SCRATCH_BYTES", scratch or chunked)
        monkeypatch.setattr(T, "PREFILL_ROTATED_BASIS", rotated)
        monkeypatch.setattr(T, "FUSED_MAX_PAIRS", fused_max)
        hidden = torch.randn(t, h, generator=gen).to(torch.bfloat16)
        top_k_index = torch.randint(0, e, (t, 3), generator=gen)
        top_k_index[0, 1] = e  # "no expert"
        top_k_index[t - 1, 0] = -1
        top_k_weights = torch.rand(t, 3, generator=gen)
        args = (hidden, top_k_index, top_k_weights, gu_p, gu_n, cb, d_p, d_n, cb, s1, s2, g, e, "silu")
        ref = ops.turboquant_moe_experts(hidden.float(), *args[1:])
        y = M.moe_experts(hidden, top_k_index, top_k_weights, gu_k, gu_n, cb_k, d_k, d_n, cb_k, s1, s2, g, e, "silu")
        assert y.dtype == torch.bfloat16 and y.shape == hidden.shape
        assert _rel(y, ref) < 1.5e-2, (t, scratch, rotated, fused_max, on_gemm, _rel(y, ref))
        assert len(gemms) == (2 if on_gemm and runtime else 0)  # (the GEMM serves the runtime layout)


@pytest.mark.parametrize("bits", [2, 3, 4, fmt.TERNARY])
@pytest.mark.parametrize("g", [64, 128])
def test_routed_lut_mm_matches_reference(L, M, bits, g):
    """The fused routed product (experts decoded inside the grouped product) against float64 products of each
    expert's rotated-basis weight (`codec.rotated_weight`): rows gathered from the tokens or read in order, groups of
    uneven sizes with empty experts, weight rows not a multiple of the tile, blocks of 16 and 32 rows; also fewer
    rows than experts. Runtime layouts as TurboQuantExperts holds them on a GPU (ternary as 2-bit codes)."""
    e, n, k = 4, 40, 256
    packed, norms, cb, _, _ = _weight(e * n, k, bits, g, seed=70 + g + int(bits * 10))
    ng = norms.shape[1]
    rot = codec.rotated_weight(packed, norms, cb, g).double().view(e, n, ng * g)
    nl = cb.numel()
    if nl == 3:
        pk, kcb = layout.to_runtime(packed, 3, g, ng), layout.pairs_codebook(cb)
    else:
        pk = layout.to_runtime(packed, nl, g, ng) if layout.supports(nl, g) else packed
        kcb = _kcb(pk, cb)
    gen = torch.Generator().manual_seed(g + nl)
    x = torch.randn(9, ng * g, generator=gen)
    for sizes, block_rows in (([7, 0, 19, 5], 16), ([7, 0, 19, 5], 32), ([0, 2, 0, 1], 0)):
        p = sum(sizes)
        offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
        xrow = torch.randint(0, 9, (p,), generator=gen, dtype=torch.int32)
        y = M.routed_lut_mm(x, offs, pk, norms, kcb, g, e, torch.float32, xrow=xrow, block_rows=block_rows)
        y_direct = M.routed_lut_mm(x[xrow.long()], offs, pk, norms, kcb, g, e, torch.float32, block_rows=block_rows)
        assert y.shape == (p, n) and torch.equal(y, y_direct)
        want = torch.cat([x[xrow[s:s + c].long()].double() @ rot[ex].T
                          for ex, (s, c) in enumerate(zip((offs - torch.tensor(sizes)).tolist(), sizes))])
        assert 1e-6 < _rel(y, want) < 4e-3, (sizes, block_rows, _rel(y, want))
    with pytest.raises(ValueError, match="width"):
        M.routed_lut_mm(x[:, :g], offs, pk, norms, kcb, g, e, torch.float32)


def test_moe_scratch_budget_from_environment(L, monkeypatch):
    """`TURBOQUANT_MOE_SCRATCH_MB` sets the prefill scratch budget; a value that is not a positive whole number of
    MiB is refused with an error naming the variable."""
    import turboquant_hf.kernels as kpkg

    path = os.path.join(os.path.dirname(kpkg.__file__), "tuning.py")

    def load():
        spec = importlib.util.spec_from_file_location("turboquant_hf.kernels._tuning_budget", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    monkeypatch.delenv("TURBOQUANT_MOE_SCRATCH_MB", raising=False)
    assert load().PREFILL_SCRATCH_BYTES == 1 << 30
    monkeypatch.setenv("TURBOQUANT_MOE_SCRATCH_MB", "96")
    assert load().PREFILL_SCRATCH_BYTES == 96 << 20
    for bad in ("0", "-5", "1.5", "lots"):
        monkeypatch.setenv("TURBOQUANT_MOE_SCRATCH_MB", bad)
        with pytest.raises(ValueError, match="TURBOQUANT_MOE_SCRATCH_MB"):
            load()


@pytest.mark.parametrize("activation", ["silu", "relu", "gelu_pytorch_tanh", "gelu"])
def test_act_mul_matches_torch(M, activation):
    """The gate/up activation kernel (silu, relu and tanh-GELU; exact GELU and strided inputs take torch ops)
    against `act(gate) * up` in float32, over rows and columns that are not multiples of its blocks."""
    gen = torch.Generator().manual_seed(len(activation))
    inter = 300
    gu = torch.randn(37, 2 * inter, generator=gen) * 3
    want = ops.ACTIVATIONS[activation](gu[:, :inter]) * gu[:, inter:]
    got = M.act_mul(gu, inter, activation, torch.float32)
    assert got.shape == want.shape and _rel(got, want) < 1e-6, _rel(got, want)
    strided = torch.cat([gu, gu], 1)[:, ::2]  # (not unit-stride: the torch fallback)
    assert _rel(M.act_mul(strided, inter, activation, torch.float32),
                ops.ACTIVATIONS[activation](strided[:, :inter]) * strided[:, inter:]) < 1e-6


def test_combine_sums_routed_rows(M):
    """The output gather of the prefill path: per token, the routing-weighted sum of its pairs' rows from the
    expert-sorted results, pairs routed to no expert (negative or >= E) counting zero, against index_add."""
    gen = torch.Generator().manual_seed(11)
    t, k, h, e = 9, 3, 1100, 4
    idx = torch.randint(0, e, (t, k), generator=gen)
    idx[1, 2], idx[3, 0] = e, -1
    idx[5] = torch.tensor([e, -1, e])  # a token routed nowhere
    tok, slot, counts, counts_list = ops.expert_groups(idx, e)
    assert counts.tolist() == counts_list == torch.bincount(idx[(idx >= 0) & (idx < e)], minlength=e).tolist()
    assert sorted(zip(tok.tolist(), slot.tolist())) == sorted(
        (i, j) for i in range(t) for j in range(k) if 0 <= idx[i, j] < e)
    assert idx[tok, slot].tolist() == sorted(idx[tok, slot].tolist())  # grouped by expert
    y = torch.randn(tok.numel(), h, generator=gen)
    w = torch.rand(t, k, generator=gen)
    want = torch.zeros(t, h).index_add_(0, tok, y * w[tok, slot, None])
    pos = M.positions(tok, slot, t, k)
    got = M.combine(y, pos, w, torch.float32)
    assert _rel(got, want) < 1e-6 and torch.equal(got[5], torch.zeros(h))
    assert M.combine(y.to(torch.bfloat16), pos, w, torch.bfloat16).dtype == torch.bfloat16
    # the routing computed on the device (no host synchronisation; a counting sort in three kernels): the same
    # pairs routed, each to a row of its own, the routed ones first and grouped by expert (order inside a group
    # free), each row reading its pair's token; the pairs routed nowhere after them; the same output through
    # `combine`
    live = pos >= 0
    flat = torch.arange(t * k)
    tok_d, pos_d, sel, offs = M._device_routing(idx, e)
    rows = pos_d[live].long()
    assert torch.equal(pos_d >= 0, live) and sorted(rows.tolist()) == list(range(tok.numel()))
    assert torch.equal(tok_d[rows], flat[live] // k)
    assert sorted(tok_d[tok.numel():].tolist()) == (flat[~live] // k).tolist()
    expert_of_row = torch.empty(tok.numel(), dtype=torch.long)
    expert_of_row[rows] = idx.reshape(-1)[live]
    assert expert_of_row.tolist() == sorted(expert_of_row.tolist())
    assert sel.tolist() == [ex if counts_list[ex] or ex == e - 1 else -1 for ex in range(e)]
    assert offs.tolist()[:-1] == torch.tensor(counts_list).cumsum(0).tolist()[:-1] and offs[-1] == t * k
    y_d = torch.full((t * k, h), float("nan"))  # (rows of pairs routed nowhere are never read)
    y_d[rows] = y[pos[live].long()]
    assert torch.equal(M.combine(y_d, pos_d, w, torch.float32), got)


# Experts in transformers' other layouts, as the op receives them: gpt-oss-shaped (gate/up outputs interleaved, expert
# biases, the clamped SwiGLU; widths that are not multiples of G = 128, as gpt-oss's 2880) and Llama-4-shaped (its
# expert blocks gathered into one routed pair per row, some rows routed nowhere, unit weights).
LAYOUT_SHAPES = {"gpt_oss": dict(e=5, h=192, inter=96, g=128, k=2),
                 "llama4": dict(e=6, h=128, inter=64, g=64, k=1)}


def _layout_case(kind: str, bits, runtime: bool, seed: int):
    """(weights as the reference reads them, as the kernels read them, the op's layout arguments, the codebook) of
    a `LAYOUT_SHAPES` case; the gpt-oss-shaped gate/up weights are wide enough that the clamp (limit 7) acts."""
    c = LAYOUT_SHAPES[kind]
    e, h, inter, g = c["e"], c["h"], c["inter"], c["g"]
    gen = torch.Generator().manual_seed(seed)
    gu_p, gu_n = codec.quantize_weight(torch.randn(e, 2 * inter, h, generator=gen), bits, g)
    d_p, d_n = codec.quantize_weight(torch.randn(e, h, inter, generator=gen) * 0.2, bits, g)
    if bits == fmt.TERNARY:
        gu_n, d_n = gu_n.half(), d_n.half()  # as TurboQuantWeight stores the ternary tier
    nl = fmt.levels_for_bits(bits)
    cb = fmt.codebook(nl, g)
    gu_k, d_k, cb_k = gu_p, d_p, cb
    if runtime:
        gu_k, d_k = layout.to_runtime(gu_p, nl, g, gu_n.shape[1]), layout.to_runtime(d_p, nl, g, d_n.shape[1])
        cb_k = layout.runtime_codebook(cb)
    if kind == "gpt_oss":
        extra = (torch.randn(e, 2 * inter, generator=gen).to(torch.bfloat16),
                 torch.randn(e, h, generator=gen).to(torch.bfloat16), True, 1.702, 7.0)
        act = "clamped_swiglu"
    else:
        extra = (None, None, False, 1.0, 0.0)
        act = "silu"
    return (gu_p, gu_n, cb, d_p, d_n, cb), (gu_k, gu_n, cb_k, d_k, d_n, cb_k), act, extra


def _layout_routing(kind: str, t: int, gen):
    c = LAYOUT_SHAPES[kind]
    e, k = c["e"], c["k"]
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    idx[0, -1] = e  # routed nowhere ("no expert")
    if t > 2:
        idx[t - 1, 0] = -1
    weights = torch.ones(t, k) if kind == "llama4" else torch.rand(t, k, generator=gen)
    return idx, weights


@pytest.mark.parametrize("kind", list(LAYOUT_SHAPES))
@pytest.mark.parametrize("bits,runtime", [(3, True), (fmt.TERNARY, False)])
def test_moe_experts_kernel_paths_in_other_layouts(L, M, kind, bits, runtime, monkeypatch):
    """The CUDA implementation of the MoE op (under the interpreter) for gpt-oss-shaped experts (biases, interleaved
    gate/up, clamped SwiGLU) and Llama-4-shaped ones against the torch reference, on every path: the pair GEMVs
    (decode; the biases and the activation in torch, on the device), the fused routed products, on the lookup kernel
    or (Llama 4) the packed-weight GEMM (the gate/up bias and the activation in `act_mul`, the down bias in
    `combine`), the
    decoded prefill (in chunks; `test_moe_experts_kernel_paths` runs its other forms, which share the epilogue), and
    for ternary bytes the per-expert products. The clamp acts on part of the gate and up values."""
    c = LAYOUT_SHAPES[kind]
    ref_w, ker_w, act, extra = _layout_case(kind, bits, runtime, seed=int(bits * 10) + len(kind))
    s1, s2 = fmt.signs(c["g"])
    gen = torch.Generator().manual_seed(5)
    monkeypatch.setattr(T, "PAIR_MAX_ROWS", 4)
    per_expert = 3 * c["inter"] * c["h"] * 4
    settings = [(None, True, 1 << 62, False), (2 * per_expert, True, 1 << 62, False),
                (2 * per_expert, True, 0, False)]
    if kind == "llama4":  # (the GEMM route shares the epilogue: one layout runs it)
        settings.append((2 * per_expert, True, 1 << 62, True))
    routed_gemm = L.gemm.routed_gemm
    for scratch, rotated, fused_max, on_gemm in settings:
        t = 2 if scratch is None else (6 if kind == "gpt_oss" else 9)
        for key, value in dict(T.GEMM_OPEN, ROUTED_GEMM_MIN_PAIRS=2 if on_gemm else 1 << 62).items():
            monkeypatch.setattr(T, key, value)  # (the grouped products on the GEMM, or not)
        gemms = []
        monkeypatch.setattr(L.gemm, "routed_gemm", lambda *a, **kw: gemms.append(1) or routed_gemm(*a, **kw))
        monkeypatch.setattr(T, "PREFILL_SCRATCH_BYTES", scratch or per_expert)
        monkeypatch.setattr(T, "PREFILL_ROTATED_BASIS", rotated)
        monkeypatch.setattr(T, "FUSED_MAX_PAIRS", fused_max)
        hidden = torch.randn(t, c["h"], generator=gen).to(torch.bfloat16)
        idx, wts = _layout_routing(kind, t, gen)
        ref = ops.turboquant_moe_experts(hidden.float(), idx, wts, *ref_w, s1, s2, c["g"], c["e"], act, *extra)
        y = M.moe_experts(hidden, idx, wts, *ker_w, s1, s2, c["g"], c["e"], act, *extra)
        assert y.dtype == torch.bfloat16 and y.shape == hidden.shape
        assert _rel(y, ref) < 1.5e-2, (t, scratch, rotated, fused_max, on_gemm, _rel(y, ref))
        assert len(gemms) == (2 if on_gemm and runtime else 0)  # (the GEMM serves the runtime layout)
        if kind == "gpt_oss" and scratch is None:  # (the clamp is reached: the layout's epilogue matters)
            x_rot = ops.rotate_activations(hidden.float(), s1, s2, c["g"])
            rows = 2 * c["inter"]  # expert 0's gate/up rows
            gu = ops.codebook_matmul(x_rot, ref_w[0][:rows * ref_w[1].shape[1]], ref_w[1][:rows].float(), ref_w[2],
                                     c["g"])
            assert (gu.abs() > extra[4]).float().mean() > 0.05
    no_bias = ops.turboquant_moe_experts(hidden.float(), idx, wts, *ref_w, s1, s2, c["g"], c["e"], act, None, None,
                                         *extra[2:])
    if kind == "gpt_oss":
        assert _rel(no_bias, ref) > 0.1  # the biases change the output well beyond the tolerance above


def test_act_mul_and_combine_apply_the_layout_epilogue(M):
    """`act_mul` with a per-row expert bias, interleaved gate/up columns and the clamped SwiGLU against
    `activations.gated` in float32 (rows and columns not multiples of its blocks; a strided input takes torch ops),
    and `combine` adding each routed pair's down bias (none for pairs routed nowhere) against a direct sum."""
    from turboquant_hf.modeling.activations import gated

    gen = torch.Generator().manual_seed(21)
    e, inter, rows = 5, 300, 37
    gu = torch.randn(rows, 2 * inter, generator=gen) * 6
    bias = torch.randn(e, 2 * inter, generator=gen)
    experts = torch.randint(0, e, (rows,), generator=gen, dtype=torch.int32)
    for act, interleaved in (("clamped_swiglu", True), ("clamped_swiglu", False), ("silu", True), ("relu", False)):
        epi = M.Epilogue(bias, None, interleaved, 1.702, 7.0)
        want = gated(gu + bias[experts.long()], act, interleaved, 1.702, 7.0)
        got = M.act_mul(gu, inter, act, torch.float32, epi, experts)
        assert got.shape == want.shape and _rel(got, want) < 1e-6, (act, interleaved, _rel(got, want))
        strided = torch.cat([gu, gu], 1)[:, ::2]
        assert _rel(M.act_mul(strided, inter, act, torch.float32, epi, experts),
                    gated(strided + bias[experts.long()], act, interleaved, 1.702, 7.0)) < 1e-6
        assert _rel(M.act_mul(gu, inter, act, torch.float32, M.Epilogue(None, None, interleaved, 1.702, 7.0)),
                    gated(gu, act, interleaved, 1.702, 7.0)) < 1e-6
    assert (gu[:, ::2] > 7).any() and (gu.abs() > 7).any()  # the clamp acts

    t, k, h = 9, 3, 260
    idx = torch.randint(0, e, (t, k), generator=gen)
    idx[1, 2], idx[3, 0] = e, -1
    tok, slot, _, _ = ops.expert_groups(idx, e)
    y = torch.randn(tok.numel(), h, generator=gen)
    w = torch.rand(t, k, generator=gen)
    d_bias = torch.randn(e, h, generator=gen)
    want = torch.zeros(t, h).index_add_(0, tok, (y + d_bias[idx[tok, slot]]) * w[tok, slot, None])
    pos = M.positions(tok, slot, t, k)
    assert _rel(M.combine(y, pos, w, torch.float32, d_bias, idx), want) < 1e-6
    # each sorted row's expert, from the routing on the device (pairs routed nowhere: rows past the routed ones)
    tok_d, pos_d, _, _ = M._device_routing(idx, e)
    rows_e = M.row_experts(idx, pos_d, tok_d.numel())
    live = pos_d >= 0
    assert torch.equal(rows_e[pos_d[live].long()], idx.reshape(-1)[live].to(torch.int32))


@pytest.mark.parametrize("tiers", [(3, 3, 3), (fmt.TERNARY, fmt.TERNARY, 4)])
def test_hadamard_moe_experts_kernel_path(L, M, tiers, monkeypatch):
    """turboquant-mlx experts (whole-row rotations with per-projection signs and codebooks, float16 norms
    and codebooks) through the CUDA implementation's routed-pair path, run under the interpreter, against
    the torch reference op; a hidden width of 192 = 12 * 16 takes an order-12 block."""
    e, h, inter, g = 5, 192, 128, 64
    gen = torch.Generator().manual_seed(len(str(tiers)))
    parts = []
    for bits, shape in zip(tiers, ((e, inter, h), (e, inter, h), (e, h, inter))):
        packed, norms = codec.quantize_weight(torch.randn(*shape, generator=gen), bits, g)
        cb = fmt.codebook(fmt.levels_for_bits(bits), g) * 1.5  # a module's own codebook, not the format's
        signs = torch.randint(0, 2, (shape[-1],), generator=gen).float() * 2 - 1
        parts += [packed, norms.half(), cb.half(), signs.half()]
    hidden = torch.randn(2, h, generator=gen).to(torch.bfloat16)
    idx = torch.tensor([[1, 4, 0], [3, 5, 2]])  # 5 = E: no expert
    wts = torch.rand(2, 3, generator=gen)
    args = (hidden, idx, wts, *parts, e, "silu")
    monkeypatch.setattr(T, "PAIR_MAX_ROWS", 8)
    if tiers[0] == fmt.TERNARY:  # (the decode path on the ternary tiers, cheaper to interpret; the 3-bit pair
        # GEMV has its own tests)
        ref = ops.turboquant_hadamard_moe_experts(hidden.float(), *args[1:])
        y = M.hadamard_moe_experts(*args)
        assert y.dtype == torch.bfloat16 and _rel(y, ref) < 1.5e-2, _rel(y, ref)
    # four tokens: the prefill path (ternary in its runtime layout, read with the padded codebook, as
    # TurboQuantExperts holds it on a GPU): the fused routed products; for the ternary tiers (cheaper to interpret)
    # also the routed experts decoded all at once (the routing on the device) and two at a time (the counts on the
    # host)
    for i in range(3):
        packed, cb = parts[4 * i], parts[4 * i + 2]
        if cb.numel() == 3:
            parts[4 * i] = layout.to_runtime(packed, 3, 64, parts[4 * i + 1].shape[1])
            parts[4 * i + 2] = layout.pairs_codebook(cb)
    hidden = torch.randn(4, h, generator=gen).to(torch.bfloat16)
    idx = torch.tensor([[1, 4, 0], [3, 5, 2], [2, 2, 1], [0, 3, 4]])
    wts = torch.rand(4, 3, generator=gen)
    ref = ops.turboquant_hadamard_moe_experts(hidden.float(), idx, wts, *parts, e, "silu")
    # (the experts decoded inside the products, then into the scratch buffer)
    # (the scratch-buffer forms on the ternary tiers, cheaper to interpret; the fused products on both)
    settings = [(1 << 62, 1 << 30)] + ([(0, 1 << 30), (0, 2 * 3 * inter * h * 4)] if tiers[0] == fmt.TERNARY else [])
    for fused, scratch in settings:
        monkeypatch.setattr(T, "FUSED_MAX_PAIRS", fused)
        monkeypatch.setattr(T, "PREFILL_SCRATCH_BYTES", scratch)
        y = M.hadamard_moe_experts(hidden, idx, wts, *parts, e, "silu")
        assert y.dtype == torch.bfloat16 and _rel(y, ref) < 1.5e-2, (fused, scratch, _rel(y, ref))
    monkeypatch.setattr(T, "FUSED_MAX_PAIRS", 1 << 62)
    # float32 activations at prefill: the torch reference itself
    assert torch.equal(M.hadamard_moe_experts(hidden.float(), idx, wts, *parts, e, "silu"), ref)


def test_unit_geometry_covers_groups(L):
    for nl in (3, 4, 8, 16):
        for g in fmt.GROUP_SIZES:
            geo = L.unit_geometry(nl, g)
            bpg = fmt.bytes_per_group(nl, g)
            if nl == 3:
                assert geo["UPG"] == bpg and geo["PER"] * bpg >= g
            else:
                assert geo["UPG"] * geo["PER"] == g and geo["UPG"] * geo["WPU"] * 4 == bpg


def test_lut_levels_inverts_lut_unit(L):
    """The rotation decides its early launch from the pair unit it writes: `lut_levels` must give back the
    codebook size the pair GEMV that reads it has, for every size the byte-permute kernels serve, and 0 for
    anything else (no early launch on a guess)."""
    units = {nl: L.lut_unit(nl) for nl in (3, 4, 8, 16)}
    assert units == {3: 0, 4: 16, 8: 32, 16: 8}
    for nl, unit in units.items():
        if unit:
            assert L.lut_levels(unit) == nl
    for unit in (0, 1, 4, 64, 128):
        assert L.lut_levels(unit) == 0


def test_registration():
    import turboquant_hf.kernels as kpkg

    if importlib.util.find_spec("triton") is not None and os.environ.get("TURBOQUANT_DISABLE_TRITON", "0") in ("", "0"):
        assert kpkg.registered()
    # CPU tensors always run the reference
    packed, norms, cb, s1, s2 = _weight(8, 64, 3, 64, seed=0)
    x = torch.randn(2, 64)
    y = torch.ops.turboquant.linear(x, packed, norms, cb, s1, s2, 64, 64)
    assert torch.allclose(y, ops.turboquant_linear(x, packed, norms, cb, s1, s2, 64, 64))


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("g", [64, 128])
def test_lookup_dequantization(L, bits, g):
    """`dequantize_lut`, the prefill path's scratch weight: the rotated-basis weight and the weight itself (the
    rotation undone by the +-1 matrix product), from both layouts, with several row blocks per program, rows
    and `in_features` not multiples of the block or of G. Its codebook values are 16-bit patterns, so it is
    within 4e-3 of the float32 codec, and above 1e-5 (the rounded values are really in use)."""
    n, k = 21, 330
    packed, norms, cb, s1, s2 = _weight(n, k, bits, g, seed=60 + bits + g)
    ng = norms.shape[1]
    layouts = [packed] + ([layout.to_runtime(packed, cb.numel(), g, ng)] if layout.supports(cb.numel(), g) else [])
    rot_ref = codec.rotated_weight(packed, norms, cb, g)
    w_ref = codec.dequantize_weight(packed, norms, k, g)
    first = None
    for pk in layouts:
        for block_rows, programs in ((16, 2), (64, 0)):
            rot = L.dequantize_lut(pk, norms, _kcb(pk, cb), g, torch.float32, block_rows=block_rows, programs=programs)
            w = L.dequantize_lut(pk, norms, _kcb(pk, cb), g, torch.float32, s1, s2, k, block_rows=block_rows,
                                 programs=programs)
            assert rot.shape == rot_ref.shape and w.shape == w_ref.shape
            assert 1e-5 < _rel(rot, rot_ref) < 4e-3 and 1e-5 < _rel(w, w_ref) < 4e-3, (pk.dtype, block_rows)
            if first is None:
                first = (rot, w)
            # (the weight itself comes out of a dot, which the interpreter runs as numpy's BLAS: its summation order
            # follows the operand shapes on some CPUs, so other block sizes agree to float32 rounding there)
            same_w = torch.equal if not _INTERPRETED else (lambda a, b: _rel(a, b) < 1e-6)
            assert torch.equal(rot, first[0]) and same_w(w, first[1]), (pk.dtype, block_rows)
        # selected matrices of a stack (experts): the 21 rows as three matrices of 7, the third and the first
        sel = torch.tensor([2, 0], dtype=torch.int32)
        rows = torch.cat([torch.arange(14, 21), torch.arange(0, 7)])
        assert torch.equal(L.dequantize_lut(pk, norms, _kcb(pk, cb), g, torch.float32, select=sel, select_rows=7),
                           first[0][rows])
        assert same_w(L.dequantize_lut(pk, norms, _kcb(pk, cb), g, torch.float32, s1, s2, k, select=sel,
                                       select_rows=7),
                      first[1][rows])
    with pytest.raises(ValueError, match="4-, 8- and 16-entry"):
        t_packed, t_norms, t_cb, *_ = _weight(4, 64, fmt.TERNARY, 64, seed=1)
        L.dequantize_lut(t_packed, t_norms, t_cb, 64, torch.float32)


def test_gemm_min_m_from_environment(monkeypatch):
    """`TURBOQUANT_GEMM_MIN_M` sets the smallest M of the packed-weight GEMM; 0 turns it off; unset leaves the tuned
    range; anything else is refused with the variable's name."""
    from turboquant_hf import settings

    monkeypatch.delenv("TURBOQUANT_GEMM_MIN_M", raising=False)
    assert settings.gemm_min_m() is None
    for raw, want in (("0", 1 << 62), ("17", 17), ("2", 2), ("", None)):
        monkeypatch.setenv("TURBOQUANT_GEMM_MIN_M", raw)
        assert settings.gemm_min_m() == want
    for bad in ("1", "-3", "many"):
        monkeypatch.setenv("TURBOQUANT_GEMM_MIN_M", bad)
        with pytest.raises(ValueError, match="TURBOQUANT_GEMM_MIN_M"):
            settings.gemm_min_m()


def test_gemm_dispatch_by_default_and_from_environment(L, M, monkeypatch):
    """Unset, `TURBOQUANT_GEMM_MIN_M` leaves the tuned range: dense 16-bit layers of every tier (runtime layout; 2-
    and 3-bit published bytes) at G = 128 from 33 to 256 rows, not G = 64, float32 or 4-bit published bytes; a MoE
    layer's grouped products from 65 routed pairs (past the pair path) up to 32 pairs an expert. N opens every M
    and number of pairs from N and G = 64; 0 turns the GEMM off."""
    path = os.path.join(os.path.dirname(T.__file__), "tuning.py")
    keys = ("GEMM_MIN_M", "GEMM_MAX_M", "GEMM_LEVELS", "GEMM_GROUP_MULTIPLE", "ROUTED_GEMM_MIN_PAIRS",
            "ROUTED_GEMM_MAX_ROWS")
    i32, u8 = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.uint8)
    bf16 = torch.bfloat16

    def gemm(m, nl, g, packed=i32, dtype=bf16):
        return L.path(m, nl, g, dtype, packed) == "gemm"

    def routed(pairs, e, nl, g=128, packed=i32):
        cb = torch.zeros(nl)
        return M._routed_on_gemm(pairs, e, g, packed, cb, packed, cb)

    for raw in (None, "17", "0"):
        if raw is None:
            monkeypatch.delenv("TURBOQUANT_GEMM_MIN_M", raising=False)
        else:
            monkeypatch.setenv("TURBOQUANT_GEMM_MIN_M", raw)
        spec = importlib.util.spec_from_file_location("turboquant_hf.kernels._tuning_fresh", path)
        fresh = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(fresh)
        for key in keys:
            monkeypatch.setattr(T, key, getattr(fresh, key))
        if raw is None:
            assert [m for m in (32, 33, 64, 256, 257, 2048) if gemm(m, 8, 128)] == [33, 64, 256]
            assert all(gemm(64, nl, 128) for nl in (4, 8, 16)) and gemm(64, 8, 256) and gemm(64, 4, 128, u8)
            assert not (gemm(64, 8, 64) or gemm(64, 16, 128, u8) or gemm(64, 8, 128, dtype=torch.float32))
            assert [p for p in (64, 65, 8192, 8193) if routed(p, 256, 8)] == [65, 8192]
            assert routed(96, 8, 4) and not routed(257, 8, 4) and not routed(96, 8, 8, g=64)
            assert not routed(96, 8, 16, packed=u8)
        elif raw == "17":
            assert [m for m in (16, 17, 2048) if gemm(m, 8, 64)] == [17, 2048]
            assert routed(17, 8, 8, g=64) and routed(1 << 20, 8, 8) and not routed(16, 8, 8)
        else:
            assert not any(gemm(m, 8, 128) for m in (33, 64, 256, 2048)) and not routed(96, 256, 8)


def _lane_order_by_hand(x_rot: torch.Tensor, unit: int, block: int) -> torch.Tensor:
    """The packed-weight GEMM's lane order built with torch: within each block of `block` columns, element j of unit
    ub (R = block / (4 unit) units a lane; lane t = ub // R with lanes 1 and 2 swapped; r = ub % R) at
    8 (r unit / 2 + j // 2) + 2 t + j % 2."""
    m, k = x_rot.shape
    r_units = block // (4 * unit)
    out = torch.empty_like(x_rot)
    for c in range(k):
        kin, j = c % block, c % unit
        ub = kin // unit
        q = ub // r_units
        t = (q & 1) * 2 + (q >> 1)
        dst = (c // block) * block + 8 * ((ub % r_units) * (unit // 2) + j // 2) + 2 * t + j % 2
        out[:, dst] = x_rot[:, c]
    return out


@pytest.mark.parametrize("unit,block,g", [(32, 128, 128), (16, 128, 256), (8, 64, 64), (8, 128, 128)])
def test_rotate_lane_order(L, unit, block, g):
    """`rotate(..., lane_unit=...)` writes the rotated activations in the GEMM's lane order (a permutation built
    here by hand from its definition) with the butterfly kernel (M = 3) and the tensor-core one (M = 21), the
    values bit for bit those of the natural order; orders that exclude each other, or blocks the group does not
    hold, are refused."""
    k = 2 * g + 40  # (zero-padded to whole groups)
    s1, s2 = fmt.signs(g)
    gen = torch.Generator().manual_seed(unit + g)
    for m in (3, 21):
        x = torch.randn(m, k, generator=gen)
        nat = L.rotate(x, s1, s2, g, torch.float32)
        lane = L.rotate(x, s1, s2, g, torch.float32, lane_unit=unit, lane_block=block)
        assert not torch.equal(lane, nat)
        assert torch.equal(lane, _lane_order_by_hand(nat, unit, block)), m
    with pytest.raises(ValueError, match="exclude each other"):
        L.rotate(x, s1, s2, g, torch.float32, lane_unit=unit, mma_levels=16)
    with pytest.raises(ValueError, match="lane order"):
        L.rotate(x, s1, s2, g, torch.float32, lane_unit=unit, lane_block=2 * g)


@pytest.mark.parametrize("bits,g", [(3, 128), (3, 64), (3, 256), (2, 128), (2, 64), (4, 128), (4, 64),
                                    (fmt.TERNARY, 128)])
def test_gemm_matches_reference(L, bits, g, monkeypatch):
    """The packed-weight GEMM (`gemm.gemm`) against the float32 reference on the rotated activations: the runtime
    layout (ternary: 2-bit codes) and, for 2 and 3 bits, the published bytes; the weight on the left (with and
    without the lane order) and on the right; split-K over 2 and 4 ranges (every per-tile counter back at zero
    afterwards); weight rows not a multiple of BN, activation rows not a multiple of BM, groups of 64 to 256; with
    the next block's packed words loaded ahead (`tuning.GEMM_PREFETCH`), the same values."""
    gm = L.gemm
    n, k = 40, max(2 * g, 256)
    packed, norms, cb, s1, s2 = _weight(n, k, bits, g, seed=int(10 * float(bits)) + g)
    nl, ng = cb.numel(), norms.shape[1]
    if bits == fmt.TERNARY:
        layouts = [(layout.to_runtime(packed, 3, g, ng), layout.pairs_codebook(cb))]
    else:
        layouts = [(layout.to_runtime(packed, nl, g, ng), layout.runtime_codebook(cb))]
        layouts += [(packed, cb)] if nl != 16 else []
    knl = layouts[0][1].numel()
    bk = min(g, 128)
    nblk = ng * g // bk
    lanes_ok = bk % (4 * gm.lane_unit(knl)) == 0
    gen = torch.Generator().manual_seed(g)
    for pk, kcb in layouts:
        runtime = layout.is_runtime(pk)
        configs = [(16, 32, bk, 2 if nblk % 2 == 0 else 1, True, False, 1, 2, 1, 13),
                   (32, 16, bk, 1, False, False, 2, 1, 1, 40)]
        if runtime and lanes_ok:
            configs.append((16, 32, bk, 4 if nblk % 4 == 0 else 1, True, True, 1, 2, 1, 21))
        for *cfg, m in configs:
            x = torch.randn(m, k, generator=gen)
            nat = L.rotate(x, s1, s2, g, torch.float32)
            ref = ops.codebook_matmul(nat, packed, norms, cb, g)
            xr = L.rotate(x, s1, s2, g, torch.float32, lane_unit=gm.lane_unit(knl), lane_block=bk) if cfg[5] else nat
            for lf in (True, False) if cfg[5] else (None,):  # (the lane tile's axis order for either Triton)
                y = gm.gemm(xr, pk, norms, kcb, g, torch.float32, config=tuple(cfg), runtime_layout=runtime,
                            use_asm=False, lanes_first=lf)
                assert y.shape == (m, n) and _rel(y, ref) < 6e-3, (runtime, cfg, lf, _rel(y, ref))
            if runtime and m == configs[-1][-1]:  # the next block's words and norms loaded ahead: the same products
                monkeypatch.setattr(gm.tuning, "GEMM_PREFETCH", True)
                assert torch.equal(gm.gemm(xr, pk, norms, kcb, g, torch.float32, config=tuple(cfg),
                                           use_asm=False, lanes_first=lf), y)
                monkeypatch.setattr(gm.tuning, "GEMM_PREFETCH", False)
            if cfg[3] > 1:
                assert not gm._counters(y.device).any()
    with pytest.raises(ValueError, match="split"):
        gm.gemm(nat, layouts[0][0], norms, layouts[0][1], g, torch.float32, config=(16, 32, bk, 3, True, False, 1, 2, 1),
                use_asm=False)


@pytest.mark.parametrize("bits,g", [(3, 128), (2, 64)])
def test_routed_gemm_matches_reference(L, bits, g):
    """The routed packed-weight GEMM (`gemm.routed_gemm`, the MoE prefill's grouped products on the tensor cores)
    against float64 products of each expert's rotated-basis weight: rows gathered from the tokens or read in
    order, groups of uneven sizes with empty experts, weight rows not a multiple of the tile, the weight on the
    left with and without the lane order (both axis orders) and on the right; fewer rows than experts. (Its tiles
    are `gemm.gemm`'s, whose test covers every tier.)"""
    gm = L.gemm
    e, n, k = 4, 40, 256
    packed, norms, cb, _, _ = _weight(e * n, k, bits, g, seed=90 + g + int(bits * 10))
    ng = norms.shape[1]
    rot = codec.rotated_weight(packed, norms, cb, g).double().view(e, n, ng * g)
    nl = cb.numel()
    pk = layout.to_runtime(packed, 3 if nl == 3 else nl, g, ng)
    kcb = layout.pairs_codebook(cb) if nl == 3 else layout.runtime_codebook(cb)
    bk = min(g, 128)
    unit = gm.lane_unit(kcb.numel())
    gen = torch.Generator().manual_seed(g + nl)
    x = torch.randn(9, ng * g, generator=gen)
    configs = [((16, 32, bk, True, False, 2, 1), None), ((32, 16, bk, False, False, 1, 1), None)]
    if bk % (4 * unit) == 0:
        configs += [((16, 32, bk, True, True, 2, 1), True), ((16, 32, bk, True, True, 2, 1), False)]
    for sizes in ([7, 0, 19, 5], [0, 2, 0, 1]):
        p = sum(sizes)
        offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
        xrow = torch.randint(0, 9, (p,), generator=gen, dtype=torch.int32)
        want = torch.cat([x[xrow[s:s + c].long()].double() @ rot[ex].T
                          for ex, (s, c) in enumerate(zip((offs - torch.tensor(sizes)).tolist(), sizes))])
        for i, (cfg, lanes_first) in enumerate(configs if sizes[0] else configs[:1]):
            xs = _lane_order_by_hand(x, unit, bk) if cfg[4] else x
            y = gm.routed_gemm(xs, offs, pk, norms, kcb, g, e, torch.float32, xrow=xrow, config=cfg, use_asm=False,
                               lanes_first=lanes_first)
            assert y.shape == (p, n) and 1e-6 < _rel(y, want) < 4e-3, (sizes, cfg, lanes_first, _rel(y, want))
            if i == 0:  # rows read in order
                y_direct = gm.routed_gemm(xs[xrow.long()], offs, pk, norms, kcb, g, e, torch.float32, config=cfg,
                                          use_asm=False, lanes_first=lanes_first)
                assert torch.equal(y, y_direct)
    with pytest.raises(ValueError, match="width"):
        gm.routed_gemm(x[:, :g], offs, pk, norms, kcb, g, e, torch.float32, use_asm=False)


def test_gemm_dispatch_table(L, monkeypatch):
    """`gemm_config` (the GEMM's one dispatch table, from the weight shape and M's bucket): LANES only where the
    table, the orientation, the warps and the unit allow it; split-K until the tiles fill the multiprocessors
    twice, by powers of two that divide the row's blocks, at least 4 blocks each, at most the bucket's."""
    gm = L.gemm
    monkeypatch.setattr(L.tuning, "GEMM_CONFIGS", ((64, (64, 64, True, True, 1, 4, 3, 8)),
                                                   (256, (128, 64, True, True, 4, 4, 3, 2)),
                                                   (1 << 62, (128, 128, False, True, 8, 8, 3, 8))))
    monkeypatch.setattr(L.tuning, "GEMM_SMS", 132)
    bm, bn, bk, split, swap, lanes, group, warps, stages = gm.gemm_config(64, 4096, 32, 8, 128)
    assert (bm, bn, bk, swap, lanes, warps) == (64, 64, 128, True, True, 4) and split == 8  # 64 tiles: 512 programs
    assert gm.gemm_config(64, 4096, 32, 8, 128, lanes=False)[5] is False
    assert gm.gemm_config(64, 4096, 1, 8, 64)[5] is False  # 3-bit units: four lanes need blocks of 128
    assert gm.gemm_config(64, 4096, 2, 4, 64)[5] is True and gm.gemm_config(64, 4096, 2, 4, 64)[3] == 1
    assert gm.gemm_config(2048, 4096, 32, 8, 128)[3:6] == (1, False, False)  # 512 tiles; the weight on the right
    assert gm.gemm_config(257, 1024, 112, 8, 128)[3] == 8  # 24 tiles: at most 8 splits (14 blocks each)
    assert gm.gemm_config(65, 1024, 20, 8, 128)[3] == 2  # the bucket's largest split
    assert gm.gemm_config(257, 1024, 20, 8, 128)[3] == 4  # 20 blocks: 8 does not divide them
    monkeypatch.setattr(L.tuning, "GEMM_MAX_SPLIT", 1)
    assert gm.gemm_config(257, 1024, 112, 8, 128)[3] == 1


# ---------------------------------------------------------------------------
# CUDA (real kernels, fresh process)
# ---------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_op_matches_reference():
    """Real kernels on CUDA: one fresh process per bit width, in parallel (compiling dominates)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TURBOQUANT_DISABLE_TRITON")}
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--cuda-check", str(b)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for b in BITS]
    failed = []
    for b, proc in zip(BITS, procs):
        out, _ = proc.communicate(timeout=1800)
        print(out[-20000:])
        if proc.returncode != 0:
            failed.append((b, out[-3000:]))
    assert not failed, failed


def _poison_allocator(nbytes: int) -> None:
    """Leave NaN-filled blocks in the caching allocator so that an output nobody writes shows up as NaN."""
    blocks = [torch.full((nbytes // 4,), float("nan"), device="cuda") for _ in range(4)]
    del blocks


def _cuda_check(bits) -> int:
    from turboquant_hf import kernels

    assert kernels.registered(), "Triton kernels are not registered for CUDA"
    failures = 0
    dev = "cuda"
    torch.manual_seed(0)
    tol = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-4}
    # (rows, in_features): in not a multiple of G, rows not a multiple of any block
    for g in fmt.GROUP_SIZES:
        # (and, G = 128, long rows: 8400 inputs take the pair GEMV's 4-row programs and the early launch)
        # (and 4096 / 8200 rows: the 32 / 64 weight rows a program above M = 16, 8200x256 with half the warps)
        shapes = [(200, 330), (1000, 1056)] + ([(4096, 512), (2102, 8400), (8200, 256)] if g == 128 else [])
        for n, k in shapes:
            packed, norms, cb, s1, s2 = _weight(n, k, bits, g, seed=n + k + g)
            pk_d, nr_d, cb_d, s1_d, s2_d = (t.to(dev) for t in (packed, norms, cb, s1, s2))
            nl, ng = cb.numel(), norms.shape[1]
            # the published bytes at every M; the runtime layout (ternary, 2-, 3-, 4-bit, read with
            # `layout.runtime_codebook`) on each path: LUT, mma, prefill
            layouts = [("published", pk_d, cb_d, (1, 2, 3, 8, 16, 17, 40, 64, 65, 100))]
            if layout.supports(nl, g):
                layouts.append(("runtime", layout.to_runtime(pk_d, nl, g, ng),
                                layout.runtime_codebook(cb_d), (1, 3, 16, 17, 33, 64, 65)))
            for name, pk, cb_k, ms in layouts:
                for m in ms:
                    x = torch.randn(m, k)
                    dtypes = (torch.bfloat16, torch.float16, torch.float32) if g == 128 else (torch.bfloat16,)
                    for dt in dtypes:
                        if dt == torch.float32 and m not in (1, 2, 100):
                            continue
                        xd = x.to(dt)
                        refd = ops.turboquant_linear(xd.float(), packed, norms, cb, s1, s2, g, k)
                        _poison_allocator(4 * m * n * 4)
                        y = torch.ops.turboquant.linear(xd.to(dev), pk, nr_d, cb_k, s1_d, s2_d, g, k)
                        err = _rel(y, refd) if torch.isfinite(y).all() else float("nan")
                        ok = y.dtype == dt and y.shape == (m, n) and err < tol[dt]
                        failures += not ok
                        if not ok or m in (1, 16, 64):
                            print(f"{'ok  ' if ok else 'FAIL'} bits={bits} G={g} {n}x{k} {name} M={m} {str(dt)[6:]} "
                                  f"rel_err={err:.2e}")
    # the pair GEMV (M = 1) with activations far outside float16's range and far below it: the power-of-two group
    # scales keep its float16 chains finite and exact to the same relative error
    if fmt.levels_for_bits(bits) in (4, 8, 16):
        packed, norms, cb, s1, s2 = _weight(512, 1024, bits, 128, seed=11)
        for scale in (3e5, 1e-6):
            x = (torch.randn(1, 1024) * scale).to(torch.bfloat16)
            refd = ops.turboquant_linear(x.double(), packed, norms.double(), cb.double(), s1.double(), s2.double(),
                                         128, 1024)
            y = torch.ops.turboquant.linear(x.to(dev), packed.to(dev), norms.to(dev), cb.to(dev), s1.to(dev),
                                            s2.to(dev), 128, 1024)
            err = _rel(y, refd) if torch.isfinite(y).all() else float("nan")
            ok = err < 1e-2
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} bits={bits} M=1 activations x{scale:g} rel_err={err:.2e}")
    # launch options that the configuration sweeps try: the prefetching pair GEMV (and unit steps below one per
    # lane), several blocks a warp in the tensor-core GEMV; compiled for the GPU, they must agree with the
    # reference as the defaults do
    nl = fmt.levels_for_bits(bits)
    if nl in (4, 8, 16):
        from turboquant_hf.kernels import linear as KL

        n, k, g = 1000, 2048, 128
        packed, norms, cb, s1, s2 = _weight(n, k, bits, g, seed=12)
        pk = layout.to_runtime(packed, nl, g, k // g) if layout.supports(nl, g) else packed
        pk, nr_d, cb_d, s1_d, s2_d = (t.to(dev) for t in (pk, norms, _kcb(pk, cb), s1, s2))
        for m in (1, 2, 4, 5, 16):
            x = torch.randn(m, k).to(torch.bfloat16)
            refd = ops.turboquant_linear(x.float(), packed, norms, cb, s1, s2, g, k)
            if m <= 4:
                x2, xs = KL.rotate(x.to(dev), s1_d, s2_d, g, torch.bfloat16, unit=KL.lut_unit(nl))
                runs = [(cfg, KL.gemv_pairs(x2, xs, pk, nr_d, cb_d, g, torch.bfloat16, config=cfg))
                        for cfg in ((8, 4, 0, 1), (8, 2, 128, 1), (8, 4, 0, 1, 64), (16, 4, 0, 0, 64),
                                    (4, 2, 128), (4, 4, 96, 1))]
            else:
                x_rot = KL.rotate(x.to(dev), s1_d, s2_d, g, torch.bfloat16)
                runs = [(cfg, KL.gemv_dot(x_rot, pk, nr_d, cb_d, g, torch.bfloat16, config=cfg))
                        for cfg in ((16, 1, 1, 1, 0, 2), (16, 1, 1, 1, 0, 4), (16, 2, 1, 2, 0, 2), (32, 1, 1, 1, 0, 2))]
            for cfg, y in runs:
                err = _rel(y, refd) if torch.isfinite(y).all() else float("nan")
                ok = y.shape == (m, n) and err < 1e-2
                failures += not ok
                print(f"{'ok  ' if ok else 'FAIL'} bits={bits} M={m} config {cfg} rel_err={err:.2e}")
    # the packed-weight GEMM compiled for the GPU: every orientation, the lane order, split-K (its counters back
    # at zero, and a CUDA graph replayed with new inputs), bf16 and fp16; the whole op with it in the dispatch
    if nl in (3, 4, 8, 16):
        from turboquant_hf.kernels import gemm as KG
        from turboquant_hf.kernels import linear as KL
        from turboquant_hf.kernels import tuning as KT

        n, k, g = 1000, 2048, 128
        packed, norms, cb, s1, s2 = _weight(n, k, bits, g, seed=13)
        knl = 4 if nl == 3 else nl
        pk = layout.to_runtime(packed, nl, g, k // g)
        kcb = layout.pairs_codebook(cb) if nl == 3 else layout.runtime_codebook(cb)
        pk, nr_d, cb_d, s1_d, s2_d = (t.to(dev) for t in (pk, norms, kcb, s1, s2))
        configs = [None, (16, 64, 128, 1, True, True, 1, 4, 3), (64, 128, 128, 4, True, True, 1, 4, 3),
                   (64, 128, 128, 2, True, False, 1, 4, 3), (128, 128, 128, 1, True, True, 4, 8, 3),
                   (128, 128, 128, 1, False, False, 4, 8, 3), (256, 128, 128, 1, True, True, 8, 8, 2)]
        old_pf = KT.GEMM_PREFETCH
        for m in (17, 64, 300):
            x = torch.randn(m, k)
            refd = ops.turboquant_linear(x, packed, norms, cb, s1, s2, g, k)
            for dt, cfg, pf in itertools.product((torch.bfloat16, torch.float16), configs, (True, False)):
                KT.GEMM_PREFETCH = pf
                cfg = cfg or KG.gemm_config(m, n, k // g, knl, g)
                xr = KL.rotate(x.to(dev, dt), s1_d, s2_d, g, dt, lane_unit=KG.lane_unit(knl) if cfg[5] else 0)
                y = KG.gemm(xr, pk, nr_d, cb_d, g, dt, config=cfg)
                err = _rel(y, refd) if torch.isfinite(y).all() else float("nan")
                ok = y.shape == (m, n) and err < tol[dt] and not KG._counters(y.device).any()
                failures += not ok
                print(f"{'ok  ' if ok else 'FAIL'} gemm bits={bits} M={m} {str(dt)[6:]} {cfg} prefetch={pf} "
                      f"rel_err={err:.2e}")
            KT.GEMM_PREFETCH = old_pf
        old = {key: getattr(KT, key) for key in ("GEMM_MIN_M", *KT.GEMM_OPEN)}
        for key, value in dict(KT.GEMM_OPEN, GEMM_MIN_M=17).items():
            setattr(KT, key, value)
        try:
            for m in (17, 300):
                x = torch.randn(m, k).to(torch.bfloat16)
                refd = ops.turboquant_linear(x.float(), packed, norms, cb, s1, s2, g, k)
                y = torch.ops.turboquant.linear(x.to(dev), pk, nr_d, cb_d, s1_d, s2_d, g, k)
                err = _rel(y, refd)
                ok = err < 1e-2
                failures += not ok
                print(f"{'ok  ' if ok else 'FAIL'} op with the gemm bits={bits} M={m} rel_err={err:.2e}")
            static_x = torch.randn(40, k, device=dev, dtype=torch.bfloat16)
            assert KG.gemm_config(40, n, k // g, knl, g)[3] > 1  # (split-K inside the graph)
            torch.ops.turboquant.linear(static_x, pk, nr_d, cb_d, s1_d, s2_d, g, k)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_y = torch.ops.turboquant.linear(static_x, pk, nr_d, cb_d, s1_d, s2_d, g, k)
            for _ in range(2):
                xn = torch.randn(40, k, dtype=torch.bfloat16)
                static_x.copy_(xn.to(dev))
                graph.replay()
                torch.cuda.synchronize()
                err = _rel(static_y, ops.turboquant_linear(xn.float(), packed, norms, cb, s1, s2, g, k))
                ok = err < 1e-2
                failures += not ok
                print(f"{'ok  ' if ok else 'FAIL'} gemm split-K CUDA graph bits={bits} rel_err={err:.2e}")
        finally:
            for key, value in old.items():
                setattr(KT, key, value)
    # the MoE op on CUDA (pair path at decode, the fused routed products for many tokens: blocks of 32 rows at
    # T = 40, of 128 at T = 300) against the CPU reference, and both inside a CUDA graph
    e, h, inter, g = 16, 512, 256, 128
    gu_p, gu_n = codec.quantize_weight(torch.randn(e, 2 * inter, h), bits, g)
    d_p, d_n = codec.quantize_weight(torch.randn(e, h, inter), bits, g)
    if bits == fmt.TERNARY:
        gu_n, d_n = gu_n.half(), d_n.half()  # as TurboQuantWeight stores the ternary tier
    cb = fmt.codebook(fmt.levels_for_bits(bits), g)
    s1, s2 = fmt.signs(g)
    dev_w = [t.to(dev) for t in (gu_p, gu_n, cb, d_p, d_n, cb, s1, s2)]
    nl = cb.numel()
    weights = [("published", dev_w)]
    if layout.supports(nl, g):  # the runtime layout, as TurboQuantExperts holds it on a GPU
        cb_rt = layout.runtime_codebook(dev_w[2])
        weights.append(("runtime", [layout.to_runtime(dev_w[0], nl, g, h // g), dev_w[1], cb_rt,
                                    layout.to_runtime(dev_w[3], nl, g, inter // g), dev_w[4], cb_rt, *dev_w[6:]]))
    for (name, wl), t in [(w, t) for w in weights for t in (1, 3, 40, 300)]:
        hidden = torch.randn(t, h).to(torch.bfloat16)
        idx = torch.randint(0, e, (t, 4))
        idx[0, 1] = e  # routed to no expert
        wts = torch.rand(t, 4)
        ref = ops.turboquant_moe_experts(hidden.float(), idx, wts, gu_p, gu_n, cb, d_p, d_n, cb, s1, s2, g, e, "silu")
        y = torch.ops.turboquant.moe_experts(hidden.to(dev), idx.to(dev), wts.to(dev), *wl, g, e, "silu")
        err = _rel(y, ref)
        ok = err < 1.5e-2 and y.dtype == torch.bfloat16
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} moe_experts bits={bits} {name} T={t} rel_err={err:.2e}")
    for t in (1, 40):  # the decode path and the fused routed products, captured and replayed with new inputs
        static_h = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
        static_i = torch.randint(0, e, (t, 4), device=dev)
        static_w = torch.rand(t, 4, device=dev)
        torch.ops.turboquant.moe_experts(static_h, static_i, static_w, *weights[-1][1], g, e, "silu")
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = torch.ops.turboquant.moe_experts(static_h, static_i, static_w, *weights[-1][1], g, e, "silu")
        hn, inn, wn = torch.randn(t, h).to(torch.bfloat16), torch.randint(0, e, (t, 4)), torch.rand(t, 4)
        static_h.copy_(hn.to(dev))
        static_i.copy_(inn.to(dev))
        static_w.copy_(wn.to(dev))
        graph.replay()
        torch.cuda.synchronize()
        err = _rel(static_y, ops.turboquant_moe_experts(hn.float(), inn, wn, gu_p, gu_n, cb, d_p, d_n, cb, s1, s2, g,
                                                        e, "silu"))
        ok = err < 1.5e-2
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} moe_experts CUDA graph T={t} rel_err={err:.2e}")
    if bits != 3:
        print(f"cuda check bits={bits}: {failures} failure(s)")
        return failures
    # CUDA graph capture of the decode paths (M=1 FMA, M=16 tensor cores)
    packed, norms, cb, s1, s2 = _weight(1024, 2048, 3, 128, seed=5)
    args = [t.to(dev) for t in (packed, norms, cb, s1, s2)]
    for m in (1, 16):
        static_x = torch.randn(m, 2048, device=dev, dtype=torch.bfloat16)
        torch.ops.turboquant.linear(static_x, *args, 128, 2048)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = torch.ops.turboquant.linear(static_x, *args, 128, 2048)
        for _ in range(2):
            xn = torch.randn(m, 2048, dtype=torch.bfloat16)
            static_x.copy_(xn.to(dev))
            graph.replay()
            torch.cuda.synchronize()
            err = _rel(static_y, ops.turboquant_linear(xn.float(), packed, norms, cb, s1, s2, 128, 2048))
            ok = err < 1e-2
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} CUDA graph M={m} rel_err={err:.2e}")
    # the module on CUDA, 3-D input, bias
    from turboquant_hf.modeling.modules import TurboQuantLinear, quantize_linear_

    lin = TurboQuantLinear(300, 257, bias=True, bits=3, group_size=128, dtype=torch.bfloat16)
    w = torch.randn(257, 300)
    quantize_linear_(lin, w)
    with torch.no_grad():
        lin.bias.normal_()
    x = torch.randn(2, 3, 300, dtype=torch.bfloat16)
    ref = lin(x)  # CPU reference
    lin = lin.to(dev)
    y = lin(x.to(dev))
    err = _rel(y, ref)
    ok = err < 1e-2 and y.shape == (2, 3, 257) and y.dtype == torch.bfloat16
    failures += not ok
    print(f"{'ok  ' if ok else 'FAIL'} TurboQuantLinear 3-D input rel_err={err:.2e}")
    print(f"cuda check: {failures} failure(s)")
    return failures


if __name__ == "__main__":
    if "--cuda-check" in sys.argv:
        b = sys.argv[sys.argv.index("--cuda-check") + 1]
        sys.exit(1 if _cuda_check(fmt.check_bits(float(b) if "." in b else int(b))) else 0)
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
