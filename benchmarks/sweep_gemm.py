"""Tune the packed-weight GEMM (`kernels/gemm.py`): for each weight shape and M, time candidate configurations of
`gemm.gemm` on rotated activations, the whole op (`torch.ops.turboquant.linear`: rotation + product, as dispatched
now) and bf16 cuBLAS in the same run, as CUDA-graph replays over weight copies that overflow the L2.

    python sweep_gemm.py [--bits 3] [--ms 16,32,64,128,256,512,2048] [--shapes 4096x4096,...] [--json out.json]
                         [--prefetch 0,1]

`--prefetch 0,1` times every configuration without and with `tuning.GEMM_PREFETCH` (the next block's packed words
loaded before the current block is decoded).

Every candidate's output is checked against the float32 reference first (relative error column); a candidate that
fails to compile or is wrong is reported and skipped.
"""

from __future__ import annotations

import argparse
import json
import sys

import bench_linear as B
import torch
import torch.nn.functional as F
from turboquant_hf.kernels import gemm as GM
from turboquant_hf.kernels import linear as L
from turboquant_hf.kernels import tuning as T

from turboquant_hf.format import constants as fmt


def _n_buffers(nbytes: int, m: int) -> int:
    """Weight copies enough to overflow the L2 four times, at every M."""
    import math

    return int(min(64, max(2, math.ceil(4 * B.L2_BYTES / max(nbytes, 1)))))


B.n_buffers = _n_buffers


def candidates(m: int, n: int) -> list[tuple]:
    """(BM, BN, SWAP, LANES, GROUP, warps, stages) to try at M rows for N outputs."""
    if m <= 16:
        out = [(16, 64, True, True, 1, 4, 3), (16, 64, True, True, 1, 4, 5), (16, 128, True, True, 1, 4, 4),
               (16, 64, True, False, 1, 4, 3)]
    elif m <= 32:
        out = [(32, 64, True, True, 1, 4, 3), (32, 64, True, True, 1, 4, 5), (32, 128, True, True, 1, 4, 4)]
    elif m <= 64:
        out = [(64, 64, True, True, 1, 4, 3), (64, 64, True, True, 1, 4, 5), (64, 128, True, True, 1, 4, 3),
               (64, 128, True, True, 1, 8, 3), (64, 128, True, False, 1, 4, 3)]
    elif m <= 128:
        out = [(128, 64, True, True, 1, 4, 3), (128, 128, True, True, 1, 8, 3), (64, 128, True, True, 1, 4, 3)]
    elif m <= 512:
        out = [(128, 128, True, True, 4, 8, 3), (256, 128, True, True, 4, 8, 2), (128, 128, False, False, 4, 8, 3),
               (128, 64, True, True, 4, 4, 3), (64, 128, True, True, 4, 4, 3)]
    else:
        out = [(128, 128, True, True, 8, 8, 3), (256, 128, True, True, 8, 8, 2), (128, 128, False, False, 8, 8, 3),
               (128, 128, False, False, 8, 8, 4), (128, 128, True, True, 8, 8, 4), (128, 128, True, False, 8, 8, 3)]
    return out


def splits(m: int, n: int, ng: int, g: int, bm: int, bn: int) -> list[int]:
    tiles = -(-m // bm) * -(-n // bn)
    nblk = ng * g // min(g, 128)
    out = [1]
    for s in (2, 4, 8):
        if nblk % s == 0 and nblk // s >= 2 and tiles * s <= 8 * 132:
            out.append(s)
    return out


def jobs_for(bits, shapes, ms, all_splits, prefetch=(0,)):
    """Every (bits, k, n, m, cfg, prefetch) the sweep will time."""
    out = []
    for label, k, n in shapes:
        nl = fmt.levels_for_bits(bits)
        ng = -(-k // 128)
        for m in ms:
            for bm, bn, swap, lanes, group, warps, stages in candidates(m, n):
                sps = splits(m, n, ng, 128, bm, bn) if all_splits else sorted(
                    {1, GM.gemm_config(m, n, ng, nl, 128)[3]} | set(splits(m, n, ng, 128, bm, bn)[-1:]))
                for sp in sps:
                    for pf in prefetch:
                        out.append((bits, k, n, m, (bm, bn, 128, sp, swap, lanes, group, warps, stages), pf))
    return out


def _compile_job(job):
    """Compile one job's kernel (a launch on random words: Triton's disk cache then serves the timing run)."""
    bits, k, n, m, cfg, pf = job
    T.GEMM_PREFETCH = bool(pf)
    try:
        nl = fmt.levels_for_bits(bits)
        knl = 4 if nl == 3 else nl
        ng = -(-k // 128)
        words = ng * 128 * (3 if knl == 8 else 1) // (32 if knl == 8 else (8 if knl == 16 else 16))
        pk = torch.randint(-2**31, 2**31 - 1, (n, words), dtype=torch.int32, device="cuda")
        nr = torch.rand(n, ng, device="cuda")
        cb = torch.linspace(-1, 1, knl, device="cuda")
        xr = torch.randn(m, ng * 128, device="cuda", dtype=torch.bfloat16)
        GM.gemm(xr, pk, nr, cb, 128, torch.bfloat16, config=cfg)
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # noqa: BLE001
        return f"{job}: {type(exc).__name__}: {str(exc)[:200]}"


def precompile(jobs, workers: int) -> None:
    import concurrent.futures
    import multiprocessing
    import time

    t0 = time.time()
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        for err in pool.map(_compile_job, jobs, chunksize=1):
            if err:
                print("precompile FAILED", err, flush=True)
    print(f"precompiled {len(jobs)} jobs in {time.time() - t0:.0f} s with {workers} processes", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--bits", default="3")
    p.add_argument("--ms", default="16,32,64,128,256,512,2048")
    p.add_argument("--shapes", default="")
    p.add_argument("--json", default="")
    p.add_argument("--all-splits", action="store_true")
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--prefetch", default="0")
    args = p.parse_args()
    pfs = tuple(int(v) for v in args.prefetch.split(","))
    bits_list = [fmt.TERNARY if b in ("1.58", "ternary") else int(b) for b in args.bits.split(",")]
    ms = [int(v) for v in args.ms.split(",")]
    shapes = [s for s in B.SHAPES if not args.shapes or s[0].split(" ")[0] in args.shapes.split(",")]
    if args.workers > 1:
        precompile([j for b in bits_list for j in jobs_for(b, shapes, ms, args.all_splits, pfs)], args.workers)
    rows = []
    for bits in bits_list:
        for label, k, n in shapes:
            case = B.Case(k, n, bits)
            ng = case.norms.shape[1]
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = case.reference(x.float())
                q, bw = case.buffers(m)
                xr_nat = L.rotate(x, case.s1, case.s2, case.g, torch.bfloat16)
                unit = GM.lane_unit(case.nl if case.nl != 3 else 4)
                xr_lane = L.rotate(x, case.s1, case.s2, case.g, torch.bfloat16, lane_unit=unit)
                t_bf16, _ = B.time_calls([lambda w=w: F.linear(x, w) for w in bw], graph=True)
                old = {key: getattr(T, key) for key in ("GEMM_MIN_M", *T.GEMM_OPEN)}
                T.GEMM_MIN_M = 1 << 62  # the dispatch without the GEMM
                t_op, _ = B.time_calls([lambda pk=pk, nr=nr: torch.ops.turboquant.linear(
                    x, pk, nr, case.cb_ours, case.s1, case.s2, case.g, k) for pk, nr in q], graph=True)
                # ... and with it at every M, as `gemm_config` chooses (checked first)
                for key, value in dict(T.GEMM_OPEN, GEMM_MIN_M=17).items():
                    setattr(T, key, value)
                y_op = torch.ops.turboquant.linear(x, q[0][0], q[0][1], case.cb_ours, case.s1, case.s2, case.g, k)
                err_op = B.rel_err(y_op, ref)
                if not err_op < 2e-2:
                    print(f"  {label} M={m}: the op with the GEMM is WRONG: rel. error {err_op:.2e}", flush=True)
                t_op_gemm, _ = B.time_calls([lambda pk=pk, nr=nr: torch.ops.turboquant.linear(
                    x, pk, nr, case.cb_ours, case.s1, case.s2, case.g, k) for pk, nr in q], graph=True)
                for key, value in old.items():
                    setattr(T, key, value)
                t_rot, _ = B.time_calls([lambda: L.rotate(x, case.s1, case.s2, case.g, torch.bfloat16,
                                                          lane_unit=unit)], graph=True)
                best = None
                for cfg, pf in [j[4:] for j in jobs_for(bits, [(label, k, n)], [m], args.all_splits, pfs)]:
                    T.GEMM_PREFETCH = bool(pf)
                    if True:
                        xr = xr_lane if cfg[5] else xr_nat
                        try:
                            y = GM.gemm(xr, q[0][0], q[0][1], case.cb_ours, case.g, torch.bfloat16, config=cfg)
                            err = B.rel_err(y, ref)
                            if not err < 2e-2:
                                raise RuntimeError(f"wrong result: rel. error {err:.2e}")
                            t, _ = B.time_calls([lambda pk=pk, nr=nr: GM.gemm(
                                xr, pk, nr, case.cb_ours, case.g, torch.bfloat16, config=cfg) for pk, nr in q],
                                graph=True)
                        except Exception as exc:  # noqa: BLE001
                            print(f"  {label} M={m} {cfg}: FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                            continue
                        row = dict(bits=str(bits), shape=label, m=m, cfg=cfg, prefetch=pf, us=t, err=err, bf16=t_bf16,
                                   op=t_op, rot=t_rot)
                        rows.append(row)
                        print(f"  {label} b{bits} M={m} {cfg}{' prefetch' if pf else ''}: {t:.1f} us ({t_bf16 / t:.2f}x bf16; "
                              f"+rot {t_bf16 / (t + t_rot):.2f}x) err {err:.1e}", flush=True)
                        if best is None or t < best["us"]:
                            best = row
                if best:
                    print(f"BEST {label} b{bits} M={m}: bf16 {t_bf16:.1f} op-now {t_op:.1f} ({t_bf16 / t_op:.2f}x) "
                          f"op-gemm-table {t_op_gemm:.1f} ({t_bf16 / t_op_gemm:.2f}x) "
                          f"rot {t_rot:.1f} gemm {best['us']:.1f} ({t_bf16 / best['us']:.2f}x; with rot "
                          f"{t_bf16 / (best['us'] + t_rot):.2f}x) {best['cfg']} prefetch {best['prefetch']}", flush=True)
                del q, bw
                torch.cuda.empty_cache()
                if args.json:  # after every (shape, M): a run cut short keeps what it measured
                    with open(args.json, "w") as f:
                        json.dump(rows, f, indent=0)
    print("\nSUMMARY (graph replays; ratio = bf16 / ours)")
    print("bits shape M | bf16 us | op-now us (x) | best gemm+rot us (x) | cfg")
    seen = {}
    for r in rows:
        key = (r["bits"], r["shape"], r["m"])
        if key not in seen or r["us"] < seen[key]["us"]:
            seen[key] = r
    for (bits, shape, m), r in seen.items():
        tot = r["us"] + r["rot"]
        print(f"{bits} {shape} {m} | {r['bf16']:.1f} | {r['op']:.1f} ({r['bf16'] / r['op']:.2f}) | {tot:.1f} "
              f"({r['bf16'] / tot:.2f}) | {r['cfg']} prefetch {r['prefetch']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
