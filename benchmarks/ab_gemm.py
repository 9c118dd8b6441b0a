"""The whole op (`torch.ops.turboquant.linear`: rotation and product) with and without the packed-weight GEMM, by
M: the dispatch without it (tensor-core GEMV up to 64 rows, then dequantize + cuBLAS), with it at every M from 17
rows (`tuning.GEMM_MIN_M`, `GEMM_MAX_M`), with and without the next block's words loaded ahead
(`tuning.GEMM_PREFETCH`), and as dispatched by default; bf16 `F.linear` in the same run. CUDA-graph replays over
weight copies that overflow the L2, and eager calls.

    python ab_gemm.py [--bits 3] [--ms 32,64,128,256,512,1024,2048] [--shapes 0,1,2,3]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import bench_linear as B
from turboquant_hf.kernels import tuning as T

SHAPES = (("4096x4096", 4096, 4096), ("4096->6144 (q/k/v)", 4096, 6144), ("4096->28672 (gate/up)", 4096, 28672),
          ("14336->4096 (down)", 14336, 4096), ("2048->1024 (expert)", 2048, 1024))
# (name, (GEMM_MIN_M, GEMM_MAX_M, GEMM_PREFETCH) or None: as dispatched by default)
VARIANTS = (("no GEMM", (1 << 62, 1 << 62, True)), ("GEMM", (17, 1 << 62, False)),
            ("GEMM+prefetch", (17, 1 << 62, True)), ("default", None))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--ms", default="32,64,128,256,512,1024,2048")
    ap.add_argument("--shapes", default="0,1,2,3")
    ap.add_argument("--variants", default="0,2,3")
    ap.add_argument("--eager", action="store_true", help="also eager calls")
    args = ap.parse_args()
    variants = [VARIANTS[int(v)] for v in args.variants.split(",")]
    old = (T.GEMM_MIN_M, T.GEMM_MAX_M, T.GEMM_PREFETCH)
    for si in (int(v) for v in args.shapes.split(",")):
        label, k, n = SHAPES[si]
        case = B.Case(k, n, args.bits)
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 0.5
            ref = case.reference(x.float())
            q, bw = case.buffers(m)
            modes = (True, False) if args.eager else (True,)
            t_b = {gr: B.time_calls([lambda w=w: F.linear(x, w) for w in bw], graph=gr)[0] for gr in modes}
            cells = [f"bf16 {t_b[True]:.1f}" + (f"/{t_b[False]:.1f}" if args.eager else "")]
            for name, setting in variants:
                T.GEMM_MIN_M, T.GEMM_MAX_M, T.GEMM_PREFETCH = setting or old
                y = torch.ops.turboquant.linear(x, q[0][0], q[0][1], case.cb_ours, case.s1, case.s2, case.g, k)
                err = B.rel_err(y, ref)
                ts = {gr: B.time_calls([lambda pk=pk, nr=nr: torch.ops.turboquant.linear(
                    x, pk, nr, case.cb_ours, case.s1, case.s2, case.g, k) for pk, nr in q], graph=gr)[0]
                    for gr in modes}
                cell = f"{name} {ts[True]:.1f} ({t_b[True] / ts[True]:.2f}x)"
                if args.eager:
                    cell += f" eager {ts[False]:.1f} ({t_b[False] / ts[False]:.2f}x)"
                cells.append(cell + ("" if err < 2e-2 else f" WRONG {err:.1e}"))
            T.GEMM_MIN_M, T.GEMM_MAX_M, T.GEMM_PREFETCH = old
            print(f"{args.bits}-bit {label} M={m}: " + ", ".join(cells), flush=True)
            del q, bw
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
