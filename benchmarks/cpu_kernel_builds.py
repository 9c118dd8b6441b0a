"""Which builds of the CPU kernel (`turboquant_hf/modeling/cpu_kernel.c`) compute the reference's products on this
machine: each set of compiler flags and defines is built (cached like the kernel's own build), loaded and checked by
`cpu_kernel.self_check` (every codebook size, G = 64 and 128, a padded last group, 1 and 3 activation rows) at 1, 2
and torch's thread counts. For a machine where `cpu_kernel.status()` reports a build unlike the reference.

    python benchmarks/cpu_kernel_builds.py
"""

from __future__ import annotations

import platform
import subprocess

import torch

from turboquant_hf.modeling import cpu_kernel

FLAG_SETS = (("-O3", "-march=native", "-fopenmp"), ("-O3", "-march=native"), ("-O3", "-mavx2", "-mfma", "-fopenmp"),
             ("-O2", "-march=native", "-fopenmp"), ("-O3", "-fopenmp"))
DEFINES = ((), ("TQ_NO_AVX512",), ("TQ_PORTABLE",))


def main() -> int:
    cc = cpu_kernel._compiler()
    version = "-"
    if cc:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout.splitlines()[0]
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    model = names[0] if names else platform.processor()
    print(f"CPU: {model}; compiler: {cc} ({version}); torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("kernel in use:", cpu_kernel.status())
    threads = torch.get_num_threads()
    try:
        for flags in FLAG_SETS:
            for defines in DEFINES:
                path, why = cpu_kernel.build(defines, (flags,))
                label = " ".join(flags + tuple(f"-D{d}" for d in defines))
                if path is None:
                    print(f"{label}: not built ({why[:200]})")
                    continue
                lib = cpu_kernel.load(path)
                for n in sorted({1, 2, threads}):
                    torch.set_num_threads(n)
                    print(f"{label}, {n} thread(s): {cpu_kernel.self_check(lib) or 'agrees with the reference'}")
                torch.set_num_threads(threads)
    finally:
        torch.set_num_threads(threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
