"""Launching the Triton kernels with less host work per call.

`kernel[grid](*args, **meta)` binds every argument to the kernel's signature, computes Triton's specialization key
and looks the compiled kernel up on every call, which takes longer on the host than launching the compiled kernel
itself; a decode step at batch 1 makes two such launches per linear layer, so in eager mode (no CUDA graph) the
host, not the GPU, sets the pace (measurements: benchmarks/RESULTS.md, "Cached kernel launches").

`launch` keeps, per kernel, a cache from a key of its own to the compiled kernel that Triton's first launch
returned, and launches that compiled kernel directly afterwards. The key is at least as fine as Triton's
specialization: the launch options and constexpr values as given, the current device, and for every positional
argument its dtype and 16-byte alignment (tensors) or whether it equals 1, is a multiple of 16 and fits in 32 or
64 signed bits (integers) -- every property Triton specializes a kernel on (tests/test_launch.py checks this
against Triton's own specializer). Two calls with the same key therefore run the kernel Triton itself would pick.
Anything the key does not cover (a tensor passed by keyword, an unhashable argument, a Triton whose compiled
kernels lack the launch interface, the interpreter) takes Triton's own launch path.

The compiled kernel is then launched the way Triton's own runner does it, minus the launch metadata and the hooks
that only Triton's profiling hooks use (while any hook is set, Triton's runner is called).

`memo` keeps the other host work of a launch -- the dispatch decisions, configurations and constexpr values that
depend only on shapes, dtypes and the tuning table -- in a per-function cache.

`TURBOQUANT_FAST_LAUNCH=0` (read at import) always takes Triton's path.
"""

from __future__ import annotations

import torch

from turboquant_hf import settings

from . import tuning

ENABLED = settings.fast_launch()

_CACHE: dict = {}
_I32 = (-(2**31), 2**31 - 1)
_I64 = (-(2**63), 2**63 - 1)


def cdiv(a: int, b: int) -> int:
    """`triton.cdiv` for host code (newer Tritons wrap it for use inside kernels, at a cost per host call)."""
    return -(-a // b)


def triton_version() -> tuple[int, int]:
    """(major, minor) of the installed Triton."""
    import triton

    parts = []
    for piece in triton.__version__.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def next_power_of_2(n: int) -> int:
    """`triton.next_power_of_2` for host code (0 for n <= 0, as Triton's)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _spec(a):
    """What Triton could specialize on in a positional argument (a hashable summary)."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    t = type(a)
    if t is int:
        return a == 1, a % 16 == 0, _I32[0] <= a <= _I32[1], _I64[0] <= a <= _I64[1]
    if t is float:
        return t
    if a is None or t is bool:
        return t, a
    # anything else (a NumPy or symbolic integer, ...): Triton's path, rather than a cache entry per value
    raise TypeError(f"no launch key for {t.__name__}")


_Tensor = torch.Tensor
_LO, _HI = _I32


def _key(args: tuple) -> tuple:
    """`tuple(map(_spec, args))`, with the common cases (plain tensors, integers in int32 range) inline."""
    return tuple([(a.dtype, not a.data_ptr() & 15) if type(a) is _Tensor
                  else (a == 1, not a & 15, True, True) if type(a) is int and _LO <= a <= _HI
                  else _spec(a) for a in args])


def _tail(kernel, n_args: int, meta: dict) -> tuple:
    """The values of the parameters after the positional ones, in signature order (constexprs by keyword, or
    their defaults)."""
    return tuple(meta.get(p.name, p.default) for p in kernel.params[n_args:])


def _launchable(compiled) -> bool:
    return all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata", "launch_metadata"))


_MEMOS: list = []
_MEMO_MAX = 4096  # entries a memoized function keeps (a cache that fills is emptied: shapes are few, M varies)


def memo(fn):
    """Cache `fn`'s result per positional arguments (hashable) and the tuning table's generation
    (`tuning.GENERATION`). For functions of shapes, dtypes, devices and settings that return launch plans."""
    cache: dict = {}

    def cached(*args):
        key = (tuning.GENERATION, *args)
        hit = cache.get(key)
        if hit is None:
            if len(cache) >= _MEMO_MAX:
                cache.clear()
            hit = cache[key] = fn(*args)
        return hit

    cached.__name__, cached.__qualname__, cached.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
    cached.cache = cache
    _MEMOS.append(cached)
    return cached


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_HOOKS = None  # (Triton's enter and exit hook chains, or None where they are not where Triton 3.6 keeps them)


def _hook_chains():
    global _HOOKS
    if _HOOKS is None:
        try:
            from triton import knobs

            chains = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
            _HOOKS = chains if all(hasattr(c, "calls") for c in chains) else ()
        except (ImportError, AttributeError):
            _HOOKS = ()
    return _HOOKS


def _direct(compiled):
    """The launcher of `compiled` if it can be called directly (`_run`): Triton's CUDA launcher, called the way
    Triton's own runner calls it (Triton 3.6 to 3.9 at least), and the current stream readable from torch; else
    None."""
    run = getattr(compiled, "run", None)
    if (_RAW_STREAM is not None and type(run).__name__ == "CudaLauncher" and _hook_chains()
            and getattr(compiled, "function", None) is not None):
        return run
    return None


def _run(compiled, launcher, grid: tuple, device: int, args: tuple) -> None:
    g = tuple(grid)
    if len(g) < 3:
        g = g + (1,) * (3 - len(g))
    if launcher is not None and not (_HOOKS[0].calls or _HOOKS[1].calls):
        launcher(g[0], g[1], g[2], _RAW_STREAM(device), compiled.function, compiled.packed_metadata, None, None,
                 None, *args)
    else:
        compiled[g](*args)


class Bound:
    """A kernel with its launch options and constexpr values bound (`bind`): `bound(grid, *args)` is
    `kernel[grid](*args, **meta)`, keyed like `launch` but on the positional arguments only."""

    __slots__ = ("kernel", "meta", "tail", "cache", "fast")

    def __init__(self, kernel, meta: dict):
        self.kernel, self.meta = kernel, meta
        self.fast = type(kernel).__name__ == "JITFunction" and not any(
            isinstance(v, torch.Tensor) for v in meta.values())
        self.tail = None
        self.cache: dict = {}

    def __call__(self, grid: tuple, *args):
        if not (self.fast and ENABLED):
            return self.kernel[grid](*args, **self.meta)
        try:
            device = torch.cuda.current_device()
            key = (device, _key(args))
            entry = self.cache.get(key)
        except TypeError:
            return self.kernel[grid](*args, **self.meta)
        if entry is None:
            compiled = self.kernel[grid](*args, **self.meta)
            if _launchable(compiled):
                if self.tail is None:
                    self.tail = _tail(self.kernel, len(args), self.meta)
                self.cache[key] = (compiled, _direct(compiled))
            return compiled
        compiled, launcher = entry
        _run(compiled, launcher, grid, device, (*args, *self.tail))
        return compiled


def bind(kernel, **meta) -> Bound:
    """`kernel` with `meta` (launch options, constexprs by keyword) bound, for launch plans kept by `memo`."""
    return Bound(kernel, meta)


def launch(kernel, grid: tuple, *args, **meta):
    """`kernel[grid](*args, **meta)`, through the cache above where it applies."""
    if not ENABLED or type(kernel).__name__ != "JITFunction":
        return kernel[grid](*args, **meta)
    try:
        device = torch.cuda.current_device()
        key = (kernel, device, tuple(map(_spec, args)), tuple(meta.items()))
        entry = _CACHE.get(key)
    except TypeError:  # an argument without a key of ours, or unhashable: Triton's path
        return kernel[grid](*args, **meta)
    if entry is None:
        compiled = kernel[grid](*args, **meta)
        if _launchable(compiled) and not any(isinstance(v, torch.Tensor) for v in meta.values()):
            _CACHE[key] = (compiled, _tail(kernel, len(args), meta), _direct(compiled))
        return compiled
    compiled, tail, launcher = entry
    _run(compiled, launcher, grid, device, (*args, *tail))
    return compiled


def clear() -> None:
    """Forget the compiled kernels (the next launch of each goes through Triton again), and the launch plans that
    hold them."""
    _CACHE.clear()
    for fn in _MEMOS:
        fn.cache.clear()
