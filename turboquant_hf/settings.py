"""Every environment setting of the package, read in one place (each at the moment it is needed, so that a
process or a test can change it between calls).

| variable | default | effect |
|---|---|---|
| `TURBOQUANT_COMPACT_TERNARY` | 0 | ternary weights on a GPU keep their 1.6-bit layout instead of the 2-bit runtime one (smaller, slower) |
| `TURBOQUANT_FUSE` | 1 | sibling projections (q/k/v, gate/up) on a GPU run as one packed op |
| `TURBOQUANT_DISABLE_TRITON` | 0 | CUDA tensors use the torch reference instead of the Triton kernels (read at import) |
| `TURBOQUANT_FAST_LAUNCH` | 1 | the kernels' own launcher instead of Triton's (read at import) |
| `TURBOQUANT_PDL` | 1 | programmatic dependent launch of the pair GEMV |
| `TURBOQUANT_MOE_SCRATCH_MB` | 1024 | MiB of scratch for decoded routed experts at prefill |
| `TURBOQUANT_CPU_KERNEL` | 1 | CPU products of up to 16 rows run the compiled kernel (`cpu_kernel`); 0: the torch reference |
"""

from __future__ import annotations

import os


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value not in ("", "0")


def compact_ternary() -> bool:
    return _flag("TURBOQUANT_COMPACT_TERNARY", False)


def fuse_projections() -> bool:
    return _flag("TURBOQUANT_FUSE", True)


def cpu_kernel() -> bool:
    return _flag("TURBOQUANT_CPU_KERNEL", True)


def triton_disabled() -> bool:
    return _flag("TURBOQUANT_DISABLE_TRITON", False)


def fast_launch() -> bool:
    return _flag("TURBOQUANT_FAST_LAUNCH", True)


def dependent_launch() -> bool:
    return _flag("TURBOQUANT_PDL", True)


def moe_scratch_bytes() -> int:
    """`TURBOQUANT_MOE_SCRATCH_MB` (MiB, default 1024) in bytes."""
    raw = os.environ.get("TURBOQUANT_MOE_SCRATCH_MB", "1024")
    try:
        mb = int(raw)
    except ValueError:
        mb = 0
    if mb < 1:
        raise ValueError(f"TURBOQUANT_MOE_SCRATCH_MB must be a whole number of MiB, at least 1, not {raw!r}")
    return mb << 20


def gemm_min_m() -> int | None:
    """`TURBOQUANT_GEMM_MIN_M`: the smallest number of activation rows the packed-weight GEMM serves, at every
    larger M and in the MoE layer's grouped products too (at least 2; 0: the GEMM serves none; unset: None, the
    tuned range of `kernels/tuning.py`)."""
    raw = os.environ.get("TURBOQUANT_GEMM_MIN_M")
    if raw is None or raw == "":
        return None
    try:
        m = int(raw)
    except ValueError:
        m = -1
    if m < 0 or m == 1:
        raise ValueError(f"TURBOQUANT_GEMM_MIN_M must be 0 (off) or a number of rows of at least 2, not {raw!r}")
    return m or 1 << 62
