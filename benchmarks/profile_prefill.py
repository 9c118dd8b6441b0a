"""Where the prefill product's time goes (M above the tensor-core GEMV's rows), and what decoding the weight a
chunk of rows at a time into one L2-sized scratch buffer gives: the same run times, as CUDA-graph replays over
weight copies that overflow the L2,

- bf16 cuBLAS (`F.linear`) and the op as dispatched (`torch.ops.turboquant.linear`);
- its parts: the whole weight decoded with the rotation undone (`dequantize_lut` with the signs), decoded in the
  rotated basis (without), and the rotation of the activations;
- chunked: for each chunk of C rows, decode them into the one scratch buffer, then cuBLAS into those columns of
  the output (`torch.mm(..., out=y[:, a:b])`); "unrot" decodes with the rotation undone and multiplies the
  activations as they are (as `linear.prefill` does with the whole weight), "rot" rotates the activations once and
  decodes in the rotated basis. C is given in MiB of bf16 scratch. (Slower than the whole weight at once at every
  size on an H100: GEMM.md.)

    python profile_prefill.py [--ms 128,256,512,2048] [--mib 4,8,16,32] [--bits 3]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import bench_linear as B
from turboquant_hf.kernels import linear as L

SHAPES = (("4096x4096", 4096, 4096), ("4096->6144 (q/k/v)", 4096, 6144), ("4096->28672 (gate/up)", 4096, 28672),
          ("14336->4096 (down)", 14336, 4096))


def chunked(x, pk, nr, case, rows: int, scratch, rotated: bool):
    """The product a chunk of `rows` weight rows at a time through `scratch`."""
    n, ng = nr.shape
    g = case.g
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    xr = L.rotate(x, case.s1, case.s2, g, x.dtype) if rotated else x
    for a in range(0, n, rows):
        b = min(n, a + rows)
        w = scratch[: b - a]
        if rotated:
            L.dequantize_lut(pk[a * ng:b * ng], nr[a:b], case.cb_ours, g, x.dtype, out=w)
        else:
            L.dequantize_lut(pk[a * ng:b * ng], nr[a:b], case.cb_ours, g, x.dtype, case.s1, case.s2, case.k, out=w)
        torch.mm(xr, w.t(), out=y[:, a:b])
    return y


_SIDE: dict = {}


def overlapped(x, pk, nr, case, parts: int, buffers):
    """The product in `parts` chunks of rows, each decoded on a second stream into one of two buffers while the
    main stream multiplies the chunk before (the decode is memory-bound, cuBLAS at large M compute-bound)."""
    n, ng = nr.shape
    g = case.g
    rows = (-(-n // parts) + 63) // 64 * 64
    main = torch.cuda.current_stream()
    side = _SIDE.setdefault(x.device, torch.cuda.Stream(x.device))
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    side.wait_stream(main)
    used = [None, None]  # (the event after the product that last read each buffer)
    for i, a in enumerate(range(0, n, rows)):
        b = min(n, a + rows)
        w = buffers[i % 2][: b - a]
        with torch.cuda.stream(side):
            if used[i % 2] is not None:
                side.wait_event(used[i % 2])
            L.dequantize_lut(pk[a * ng:b * ng], nr[a:b], case.cb_ours, g, x.dtype, case.s1, case.s2, case.k, out=w)
            done = torch.cuda.Event()
            done.record(side)
        main.wait_event(done)
        torch.mm(x, w.t(), out=y[:, a:b])
        used[i % 2] = torch.cuda.Event()
        used[i % 2].record(main)
    main.wait_stream(side)
    return y


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="128,256,512,2048")
    ap.add_argument("--mib", default="4,8,16,32")
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--shapes", default="0,1,2,3")
    ap.add_argument("--parts", default="", help="only the two-stream variant, in these numbers of chunks (e.g. 2,4,8)")
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    mibs = [int(v) for v in args.mib.split(",")]
    for si in (int(v) for v in args.shapes.split(",")):
        label, k, n = SHAPES[si]
        case = B.Case(k, n, args.bits)
        ng = case.norms.shape[1]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 0.5
            q, bw = case.buffers(m)
            ref = torch.ops.turboquant.linear(x, q[0][0], q[0][1], case.cb_ours, case.s1, case.s2, case.g, k)
            t_b, _ = B.time_calls([lambda w=w: F.linear(x, w) for w in bw], graph=True)
            del bw
            t_op, _ = B.time_calls([lambda pk=pk, nr=nr: torch.ops.turboquant.linear(
                x, pk, nr, case.cb_ours, case.s1, case.s2, case.g, k) for pk, nr in q], graph=True)
            if args.parts:
                cells = [f"bf16 {t_b:.1f}", f"op {t_op:.1f} ({t_b / t_op:.2f}x)"]
                for parts in (int(v) for v in args.parts.split(",")):
                    rows = (-(-n // parts) + 63) // 64 * 64
                    bufs = [torch.empty(rows, k, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
                    y = overlapped(x, q[0][0], q[0][1], case, parts, bufs)
                    torch.cuda.synchronize()
                    err = B.rel_err(y, ref)
                    t, _ = B.time_calls([lambda pk=pk, nr=nr: overlapped(x, pk, nr, case, parts, bufs)
                                         for pk, nr in q], graph=True)
                    cells.append(f"2 streams x{parts} {t:.1f} ({t_b / t:.2f}x)" + ("" if err < 2e-2 else f" err {err:.1e}"))
                    del bufs
                print(f"{args.bits}-bit {label} M={m}: " + ", ".join(cells), flush=True)
                del q
                torch.cuda.empty_cache()
                continue
            t_du, _ = B.time_calls([lambda pk=pk, nr=nr: L.dequantize_lut(
                pk, nr, case.cb_ours, case.g, torch.bfloat16, case.s1, case.s2, k) for pk, nr in q], graph=True)
            t_dr, _ = B.time_calls([lambda pk=pk, nr=nr: L.dequantize_lut(
                pk, nr, case.cb_ours, case.g, torch.bfloat16) for pk, nr in q], graph=True)
            t_rx, _ = B.time_calls([lambda: L.rotate(x, case.s1, case.s2, case.g, torch.bfloat16)], graph=True)
            cells = [f"bf16 {t_b:.1f}", f"op[{L.path(m, case.nl, case.g, torch.bfloat16, case.ours)}] {t_op:.1f} "
                     f"({t_b / t_op:.2f}x)", f"dequant unrot {t_du:.1f}", f"dequant rot {t_dr:.1f}",
                     f"rotate x {t_rx:.1f}"]
            for mib in mibs:
                rows = max(64, min(n, (mib << 20) // (2 * ng * case.g)) // 64 * 64)
                scratch = torch.empty(rows, max(k, ng * case.g), dtype=torch.bfloat16, device="cuda")
                for rotated in (False, True):
                    sc = scratch[:, : ng * case.g] if rotated else scratch[:, :k]
                    y = chunked(x, q[0][0], q[0][1], case, rows, sc, rotated)
                    err = B.rel_err(y, ref)
                    t, _ = B.time_calls([lambda pk=pk, nr=nr: chunked(x, pk, nr, case, rows, sc, rotated)
                                         for pk, nr in q], graph=True)
                    cells.append(f"{'rot' if rotated else 'unrot'} {mib}MiB/{rows}r {t:.1f} ({t_b / t:.2f}x)"
                                 + ("" if err < 2e-2 else f" err {err:.1e}"))
                del scratch
            print(f"{args.bits}-bit {label} M={m}: " + ", ".join(cells), flush=True)
            del q
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
