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

`TURBOQUANT_FAST_LAUNCH=0` (read at import) always takes Triton's path.
"""

from __future__ import annotations

import torch

from turboquant_hf import settings

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


def _tail(kernel, n_args: int, meta: dict) -> tuple:
    """The values of the parameters after the positional ones, in signature order (constexprs by keyword, or
    their defaults)."""
    return tuple(meta.get(p.name, p.default) for p in kernel.params[n_args:])


def _launchable(compiled) -> bool:
    return all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata", "launch_metadata"))


def launch(kernel, grid: tuple, *args, **meta):
    """`kernel[grid](*args, **meta)`, through the cache above where it applies."""
    if not ENABLED or type(kernel).__name__ != "JITFunction":
        return kernel[grid](*args, **meta)
    try:
        key = (kernel, torch.cuda.current_device(), tuple(map(_spec, args)), tuple(meta.items()))
        entry = _CACHE.get(key)
    except TypeError:  # an argument without a key of ours, or unhashable: Triton's path
        return kernel[grid](*args, **meta)
    if entry is None:
        compiled = kernel[grid](*args, **meta)
        if _launchable(compiled) and not any(isinstance(v, torch.Tensor) for v in meta.values()):
            _CACHE[key] = (compiled, _tail(kernel, len(args), meta))
        return compiled
    compiled, tail = entry
    g = tuple(grid)
    if len(g) < 3:
        g = g + (1,) * (3 - len(g))
    compiled[g](*args, *tail)
    return compiled


def clear() -> None:
    """Forget the compiled kernels (the next launch of each goes through Triton again)."""
    _CACHE.clear()
