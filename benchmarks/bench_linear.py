"""Time `torch.ops.turboquant.linear` (Triton kernels) against bf16 cuBLAS (`F.linear`) on one CUDA GPU,
and against the Triton kernels of turboquant-plus-vllm (package `turboquant_vllm`) where it is installed.

    python benchmarks/bench_linear.py                  # the results table (RESULTS.md)
    python benchmarks/bench_linear.py --md out.md      # ... also written as markdown
    python benchmarks/bench_linear.py --no-peer        # without the turboquant-plus-vllm columns
    python benchmarks/bench_linear.py --sweep          # kernel configurations per shape (for tuning)
    python benchmarks/bench_linear.py --sweep-whole    # pair GEMV configurations timed on the whole op (M = 1)
    python benchmarks/bench_linear.py --ab-x-order     # the tensor-core GEMV's activation order on and off
    python benchmarks/bench_linear.py --ab-wide        # its wide blocks (3-bit G = 128) on and off

Method (see docs/performance.md): both sides run in the same process on the
same shapes; random normal weights, quantized with `codec.quantize_weight`;
several copies of every weight buffer, used in turn, so that the 60 MB L2 does
not serve them; M <= 16 is timed as CUDA-graph replays of one call per buffer
(so the time includes the launch gaps inside a graph, ~1 us per kernel), larger
M with CUDA events around eager calls; the median of many repeats. Every timed
output is checked against the plain-torch reference (`ops.rotate_activations`
+ `ops.codebook_matmul`, float32) before timing, and the graph's outputs again
after timing. Bandwidth counts the packed bytes plus the norms (ours)
and the bf16 weight (cuBLAS), read once per call.

The peer (turboquant-plus-vllm 0.13.12) reads the same tq3_native tensors
byte for byte, so it is fed exactly the packed indices, norms, codebook and
signs that ours gets (the same buffer copies), and is timed and checked the
same way. Only its Triton module is imported (`turboquant_vllm.triton_ops`,
without running the package's `__init__`, which pulls in its vLLM patches);
the kernel is the one its vLLM linear method dispatches to when its CUDA
extension is not built (see `peer_kernel`). A peer that is missing, fails or
gives a wrong result leaves "n/a" in its columns with the reason; the run goes on.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import importlib.util
import json
import math
import platform
import statistics
import sys
import types

import torch
import torch.nn.functional as F
import triton
from turboquant_hf.kernels import linear as L
from turboquant_hf.kernels import tuning as T

from turboquant_hf.format import codec
from turboquant_hf.format import constants as fmt
from turboquant_hf.format import runtime_layout as layout
from turboquant_hf.modeling import ops

# (label, in_features K, out_features N)
SHAPES = [
    ("4096x4096", 4096, 4096),
    ("4096x14336", 4096, 14336),
    ("14336x4096 (down)", 14336, 4096),
    ("8192x28672", 8192, 28672),
    ("2048->1024 (expert)", 2048, 1024),
    ("2048x8192", 2048, 8192),
    ("512->2048 (expert down)", 512, 2048),
]
# what `integration.fusion` makes of sibling projections at load (for --sweep-pairs --fused): Llama-3.1-8B's
# q/k/v and gate/up, Qwen3.6-35B-A3B's gated-delta-net in_proj_qkv/z/b/a and attention q/k/v
FUSED_SHAPES = [
    ("4096->6144 (q/k/v fused)", 4096, 6144),
    ("4096->28672 (gate/up fused)", 4096, 28672),
    ("2048->12352 (in_proj fused)", 2048, 12352),
    ("2048->9216 (q/k/v fused)", 2048, 9216),
]
L2_BYTES = 60 << 20
DEV = "cuda"


def n_buffers(nbytes: int, m: int) -> int:
    """Weight copies used in turn: enough to overflow the L2 four times, at every M (at least 2, at most 64)."""
    return int(min(64, max(2, math.ceil(4 * L2_BYTES / max(nbytes, 1)))))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a - b).norm() / b.norm()).item()


def time_calls(fns, graph: bool, reps: int = 30) -> float:
    """Median microseconds per call of `fns` (one callable per buffer, run in turn)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for f in fns:
                f()
        run = g.replay
        for _ in range(3):
            run()
    else:
        g = None

        def run():
            for f in fns:
                f()

        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        run()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1000.0 / len(fns))
    return statistics.median(times), g


class Case:
    """One weight shape and bit width: quantized buffers, bf16 buffers, reference."""

    def __init__(self, k: int, n: int, bits, g: int = 128, seed: int = 0):
        torch.manual_seed(seed)
        w = torch.randn(n, k, device=DEV) * 0.02
        self.k, self.n, self.bits, self.g = k, n, bits, g
        self.packed, self.norms = codec.quantize_weight(w, bits, g)
        self.nl = fmt.levels_for_bits(bits)
        self.norms = self.norms.to(fmt.default_norms_dtype(self.nl))  # as TurboQuantWeight stores them
        # ours runs on what TurboQuantLinear holds on a GPU: the runtime layout where the tier has one (ternary:
        # 2-bit codes read with the 4-entry codebook)
        self.ours = (layout.to_runtime(self.packed, self.nl, g, self.norms.shape[1])
                     if layout.wanted(self.nl, g) else self.packed)
        self.layout = "runtime" if layout.is_runtime(self.ours) else "published"
        self.cb = fmt.codebook(self.nl, g, DEV)
        self.cb_ours = layout.runtime_codebook(self.cb) if self.layout == "runtime" else self.cb
        self.s1, self.s2 = fmt.signs(g, DEV)
        self.w16 = w.to(torch.bfloat16)
        del w
        # the bytes ours reads: packed indices in its layout and the norms
        self.qbytes = self.ours.numel() * self.ours.element_size() + self.norms.numel() * self.norms.element_size()
        self.bbytes = self.w16.numel() * 2

    def buffers(self, m: int, published: bool = False):
        """Copies of (packed, norms) for ours (or, `published`, the checkpoint bytes the peer reads) and of the
        bf16 weight."""
        nq = n_buffers(self.qbytes, m)
        nb = n_buffers(self.bbytes, m)
        q = [((self.packed if published else self.ours).clone(), self.norms.clone()) for _ in range(nq)]
        b = [self.w16.clone() for _ in range(nb)]
        return q, b

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        x_rot = ops.rotate_activations(x.reshape(-1, self.k), self.s1, self.s2, self.g)
        return ops.codebook_matmul(x_rot, self.packed, self.norms, self.cb, self.g)


# ---------------------------------------------------------------------------
# the peer: turboquant-plus-vllm's Triton kernels on the same packed tensors
# ---------------------------------------------------------------------------

PEER_DIST, PEER_PKG = "turboquant-plus-vllm", "turboquant_vllm"
_peer_state: dict = {}


class PeerUnavailable(Exception):
    """The peer cannot run this row (not installed, no such bit width, ...): its columns read n/a."""


def load_peer():
    """The peer's `triton_ops` module, imported without the package `__init__` (vLLM patches) and without vLLM.

    A stand-in package module with the real `__path__` lets `turboquant_vllm.triton_ops` (torch + triton) and the
    `turboquant_vllm.torch_ops` it reaches for its rotation matrix load alone. Raises PeerUnavailable.
    """
    if "module" in _peer_state:
        return _peer_state["module"]
    if "error" in _peer_state:
        raise PeerUnavailable(_peer_state["error"])
    try:
        if PEER_PKG not in sys.modules:
            spec = importlib.util.find_spec(PEER_PKG)
            if spec is None or not spec.submodule_search_locations:
                raise ImportError(f"{PEER_DIST} is not installed")
            stub = types.ModuleType(PEER_PKG)
            stub.__path__ = list(spec.submodule_search_locations)
            stub.__package__ = PEER_PKG
            sys.modules[PEER_PKG] = stub
        t_ops = importlib.import_module(PEER_PKG + ".triton_ops")
        if not getattr(t_ops, "HAS_TRITON", False):
            raise ImportError(f"{PEER_PKG}.triton_ops found no triton")
        importlib.import_module(PEER_PKG + ".torch_ops")
    except Exception as exc:  # a missing or broken peer must not stop the benchmark
        _peer_state["error"] = f"{PEER_DIST} unavailable: {exc!r}"[:300]
        raise PeerUnavailable(_peer_state["error"]) from None
    _peer_state["module"] = t_ops
    return t_ops


def peer_version() -> str:
    try:
        load_peer()
    except PeerUnavailable as exc:
        return str(exc)
    try:
        return f"{PEER_DIST} {importlib.metadata.version(PEER_DIST)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{PEER_DIST} (version unknown)"


def peer_kernel(bits, n: int, g: int):
    """(name, launcher) of the peer's Triton path for an (N rows, bits, G) layer with bf16 activations, no bias.

    Its vLLM linear method routes 3-bit bf16 layers through `tq3_apply`, which (with no CUDA extension built)
    calls the FWHT-on-input GEMM for every M; other widths follow its `_select_triton_gemm_fns`: FWHT-on-input
    for G > 128 or N >= 4096, else the fused dequant-GEMM. The raw launchers are called (its custom-op wrappers
    around them are CUDA-only and add only host-side dispatch).
    """
    t_ops = load_peer()
    if bits not in (2, 3, 4):
        raise PeerUnavailable(f"the peer has no {bits}-bit tier")
    fwht = getattr(t_ops, "_tq_fwht_input_gemm_impl", None) or t_ops.tq_fwht_input_gemm
    dequant = getattr(t_ops, "_tq_fused_gemm_impl", None) or t_ops.tq_fused_gemm
    if bits == 3 or g > 128 or n >= 4096:
        return "tq_fwht_input_gemm", fwht
    return "tq_fused_gemm", dequant


def peer_linear(x: torch.Tensor, packed: torch.Tensor, norms: torch.Tensor, codebook: torch.Tensor,
                signs1: torch.Tensor, signs2: torch.Tensor, group_size: int, bits, kernel=None) -> torch.Tensor:
    """`x @ W.T` by the peer's Triton kernel from our tensors: packed uint8 (rows*n_groups, bytes per group),
    norms float32 (rows, n_groups), the float32 codebook and +-1 float32 signs (seed 42) -- the layout its
    kernels read (`packed_row = n * n_groups + g`), so nothing is converted. `x` is (M, K) with K = n_groups*G.
    """
    if kernel is None:
        kernel = peer_kernel(bits, norms.shape[0], group_size)[1]
    return kernel(x, packed, norms, signs1, signs2, codebook, group_size=group_size, bits=int(bits), bias=None)


def _peer_retune(t_ops) -> None:
    """Forget the peer's autotuned configs: its FWHT GEMM autotunes on (N, K) only and would keep the
    first M's tiles; clearing before each row gives it the best tiles for every M."""
    kern = getattr(t_ops, "_polar_fused_gemm_kernel", None)
    cache = getattr(kern, "cache", None)
    if isinstance(cache, dict):
        cache.clear()


def bench_peer(case: "Case", m: int, x: torch.Tensor, ref: torch.Tensor, qbufs, graph: bool, t_ours: float,
               tol: float = 1e-2) -> dict:
    """Peer columns for one row; never raises (a failure is recorded in `peer_note`)."""
    row = dict(us_peer=None, ours_vs_peer=None, gbps_peer=None, err_peer=None, peer_kernel=None, peer_note=None)
    outs = {}
    try:
        name, kernel = peer_kernel(case.bits, case.n, case.g)
        row["peer_kernel"] = name
        _peer_retune(load_peer())

        def call(p, nr):
            return peer_linear(x, p, nr, case.cb, case.s1, case.s2, case.g, case.bits, kernel)

        y = call(*qbufs[0])  # first call autotunes, outside any graph
        torch.cuda.synchronize()
        err = rel_err(y, ref) if tuple(y.shape) == tuple(ref.shape) else float("nan")
        row["err_peer"] = err
        if not err < tol:
            raise PeerUnavailable(f"wrong result before timing (rel_err={err:.3g}, shape {tuple(y.shape)})")

        def peer(i, p, nr):
            def f():
                outs[i] = call(p, nr)
            return f

        t_peer, g_peer = time_calls([peer(i, p, nr) for i, (p, nr) in enumerate(qbufs)], graph)
        err_after = max(rel_err(outs[i], ref) for i in range(len(qbufs)))
        del g_peer
        if not err_after < tol:
            raise PeerUnavailable(f"wrong result after timing (rel_err={err_after:.3g})")
        row.update(us_peer=t_peer, ours_vs_peer=t_peer / t_ours, gbps_peer=case.qbytes / t_peer / 1e3)
    except PeerUnavailable as exc:
        row["peer_note"] = str(exc)
    except Exception as exc:  # the peer's failure is a result, not a reason to stop
        row["peer_note"] = f"failed: {exc!r}"[:300]
        try:
            torch.cuda.synchronize()
        except Exception:
            pass
    if row["peer_note"] and row["peer_note"] != _peer_state.get("error"):
        print(f"peer n/a: K={case.k} N={case.n} bits={case.bits} M={m}: {row['peer_note']}", flush=True)
    outs.clear()
    return row


def bench_case(case: Case, m: int, tol: float = 1e-2, peer: bool = True) -> dict:
    x = torch.randn(m, case.k, device=DEV, dtype=torch.bfloat16)
    ref = case.reference(x)
    qbufs, bbufs = case.buffers(m)
    graph = m <= 16
    outs = {}

    def ours(i, p, nr):
        def f():
            outs[i] = torch.ops.turboquant.linear(x, p, nr, case.cb_ours, case.s1, case.s2, case.g, case.k)
        return f

    y = torch.ops.turboquant.linear(x, qbufs[0][0], qbufs[0][1], case.cb_ours, case.s1, case.s2, case.g, case.k)
    err = rel_err(y, ref)
    if not err < tol:
        raise SystemExit(f"WRONG RESULT before timing: K={case.k} N={case.n} bits={case.bits} M={m} rel_err={err}")
    t_ours, g_ours = time_calls([ours(i, p, nr) for i, (p, nr) in enumerate(qbufs)], graph)
    err_after = max(rel_err(outs[i], ref) for i in range(len(qbufs)))
    if not err_after < tol:
        raise SystemExit(f"WRONG RESULT after timing: K={case.k} N={case.n} bits={case.bits} M={m} rel_err={err_after}")
    del g_ours
    bout = {}

    def base(i, w):
        def f():
            bout[i] = F.linear(x, w)
        return f

    t_bf16, g_b = time_calls([base(i, w) for i, w in enumerate(bbufs)], graph)
    del g_b
    e_b = rel_err(bout[0], ref)
    if graph:  # the same calls eager as well (a non-compiled `generate` runs them so)
        t_ours_e, _ = time_calls([ours(i, p, nr) for i, (p, nr) in enumerate(qbufs)], False)
        t_bf16_e, _ = time_calls([base(i, w) for i, w in enumerate(bbufs)], False)
        eager = dict(us_ours_eager=t_ours_e, us_bf16_eager=t_bf16_e, ratio_eager=t_bf16_e / t_ours_e)
    else:
        # M > 16: the eager times above include each call's host work whenever it outlasts the GPU's (a prefill
        # inside a model queues its kernels ahead of the GPU); the same calls as CUDA-graph replays give the
        # device's throughput, which the ratio column reports for every M
        eager = dict(us_ours_eager=t_ours, us_bf16_eager=t_bf16, ratio_eager=t_bf16 / t_ours)
        t_ours, g_ours = time_calls([ours(i, p, nr) for i, (p, nr) in enumerate(qbufs)], True)
        del g_ours
        err_after = max(rel_err(outs[i], ref) for i in range(len(qbufs)))
        if not err_after < tol:
            raise SystemExit(f"WRONG RESULT after graph timing: K={case.k} N={case.n} bits={case.bits} M={m} "
                             f"rel_err={err_after}")
        t_bf16, g_b = time_calls([base(i, w) for i, w in enumerate(bbufs)], True)
        del g_b
    del bbufs, outs, bout
    torch.cuda.empty_cache()
    if peer:  # copies of the same weights in the published layout (the peer reads tq3_native bytes)
        del qbufs
        qbufs, _ = case.buffers(m, published=True)
        # (timed as ours was: graph replays for M <= 16, eager above, against our eager time)
        prow = bench_peer(case, m, x, ref, qbufs, graph, eager.get("us_ours_eager", t_ours), tol)
    else:
        prow = dict(us_peer=None, ours_vs_peer=None, gbps_peer=None, err_peer=None, peer_kernel=None,
                    peer_note="skipped (--no-peer)")
    del qbufs
    torch.cuda.empty_cache()
    return dict(K=case.k, N=case.n, bits=str(case.bits), G=case.g, M=m, layout=case.layout, us_bf16=t_bf16, us_ours=t_ours,
                ratio=t_bf16 / t_ours, gbps_ours=case.qbytes / t_ours / 1e3, gbps_bf16=case.bbytes / t_bf16 / 1e3,
                err_ours=err, err_bf16_vs_quantized=e_b, **eager, **prow)


# ---------------------------------------------------------------------------
# sweep: kernel configurations, called through the launchers
# ---------------------------------------------------------------------------

# kernel configurations tried by --sweep: FMA (BN, GPI, warps, LUT_MASK) at M=1 per bit width,
# tensor-core (BN, warps, stages, LUT_MASK) at M=16
FMA_SWEEP = {
    3: [(16, 8, 4, 0), (16, 8, 4, 0x01010101), (16, 8, 4, 0x11111111), (32, 4, 4, 0x01010101),
        (16, 8, 2, 0x01010101), (32, 8, 8, 0x01010101), (8, 8, 2, 0x01010101), (16, 4, 4, 0x01010101),
        (4, 8, 1, 0x01010101), (32, 8, 4, 0x01010101)],
    2: [(16, 8, 4, 0), (16, 8, 2, 0), (32, 8, 4, 0), (32, 4, 4, 0), (16, 16, 4, 0), (32, 8, 8, 0)],
    4: [(16, 8, 4, 0x55555555), (16, 8, 4, 0x11111111), (16, 8, 2, 0x55555555), (32, 4, 4, 0x55555555),
        (16, 4, 4, 0x55555555), (16, 8, 4, 0x77777777)],
    fmt.TERNARY: [(16, 2, 4, 0x11), (16, 2, 4, 0x15), (16, 2, 4, 0x1F), (16, 2, 4, 0x5), (32, 2, 4, 0x11),
                  (16, 4, 4, 0x11), (16, 2, 2, 0x11), (16, 1, 4, 0x11)],
}
DOT_SWEEP = [(64, 4, 1, 0), (64, 4, 1, 0x01010101), (64, 4, 1, 0x11111111), (32, 4, 1, 0x01010101),
             (128, 8, 1, 0x01010101), (64, 8, 1, 0x01010101), (32, 4, 1, 0)]


def mma_sweep(d0: tuple) -> list[tuple]:
    """Tensor-core GEMV configurations (BN, warps, stages, prefetch, maxnreg, blocks) tried by --sweep around the
    default `d0`: register caps of 128 and 168, 1 or 2 blocks a warp, 4 or 8 warps, prefetch 2, twice or half the
    rows (the default first)."""
    bn, w, st, pf, _, blk = d0
    out = [d0]
    for c in ((bn, w, st, pf, 128, blk), (bn, w, st, pf, 168, blk), (bn, w, st, pf, 0, 2), (bn, w, st, pf, 128, 2),
              (bn, 8, st, pf, 0, 2), (bn, 8, st, pf, 128, 2), (bn, 8, st, pf, 0, 1), (bn, 4, st, pf, 0, 1),
              (bn, 4, st, pf, 128, 1), (bn, w, st, 2, 0, blk), (bn, w, st, 2, 168, blk), (2 * bn, w, st, pf, 0, blk),
              (max(16, bn // 2), 2 * w, st, pf, 0, blk)):
        if c not in out:
            out.append(c)
    return out


# pair GEMV configurations tried by --sweep-pairs: (BN, warps[, maxnreg]) at M = 1
PAIR_SWEEP = [(4, 4), (8, 4), (8, 8), (16, 4), (16, 8), (4, 8), (8, 8, 64), (8, 4, 96), (16, 4, 96), (4, 8, 64),
              (4, 4, 64), (2, 4), (2, 8), (2, 2), (4, 2), (2, 4, 96), (4, 2, 128), (8, 2, 128), (8, 4, 96, 1),
              (4, 4, 96, 1), (8, 8, 64, 1), (2, 8, 64)]
PAIRS_ONLY = False


def _time_variants(case, label, m, x, ref, variants, graph, t_b):
    rows = []
    qbufs, _ = case.buffers(m) if m <= 16 else ([(case.packed, case.norms)] * 2, None)
    for name, fn in variants:
        try:
            y = fn(*qbufs[0])
            err = rel_err(y, ref) if y.shape == ref.shape else None
            if err is not None and not err < 1e-2:
                rows.append(dict(shape=label, bits=str(case.bits), M=m, variant=name, us=float("nan"), err=err))
                print(json.dumps(rows[-1]), flush=True)
                continue
            t, _ = time_calls([(lambda p=p, nr=nr: fn(p, nr)) for p, nr in qbufs], graph)
            rows.append(dict(shape=label, bits=str(case.bits), M=m, variant=name, us=t,
                             ratio=(t_b / t) if t_b else float("nan"), gbps=case.qbytes / t / 1e3, err=err))
        except Exception as exc:  # a configuration that does not compile or fit: note it, go on
            rows.append(dict(shape=label, bits=str(case.bits), M=m, variant=name, us=float("nan"),
                             error=repr(exc)[:200]))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def sweep_case(case: Case, label: str, ms=(1, 16)) -> list[dict]:
    rows = []
    n, k, g, nl = case.n, case.k, case.g, case.nl
    ng = case.norms.shape[1]
    for m in ms:
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        ref = case.reference(x)
        _, bbufs = case.buffers(m)
        graph = m <= 16
        t_b, _ = time_calls([(lambda w=w: F.linear(x, w)) for w in bbufs], graph)
        del bbufs
        rows.append(dict(shape=label, bits=str(case.bits), M=m, variant="bf16 F.linear", us=t_b))
        variants = []
        if PAIRS_ONLY:
            cb = case.cb_ours
            unit = L.lut_unit(cb.numel())
            x2, xs = L.rotate(x, case.s1, case.s2, g, torch.bfloat16, unit=unit)
            t_r, _ = time_calls([lambda: L.rotate(x, case.s1, case.s2, g, torch.bfloat16, unit=unit)] * 8, True)
            rows.append(dict(shape=label, bits=str(case.bits), M=m, variant="rotate (pair layout) only", us=t_r))
            variants.append(("whole op", lambda p, nr: torch.ops.turboquant.linear(x, p, nr, cb, case.s1, case.s2,
                                                                                   g, k)))
            d0 = L._pair_config(n, ng * g // unit, cb.numel())
            for cfg in [d0] + [c for c in PAIR_SWEEP if c != d0]:
                variants.append((f"pair gemv only {cfg}" + (" *" if cfg == d0 else ""),
                                 lambda p, nr, cfg=cfg: L.gemv_pairs(x2, xs, p, nr, cb, g, torch.bfloat16, config=cfg)))
        elif m == 1:
            x_rot = L.rotate(x, case.s1, case.s2, g, torch.float32)
            t_r, _ = time_calls([lambda: L.rotate(x, case.s1, case.s2, g, torch.float32)] * 8, True)
            rows.append(dict(shape=label, bits=str(case.bits), M=m, variant="rotate only", us=t_r))
            d0 = L._with_mask(L._fma_config(n, ng, nl, g), nl)
            for cfg in [d0] + [c for c in FMA_SWEEP[case.bits] if c != d0]:
                variants.append((f"fma gemv only {cfg[:3]} {cfg[3]:#x}" + (" *" if cfg == d0 else ""),
                                 lambda p, nr, cfg=cfg: L.gemv_fma(x_rot, p, nr, case.cb_ours, g, torch.bfloat16,
                                                                   config=cfg)))
        elif m <= 16 and L._mma_serves(nl, g):
            # the tensor-core GEMV as `linear` runs it (activation order and block as it picks them)
            order = L.uses_x_order(n, ng, nl, g)
            kb = L.mma_block(nl, g, n, ng, m)
            x_rot = L.rotate(x, case.s1, case.s2, g, torch.bfloat16, mma_levels=nl if order else 0,
                             mma_block=kb if order else 0)
            d0 = tuple(L._dot_config(n, ng, nl, g, kb))
            for cfg in mma_sweep(d0):
                variants.append((f"mma gemv only {cfg}" + (" *" if cfg == d0 else ""),
                                 lambda p, nr, cfg=cfg: L.gemv_dot(x_rot, p, nr, case.cb_ours, g, torch.bfloat16,
                                                                   config=cfg, x_order=order, block=kb)))
        elif m <= 16:
            x_rot = L.rotate(x, case.s1, case.s2, g, torch.bfloat16)
            d0 = L._with_mask(L._dot_config(n, ng, nl, g, L.mma_block(nl, g, n, ng, m)), nl)
            for cfg in [d0] + [c for c in DOT_SWEEP if c != d0]:
                variants.append((f"dot gemv only {cfg[:3]} {cfg[3]:#x}" + (" *" if cfg == d0 else ""),
                                 lambda p, nr, cfg=cfg: L.gemv_dot(x_rot, p, nr, case.cb_ours, g, torch.bfloat16,
                                                                   config=cfg)))
        else:
            x_rot = L.rotate(x, case.s1, case.s2, g, torch.bfloat16)
            decode = lambda p, nr: L.dequantize_rotated(p, nr, case.cb_ours, g, torch.bfloat16)  # noqa: E731
            variants.append(("dequant only", decode))
            variants.append(("dequant + F.linear (no rotate) *", lambda p, nr: F.linear(x_rot, decode(p, nr))))
        rows += _time_variants(case, label, m, x, ref, variants, graph, t_b)
        torch.cuda.empty_cache()
    return rows


# pair GEMV configurations timed on the whole op (--sweep-whole), per codebook size; None: the default
WHOLE_SWEEP = {8: [None, (8, 4, 96), (8, 2, 128), (4, 2, 128), (8, 4, 96, 1), (4, 2, 128, 1), (8, 2, 128, 1), (16, 8),
                   (4, 4, 96, 1)],
               16: [None, (8, 4), (8, 2), (16, 4), (8, 4, 96), (8, 2, 128), (4, 4, 64), (8, 4, 96, 1), (8, 2, 128, 1),
                    (4, 2, 128)],
               4: [None, (8, 4, 96), (8, 2, 128), (4, 2, 128), (16, 4, 96), (16, 2, 128), (8, 4, 96, 1), (8, 2, 128, 1),
                   (4, 4, 96, 1), (4, 8, 64), (16, 4)]}


def sweep_whole(case: Case, label: str, reps: int = 2) -> list[dict]:
    """The whole op at M = 1 (rotation + pair GEMV, graph replays) with each configuration of WHOLE_SWEEP in
    place of the default, and, for rows over `PDL_MAX_K` inputs, with the early launch on and off; every
    configuration timed `reps` times in turn (the spread between the passes is the noise to read the differences
    against). Each output is checked against the reference first."""
    k, g = case.k, case.g
    x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
    ref = case.reference(x)
    qbufs, bbufs = case.buffers(1)
    t_b, _ = time_calls([(lambda w=w: F.linear(x, w)) for w in bbufs], True)
    del bbufs
    cb = case.cb_ours
    default, limits = L._pair_config, (T.PDL_MAX_K, T.PDL_MAX_K_PAIRS, T.PDL_PAIR_LEVELS)
    times: dict = {}
    try:
        for _ in range(reps):
            for long_pdl in ((False, True) if k > T.PDL_MAX_K else (False,)):
                for cfg in WHOLE_SWEEP.get(case.cb_ours.numel(), [None]):
                    T.PDL_MAX_K_PAIRS = 1 << 30 if long_pdl else T.PDL_MAX_K
                    T.PDL_PAIR_LEVELS = (4, 8, 16)
                    L._pair_config = default if cfg is None else (lambda *a, cfg=cfg: cfg)

                    def fn(p, nr):
                        return torch.ops.turboquant.linear(x, p, nr, cb, case.s1, case.s2, g, k)

                    key = (str(cfg), long_pdl)
                    if rel_err(fn(*qbufs[0]), ref) >= 1e-2:
                        times.setdefault(key, []).append(float("nan"))
                        continue
                    t, _ = time_calls([(lambda p=p, nr=nr: fn(p, nr)) for p, nr in qbufs], True)
                    times.setdefault(key, []).append(t)
    finally:
        L._pair_config = default
        T.PDL_MAX_K, T.PDL_MAX_K_PAIRS, T.PDL_PAIR_LEVELS = limits
    rows = [dict(shape=label, bits=str(case.bits), M=1, variant="bf16 F.linear", us=t_b)]
    nut = case.norms.shape[1] * g // L.lut_unit(cb.numel())
    for (cfg, long_pdl), ts in times.items():
        name = f"whole op, pair {cfg if cfg != 'None' else 'default ' + str(default(case.n, nut, cb.numel()))}"
        name += ", early launch" if long_pdl else ""
        t = statistics.median(ts)
        rows.append(dict(shape=label, bits=str(case.bits), M=1, variant=name, us=t,
                         passes=" ".join(f"{v:.2f}" for v in ts), ratio=t_b / t, gbps=case.qbytes / t / 1e3))
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def environment(peer: bool = True) -> dict:
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, python=platform.python_version(),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                peer=peer_version() if peer else "not run")


def _fmt(v, spec: str) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def markdown(rows: list[dict], env: dict, command: str) -> str:
    out = ["# torch.ops.turboquant.linear vs bf16 cuBLAS and turboquant-plus-vllm", "",
           f"- device: {env['device']}; torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, "
           f"Python {env['python']}",
           f"- date: {env['date']}",
           f"- command: `{command}`",
           "- method: same process, same shapes; weights random normal, G=128; several copies of each weight used "
           "in turn so the L2 cache (50 MB on the H100, 60 MB on the H200) does not serve them; M <= 16 timed as "
           "CUDA-graph replays (one call per buffer; ours is 2 kernels: rotate + GEMV), M = 2048 both as CUDA-graph "
           "replays (ratio: the device's throughput, as in a prefill whose kernels queue ahead of the GPU) and "
           "eager (eager ratio: each call's host work included where it outlasts the GPU's; the peer is timed this "
           "way); median of 30; every output checked "
           "against the float32 torch reference before and after timing (rel. error column). Ours reads the packed "
           "indices in the layout TurboQuantLinear holds on a GPU (2- and 3-bit: the runtime layout, "
           "`format.runtime_layout`, same bytes rearranged; 4-bit: the same bytes as sign-magnitude codes of the "
           "symmetric codebook; ternary: the runtime layout's 2-bit codes, 32 instead of 26 bytes per group) and the "
           "norms in the dtype it stores (float16 for ternary, else float32); the peer always gets the published "
           "bytes.",
           "- ratio = bf16 time / ours (> 1: ours faster). GB/s counts the packed bytes ours reads + norms and the "
           "bf16 weight (cuBLAS); the measured copy ceiling of the H200 is about 4300 GB/s.",
           f"- peer: {env.get('peer', 'n/a')}, its Triton kernels only (no vLLM), fed the same packed/norms "
           "buffers, codebook and seed-42 signs as ours, timed and checked the same way; the kernel is the one its "
           "vLLM linear method picks for a bf16 layer without its CUDA extension (3-bit: `tq_fwht_input_gemm` = "
           "a float32 cast, a float32 rotation matmul (cuBLAS) and one Triton GEMM, autotuned afresh for every "
           "row). ours vs peer = peer time / ours (> 1: ours faster); n/a: the peer did not run (reasons below).",
           "",
           "| shape (in x out) | bits | layout | M | bf16 us | ours us | peer us | ratio | eager ratio | ours vs peer "
           "| ours GB/s | bf16 GB/s | rel. error | peer rel. error |",
           "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    label = {(k, n): lab for lab, k, n in SHAPES}
    notes = []
    for r in rows:
        bits = "ternary" if r["bits"] == "1.58" else r["bits"]
        out.append(f"| {label[(r['K'], r['N'])]} | {bits} | {r.get('layout', 'published')} | {r['M']} | "
                   f"{r['us_bf16']:.1f} | {r['us_ours']:.1f} | "
                   f"{_fmt(r.get('us_peer'), '.1f')} | {r['ratio']:.2f} | {_fmt(r.get('ratio_eager'), '.2f')} | "
                   f"{_fmt(r.get('ours_vs_peer'), '.2f')} | "
                   f"{r['gbps_ours']:.0f} | {r['gbps_bf16']:.0f} | {r['err_ours']:.1e} | "
                   f"{_fmt(r.get('err_peer'), '.1e')} |")
        if r.get("peer_note"):
            notes.append((r["peer_note"], f"{label[(r['K'], r['N'])]} {bits}-bit M={r['M']}"))
    if notes:
        by_reason = {}
        for reason, where in notes:
            by_reason.setdefault(reason, []).append(where)
        out += ["", "Peer n/a:", ""] + [f"- {reason}: {'; '.join(w)}" for reason, w in by_reason.items()]
    return "\n".join(out) + "\n"


def _ab_switch(case: Case, label: str, m: int, switch: str) -> dict:
    """The whole op with the kernels' module flag `switch` (`kernels.tuning.X_ORDER`, `WIDE`) off and on, in turn,
    each timed twice as CUDA-graph replays (the faster kept), against bf16 in the same run; each output is
    checked against the float32 reference. Returns the row's common fields and both outputs' relative errors
    (`outs`: the last output of each setting)."""
    x = torch.randn(m, case.k, device=DEV, dtype=torch.bfloat16)
    qbufs, bbufs = case.buffers(m)
    t_bf16, g_b = time_calls([(lambda w=w: F.linear(x, w)) for w in bbufs], True)
    del g_b
    times = {False: [], True: []}
    outs, errs = {}, {}
    ref = case.reference(x)
    saved = getattr(T, switch)
    try:
        for on in (False, True, False, True):
            setattr(T, switch, on)
            outs[on] = L.linear(x, qbufs[0][0], qbufs[0][1], case.cb_ours, case.s1, case.s2, case.g, case.k)
            errs[on] = rel_err(outs[on], ref)
            if not errs[on] < 1e-2:
                raise SystemExit(f"WRONG RESULT: {label} bits={case.bits} M={m} {switch}={on} rel_err={errs[on]}")
            t, g = time_calls([(lambda p=p, nr=nr: L.linear(x, p, nr, case.cb_ours, case.s1, case.s2, case.g, case.k))
                               for p, nr in qbufs], True)
            del g
            times[on].append(t)
    finally:
        setattr(T, switch, saved)
    t_off, t_on = min(times[False]), min(times[True])
    del qbufs, bbufs
    torch.cuda.empty_cache()
    return dict(shape=label, bits=str(case.bits), M=m, us_bf16=t_bf16, us_off=t_off, us_on=t_on,
                ratio_off=t_bf16 / t_off, ratio_on=t_bf16 / t_on, speedup=t_off / t_on,
                err_off=errs[False], err_on=errs[True], outs=outs)


def ab_x_order(case: Case, label: str, m: int) -> dict:
    """The tensor-core GEMV's activation order (`kernels.tuning.X_ORDER`) on and off (`_ab_switch`); the outputs of
    the two orders must be equal bit for bit."""
    row = _ab_switch(case, label, m, "X_ORDER")
    outs = row.pop("outs")
    if not torch.equal(outs[False], outs[True]):
        raise SystemExit(f"activation order changed the output: {label} bits={case.bits} M={m}")
    row["default_on"] = L.uses_x_order(case.n, case.norms.shape[1], case.nl, case.g)
    return row


def ab_wide(case: Case, label: str, m: int) -> dict:
    """The tensor-core GEMV's wide blocks (`kernels.tuning.WIDE`: two groups a block for 3-bit G = 128) on and off
    (`_ab_switch`); both outputs checked against the float32 reference (the wide blocks round each value times its
    norm to 16 bits, so the two differ)."""
    row = _ab_switch(case, label, m, "WIDE")
    row.pop("outs")
    row["default_on"] = L.mma_block(case.nl, case.g, case.n, case.norms.shape[1], m) == L.wide_block(case.nl, case.g)
    return row


def ab_markdown(rows: list, env: dict, command: str, off: str, on: str, errors: bool) -> str:
    """The table of a same-run A/B (`_ab_switch` rows): `off` / `on` name the two settings in the headers;
    `errors`: with both settings' relative errors (they differ only where the switch changes the output)."""
    out = [f"- device: {env['device']}; torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, "
           f"Python {env['python']}", f"- date: {env['date']}", f"- command: `{command}` (from benchmarks/)", "",
           f"| shape (in x out) | bits | M | bf16 us | {off} us | {on} us | ratio {off} | ratio {on} | {on} speedup | "
           f"{on} by default |" + (f" rel. error {off} | rel. error {on} |" if errors else ""),
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---|" + ("---:|---:|" if errors else "")]
    for r in rows:
        out.append(f"| {r['shape']} | {r['bits']} | {r['M']} | {r['us_bf16']:.1f} | {r['us_off']:.1f} | "
                   f"{r['us_on']:.1f} | {r['ratio_off']:.2f} | {r['ratio_on']:.2f} | "
                   f"{r['speedup']:.2f} | {'yes' if r['default_on'] else 'no'} |"
                   + (f" {r['err_off']:.1e} | {r['err_on']:.1e} |" if errors else ""))
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="time kernel configurations instead of the table")
    ap.add_argument("--sweep-pairs", action="store_true", help="time pair GEMV configurations (M = 1, every bit width)")
    ap.add_argument("--md", help="write the table as markdown here")
    ap.add_argument("--json", help="write raw rows as JSON here")
    ap.add_argument("--shapes", help="comma-separated shape indices (default: all)")
    ap.add_argument("--sweep-whole", action="store_true",
                    help="time pair GEMV configurations on the whole op (M = 1, 3- and 4-bit unless --bits)")
    ap.add_argument("--fused", action="store_true", help="with --sweep-pairs / --sweep-whole: the fused projections' shapes too")
    ap.add_argument("--bits", help="with --sweep-pairs / --sweep-whole: the bit widths (default 3,2,4,1.58 / 3,4)")
    ap.add_argument("--ms", help="comma-separated M (default 1,16,32,64,128,256,512,2048; with --sweep 1,16 (and 2048 for 2048 inputs); "
                                 "with --ab-x-order / --ab-wide 8,16,32,64)")
    ap.add_argument("--no-peer", action="store_true", help=f"do not time {PEER_DIST} (its columns read n/a)")
    ap.add_argument("--ab-x-order", action="store_true",
                    help="time the tensor-core GEMV's activation order on and off (--ms, default 8,16,32,64; --bits)")
    ap.add_argument("--ab-wide", action="store_true",
                    help="time the tensor-core GEMV's wide blocks (3-bit G = 128) on and off (--ms, default 8,16,32,64)")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    run_peer = not (args.no_peer or args.sweep or args.sweep_pairs or args.sweep_whole or args.ab_x_order
                    or args.ab_wide)
    env = environment(run_peer)
    print(json.dumps(env), flush=True)
    shapes = SHAPES if not args.shapes else [SHAPES[int(i)] for i in args.shapes.split(",")]
    rows = []
    if args.ab_wide or args.ab_x_order:  # same-run A/B of one switch of the kernels, on and off
        ab, names, bits_default = ((ab_wide, ("one-group blocks", "wide blocks", True), "3") if args.ab_wide
                                   else (ab_x_order, ("natural", "ordered", False), "3,4,2"))
        ms = [int(v) for v in (args.ms or "8,16,32,64").split(",")]
        for bits in [int(b) for b in ((args.bits if args.ab_x_order else None) or bits_default).split(",")]:
            for label, k, n in shapes:
                case = Case(k, n, bits)
                for m in ms:
                    rows.append(ab(case, label, m))
                    print(json.dumps(rows[-1]), flush=True)
                del case
                torch.cuda.empty_cache()
        md = ab_markdown(rows, env, "python " + " ".join(sys.argv), *names)
        print(md)
        if args.md:
            with open(args.md, "w") as f:
                f.write(md)
    elif args.sweep_whole:
        args.sweep = True
        for bits in [fmt.TERNARY if b == "1.58" else int(b) for b in (args.bits or "3,4").split(",")]:
            for label, k, n in shapes + (FUSED_SHAPES if args.fused else []):
                case = Case(k, n, bits)
                rows += sweep_whole(case, label)
                del case
                torch.cuda.empty_cache()
    elif args.sweep_pairs:
        global PAIRS_ONLY
        PAIRS_ONLY = True
        args.sweep = True
        if args.fused:
            shapes = FUSED_SHAPES if not args.shapes else [FUSED_SHAPES[int(i)] for i in args.shapes.split(",")]
        for bits in [fmt.TERNARY if b == "1.58" else int(b) for b in (args.bits or "3,2,4,1.58").split(",")]:
            for label, k, n in shapes:
                case = Case(k, n, bits)
                rows += sweep_case(case, label, ms=(1,))
                del case
                torch.cuda.empty_cache()
    elif args.sweep:
        for label, k, n in shapes:
            case = Case(k, n, 3)
            ms = tuple(int(v) for v in args.ms.split(",")) if args.ms else (1, 16) if k != 2048 else (1, 16, 2048)
            rows += sweep_case(case, label, ms=ms)
            del case
            torch.cuda.empty_cache()
        label, k, n = next((s for s in shapes if s[1] == 8192), shapes[0])
        for bits in (2, 4, fmt.TERNARY):
            case = Case(k, n, bits)
            rows += sweep_case(case, label, ms=(1,))
            del case
            torch.cuda.empty_cache()
    else:
        ms = [int(v) for v in (args.ms or "1,16,32,64,128,256,512,2048").split(",")]
        for label, k, n in shapes:
            case = Case(k, n, 3)
            for m in ms:
                r = bench_case(case, m, peer=run_peer)
                rows.append(r)
                print(json.dumps(r), flush=True)
            del case
            torch.cuda.empty_cache()
        # the other bit widths on the two shapes the targets name (4096 -> 14336 and 8192 -> 28672)
        for label, k, n in [s for s in shapes if (s[1], s[2]) in ((4096, 14336), (8192, 28672))] or shapes[:1]:
            for bits in (fmt.TERNARY, 2, 4):
                case = Case(k, n, bits)
                for m in ms:
                    r = bench_case(case, m, peer=run_peer)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
                del case
                torch.cuda.empty_cache()
        command = "python " + " ".join(sys.argv)
        md = markdown(rows, env, command)
        print(md)
        if args.md:
            with open(args.md, "w") as f:
                f.write(md)
    if args.sweep:
        print("\nshape | bits | M | variant | us | ratio vs bf16 | GB/s")
        for r in rows:
            print(f"{r['shape']} | {r['bits']} | {r['M']} | {r['variant']} | {r['us']:.2f} | "
                  f"{r.get('ratio', float('nan')):.2f} | {r.get('gbps', float('nan')):.0f}"
                  + (f" | {r['error']}" if "error" in r else "") + (f" | passes {r['passes']}" if "passes" in r else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(env=env, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
