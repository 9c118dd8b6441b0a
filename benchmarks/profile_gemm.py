"""Where the packed-weight GEMM's time goes: the same run times, as CUDA-graph replays over weight copies that
overflow the L2,

- bf16 cuBLAS (`F.linear`) and a plain Triton bf16 GEMM with the GEMM's own tile shape (what Triton reaches on
  these tiles without any decoding: the ceiling of a decode-in-the-loop Triton kernel);
- `gemm.gemm` (3-bit) with the given configuration;
- the rotation of the activations in the natural and in the lane order;
- at `--moe`, the MoE layer's two grouped products at 2048 tokens (E = 256, top-8, H = 2048, I = 512): the
  routed packed-weight GEMM against the routed lookup product and bf16 `torch._grouped_mm`.

    python profile_gemm.py [--m 2048] [--k 4096] [--n 4096] [--cfg 256,128,128,1,1,1,8,8,2] [--moe]
    ncu --clock-control none -k regex:"_gemm_kernel|_bf16_gemm_kernel" --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section WarpStateStats python profile_gemm.py --once
"""

from __future__ import annotations

import argparse

import bench_linear as B
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from turboquant_hf.kernels import gemm as GM
from turboquant_hf.kernels import linear as L


@triton.jit
def _bf16_gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      GROUP: tl.constexpr):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    width = GROUP * grid_n
    first_m = (pid // width) * GROUP
    gsize = tl.minimum(grid_m - first_m, GROUP)
    pid_m = first_m + (pid % width) % gsize
    pid_n = (pid % width) // gsize
    rm = tl.minimum(pid_m * BM + tl.arange(0, BM), M - 1).to(tl.int64)
    rn = tl.minimum(pid_n * BN + tl.arange(0, BN), N - 1).to(tl.int64)
    kk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(x_ptr + rm[:, None] * K + (k0 + kk)[None, :])
        b = tl.load(w_ptr + rn[:, None] * K + (k0 + kk)[None, :])
        acc = tl.dot(a, tl.trans(b), acc)
    om = pid_m * BM + tl.arange(0, BM)
    on = pid_n * BN + tl.arange(0, BN)
    tl.store(out_ptr + om[:, None].to(tl.int64) * N + on[None, :], acc.to(tl.bfloat16),
             mask=(om < M)[:, None] & (on < N)[None, :])


def bf16_gemm(x, w, bm=128, bn=256, bk=64, warps=8, stages=3, group=8):
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _bf16_gemm_kernel[grid](x, w, out, m, n, k, BM=bm, BN=bn, BK=bk, GROUP=group, num_warps=warps,
                            num_stages=stages)
    return out


def dense(args) -> None:
    m, k, n = args.m, args.k, args.n
    cfg = tuple(int(v) for v in args.cfg.split(","))
    cfg = cfg[:4] + (bool(cfg[4]), bool(cfg[5])) + cfg[6:]
    case = B.Case(k, n, 3)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    unit = GM.lane_unit(8)
    x_nat = L.rotate(x, case.s1, case.s2, case.g, torch.bfloat16)
    x_lane = L.rotate(x, case.s1, case.s2, case.g, torch.bfloat16, lane_unit=unit)
    xr = x_lane if cfg[5] else x_nat
    if args.once:  # for ncu: a few plain launches
        for _ in range(3):
            GM.gemm(xr, case.ours, case.norms, case.cb_ours, case.g, torch.bfloat16, config=cfg)
            bf16_gemm(x, case.w16)
        torch.cuda.synchronize()
        return
    q, bw = case.buffers(m)
    ref = F.linear(x.float(), case.w16.float())
    t_cublas, _ = B.time_calls([lambda w=w: F.linear(x, w) for w in bw], graph=True)
    print(f"M={m} K={k} N={n}: bf16 cuBLAS {t_cublas:.1f} us ({2 * m * n * k / t_cublas / 1e6:.0f} TFLOP/s)")
    for bm, bn, bk, warps, stages in ((128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 128, 8, 3),
                                      (cfg[0], cfg[1], cfg[2], cfg[7], cfg[8])):
        try:
            err = B.rel_err(bf16_gemm(x, case.w16, bm, bn, bk, warps, stages), ref)
            t, _ = B.time_calls([lambda w=w: bf16_gemm(x, w, bm, bn, bk, warps, stages) for w in bw], graph=True)
            print(f"  Triton bf16 GEMM BM={bm} BN={bn} BK={bk} warps={warps} stages={stages}: {t:.1f} us "
                  f"({t_cublas / t:.2f}x cuBLAS) err {err:.1e}")
        except Exception as exc:  # noqa: BLE001
            print(f"  Triton bf16 GEMM {bm, bn, bk, warps, stages}: FAILED {type(exc).__name__}: {str(exc)[:150]}")
    y = GM.gemm(xr, q[0][0], q[0][1], case.cb_ours, case.g, torch.bfloat16, config=cfg)
    t, _ = B.time_calls([lambda pk=pk, nr=nr: GM.gemm(xr, pk, nr, case.cb_ours, case.g, torch.bfloat16, config=cfg)
                         for pk, nr in q], graph=True)
    print(f"  packed GEMM {cfg}: {t:.1f} us ({t_cublas / t:.2f}x cuBLAS) err vs the reference "
          f"{B.rel_err(y, case.reference(x.float())):.1e}")
    for name, kw in (("natural", {}), ("lane", dict(lane_unit=unit))):
        t, _ = B.time_calls([lambda: L.rotate(x, case.s1, case.s2, case.g, torch.bfloat16, **kw)], graph=True)
        print(f"  rotate ({name} order): {t:.1f} us ({4 * m * k / t / 1e6:.0f} GB/s counting bytes read and written)")


def moe(args) -> None:
    from turboquant_hf.kernels import moe as KM

    from turboquant_hf.format import codec
    from turboquant_hf.format import constants as fmt
    from turboquant_hf.format import runtime_layout as layout

    e, topk, h, inter, g, t = 256, 8, 2048, 512, 128, args.moe_tokens
    torch.manual_seed(0)
    nl = 8
    cb = layout.runtime_codebook(fmt.codebook(nl, g, "cuda"))
    mats = {}
    for name, n, k in (("gate_up", 2 * inter, h), ("down", h, inter)):
        packed, norms = [], []
        for i in range(0, e, 32):
            p_, n_ = codec.quantize_weight(torch.randn(32 * n, k, device="cuda") * 0.02, 3, g)
            packed.append(layout.to_runtime(p_, nl, g, k // g))
            norms.append(n_.to(fmt.default_norms_dtype(nl)))
        mats[name] = (torch.cat(packed), torch.cat(norms), n, k)
    hidden = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(e, device="cuda")[:topk] for _ in range(t)])
    tok, pos, _, offs = KM._device_routing(idx, e)
    p = tok.numel()
    s1, s2 = fmt.signs(g, "cuda")
    for name, (pk, nr, n, k) in mats.items():
        x = hidden if name == "gate_up" else torch.randn(p, inter, device="cuda", dtype=torch.bfloat16)
        xrow = tok if name == "gate_up" else None
        x_nat = L.rotate(x, s1, s2, g, torch.bfloat16)
        cfg = GM.routed_config(p, e, n, nl, g)
        x_gemm = L.rotate(x, s1, s2, g, torch.bfloat16, lane_unit=GM.lane_unit(nl) if cfg[4] else 0,
                          lane_block=cfg[2])
        a = KM.routed_lut_mm(x_nat, offs, pk, nr, cb, g, e, torch.bfloat16, xrow=xrow)
        b = GM.routed_gemm(x_gemm, offs, pk, nr, cb, g, e, torch.bfloat16, xrow=xrow, config=cfg)
        t_lut, _ = B.time_calls([lambda: KM.routed_lut_mm(x_nat, offs, pk, nr, cb, g, e, torch.bfloat16, xrow=xrow)],
                                graph=True)
        t_gemm, _ = B.time_calls([lambda: GM.routed_gemm(x_gemm, offs, pk, nr, cb, g, e, torch.bfloat16, xrow=xrow,
                                                         config=cfg)], graph=True)
        w16 = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        xg = x[tok.long()] if xrow is not None else x
        t_bf16, _ = B.time_calls([lambda: torch._grouped_mm(xg, w16.transpose(1, 2), offs=offs)], graph=True)
        print(f"MoE {name} ({p} pairs, N={n}, K={k}): routed lookup product {t_lut:.1f} us, routed GEMM {cfg} "
              f"{t_gemm:.1f} us ({t_lut / t_gemm:.2f}x), bf16 grouped_mm {t_bf16:.1f} us; rel. diff "
              f"{B.rel_err(b[:p], a[:p]):.1e}")
        for bm in (32, 64, 128):
            for bn, warps in ((64, 4), (128, 4), (128, 8)):
                c2 = (bm, bn, cfg[2], True, cfg[4] and bn % (16 * warps) == 0, warps, 3)
                if c2[4] != cfg[4]:
                    continue
                try:
                    tt, _ = B.time_calls([lambda: GM.routed_gemm(x_gemm, offs, pk, nr, cb, g, e, torch.bfloat16,
                                                                 xrow=xrow, config=c2)], graph=True)
                    print(f"    {c2}: {tt:.1f} us")
                except Exception as exc:  # noqa: BLE001
                    print(f"    {c2}: FAILED {type(exc).__name__}: {str(exc)[:120]}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=2048)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--cfg", default="256,128,128,1,1,1,8,8,2")
    ap.add_argument("--once", action="store_true")
    ap.add_argument("--moe", action="store_true")
    ap.add_argument("--moe-tokens", type=int, default=2048)
    ap.add_argument("--prefetch", type=int, default=None, help="set tuning.GEMM_PREFETCH (default: as it is)")
    args = ap.parse_args()
    if args.prefetch is not None:
        from turboquant_hf.kernels import tuning

        tuning.GEMM_PREFETCH = bool(args.prefetch)
    if args.moe:
        moe(args)
    else:
        dense(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
