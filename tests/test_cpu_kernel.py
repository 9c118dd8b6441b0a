"""The compiled CPU product (`modeling.cpu_kernel`) against the torch reference: decoded weights bit for bit,
products within float tolerance, on every tier, both builds (vector and portable C), and the op's fallback."""

import shutil

import pytest
import torch

from turboquant_hf.format import codec
from turboquant_hf.format import constants as fmt
from turboquant_hf.modeling import cpu_kernel, ops
from turboquant_hf.modeling.modules import (
    TurboQuantLinear,
    format_constants,
    quantize_linear_,
)

LEVELS = [3, 4, 8, 16]


BUILDS = {"native": (), "avx2": ("TQ_NO_AVX512",), "portable": ("TQ_PORTABLE",)}


@pytest.fixture(scope="module", params=list(BUILDS))
def lib(request):
    """The library as `library()` builds it, the same without AVX-512 instructions, and the portable C build (no
    intrinsics) of the same source."""
    if cpu_kernel._compiler() is None:
        pytest.skip("no C compiler on this machine: the op runs the reference (test_fallback_without_the_kernel)")
    path, reason = cpu_kernel.build(BUILDS[request.param])
    assert path is not None, reason  # a compiler is here: the build must work
    return cpu_kernel.load(path)


def _weight(n_levels, group_size, rows, in_features, norms_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, in_features, generator=g)
    packed, norms = codec.quantize_weight(w, fmt.bits_for_levels(n_levels), group_size)
    return packed, norms.to(norms_dtype)


@pytest.mark.parametrize("n_levels", LEVELS)
@pytest.mark.parametrize("group_size, norms_dtype", [(64, torch.float32), (128, torch.float16), (128, torch.bfloat16)])
def test_decoded_weight_is_the_reference_bit_for_bit(lib, n_levels, group_size, norms_dtype):
    packed, norms = _weight(n_levels, group_size, rows=7, in_features=3 * group_size, norms_dtype=norms_dtype)
    cb = fmt.codebook(n_levels, group_size)
    want = codec.rotated_weight(packed, norms.float(), cb, group_size)
    assert torch.equal(cpu_kernel.decode(packed, norms, cb, group_size, lib=lib), want)
    # every byte value (the bytes of a ternary weight above 242 too), any codebook
    noise = torch.randint(0, 256, packed.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    if n_levels == 3:
        noise %= 243
    cb = torch.randn(n_levels, generator=torch.Generator().manual_seed(2))
    assert torch.equal(cpu_kernel.decode(noise, norms, cb, group_size, lib=lib),
                       codec.rotated_weight(noise, norms.float(), cb, group_size))


@pytest.mark.parametrize("n_levels", LEVELS)
@pytest.mark.parametrize("group_size, in_features", [(64, 200), (128, 384), (128, 100)])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_product_matches_the_reference(lib, n_levels, group_size, in_features, m):
    """Activations rotated in the kernel (float32, bfloat16, float16; inputs padded to whole groups) or given
    rotated: within float32 rounding of the reference product."""
    rows = 37
    packed, norms = _weight(n_levels, group_size, rows, in_features)
    cb, s1, s2 = format_constants(n_levels, group_size, "cpu")
    x = torch.randn(m, in_features, generator=torch.Generator().manual_seed(3))
    x_rot = ops.rotate_activations(x, s1, s2, group_size)
    with torch.no_grad():
        want = x_rot @ codec.rotated_weight(packed, norms, cb, group_size).T
    tol = {"rtol": 1e-5, "atol": 1e-5 * want.abs().max().item()}
    got = cpu_kernel.linear(x_rot, packed, norms, cb, group_size, lib=lib)
    assert got.dtype == torch.float32 and torch.allclose(got, want, **tol)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        want_d = ops.rotate_activations(xd, s1, s2, group_size) @ codec.rotated_weight(packed, norms, cb, group_size).T
        got = cpu_kernel.linear(xd, packed, norms, cb, group_size, (s1, s2), in_features, lib=lib)
        if dtype == torch.bfloat16:  # rounded once from float32, as torch rounds
            assert got.dtype == dtype
            assert (got.float() - want_d).abs().max() <= 2**-8 * want_d.abs().max() + tol["atol"]
        else:
            assert got.dtype == torch.float32 and torch.allclose(got, want_d, **tol)


@pytest.mark.parametrize("n_levels", [3, 8])
def test_a_row_gives_the_same_result_wherever_it_is(lib, monkeypatch, n_levels):
    """Each row is one thread's dot product, whatever the number of rows, of threads, or the row's place (the last
    row of a call is decoded without reading past it): a slice of the weight gives exactly its part of the product,
    computed on one thread or on two."""
    packed, norms = _weight(n_levels, 128, rows=50, in_features=512)
    cb, s1, s2 = format_constants(n_levels, 128, "cpu")
    per_row = packed.shape[0] // 50
    threads = torch.get_num_threads()
    monkeypatch.setattr(cpu_kernel, "MIN_WORK_PER_THREAD", 1)  # every product on all of torch's threads
    try:
        for m in (1, 5):
            x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
            torch.set_num_threads(2)
            whole = cpu_kernel.linear(x, packed, norms, cb, 128, (s1, s2), 512, lib=lib)
            torch.set_num_threads(1)
            for a, b in ((0, 50), (0, 1), (10, 11), (49, 50), (7, 30)):
                part = cpu_kernel.linear(x, packed[a * per_row:b * per_row], norms[a:b], cb, 128, (s1, s2), 512,
                                         lib=lib)
                assert torch.equal(part, whole[:, a:b])
    finally:
        torch.set_num_threads(threads)


def test_the_op_runs_the_kernel_for_a_few_rows_and_the_reference_beyond(monkeypatch):
    if cpu_kernel._compiler() is None:
        pytest.skip("no C compiler on this machine")
    assert cpu_kernel.library() is not None, cpu_kernel.status()
    layer = TurboQuantLinear(256, 48, bias=True, bits=3, group_size=128)
    quantize_linear_(layer, torch.randn(48, 256))
    torch.nn.init.normal_(layer.bias)
    calls = []
    real = cpu_kernel.linear
    monkeypatch.setattr(cpu_kernel, "linear", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])
    for m, served in ((1, True), (cpu_kernel.MAX_ROWS, True), (cpu_kernel.MAX_ROWS + 1, False)):
        calls.clear()
        x = torch.randn(m, 256)
        y = layer(x)
        assert (calls[-1] is not None) == served
        w = codec.dequantize_weight(layer.weight.tq_packed, layer.weight.tq_norms, 256, 128)
        want = x @ w.T + layer.bias
        assert torch.allclose(y, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_a_build_whose_products_differ_from_the_reference_is_not_used(monkeypatch):
    """`library` checks the build's products against the reference before using it: a build that gets one output
    of one product wrong (as a miscompiling compiler or an unforeseen CPU could) is dropped, `status` says why,
    and the op gives the reference's product."""
    import ctypes

    if cpu_kernel._compiler() is None:
        pytest.skip("no C compiler on this machine")
    calls = []

    class OneWrongOutput:
        def __init__(self, lib):
            self.lib = lib

        def __getattr__(self, name):
            return getattr(self.lib, name)

        def tq_linear(self, *args):
            rc = self.lib.tq_linear(*args)
            calls.append(args[2])
            if len(calls) == 5:  # (the fifth product checked: the 4-entry codebook at G = 64, one row)
                ctypes.memset(args[16], 0, 4)
            return rc

    real_load = cpu_kernel.load
    monkeypatch.setattr(cpu_kernel, "_state", {})
    monkeypatch.setattr(cpu_kernel, "load", lambda path: OneWrongOutput(real_load(path)))
    assert cpu_kernel.library() is None
    assert "unlike the reference (4-entry codebook, G = 64, 1 activation rows" in cpu_kernel.status()
    packed, norms = _weight(8, 64, rows=9, in_features=200)
    cb, s1, s2 = format_constants(8, 64, "cpu")
    x = torch.randn(2, 200)
    assert cpu_kernel.linear(x, packed, norms, cb, 64, (s1, s2), 200) is None
    monkeypatch.setattr(cpu_kernel, "_state", {})
    monkeypatch.setattr(cpu_kernel, "load", real_load)
    assert cpu_kernel.library() is not None and cpu_kernel.self_check(cpu_kernel.library()) is None


def test_fallback_without_the_kernel(monkeypatch, tmp_path):
    """No compiler, or one that fails: the build says so, `linear` returns None and the op gives the reference's
    product."""
    failing = shutil.which("false")
    if failing:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        monkeypatch.setattr(cpu_kernel, "_compiler", lambda: failing)
        path, reason = cpu_kernel.build()
        assert path is None and reason.startswith("building the CPU kernel failed") and reason.count(failing) == 3
    monkeypatch.setattr(cpu_kernel, "_compiler", lambda: None)
    path, reason = cpu_kernel.build()
    assert path is None and "no C compiler" in reason
    monkeypatch.setattr(cpu_kernel, "_state", {})
    assert cpu_kernel.library() is None and "no C compiler" in cpu_kernel.status()
    packed, norms = _weight(8, 64, rows=9, in_features=200)
    cb, s1, s2 = format_constants(8, 64, "cpu")
    x = torch.randn(2, 200)
    assert cpu_kernel.linear(x, packed, norms, cb, 64, (s1, s2), 200) is None
    y = torch.ops.turboquant.linear(x, packed, norms, cb, s1, s2, 64, 200)
    monkeypatch.setenv("TURBOQUANT_CPU_KERNEL", "0")
    assert "TURBOQUANT_CPU_KERNEL=0" in cpu_kernel.status()
    assert torch.equal(y, ops.codebook_matmul(ops.rotate_activations(x, s1, s2, 64), packed, norms, cb, 64))


def test_gradients_and_compile_through_the_kernel():
    """The op's forward runs the kernel with an input that requires a gradient (the backward is the op's own
    formula), and under torch.compile the compiled graph calls the same op."""
    layer = TurboQuantLinear(200, 30, bias=False, bits=4, group_size=64)
    quantize_linear_(layer, torch.randn(30, 200))
    x = torch.randn(3, 200, requires_grad=True)
    y = layer(x)
    y.square().sum().backward()
    w = codec.dequantize_weight(layer.weight.tq_packed, layer.weight.tq_norms, 200, 64)
    xr = x.detach().clone().requires_grad_()
    (xr @ w.T).square().sum().backward()
    assert torch.allclose(x.grad, xr.grad, rtol=1e-4, atol=1e-4 * xr.grad.abs().max().item())
    with torch.no_grad():
        assert torch.equal(torch.compile(layer, fullgraph=True, backend="aot_eager")(x), layer(x))


def test_shapes_that_do_not_fit_are_left_to_the_reference():
    """The kernel reads by the shapes it is given: packed bytes, norms or activations that do not fit one another are
    not passed to it, and the op raises an error naming the shapes instead of reading past a tensor."""
    if cpu_kernel._compiler() is None:
        pytest.skip("no C compiler on this machine")
    packed, norms = _weight(8, 64, rows=9, in_features=200)
    cb, s1, s2 = format_constants(8, 64, "cpu")
    x = torch.randn(2, 200)
    assert cpu_kernel.linear(x, packed, norms, cb, 64, (s1, s2), 200) is not None
    assert cpu_kernel.linear(x, packed[:-1], norms, cb, 64, (s1, s2), 200) is None  # a group's bytes missing
    for bad in ((x, packed[:, :-1], norms, 200), (x[:, :120], packed, norms, 120), (x, packed, norms[:, :3], 200)):
        assert cpu_kernel.linear(bad[0], bad[1], bad[2], cb, 64, (s1, s2), bad[3]) is None
        with pytest.raises(ValueError, match="TurboQuant weight"):
            torch.ops.turboquant.linear(bad[0], bad[1], bad[2], cb, s1, s2, 64, bad[3])
    x_rot = ops.rotate_activations(x, s1, s2, 64)
    assert cpu_kernel.linear(x_rot[:, :-16], packed, norms, cb, 64) is None


@pytest.mark.parametrize("n_levels", LEVELS)
@pytest.mark.parametrize("group_size", [16, 32, 256])
def test_rotated_activations_at_every_group_size(lib, n_levels, group_size):
    """Activations already rotated (the whole-row rotation of turboquant-mlx layers, the MoE op), any group size the
    formats use, a stored float16 codebook and float16 norms: the reference's product."""
    g = torch.Generator().manual_seed(group_size)
    rows, n_groups = 11, 3
    bpg = fmt.bytes_per_group(n_levels, group_size)
    packed = torch.randint(0, 243 if n_levels == 3 else 256, (rows * n_groups, bpg), dtype=torch.uint8, generator=g)
    norms = torch.rand(rows, n_groups, generator=g).half()
    cb = torch.randn(n_levels, generator=g).half()
    x_rot = torch.randn(2, n_groups * group_size, generator=g)
    want = x_rot @ codec.rotated_weight(packed, norms.float(), cb.float(), group_size).T
    got = cpu_kernel.linear(x_rot, packed, norms, cb, group_size, lib=lib)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.equal(cpu_kernel.decode(packed, norms, cb, group_size, lib=lib),
                       codec.rotated_weight(packed, norms.float(), cb.float(), group_size))
