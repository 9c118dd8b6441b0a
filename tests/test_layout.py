"""The runtime layout of packed ternary, 2-, 3- and 4-bit indices (`format.runtime_layout`) and how modules keep
it out of checkpoints: exact round trips, the documented bit positions, and a module whose packed tensor is
in the runtime layout (as on a GPU) still computing, saving, reloading and dequantizing as the published one."""

import pytest
import torch

from turboquant_hf import TurboQuantLinear
from turboquant_hf.format import codec
from turboquant_hf.format import constants as fmt
from turboquant_hf.format import runtime_layout as layout
from turboquant_hf.modeling import ops
from turboquant_hf.modeling.modules import quantize_linear_


@pytest.fixture(autouse=True)
def _reference_products(monkeypatch):
    """The runtime layout's products are compared bit for bit with the published bytes' through the reference,
    which reads both (the compiled CPU kernel reads the published bytes only, and sums in its own order:
    tests/test_cpu_kernel.py holds it to the reference)."""
    monkeypatch.setenv("TURBOQUANT_CPU_KERNEL", "0")


@pytest.mark.parametrize("n_levels,g", [(3, 64), (3, 128), (4, 64), (4, 128), (8, 64), (8, 128), (8, 256), (16, 64),
                                       (16, 128)])
def test_round_trip_and_bit_positions(n_levels, g):
    rows, ng = 7, 3
    gen = torch.Generator().manual_seed(n_levels * g)
    idx = torch.randint(0, n_levels, (rows * ng, g), generator=gen)
    packed = codec.pack_indices(idx, n_levels)
    rt = layout.to_runtime(packed, n_levels, g, ng)
    words_per_group = g // 16 if n_levels == 3 else packed.shape[1] // 4  # (ternary: 2 bits a digit)
    assert rt.dtype == torch.int32 and rt.shape == (rows * ng, words_per_group)
    assert torch.equal(layout.to_published(rt, n_levels, g, ng), packed)
    assert layout.published(packed, n_levels, g, ng) is packed

    # every index of every row, read back from the documented positions
    per = layout.UNITS[n_levels]
    nut = ng * g // per
    words = rt.view(rows, -1).long() & 0xFFFFFFFF
    want = idx.view(rows, nut, per)
    got = torch.empty_like(want)
    if n_levels == 16:  # index i as its sign-magnitude code in nibble j: i - 8 (upper half) or 8 + (7 - i)
        want = torch.where(want >= 8, want - 8, 15 - want)
    for j in range(per):
        if n_levels == 16:
            got[:, :, j] = (words >> (4 * j)) & 15
        elif n_levels in (3, 4):
            got[:, :, j] = (words >> (4 * j if j < 8 else 4 * (j - 8) + 2)) & 3
        elif j < 24:
            p, n = divmod(j, 8)
            got[:, :, j] = (words[:, p * nut:(p + 1) * nut] >> (4 * n)) & 7
        else:
            n = j - 24
            got[:, :, j] = sum(((words[:, p * nut:(p + 1) * nut] >> (4 * n + 3)) & 1) << p for p in range(3))
    assert torch.equal(got, want)


def test_layouts_that_do_not_exist_are_refused():
    assert not layout.supports(8, 16) and not layout.supports(3, 8) and not layout.supports(16, 4)
    packed = codec.pack_indices(torch.zeros(2, 16, dtype=torch.long), 8)
    with pytest.raises(ValueError, match="no runtime layout"):
        layout.to_runtime(packed, 8, 16, 1)
    with pytest.raises(TypeError, match="uint8"):
        layout.to_runtime(torch.zeros(2, 12, dtype=torch.int32), 8, 128, 1)
    # a 2-bit code 3 is no base-3 digit: such words are not a ternary weight's, and are never saved as one
    bad = torch.full((2, 8), -1, dtype=torch.int32)  # every code 3
    with pytest.raises(ValueError, match="code 3"):
        layout.to_published(bad, 3, 128, 1)
    with pytest.raises(ValueError, match="ternary codebook"):
        layout.pairs_codebook(fmt.codebook(4, 128))


@pytest.mark.parametrize("g", [64, 128, 256])
def test_four_bit_runtime_codebook_is_sign_magnitude(g):
    """The 4-bit runtime codes are read with the format codebook's upper half, then its negatives: exact,
    because the format's codebooks are exactly symmetric (the kernels rely on entry 8 + j = -entry j)."""
    cb = fmt.codebook(16, g)
    rc = layout.runtime_codebook(cb)
    assert torch.equal(cb, -cb.flip(0)) and torch.equal(rc[8:], -rc[:8]) and bool((rc[:8] > 0).all())
    idx = torch.randint(0, 16, (6, g), generator=torch.Generator().manual_seed(g))
    packed = codec.pack_indices(idx, 16)
    rt = layout.to_runtime(packed, 16, g, 2)
    norms = torch.rand(3, 2) + 0.5
    assert torch.equal(codec.rotated_weight(layout.codes(rt, 16, g, 2), norms, rc, g),
                       codec.rotated_weight(packed, norms, cb, g))
    assert layout.codes(packed, 16, g, 2) is packed


@pytest.mark.parametrize("bits", [fmt.TERNARY, 2, 3, 4])
def test_module_in_runtime_layout_computes_saves_and_reloads_the_published_bytes(bits):
    torch.manual_seed(bits)
    lin = TurboQuantLinear(300, 40, bias=False, bits=bits, group_size=64)
    quantize_linear_(lin, torch.randn(40, 300))
    published = lin.weight.tq_packed.clone()
    x = torch.randn(3, 300)
    ref = lin(x)
    w_ref = lin.weight.dequantize()

    w = lin.weight
    w.tq_packed = layout.to_runtime(published, w.n_levels, w.group_size, w.n_groups)  # as on a GPU
    assert w.runtime_layout and w.packed_shape() == tuple(published.shape)
    assert torch.equal(lin(x), ref)  # the reference op reads the runtime layout too
    assert torch.equal(w.dequantize(), w_ref)
    sd = lin.state_dict()
    assert sd["weight.tq_packed"].dtype == torch.uint8 and torch.equal(sd["weight.tq_packed"], published)

    # loading published bytes into a module in the runtime layout
    other = TurboQuantLinear(300, 40, bias=False, bits=bits, group_size=64)
    other.weight.tq_packed = layout.to_runtime(torch.zeros_like(published), w.n_levels, 64, w.n_groups)
    other.load_state_dict(sd)
    assert torch.equal(other(x), ref)
    assert torch.equal(other.weight.published_packed(), published)

    # leaving the GPU (any move to a non-CUDA device) restores the published bytes in place
    lin.to(torch.float64)
    assert not w.runtime_layout and torch.equal(w.tq_packed, published)


def test_which_tiers_take_the_runtime_layout(monkeypatch):
    lin = TurboQuantLinear(256, 16, bias=False, bits=4, group_size=128)
    quantize_linear_(lin, torch.randn(16, 256))
    assert lin.weight.wants_runtime_layout() and layout.wanted(16, 128)
    assert not lin.weight.use_runtime_layout_()  # (on CPU nothing changes)
    assert lin.weight.tq_packed.dtype == torch.uint8
    # 4-bit with a stored codebook (turboquant-mlx) stays published: the 4-bit runtime codes need the format's
    # symmetric codebook
    had = TurboQuantLinear(256, 16, bias=False, bits=4, group_size=128, rotation="hadamard")
    assert not had.weight.wants_runtime_layout()
    assert TurboQuantLinear(256, 16, bias=False, bits=3, group_size=128, rotation="hadamard").weight.wants_runtime_layout()
    # ternary weights take the 2-bit runtime layout unless the compact published bytes are asked for
    assert layout.wanted(3, 128)
    monkeypatch.setenv("TURBOQUANT_COMPACT_TERNARY", "1")
    assert not layout.wanted(3, 128) and layout.wanted(8, 128)


def test_ternary_runtime_layout_reads_as_a_two_bit_weight():
    """In the runtime layout a ternary weight is a 2-bit weight with the codebook -c, 0, +c, 0: the reference
    product and the dequantized weight are exactly those of the published base-3 bytes."""
    torch.manual_seed(5)
    w = torch.randn(33, 256)
    packed, norms = codec.quantize_weight(w, fmt.TERNARY, 128)
    cb = fmt.codebook(3, 128)
    rt = layout.to_runtime(packed, 3, 128, 2)
    pairs = layout.pairs_codebook(cb)
    assert pairs.tolist() == cb.tolist() + [0.0]
    assert torch.equal(codec.rotated_weight(layout.to_published(rt, 4, 128, 2), norms, pairs, 128),
                       codec.rotated_weight(packed, norms, cb, 128))
    x = torch.randn(3, 256)
    assert torch.equal(ops.codebook_matmul(x, rt, norms, pairs, 128), ops.codebook_matmul(x, packed, norms, cb, 128))


def test_hadamard_ternary_module_in_runtime_layout():
    """A whole-row-Hadamard (turboquant-mlx) ternary module keeps its stored 3-entry codebook and hands the
    ops the padded one while its packed tensor is in the runtime layout."""
    torch.manual_seed(6)
    lin = TurboQuantLinear(128, 24, bias=False, bits=fmt.TERNARY, group_size=64, rotation="hadamard")
    w = lin.weight
    idx = torch.randint(0, 3, (24 * 2, 64))
    cb = torch.tensor([-1.2236, 0.0, 1.2236], dtype=torch.float16)
    w.load_packed_(codec.pack_indices(idx, 3), torch.rand(24, 2, dtype=torch.float16) + 0.5, cb,
                   torch.where(torch.rand(128) < 0.5, -1.0, 1.0).half())
    x = torch.randn(2, 128)
    ref, published = lin(x), w.tq_packed.clone()
    assert w.kernel_codebook() is w.tq_codebook
    w.tq_packed = layout.to_runtime(published, 3, 64, 2)  # as on a GPU
    assert w.use_runtime_layout_() and w.kernel_codebook().tolist() == cb.tolist() + [0.0]
    assert torch.equal(lin(x), ref)
    assert torch.equal(lin.state_dict()["weight.tq_packed"], published)
    assert lin.state_dict()["weight.tq_codebook"].shape == (3,)
    w.use_published_layout_()
    assert torch.equal(w.tq_packed, published) and w.kernel_codebook() is w.tq_codebook


def test_codebook_matmul_accepts_runtime_blocks():
    """The reference product slices rows in blocks; both layouts give identical results block by block."""
    torch.manual_seed(0)
    w = torch.randn(70, 256)
    packed, norms = codec.quantize_weight(w, 3, 128)
    rt = layout.to_runtime(packed, 8, 128, 2)
    cb = fmt.codebook(8, 128)
    x = torch.randn(4, 256)
    old = ops._REFERENCE_BLOCK_ELEMENTS
    try:
        ops._REFERENCE_BLOCK_ELEMENTS = 256 * 9  # 9 rows per block: blocks do not align with anything
        assert torch.equal(ops.codebook_matmul(x, rt, norms, cb, 128), ops.codebook_matmul(x, packed, norms, cb, 128))
    finally:
        ops._REFERENCE_BLOCK_ELEMENTS = old
