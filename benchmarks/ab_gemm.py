"""The whole op (`torch.ops.turboquant.linear`: rotation and product) with and without the packed-weight GEMM, by
M: the dispatch without it (tensor-core GEMV up to 64 rows, then dequantize + cuBLAS), with it at every M from 17
rows (`tuning.GEMM_MIN_M`, `GEMM_MAX_M`), with and without the next block's words loaded ahead
(`tuning.GEMM_PREFETCH`), and as dispatched by default; bf16 `F.linear` in the same run. CUDA-graph replays over
weight copies that overflow the L2, and eager calls.

    python ab_gemm.py [--bits 3|2|4|1.58] [--ms 32,64,128,256,512,1024,2048] [--shapes 0,1,2,3]

Shape 5 (gate or up alone) against shape 2 (both fused) tells whether the fused product should serve more rows
(`tuning.FUSED_MAX_ROWS`).
"""

from __future__ import annotations

import argparse

import bench_linear as B
import torch
import torch.nn.functional as F
from turboquant_hf.kernels import tuning as T

from turboquant_hf.format import constants as fmt

SHAPES = (("4096x4096", 4096, 4096), ("4096->6144 (q/k/v)", 4096, 6144), ("4096->28672 (gate/up)", 4096, 28672),
          ("14336->4096 (down)", 14336, 4096), ("2048->1024 (expert)", 2048, 1024),
          ("4096->14336 (gate or up alone)", 4096, 14336))
_EVERYWHERE = dict(T.GEMM_OPEN, GEMM_MIN_M=17)
# (name, the tuning values it sets; {}: as dispatched by default)
VARIANTS = (("no GEMM", dict(GEMM_MIN_M=1 << 62)), ("GEMM", dict(_EVERYWHERE, GEMM_PREFETCH=False)),
            ("GEMM+prefetch", dict(_EVERYWHERE, GEMM_PREFETCH=True)), ("default", {}))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", default="3", help="2, 3, 4 or 1.58 (ternary)")
    ap.add_argument("--ms", default="32,64,128,256,512,1024,2048")
    ap.add_argument("--shapes", default="0,1,2,3")
    ap.add_argument("--variants", default="0,2,3")
    ap.add_argument("--eager", action="store_true", help="also eager calls")
    args = ap.parse_args()
    bits = fmt.TERNARY if args.bits in ("1.58", "ternary") else int(args.bits)
    variants = [VARIANTS[int(v)] for v in args.variants.split(",")]
    old = {key: getattr(T, key) for key in (*_EVERYWHERE, "GEMM_PREFETCH")}
    for si in (int(v) for v in args.shapes.split(",")):
        label, k, n = SHAPES[si]
        case = B.Case(k, n, bits)
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 0.5
            ref = case.reference(x.float())
            q, bw = case.buffers(m)
            modes = (True, False) if args.eager else (True,)
            t_b = {gr: B.time_calls([lambda w=w: F.linear(x, w) for w in bw], graph=gr)[0] for gr in modes}
            cells = [f"bf16 {t_b[True]:.1f}" + (f"/{t_b[False]:.1f}" if args.eager else "")]
            for name, setting in variants:
                for key, value in {**old, **setting}.items():
                    setattr(T, key, value)
                y = torch.ops.turboquant.linear(x, q[0][0], q[0][1], case.cb_ours, case.s1, case.s2, case.g, k)
                err = B.rel_err(y, ref)
                ts = {gr: B.time_calls([lambda pk=pk, nr=nr: torch.ops.turboquant.linear(
                    x, pk, nr, case.cb_ours, case.s1, case.s2, case.g, k) for pk, nr in q], graph=gr)[0]
                    for gr in modes}
                cell = f"{name} {ts[True]:.1f} ({t_b[True] / ts[True]:.2f}x)"
                if args.eager:
                    cell += f" eager {ts[False]:.1f} ({t_b[False] / ts[False]:.2f}x)"
                cells.append(cell + ("" if err < 2e-2 else f" WRONG {err:.1e}"))
            for key, value in old.items():
                setattr(T, key, value)
            print(f"{args.bits}-bit {label} M={m}: " + ", ".join(cells), flush=True)
            del q, bw
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
