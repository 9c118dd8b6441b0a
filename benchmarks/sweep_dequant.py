"""The prefill's weight decoding (`dequantize_lut` with the rotation undone: packed words in, the 16-bit weight
out) by launch configuration: rows of (row, group) pairs a block, warps, programs per multiprocessor; CUDA-graph
replays over weight copies that overflow the L2, with the bandwidth it reaches (packed bytes and norms read, the
16-bit weight written).

    python sweep_dequant.py [--bits 3] [--shapes 0,1,2]
"""

from __future__ import annotations

import argparse
import itertools

import torch

import bench_linear as B
from turboquant_hf.kernels import linear as L

SHAPES = (("4096x4096", 4096, 4096), ("4096->28672 (gate/up)", 4096, 28672), ("14336->4096 (down)", 14336, 4096))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--shapes", default="0,1,2")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for si in (int(v) for v in args.shapes.split(",")):
        label, k, n = SHAPES[si]
        case = B.Case(k, n, args.bits)
        q, _ = case.buffers(2048)
        nbytes = case.qbytes + 2 * n * k
        ref = L.dequantize_lut(q[0][0], q[0][1], case.cb_ours, case.g, torch.bfloat16, case.s1, case.s2, k)
        rows = []
        for br, warps, per_sm in itertools.product((16, 32, 64), (4, 8), (1, 2, 3, 4)):
            kw = dict(block_rows=br, warps=warps, programs=per_sm * sms)
            try:
                w = L.dequantize_lut(q[0][0], q[0][1], case.cb_ours, case.g, torch.bfloat16, case.s1, case.s2, k, **kw)
                if not B.rel_err(w, ref) < 1e-3:
                    raise RuntimeError(f"differs from the default launch by {B.rel_err(w, ref):.1e}")
                t, _ = B.time_calls([lambda pk=pk, nr=nr: L.dequantize_lut(
                    pk, nr, case.cb_ours, case.g, torch.bfloat16, case.s1, case.s2, k, **kw) for pk, nr in q],
                    graph=True)
            except Exception as exc:  # noqa: BLE001
                print(f"{label} BR={br} warps={warps} {per_sm}/SM: FAILED {exc}"[:300], flush=True)
                continue
            rows.append((t, br, warps, per_sm))
        rows.sort()
        default = next(r for r in rows if r[1:] == (64, 4, 2))
        print(f"{args.bits}-bit {label}: default (BR 64, 4 warps, 2/SM) {default[0]:.1f} us "
              f"({nbytes / default[0] / 1e3:.0f} GB/s)", flush=True)
        for t, br, warps, per_sm in rows[:8]:
            print(f"  BR={br} warps={warps} {per_sm}/SM: {t:.1f} us ({nbytes / t / 1e3:.0f} GB/s)", flush=True)
        del q
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
