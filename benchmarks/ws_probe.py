"""What a warp-specialized Hopper GEMM written in Gluon (Triton's lower-level language) reaches on the dense
prefill shapes with 16-bit weights, against bf16 cuBLAS in the same run: the ceiling of a packed-weight GEMM
whose weight tiles are decoded by producer warps into shared memory while the tensor cores run.

Three ways the weight tile reaches shared memory:
- `tma`: both operands by TMA (one loader warp), a plain warp-specialized GEMM;
- `warps`: the activations by TMA, the weight loaded into registers by producer warps and stored to shared memory
  (what a decoding producer does, without the decoding's arithmetic);
- `--tq`: the activations (rotated) by TMA, a 3-bit runtime-layout weight decoded by the producer warps with the
  byte-permute lookups of `kernels/gemm.py` (`tq_gemm`), against the op as dispatched and the rotation alone.

The consumer partition issues asynchronous wgmma from shared memory (activations [BM, BK] on the left, the weight
[BN, BK] transposed on the right) with one product in flight, and releases a stage when its product is done.

    python ws_probe.py [--shapes 4096x4096,...] [--ms 512,2048] [--configs 128,128,64,4,8 ...]
    python ws_probe.py --tq [--ms 256,512,2048] [--tq-configs 128,128,3,8,4,152 ...]
    ncu --set full -k regex:tq_gemm_kernel --launch-skip 1 --launch-count 1 python ws_probe.py --tq --once \\
        --shapes 4096x4096 --ms 2048 --tq-configs 128,128,3,8,4,152
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from turboquant_hf.kernels.gemm import _unit_pairs
from turboquant_hf.kernels.gemv_mma import _mma_values, _norm_pattern
from turboquant_hf.kernels.lut import _byte_tables


@gluon.jit
def _producer(p, w_ptr, K, W_BY_TMA: gl.constexpr):
    """Fills stage s once the consumer has released it: the activation tile by TMA, the weight tile by TMA
    (W_BY_TMA) or loaded a step ahead into registers and stored to shared memory by this partition's warps."""
    x_desc, w_desc, x_bufs, w_bufs, x_ready, w_ready, empty, off_m, off_n, k_steps = p
    stages: gl.constexpr = x_bufs.type.shape[0]
    BN: gl.constexpr = w_bufs.type.shape[1]
    BK: gl.constexpr = w_bufs.type.shape[2]
    if W_BY_TMA:
        for ki in range(k_steps):
            s = ki % stages
            mbarrier.wait(empty.index(s), ((ki // stages) & 1) ^ 1)
            bar = x_ready.index(s)
            mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(w_desc, [off_n, ki * BK], bar, w_bufs.index(s))
            tma.async_copy_global_to_shared(x_desc, [off_m, ki * BK], bar, x_bufs.index(s))
    else:
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        rn = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, layout))
        rk = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
        ptrs = w_ptr + rn.to(gl.int64)[:, None] * K + rk[None, :]
        w = gl.load(ptrs)
        for ki in range(k_steps):
            s = ki % stages
            nxt = gl.load(ptrs + (ki + 1) * BK, mask=(ki + 1 < k_steps), other=0.0)
            mbarrier.wait(empty.index(s), ((ki // stages) & 1) ^ 1)
            bar = x_ready.index(s)
            mbarrier.expect(bar, x_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [off_m, ki * BK], bar, x_bufs.index(s))
            w_bufs.index(s).store(w)
            fence_async_shared()
            mbarrier.arrive(w_ready.index(s), count=1)
            w = nxt


@gluon.jit
def _decode_producer(p, pk_ptr, nrm_ptr, cb_ptr, NG, NUT):
    """Fills stage s once the consumer has released it: the activation tile by TMA, the weight tile decoded from
    the 3-bit runtime layout (one group of 128 inputs a step) by this partition's warps: each thread decodes one
    row's four units with the byte-permute lookups, scales them by the group norm and stores 128 bf16 values."""
    x_desc, _, x_bufs, w_bufs, x_ready, w_ready, empty, off_m, off_n, k_steps = p
    stages: gl.constexpr = x_bufs.type.shape[0]
    BN: gl.constexpr = w_bufs.type.shape[1]
    BK: gl.constexpr = w_bufs.type.shape[2]
    UPG: gl.constexpr = BK // 32
    layout: gl.constexpr = gl.BlockedLayout([1, UPG], [32, 1], [gl.num_warps(), 1], [1, 0])
    t0, t1, t2, t3, t4, t5, t6, t7 = _byte_tables(cb_ptr, 8, 1)
    rn = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, layout))
    ru = gl.arange(0, UPG, layout=gl.SliceLayout(0, layout))
    base = pk_ptr + rn.to(gl.int64)[:, None] * (3 * NUT) + ru[None, :]
    nbase = nrm_ptr + rn.to(gl.int64)[:, None] * NG + ru[None, :] * 0  # (one norm per row, per unit)
    w0 = gl.load(base)
    w1 = gl.load(base + NUT)
    w2 = gl.load(base + 2 * NUT)
    nr = gl.load(nbase)
    for ki in range(k_steps):
        s = ki % stages
        more = ki + 1 < k_steps
        off = (ki + 1) * UPG
        n0 = gl.load(base + off, mask=more, other=0)
        n1 = gl.load(base + NUT + off, mask=more, other=0)
        n2 = gl.load(base + 2 * NUT + off, mask=more, other=0)
        nn = gl.load(nbase + ki + 1, mask=more, other=0.0)
        nsc = _norm_pattern(nr.to(gl.float32), False, True)
        v = _unit_pairs(w0.to(gl.uint32, bitcast=True), w1.to(gl.uint32, bitcast=True),
                        w2.to(gl.uint32, bitcast=True), t0, t1, t2, t3, t4, t5, t6, t7,
                        nsc, 8, True, False, True)
        vals = gl.reshape(_mma_values(gl.reshape(v, [BN, BK // 2]), False, True), [BN, BK])
        mbarrier.wait(empty.index(s), ((ki // stages) & 1) ^ 1)
        bar = x_ready.index(s)
        mbarrier.expect(bar, x_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [off_m, ki * BK], bar, x_bufs.index(s))
        w_bufs.index(s).store(vals)
        fence_async_shared()
        mbarrier.arrive(w_ready.index(s), count=1)
        w0 = n0
        w1 = n1
        w2 = n2
        nr = nn


@gluon.jit
def _consumer(p, out_ptr, M, N, W_BY_TMA: gl.constexpr, num_warps: gl.constexpr):
    _, _, x_bufs, w_bufs, x_ready, w_ready, empty, off_m, off_n, k_steps = p
    stages: gl.constexpr = x_bufs.type.shape[0]
    BM: gl.constexpr = x_bufs.type.shape[1]
    BN: gl.constexpr = w_bufs.type.shape[1]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
    acc = gl.zeros([BM, BN], gl.float32, layout=mma_layout)
    for ki in range(k_steps):
        s = ki % stages
        ph = (ki // stages) & 1
        mbarrier.wait(x_ready.index(s), ph)
        if not W_BY_TMA:
            mbarrier.wait(w_ready.index(s), ph)
        acc = warpgroup_mma(x_bufs.index(s), w_bufs.index(s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc,))
        mbarrier.arrive(empty.index((ki + stages - 1) % stages), count=1, pred=ki > 0)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    rm = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, mma_layout))
    rn = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, mma_layout))
    gl.store(out_ptr + rm.to(gl.int64)[:, None] * N + rn[None, :], acc.to(gl.bfloat16),
             mask=(rm < M)[:, None] & (rn < N)[None, :])


@gluon.jit
def ws_gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                   STAGES: gl.constexpr, GROUP: gl.constexpr, W_BY_TMA: gl.constexpr, WRITER_WARPS: gl.constexpr,
                   WRITER_REGS: gl.constexpr, num_warps: gl.constexpr):
    pid = gl.program_id(0)
    grid_m = gl.cdiv(M, BM)
    grid_n = gl.cdiv(N, BN)
    width = GROUP * grid_n
    first_m = (pid // width) * GROUP
    gsize = gl.minimum(grid_m - first_m, GROUP)
    off_m = (first_m + (pid % width) % gsize) * BM
    off_n = ((pid % width) // gsize) * BN
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
    x_desc = tma.make_tensor_descriptor(x_ptr, [M, K], [K, 1], [BM, BK], x_layout)
    w_desc = tma.make_tensor_descriptor(w_ptr, [N, K], [K, 1], [BN, BK], w_layout)
    x_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], x_layout)
    w_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK], w_layout)
    x_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    w_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(x_ready.index(i), count=1)
        mbarrier.init(w_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    p = (x_desc, w_desc, x_bufs, w_bufs, x_ready, w_ready, empty, off_m, off_n, gl.cdiv(K, BK))
    gl.warp_specialize([
        (_consumer, (p, out_ptr, M, N, W_BY_TMA, num_warps)),
        (_producer, (p, w_ptr, K, W_BY_TMA)),
    ], [1 if W_BY_TMA else WRITER_WARPS], [24 if W_BY_TMA else WRITER_REGS])


@gluon.jit
def tq_gemm_kernel(x_ptr, pk_ptr, nrm_ptr, cb_ptr, out_ptr, M, N, K, NG, NUT, BM: gl.constexpr, BN: gl.constexpr,
                   BK: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr, WRITER_WARPS: gl.constexpr,
                   WRITER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """Rotated bf16 activations `[M, K]` times a 3-bit runtime-layout weight (G = BK = 128): the decode producer
    fills the weight stages, the default partition runs the products."""
    pid = gl.program_id(0)
    grid_m = gl.cdiv(M, BM)
    grid_n = gl.cdiv(N, BN)
    width = GROUP * grid_n
    first_m = (pid // width) * GROUP
    gsize = gl.minimum(grid_m - first_m, GROUP)
    off_m = (first_m + (pid % width) % gsize) * BM
    off_n = ((pid % width) // gsize) * BN
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
    x_desc = tma.make_tensor_descriptor(x_ptr, [M, K], [K, 1], [BM, BK], x_layout)
    x_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], x_layout)
    w_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK], w_layout)
    x_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    w_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(x_ready.index(i), count=1)
        mbarrier.init(w_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    p = (x_desc, x_desc, x_bufs, w_bufs, x_ready, w_ready, empty, off_m, off_n, gl.cdiv(K, BK))
    gl.warp_specialize([
        (_consumer, (p, out_ptr, M, N, False, num_warps)),
        (_decode_producer, (p, pk_ptr, nrm_ptr, cb_ptr, NG, NUT)),
    ], [WRITER_WARPS], [WRITER_REGS])


def tq_gemm(x_rot, packed, norms, cb, bm=128, bn=128, stages=3, warps=8, group=8, writer_warps=4,
            writer_regs=152):
    m, k = x_rot.shape
    n, ng = norms.shape
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x_rot.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    tq_gemm_kernel[grid](x_rot, packed, norms, cb, out, m, n, k, ng, ng * 4, bm, bn, 128, stages, group,
                         writer_warps, writer_regs, num_warps=warps)
    return out


def ws_gemm(x, w, bm=128, bn=128, bk=64, stages=4, warps=8, group=8, w_by_tma=True, writer_warps=4,
            writer_regs=96, maxnreg=None):
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    opts = {"num_warps": warps}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    ws_gemm_kernel[grid](x, w, out, m, n, k, bm, bn, bk, stages, group, w_by_tma, writer_warps, writer_regs,
                         **opts)
    return out


def _bf16_probe(args, B) -> None:
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        nbuf = max(2, -(-4 * B.L2_BYTES // (2 * n * k)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(nbuf)]
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.float(), ws[0].float())
            t_ref, _ = B.time_calls([lambda w=w, x=x: F.linear(x, w) for w in ws], graph=True)
            print(f"{k}->{n} M={m}: bf16 cuBLAS {t_ref:.1f} us")
            for cfg in args.configs:
                bm, bn, bk, stages, warps = (int(v) for v in cfg.split(","))
                for w_by_tma in (True, False):
                    kw = {"bm": bm, "bn": bn, "bk": bk, "stages": stages, "warps": warps, "w_by_tma": w_by_tma}
                    name = f"  {'tma  ' if w_by_tma else 'warps'} BM={bm} BN={bn} BK={bk} stages={stages} warps={warps}"
                    try:
                        err = B.rel_err(ws_gemm(x, ws[0], **kw), ref)
                        t, _ = B.time_calls([lambda w=w, x=x, kw=kw: ws_gemm(x, w, **kw) for w in ws], graph=True)
                        print(f"{name}: {t:.1f} us ({t_ref / t:.2f}x cuBLAS) err {err:.1e}")
                    except Exception as exc:  # noqa: BLE001
                        print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:300]}")


def _tq_probe(args, B) -> None:
    from turboquant_hf.kernels import linear as L

    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        case = B.Case(k, n, 3)
        for m in (int(v) for v in args.ms.split(",")):
            q, bw = case.buffers(m)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            if args.once:  # (for ncu: a few plain launches of each configuration)
                x_rot = L.rotate(x, case.s1, case.s2, case.g, torch.bfloat16)
                for cfg in args.tq_configs:
                    bm, bn, stages, warps, ww, wr = (int(v) for v in cfg.split(","))
                    for _ in range(3):
                        tq_gemm(x_rot, q[0][0], q[0][1], case.cb_ours, bm=bm, bn=bn, stages=stages, warps=warps,
                                writer_warps=ww, writer_regs=wr)
                torch.cuda.synchronize()
                continue
            ref = case.reference(x.float())
            t_ref, _ = B.time_calls([lambda w=w, x=x: F.linear(x, w) for w in bw], graph=True)
            args_op = (case.cb_ours, case.s1, case.s2, case.g, k)
            t_op, _ = B.time_calls([lambda pk=pk, nr=nr, x=x, a=args_op: L.linear(x, pk, nr, *a) for pk, nr in q], graph=True)
            x_rot = L.rotate(x, case.s1, case.s2, case.g, torch.bfloat16)
            t_rot, _ = B.time_calls([lambda x=x, c=case: L.rotate(x, c.s1, c.s2, c.g, torch.bfloat16)], graph=True)
            print(f"{k}->{n} M={m}: bf16 cuBLAS {t_ref:.1f} us; op as dispatched {t_op:.1f} us ({t_ref / t_op:.2f}x); "
                  f"rotation alone {t_rot:.1f} us")
            for cfg in args.tq_configs:
                bm, bn, stages, warps, ww, wr = (int(v) for v in cfg.split(","))
                kw = {"bm": bm, "bn": bn, "stages": stages, "warps": warps, "writer_warps": ww, "writer_regs": wr}
                name = f"  decode producer BM={bm} BN={bn} stages={stages} warps={warps}+{ww} regs {wr}"
                try:
                    err = B.rel_err(tq_gemm(x_rot, q[0][0], q[0][1], case.cb_ours, **kw), ref)
                    t, _ = B.time_calls([lambda pk=pk, nr=nr, kw=kw, xr=x_rot, cb=case.cb_ours: tq_gemm(xr, pk, nr, cb, **kw)
                                         for pk, nr in q], graph=True)
                    print(f"{name}: GEMM {t:.1f} us ({t_ref / t:.2f}x cuBLAS), with the rotation "
                          f"{t_ref / (t + t_rot):.2f}x; err vs the reference {err:.1e}")
                except Exception as exc:  # noqa: BLE001
                    print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:300]}")


def main() -> int:
    import bench_linear as B

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x4096,4096x28672,14336x4096")
    ap.add_argument("--ms", default="512,2048")
    ap.add_argument("--configs", nargs="*",
                    default=["128,128,64,4,8", "128,256,64,3,8", "128,128,128,3,8", "64,128,64,4,4"],
                    help="bf16 probe: BM,BN,BK,stages,consumer warps")
    ap.add_argument("--tq", action="store_true", help="the 3-bit decode producer instead of the bf16 probe")
    ap.add_argument("--once", action="store_true", help="with --tq: three plain launches a configuration, no timing")
    ap.add_argument("--tq-configs", nargs="*", default=["128,128,3,8,4,152", "128,128,2,8,4,152",
                                                        "128,256,2,8,4,96", "64,128,3,4,4,152"],
                    help="BM,BN,stages,consumer warps,producer warps,producer registers")
    args = ap.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    if args.tq:
        _tq_probe(args, B)
    else:
        _bf16_probe(args, B)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
