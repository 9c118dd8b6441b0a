"""Host time of one eager call of a TurboQuantLinear on CUDA, and where it goes: the module's forward and the op
against `F.linear`, timed on the host with the GPU kept ahead (short calls queue), then cProfile over the same
calls (top functions by own time).

    python host_overhead.py [--m 1] [--k 4096] [--n 4096] [--bits 3] [--calls 2000]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
import torch.nn.functional as F

from turboquant_hf import TurboQuantLinear
from turboquant_hf.modeling.modules import quantize_linear_


def host_us(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    w = (torch.randn(args.n, args.k, device="cuda") * 0.02).to(torch.bfloat16)
    q = TurboQuantLinear(args.k, args.n, bias=False, bits=args.bits).to("cuda")
    quantize_linear_(q, w.float())
    q.to("cuda")  # (the runtime layout, as on a loaded model)
    x = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        t_f = host_us(lambda: F.linear(x, w), args.calls)
        t_q = host_us(lambda: q(x), args.calls)
        print(f"M={args.m} {args.k}x{args.n} {args.bits}-bit: host us a call: F.linear {t_f:.1f}, TurboQuantLinear {t_q:.1f}")
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.calls):
            q(x)
        pr.disable()
        torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
