"""The CPU product of `turboquant::linear` for a few activation rows: packed weights decoded a few rows at a time.

`cpu_kernel.c` (beside this file) multiplies up to `MAX_ROWS` activation rows by a packed weight in the published
layout without building the weight: each thread decodes a few weight rows at a time, as `codebook[idx] * norm` in
float32 exactly as the reference does (`decode` returns them, for tests), into registers or a buffer of its own in
the caches, and takes their dot products with the activation rows there; the activations are rotated per group in
the same call. Nothing is stored beside the module: the kernel reads `tq_packed` and `tq_norms` as they are. More
rows (a prompt's prefill), the GPU runtime layout, and products that autograd differentiates through
(`ops.codebook_matmul` in the MoE op's backward) take the reference.

It is compiled on first use with the machine's C compiler (`$CC`, else `cc`, `gcc` or `clang`; `-O3
-march=native`, with OpenMP where the compiler has it) into `~/.cache/turboquant-hf/cpu-kernel` (or
`$XDG_CACHE_HOME/turboquant-hf/cpu-kernel`), keyed by the source, the compiler, the flags and the CPU, and
loaded through ctypes: no Python or torch header, about a second. Where no compiler is found or the build fails,
`linear` returns None and the op runs the reference (`status()` says why); `TURBOQUANT_CPU_KERNEL=0` turns it
off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import torch

from .. import settings
from ..format import constants as fmt

# Most activation rows the kernel serves; more rows (a prompt's prefill) take the reference's matrix product.
MAX_ROWS = 16
# Weights (times activation rows) per thread below which a product runs on fewer of torch's threads: waking a thread
# costs more than it saves on a smaller product.
MIN_WORK_PER_THREAD = 1 << 20
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_kernel.c")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# the compiler flags tried in turn (the first that builds is kept), and those of every build
_FLAG_SETS = (("-O3", "-march=native", "-fopenmp"), ("-O3", "-march=native"), ("-O3",))
_FLAGS = ("-std=gnu11", "-ffp-contract=off", "-fPIC", "-shared")

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict = {}  # "lib": the loaded library or None, "reason": why there is none, "path": the built file


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _machine() -> str:
    """What `-march=native` compiles for: the CPU's model and instruction-set flags where the system lists them
    (Linux), so that a cache shared between machines (a network home directory) never hands one machine another's
    build."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features", "CPU part"))]
    except OSError:
        lines = []
    return "\n".join([platform.machine(), platform.processor(), *sorted(set(lines))])


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "turboquant-hf", "cpu-kernel")


def build(defines: tuple[str, ...] = (),
          flag_sets: tuple[tuple[str, ...], ...] = _FLAG_SETS) -> tuple[str | None, str]:
    """Compile `cpu_kernel.c` (with `-D` for each of `defines`; the first of `flag_sets` that builds) unless a build
    of the same source, compiler, flags and machine is cached; returns (path of the shared library, "") or (None,
    why not)."""
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found (set CC, or install cc, gcc or clang)"
    with open(SOURCE, "rb") as f:
        source = f.read()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, timeout=60, check=False).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{cc} --version failed: {e}"
    key = hashlib.sha256(b"\0".join([source, cc.encode(), version, _machine().encode(),
                                      repr((flag_sets, _FLAGS)).encode(), *(d.encode() for d in defines)]))
    key = key.hexdigest()[:16]
    errors = []
    user = os.getuid() if hasattr(os, "getuid") else "user"
    for folder in (_cache_dir(), os.path.join(tempfile.gettempdir(), f"turboquant-hf-{user}")):
        path = os.path.join(folder, f"tq_cpu_{key}.so")
        if os.path.exists(path):
            return path, ""
        try:
            os.makedirs(folder, exist_ok=True)
            fd, probe = tempfile.mkstemp(suffix=".so", dir=folder)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:  # not writable: the next folder
            errors.append(f"{folder}: {e}")
            continue
        for flags in flag_sets:
            cmd = [cc, *flags, *_FLAGS, *(f"-D{d}" for d in defines), SOURCE, "-o"]
            try:
                fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
                os.close(fd)
                done = subprocess.run([*cmd, tmp], capture_output=True, text=True, timeout=600, check=False)
                if done.returncode == 0:
                    os.replace(tmp, path)  # atomic: a concurrent build of the same key writes the same file
                    return path, ""
                os.unlink(tmp)
                errors.append(f"{' '.join(cmd)}: {done.stderr.strip()[-500:]}")
            except (OSError, subprocess.SubprocessError) as e:
                errors.append(f"{' '.join(cmd)}: {e}")
        break  # the compiler refused every set of flags: another folder would not change that
    return None, "building the CPU kernel failed: " + "; ".join(errors)


def load(path: str):
    """The shared library at `path` with its functions' argument types set."""
    lib = ctypes.CDLL(path)
    p, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.tq_linear.argtypes = [p, i, i, i, i, p, p, p, p, i, p, i, ll, i, i, i, p, i, i]
    lib.tq_linear.restype = i
    lib.tq_decode.argtypes = [p, p, i, p, i, ll, ll, i, i, i, p]
    lib.tq_decode.restype = i
    lib.tq_has_avx2.restype = i
    return lib


def library():
    """The compiled kernel (built on the first call), or None where it cannot be built or is turned off."""
    if not settings.cpu_kernel():
        return None
    lib = _state.get("lib", False)
    if lib is not False:
        return lib
    with _lock:
        if "lib" not in _state:
            path, reason = build()
            try:
                _state["lib"] = load(path) if path else None
            except (OSError, AttributeError) as e:
                _state["lib"], reason = None, f"loading {path} failed: {e}"
            if _state["lib"] is not None:
                differs = self_check(_state["lib"])
                if differs:
                    _state["lib"], reason = None, f"the build at {path} computed products unlike the reference ({differs})"
            _state["reason"], _state["path"] = reason, path
            if _state["lib"] is None:  # said once: CPU products of a few rows now take the slower torch reference
                (logger.info if _compiler() is None else logger.warning)(
                    "TurboQuant: CPU products run the torch reference: %s (TURBOQUANT_CPU_KERNEL=0 chooses it "
                    "without trying)", reason)
    return _state["lib"]


def self_check(lib) -> str | None:
    """Products of `lib` on small random weights of every codebook size, at G = 64 and 128 with a padded last
    group, one and three activation rows, on as many threads as torch uses (at least two, whatever the work),
    against the reference's: None where they agree, else the first case that does not. `library` runs it once
    before the kernel is used, so that a build this machine's compiler or CPU gets wrong is never used."""
    from ..format import codec

    gen = torch.Generator().manual_seed(0)
    threads = max(2, torch.get_num_threads())
    for n_levels, bits in ((3, 1.58), (4, 2), (8, 3), (16, 4)):
        for group_size in (64, 128):
            rows, in_features = 37, 3 * group_size - 24
            packed, norms = codec.quantize_weight(torch.randn(rows, in_features, generator=gen), bits, group_size)
            cb = fmt.codebook(n_levels, group_size, "cpu")
            s1, s2 = fmt.signs(group_size, "cpu")
            w = codec.rotated_weight(packed, norms, cb, group_size)
            for m in (1, 3):
                x = torch.randn(m, in_features, generator=gen)
                padded = torch.nn.functional.pad(x, (0, norms.shape[1] * group_size - in_features))
                want = codec.rotate_groups(padded.view(m, -1, group_size), s1, s2).view(m, -1) @ w.T
                got = linear(x, packed, norms, cb, group_size, (s1, s2), in_features, lib=lib, threads=threads)
                if got is None or not (got - want).abs().max() <= 1e-4 * want.abs().max():
                    return f"{n_levels}-entry codebook, G = {group_size}, {m} activation rows, {threads} threads"
    return None


def status() -> str:
    """What `linear` runs on: the compiled kernel (its file) or the reference (and why)."""
    if not settings.cpu_kernel():
        return "reference (TURBOQUANT_CPU_KERNEL=0)"
    if library() is None:
        return f"reference ({_state['reason']})"
    isa = "AVX2" if _state["lib"].tq_has_avx2() else "portable C"
    return f"compiled kernel ({isa}, {_state['path']})"


def _float32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.to(torch.float32).contiguous()


def serves(x: torch.Tensor, packed: torch.Tensor, norms: torch.Tensor, codebook: torch.Tensor, group_size: int,
           signs: tuple[torch.Tensor, torch.Tensor] | None = None, in_features: int | None = None) -> bool:
    """Whether the kernel takes this product: CPU tensors, 1 to `MAX_ROWS` activation rows, published uint8
    bytes, float32/bfloat16/float16 activations and norms, a codebook of 3, 4, 8 or 16 entries, outside a trace,
    and shapes that fit one another (the kernel reads by them; the reference raises on those that do not):
    `(rows*n_groups, bytes_per_group)` packed bytes, `(rows, n_groups)` norms, `(M, in_features)` activations
    covering the groups (`(M, n_groups*G)` float32 when already rotated, without `signs`), signs of G entries, G a
    multiple of 16 (a power of two to rotate). (It records no autograd graph: callers that differentiate through
    the product use the reference.)"""
    if not (x.is_cpu and packed.is_cpu and norms.is_cpu and packed.dtype == torch.uint8 and x.dtype in _DTYPES
            and norms.dtype in _DTYPES and x.dim() == 2 and packed.dim() == 2 and norms.dim() == 2
            and 0 < x.shape[0] <= MAX_ROWS and group_size > 0 and not group_size % 16):
        return False
    n_levels = codebook.numel()
    rows, n_groups = norms.shape
    if n_levels not in (3, 4, 8, 16) or packed.shape != (rows * n_groups, fmt.bytes_per_group(n_levels, group_size)):
        return False
    if signs is None:
        ok = x.dtype == torch.float32 and x.shape[1] == n_groups * group_size
    else:
        ok = (x.shape[1] == in_features and -(-in_features // group_size) == n_groups
              and not group_size & (group_size - 1) and signs[0].numel() == signs[1].numel() == group_size)
    return ok and not torch.compiler.is_compiling()


def linear(x: torch.Tensor, packed: torch.Tensor, norms: torch.Tensor, codebook: torch.Tensor, group_size: int,
           signs: tuple[torch.Tensor, torch.Tensor] | None = None, in_features: int | None = None, lib=None,
           threads: int | None = None):
    """`(M, rows)` product of the packed weight and `x` (bfloat16 for bfloat16 `x`, rounded from the float32 result,
    else float32), or None where the kernel does not serve it (`serves`, `library`).

    With `signs` (D1, D2), `x` is `(M, in_features)` activations (float32, bfloat16 or float16), rotated per
    group here; without, `x` is `(M, n_groups*G)` float32 activations already rotated. `lib`: a library from
    `load`, by default `library()`. `threads`: the threads to run on (default: torch's, fewer for a small product)."""
    if not serves(x, packed, norms, codebook, group_size, signs, in_features):
        return None
    lib = lib or library()
    if lib is None:
        return None
    rows, n_groups = norms.shape
    m = x.shape[0]
    if signs is None:
        s1 = s2 = None
        in_features = n_groups * group_size
    else:
        s1, s2 = _float32(signs[0]), _float32(signs[1])
    x, packed, norms, cb = x.contiguous(), packed.contiguous(), norms.contiguous(), _float32(codebook)
    x_dtype = _DTYPES[x.dtype]
    out = torch.empty(m, rows, dtype=torch.bfloat16 if x_dtype == 1 else torch.float32)
    if threads is None:
        threads = max(1, min(torch.get_num_threads(), m * rows * n_groups * group_size // MIN_WORK_PER_THREAD))
    rc = lib.tq_linear(x.data_ptr(), x_dtype, m, in_features, signs is None,
                       None if s1 is None else s1.data_ptr(), None if s2 is None else s2.data_ptr(), packed.data_ptr(),
                       norms.data_ptr(), _DTYPES[norms.dtype], cb.data_ptr(), cb.numel(), rows, n_groups, group_size,
                       packed.shape[1], out.data_ptr(), 1 if x_dtype == 1 else 0, threads)
    if rc:
        raise MemoryError("the CPU kernel could not allocate its buffers")
    return out


def decode(packed: torch.Tensor, norms: torch.Tensor, codebook: torch.Tensor, group_size: int, lib=None):
    """The weight in the rotated basis `(rows, n_groups*G)` float32, as the kernel decodes it (`lib`: a library
    from `load`, by default `library()`)."""
    lib = lib or library()
    rows, n_groups = norms.shape
    packed, norms, cb = packed.contiguous(), norms.contiguous(), _float32(codebook)
    out = torch.empty(rows, n_groups * group_size, dtype=torch.float32)
    if rows and lib.tq_decode(packed.data_ptr(), norms.data_ptr(), _DTYPES[norms.dtype], cb.data_ptr(), cb.numel(),
                              0, rows, n_groups, group_size, packed.shape[1], out.data_ptr()):
        raise MemoryError("the CPU kernel could not allocate its buffers")
    return out
