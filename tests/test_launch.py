"""The kernels' launcher (`turboquant_hf.kernels.launch`): its cache key against Triton's own specialization, and
the cache's bookkeeping (the GPU test in tests/test_cuda.py runs it on real kernels)."""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch

from turboquant_hf.kernels import launch as LA

triton = pytest.importorskip("triton")


def test_host_helpers_equal_tritons():
    for n in range(0, 3000):
        assert LA.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 64, 128, 1000):
            assert LA.cdiv(n, d) == triton.cdiv(n, d), (n, d)
    assert LA.next_power_of_2(2**40 + 1) == 2**41


def _values():
    ints = [0, 1, 2, 15, 16, 17, 31, 32, 48, 4096, 14336, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, 2**32, 2**40,
            2**63 - 16, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 16, -1, -16, -17, -(2**31), -(2**31) - 1,
            -(2**31) - 16, -(2**63)]
    base = torch.zeros(64, dtype=torch.float32)
    tensors = [base, base[1:], base[4:], base[8:], base.view(torch.int32), base.view(torch.int32)[3:],
               base.view(torch.bfloat16), base.view(torch.bfloat16)[1:], base.view(torch.bfloat16)[8:],
               base.view(torch.float16)[16:], base.view(torch.uint8), base.view(torch.uint8)[7:]]
    return ints + [0.5, 1.0, -3.25, True, False, None] + tensors


def test_key_is_at_least_as_fine_as_tritons_specialization():
    """Arguments that `launch` keys alike are specialized alike by Triton (its native specializer, as its launch
    path calls it for a parameter that is specialized on value and alignment): a cached compiled kernel is the
    one Triton would have picked."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:  # pragma: no cover - a Triton without the native specializer
        pytest.skip("this Triton has no native_specialize_impl")

    def tritons(v):
        return native_specialize_impl(BaseBackend, v, False, True, True)

    values = _values()
    distinct_triton = {repr(tritons(v)) for v in values}
    assert len(distinct_triton) >= 10  # (the values do exercise Triton's specializations)
    for a, b in itertools.combinations(values, 2):
        if LA._spec(a) == LA._spec(b):
            assert tritons(a) == tritons(b), (a if not isinstance(a, torch.Tensor) else (a.dtype, a.data_ptr() % 16),
                                              b if not isinstance(b, torch.Tensor) else (b.dtype, b.data_ptr() % 16))


class _Param:
    def __init__(self, name, default=inspect.Parameter.empty):
        self.name, self.default = name, default


class _Compiled:
    """What Triton's launch returns: a compiled kernel launched as `compiled[grid](*all_args)`."""
    run = function = packed_metadata = launch_metadata = None

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args: self.launches.append((grid, args))


class JITFunction:
    """A stand-in for `triton.runtime.jit.JITFunction` (the launcher checks the type's name): records the calls
    that take Triton's own launch path."""

    def __init__(self):
        self.params = [_Param("x"), _Param("n"), _Param("A"), _Param("B", default=7), _Param("C", default=None)]
        self.slow = []
        self.compiled = []

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.slow.append((grid, args, meta))
            self.compiled.append(_Compiled())
            return self.compiled[-1]

        return run


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(LA, "ENABLED", True)
    monkeypatch.setattr(LA, "_CACHE", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_launch_caches_the_compiled_kernel_per_key(fresh):
    k = JITFunction()
    base = torch.zeros(64)
    LA.launch(k, (4,), base, 32, A=3, num_warps=4)
    assert len(k.slow) == 1 and k.slow[0] == ((4,), (base, 32), {"A": 3, "num_warps": 4})
    # the same key (another aligned tensor, another multiple of 16 that is not 1): the compiled kernel, with every
    # parameter in signature order (constexprs given by keyword, the rest their defaults) and a 3-D grid
    other = torch.ones(32)
    LA.launch(k, (5, 2), other, 48, A=3, num_warps=4)
    assert len(k.slow) == 1
    assert k.compiled[0].launches == [((5, 2, 1), (other, 48, 3, 7, None))]
    # what Triton specializes differently goes through Triton again: a misaligned tensor, an integer that is 1 or
    # not a multiple of 16, another dtype, another constexpr value or launch option
    for args, meta in [((base[1:], 32), {"A": 3, "num_warps": 4}), ((base, 1), {"A": 3, "num_warps": 4}),
                       ((base, 33), {"A": 3, "num_warps": 4}), ((base.half(), 32), {"A": 3, "num_warps": 4}),
                       ((base, 32), {"A": 4, "num_warps": 4}), ((base, 32), {"A": 3, "num_warps": 8}),
                       ((base, 32), {"A": 3, "B": 9, "num_warps": 4})]:
        before = len(k.slow)
        LA.launch(k, (1,), *args, **meta)
        assert len(k.slow) == before + 1, (args, meta)
    assert len(LA._CACHE) == 8
    # each of those keys now launches its own compiled kernel
    LA.launch(k, (1,), base[1:], 32, A=3, num_warps=4)
    assert len(k.slow) == 8 and k.compiled[1].launches[-1][1][0].data_ptr() == base[1:].data_ptr()
    LA.launch(k, (1,), base, 32, A=3, B=9, num_warps=4)
    assert k.compiled[7].launches[-1] == ((1, 1, 1), (base, 32, 3, 9, None))


def test_launch_falls_back_to_triton(fresh, monkeypatch):
    k = JITFunction()
    t = torch.zeros(16)
    # a tensor passed by keyword: never cached (the key would hold the tensor itself)
    for _ in range(3):
        LA.launch(k, (1,), t, 16, A=t)
    assert len(k.slow) == 3 and not LA._CACHE
    # anything that is not a JITFunction (the interpreter's kernels, a test's stub) always takes its own path
    calls = []

    class Other:
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append(grid)

    for _ in range(2):
        LA.launch(Other(), (2,), t, 16, A=1)
    assert calls == [(2,), (2,)] and not LA._CACHE
    # TURBOQUANT_FAST_LAUNCH=0
    monkeypatch.setattr(LA, "ENABLED", False)
    for _ in range(2):
        LA.launch(k, (1,), t, 16, A=1)
    assert len(k.slow) == 5 and not LA._CACHE


def test_arguments_without_a_key_take_tritons_path(fresh):
    """Integers of other types (NumPy's, ...) are not keyed by value (a cache entry per value): Triton's path."""
    np = pytest.importorskip("numpy")
    k = JITFunction()
    for v in (16, 32, 48):
        LA.launch(k, (1,), torch.zeros(16), np.int64(v), A=1)
    assert len(k.slow) == 3 and not LA._CACHE


_COMBINE = {"file": "moe.py", "name": "_combine_kernel",
            "args": {"y_ptr": ["tensor", "torch.float32", True], "pos_ptr": ["tensor", "torch.int32", True],
                     "w_ptr": ["tensor", "torch.float32", True], "out_ptr": ["tensor", "torch.bfloat16", True],
                     "bias_ptr": ["tensor", "torch.float32", True], "idx_ptr": ["tensor", "torch.int32", True],
                     "H": ["int", 128], "stride_y": ["int", 128], "stride_o": ["int", 128], "stride_b": ["int", 0],
                     "K": ["int", 3], "BC": ["int", 128], "HAS_BIAS": ["bool", False]},
            "options": {"num_warps": 4}}


def _mma(use_asm: bool, activations: str) -> dict:
    return {"file": "gemv_mma.py", "name": "_gemv_mma_kernel",
            "args": {"xr_ptr": ["tensor", activations, True], "pk_ptr": ["tensor", "torch.int32", True],
                     "nrm_ptr": ["tensor", "torch.float32", True], "cb_ptr": ["tensor", "torch.float32", True],
                     "out_ptr": ["tensor", "torch.float32", True], "M": ["int", 1], "N": ["int", 20],
                     "stride_xm": ["int", 384], "stride_om": ["int", 20], "NG": ["int", 6], "NLEV": ["int", 4],
                     "G": ["int", 64], "KB": ["int", 64], "BN": ["int", 16], "BM": ["int", 8], "S": ["int", 4],
                     "RUNTIME_LAYOUT": ["bool", False], "F16": ["bool", False], "PREFETCH": ["int", 2],
                     "USE_ASM": ["bool", use_asm], "PDL": ["bool", False], "LANES_FIRST": ["bool", False],
                     "XORDER": ["bool", False]},
            "options": {"num_warps": 4, "num_stages": 1}}


def test_sm90_compile_passes_real_launches_and_reports_what_the_compiler_refuses(tmp_path, capsys):
    """`tests/sm90_compile.py compile` builds Triton's specialization from a recorded launch and compiles it for
    sm_90 without a GPU: the MoE combine kernel and the tensor-core GEMV with bfloat16 activations (its inline-PTX
    decode, as the GPU runs it) compile; the GEMV with float32 activations and the inline-PTX decode (bfloat16
    weights against float32 activations in `tl.dot`, which the dispatch never launches) is refused by the
    compiler, and the tool says so and fails."""
    import json

    import sm90_compile

    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps([_COMBINE, _mma(False, "torch.bfloat16")]))
    bad.write_text(json.dumps([_mma(True, "torch.float32")]))
    assert sm90_compile.compile_all([str(good)], 90, 1, sass=True) == 0
    out = capsys.readouterr().out
    assert "2 of 2 specializations of 2 kernels compiled" in out
    assert "gemv_mma.py:_gemv_mma_kernel: 1 specializations, SASS instructions" in out
    assert sm90_compile.compile_all([str(bad)], 90, 1, sass=False, as_recorded=True) == 1
    out = capsys.readouterr().out
    assert "FAILED gemv_mma.py:_gemv_mma_kernel" in out and "Both operands must be same dtype" in out
    assert "0 of 1 specializations" in out


def test_bound_kernel_caches_per_positional_key(fresh):
    """`bind` fixes the constexprs and options once: the compiled kernel is then looked up from the positional
    arguments alone, with the same specialization rules as `launch`."""
    k = JITFunction()
    bound = LA.bind(k, A=3, num_warps=4)
    base = torch.zeros(64)
    bound((4,), base, 32)
    bound((5, 2), torch.ones(32), 48)
    assert len(k.slow) == 1 and k.slow[0] == ((4,), (base, 32), {"A": 3, "num_warps": 4})
    assert k.compiled[0].launches[0][0] == (5, 2, 1) and k.compiled[0].launches[0][1][1:] == (48, 3, 7, None)
    for args in ((base[1:], 32), (base, 1), (base, 33), (base.half(), 32)):
        before = len(k.slow)
        bound((1,), *args)
        assert len(k.slow) == before + 1, args
    # another binding of the same kernel keys its own values
    LA.bind(k, A=4, num_warps=4)((1,), base, 32)
    assert len(k.slow) == 6 and k.slow[-1][2] == {"A": 4, "num_warps": 4}


def test_memo_follows_the_tuning_table(monkeypatch):
    """A memoized launch plan is computed once per arguments, again after any assignment to the tuning table
    (what tests and benchmarks do to switch a path), and again after `clear`."""
    from turboquant_hf.kernels import tuning as T

    calls = []

    @LA.memo
    def plan(m):
        calls.append(m)
        return (m, T.DOT_MAX_M)

    assert plan(3) == (3, T.DOT_MAX_M) and plan(3) == (3, T.DOT_MAX_M) and calls == [3]
    monkeypatch.setattr(T, "DOT_MAX_M", T.DOT_MAX_M + 5)
    assert plan(3) == (3, T.DOT_MAX_M) and calls == [3, 3]
    LA.clear()
    plan(3)
    assert calls == [3, 3, 3]
    monkeypatch.setattr(LA, "_MEMO_MAX", 2)
    for m in range(5):
        plan(100 + m)
    assert len(plan.cache) <= 2


def test_direct_launch_passes_what_tritons_runner_passes(monkeypatch):
    """The cached launch calls the compiled kernel's launcher itself: with the grid, stream, function and
    metadata that Triton's own runner (`CompiledKernel[grid](*args)`) passes, and no launch metadata or hooks
    (Triton's runner is used while a launch hook is set)."""
    compiler = pytest.importorskip("triton.compiler.compiler")
    knobs = pytest.importorskip("triton.knobs")

    class CudaLauncher:
        def __init__(self):
            self.calls = []

        def __call__(self, *a):
            self.calls.append(a)

    fallback = []

    class Compiled(compiler.CompiledKernel):  # (Triton's runner, recorded: it needs a CUDA driver to run)
        def __getitem__(self, grid):
            return lambda *a: fallback.append((grid, a))

    ck = Compiled.__new__(Compiled)
    ck._run, ck.function, ck.packed_metadata, ck.module = CudaLauncher(), object(), object(), object()
    ck.name, ck.src, ck.metadata = "k", None, None
    monkeypatch.setattr(LA, "_RAW_STREAM", lambda device: 1234)
    launcher = LA._direct(ck)
    assert launcher is ck._run
    args = (torch.zeros(4), 7, 3)
    compiler.CompiledKernel.__getitem__(ck, (2, 3, 1))(*args, stream=1234)
    LA._run(ck, launcher, (2, 3), 0, args)
    theirs, ours = ck.run.calls
    assert ours[:6] == theirs[:6] and ours[9:] == theirs[9:]
    assert ours[6:9] == (None, None, None)
    # with a hook set: Triton's runner
    hook = lambda *a: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        LA._run(ck, launcher, (2, 3), 0, args)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert fallback == [((2, 3, 1), args)] and len(ck.run.calls) == 2


def test_inline_key_equals_spec():
    """The launch key's inline cases give what `_spec` gives, argument by argument."""
    values = _values()
    assert LA._key(tuple(values)) == tuple(LA._spec(v) for v in values)
    with pytest.raises(TypeError):
        LA._key((1.5j,))
