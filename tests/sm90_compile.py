"""Compile every Triton kernel specialization the interpreter tests launch for a GPU architecture, on a machine
without a GPU: what the interpreter cannot check (inline PTX, dtype rules of `tl.dot`, layouts and register
pressure the compiler enforces) is checked by Triton's own compiler and ptxas.

    TRITON_INTERPRET=1 python tests/sm90_compile.py record launches.json [pytest arguments]
    python tests/sm90_compile.py compile launches.json|folder ... [--arch 90] [--jobs 2] [--most N] [--sass]
    TRITON_INTERPRET=1 python -m pytest -m interpreter tests/test_kernels.py --record-launches folder  (any workers)

`record` runs pytest (default: the interpreter tests of tests/test_kernels.py) in this process with every
interpreted launch recorded: the kernel (its source file and name), each argument's kind (a tensor's dtype and
whether its address is 16-byte aligned, an integer's value, a float, a bool, None) and the launch options. `compile`
rebuilds each distinct specialization the way Triton's launcher would (pointer and integer arguments typed and,
where aligned or a multiple of 16, marked divisible by 16; integers equal to 1 and constexprs folded in) and
compiles it for `--arch` (CUDA compute capability, default 90 = H100/H200) to SASS, with the inline-PTX decode the
GPU path selects (`USE_ASM=True`; `--as-recorded` keeps the interpreter's emulation). It prints one line per failure
and exits non-zero if any specialization fails; `--sass` also prints each kernel's instruction count.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import json
import os
import sys

_TORCH_TO_TRITON = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32",
                    "torch.float64": "fp64", "torch.int8": "i8", "torch.uint8": "u8", "torch.int16": "i16",
                    "torch.int32": "i32", "torch.int64": "i64", "torch.uint16": "u16", "torch.uint32": "u32",
                    "torch.bool": "i1"}
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl")


def _describe(value):
    import torch

    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype), value.data_ptr() % 16 == 0]
    if isinstance(value, bool):
        return ["bool", value]
    if isinstance(value, int):
        return ["int", value]
    if isinstance(value, float):
        return ["float", value]
    if value is None:
        return ["none"]
    if type(value).__name__ == "dtype" and type(value).__module__.startswith("triton"):
        return ["tl_dtype", str(value)]
    return ["other", repr(value)]


class Recorder:
    """Records every interpreted launch of a kernel of the package (a test's own probe kernels are left out) while
    installed; `dump` writes the distinct ones as JSON."""

    def __init__(self):
        import turboquant_hf.kernels as package

        self.kernels_dir = os.path.realpath(os.path.dirname(package.__file__))
        self.seen: dict[str, dict] = {}
        self.original = None

    def install(self) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        original = self.original = InterpretedFunction.run
        recorder = self

        def run(fn_self, *args, grid, warmup, **kwargs):
            fn = fn_self.fn
            if os.path.dirname(os.path.realpath(fn.__code__.co_filename)) == recorder.kernels_dir:
                names = fn_self.arg_names
                values = dict(zip(names, args))
                values.update({k: v for k, v in kwargs.items() if k in names})
                entry = {"file": os.path.basename(fn.__code__.co_filename), "name": fn.__name__,
                         "args": {k: _describe(v) for k, v in values.items()},
                         "options": {k: kwargs[k] for k in _OPTIONS if k in kwargs}}
                recorder.seen.setdefault(json.dumps(entry, sort_keys=True), entry)
            return original(fn_self, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = run

    def uninstall(self) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        if self.original is not None:
            InterpretedFunction.run = self.original
            self.original = None

    def dump(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(sorted(self.seen.values(), key=lambda e: (e["file"], e["name"])), f, indent=0)


def record(path: str, pytest_args: list[str]) -> int:
    import pytest

    here = os.path.dirname(os.path.abspath(__file__))
    recorder = Recorder()
    recorder.install()
    try:
        args = pytest_args or ["-m", "interpreter", "-q", "-p", "no:cacheprovider", os.path.join(here, "test_kernels.py")]
        code = pytest.main(args)
    finally:
        recorder.uninstall()
    recorder.dump(path)
    print(f"{len(recorder.seen)} distinct launches of {len({(e['file'], e['name']) for e in recorder.seen.values()})}"
          f" kernels recorded in {path}")
    return int(code)


def _kernel(entry):
    """The JITFunction of a recorded launch: from the kernels package, or from a module of this folder (a test's
    own kernel)."""
    import turboquant_hf.kernels as package

    stem = entry["file"].removesuffix(".py")
    if os.path.isfile(os.path.join(os.path.dirname(package.__file__), entry["file"])):
        module = importlib.import_module(f"turboquant_hf.kernels.{stem}")
    else:
        here = os.path.dirname(os.path.abspath(__file__))
        if here not in sys.path:
            sys.path.insert(0, here)
        module = importlib.import_module(stem)
    fn = getattr(module, entry["name"])
    if not hasattr(fn, "params"):  # a plain function the test decorates when it runs
        import triton

        fn = triton.jit(fn)
    return fn


def _source(entry):
    """(ASTSource, options) of a recorded launch."""
    import triton.language as tl
    from triton.compiler import ASTSource

    fn = _kernel(entry)
    signature, constants, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        name = param.name
        kind = entry["args"].get(name)
        if param.is_constexpr:
            signature[name] = "constexpr"
            if kind is None:
                constants[(i,)] = param.default
            elif kind[0] == "tl_dtype":
                constants[(i,)] = getattr(tl, kind[1])
            elif kind[0] in ("int", "float", "bool"):
                constants[(i,)] = kind[1]
            elif kind[0] == "none":
                constants[(i,)] = None
            else:
                raise ValueError(f"constexpr {name}: cannot rebuild {kind}")
            continue
        if kind is None:
            raise ValueError(f"argument {name} was not recorded")
        if kind[0] == "tensor":
            signature[name] = "*" + _TORCH_TO_TRITON[kind[1]]
            if kind[2] and not param.do_not_specialize_on_alignment:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif kind[0] == "int":
            value = kind[1]
            if value == 1 and not param.do_not_specialize:
                signature[name] = "constexpr"
                constants[(i,)] = 1
            else:
                signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
                if value % 16 == 0 and not param.do_not_specialize:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif kind[0] == "float":
            signature[name] = "fp32"
        elif kind[0] == "bool":
            signature[name] = "i1"
        elif kind[0] == "none":
            signature[name] = "constexpr"
            constants[(i,)] = None
        else:
            raise ValueError(f"argument {name}: cannot rebuild {kind}")
    return ASTSource(fn, signature, constants, attrs), dict(entry["options"])


def _specialization(entry) -> str:
    """What Triton compiles a launch into: integers reduced to what it specializes on (equal to 1, a multiple of 16,
    32 or 64 bits), floats to their type; launches with the same key compile to the same kernel."""
    def reduce(kind):
        if kind[0] == "int":
            v = kind[1]
            return ["int", v == 1, v % 16 == 0, -(2**31) <= v < 2**31]
        if kind[0] == "float":
            return ["float"]
        return kind

    fn = _kernel(entry)
    constexpr = {p.name for p in fn.params if p.is_constexpr}
    args = {k: (v if k in constexpr else reduce(v)) for k, v in entry["args"].items()}
    return json.dumps([entry["file"], entry["name"], args, entry["options"]], sort_keys=True)


def _compile_one(job):
    entry, arch, sass = job
    import triton
    from triton.backends.compiler import GPUTarget

    label = f"{entry['file']}:{entry['name']}"
    try:
        src, options = _source(entry)
        options.pop("launch_pdl", None)
        kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
        count = None
        if sass:
            from triton.tools.disasm import get_sass

            count = sum(1 for line in get_sass(kernel.asm["cubin"]).splitlines() if line.rstrip().endswith(";"))
        return label, None, count, kernel.metadata.shared
    except Exception as exc:  # noqa: BLE001  (every failure is reported, not raised)
        first = str(exc).strip().splitlines()
        return label, f"{type(exc).__name__}: {' | '.join(first[-3:])[:600]}", None, None


def _gpu_would_launch(entry) -> bool:
    """Whether a launch the interpreter made with the emulated decode (`USE_ASM=False`) is one the GPU makes with
    inline PTX (`USE_ASM = not _interpreting()`): every launch whose first tensor (the activations, or the packed
    weights of the decode kernels) is not float32. The dispatch sends float32 activations to the FMA GEMV and
    the torch paths; the interpreter tests drive the tensor-core kernels with them too, which only the emulation
    can run."""
    first = next((kind for kind in entry["args"].values() if kind[0] == "tensor"), None)
    return first is None or first[1] != "torch.float32"


def _load(paths) -> list[dict]:
    """The launches recorded in `paths` (JSON files, or folders of them: one per pytest worker)."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            files += sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".json"))
        else:
            files.append(path)
    if not files:
        raise SystemExit(f"no recorded launches in {', '.join(paths)}")
    out = []
    for name in files:
        with open(name, encoding="utf-8") as f:
            out += json.load(f)
    return out


def _spread(entries: list[dict], most: int) -> list[dict]:
    """At most `most` specializations per kernel, evenly spaced over its sorted list (all of them when fewer)."""
    by_kernel: dict[tuple, list] = {}
    for e in entries:
        by_kernel.setdefault((e["file"], e["name"]), []).append(e)
    out = []
    for group in by_kernel.values():
        if len(group) <= most:
            out += group
        else:
            out += [group[round(i * (len(group) - 1) / (most - 1))] for i in range(most)] if most > 1 else group[:1]
    return out


def compile_all(paths, arch: int, jobs: int, sass: bool, as_recorded: bool = False,
                most: int | None = None) -> int:
    recorded = _load(paths)
    if not as_recorded:
        for e in recorded:
            if "USE_ASM" in e["args"] and _gpu_would_launch(e):
                e["args"]["USE_ASM"] = ["bool", True]
    unique = {_specialization(e): e for e in recorded}
    entries = [unique[k] for k in sorted(unique)]
    if most:
        entries = _spread(entries, most)
    failures = 0
    results: dict[str, list] = {}
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
        for label, error, count, shared in pool.map(_compile_one, [(e, arch, sass) for e in entries]):
            if error:
                failures += 1
                print(f"FAILED {label}: {error}", flush=True)
            results.setdefault(label, []).append((count, shared))
    for label, rows in sorted(results.items()):
        if sass:
            counts = sorted({c for c, _ in rows if c is not None})
            print(f"{label}: {len(rows)} specializations, SASS instructions {counts[0] if counts else '-'}"
                  f"..{counts[-1] if counts else '-'}")
    print(f"sm_{arch}: {len(entries) - failures} of {len(entries)} specializations of {len(results)} kernels compiled")
    return 1 if failures else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record")
    r.add_argument("path")
    r.add_argument("pytest_args", nargs=argparse.REMAINDER)
    c = sub.add_parser("compile")
    c.add_argument("paths", nargs="+", help="JSON files of recorded launches, or folders of them")
    c.add_argument("--most", type=int, help="compile at most this many specializations per kernel (spread evenly)")
    c.add_argument("--arch", type=int, default=90)
    c.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    c.add_argument("--sass", action="store_true")
    c.add_argument("--as-recorded", action="store_true",
                   help="keep USE_ASM as the interpreter ran it (False) instead of the GPU's True")
    args = p.parse_args()
    if args.command == "record":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("record runs the kernels under the interpreter: start it with TRITON_INTERPRET=1")
        return record(args.path, args.pytest_args)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("compile needs Triton's compiler: start it without TRITON_INTERPRET=1")
    return compile_all(args.paths, args.arch, args.jobs, args.sass, args.as_recorded, args.most)


if __name__ == "__main__":
    sys.exit(main())
