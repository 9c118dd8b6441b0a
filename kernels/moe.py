"""CUDA implementation of `torch.ops.turboquant.moe_experts` (routed experts, packed weights).

Decode (at most `tuning.PAIR_MAX_ROWS` routed (token, slot) pairs; any bit width): five launches and no host
synchronisation, so the layer can be captured in a CUDA graph:

1. `rotate` the tokens once (every expert of a token reads the same rotated row);
2. a GEMV over pairs (the pair GEMV for 2-, 3- and 4-bit experts and 16-bit activations, else the
   select/codebook-load GEMV): row p of the result is expert `top_k_index[p]`'s gate/up matrix times token
   `p // top_k` (only routed experts are read; an index outside [0, E) gives zeros);
3. `act(gate) * up` in float32;
4. `rotate` each pair's intermediate row;
5. the GEMV over pairs with the down matrices, then the top-k weighted sum per token.

Otherwise (prefill), for 2-, 3- and 4-bit experts (ternary in its runtime layout) and 16-bit activations, up to
`tuning.FUSED_MAX_PAIRS` pairs (by default every prefill): the tokens rotated once, the (token, slot) pairs grouped by
expert on the device (`_device_routing`: a counting sort in three small kernels), and the routed experts decoded inside two grouped tensor-core
products (`routed_lut_mm`: each program finds its block's expert from the group sizes, decodes that expert's
weight tiles in registers and multiplies them with the block's rows; the gate/up product reads each pair's
token row directly) around one activation kernel (`act_mul`, then the intermediate rows rotated); one gather
kernel (`combine`) sums each token's pairs with its routing weights. No scratch buffer and no host
synchronisation at any length; experts no pair needs are never read.

With `tuning.FUSED_MAX_PAIRS` lowered, longer prefills take the decoded path instead:
the tokens are rotated once (`tuning.PREFILL_ROTATED_BASIS`), the (token, slot) pairs sorted by expert, the routed
experts' matrices decoded in the rotated basis into a scratch buffer of at most `tuning.PREFILL_SCRATCH_BYTES`, and two
grouped matrix products (`torch._grouped_mm`, bfloat16 on CUDA; a product per expert otherwise) run around one
activation kernel (`act_mul`, then the intermediate rows rotated); one gather kernel (`combine`) sums each
token's pairs with its routing weights. When the pairs are at least as many as the experts and all the
experts' gate/up matrices fit the budget, the routing stays on the device (no host synchronisation, one pass;
experts no pair needs are neither read nor decoded); otherwise the per-expert counts come to the host (one
synchronisation, as transformers' own expert loop does) and the routed experts are decoded a chunk at a time.
Other tiers (ternary in its published bytes, float32 activations) run `linear.product` per routed expert on
its tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import gemm
from . import linear as L
from . import tuning as T
from .gemm import _routed_block
from .launch import cdiv, launch, next_power_of_2
from .lut import _byte_tables
from .prefill import _lut_tile
from .units import _load_units


def _activation(name: str):
    from turboquant_hf.modeling.activations import ACTIVATIONS

    return ACTIVATIONS[name]


class Epilogue(NamedTuple):
    """What the experts' layout adds around the two products (`experts_layout.ExpertsLayout`): the gate/up bias
    `(E, 2I)` added before the activation, the down bias `(E, H)` added to each pair's output before its routing
    weight, whether the gate/up outputs alternate, and the clamped SwiGLU's `alpha` and `limit`."""

    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    interleaved: bool = False
    alpha: float = 1.0
    limit: float = 0.0


PLAIN = Epilogue()

# Activations `_act_mul_kernel` computes itself (others run in torch).
_ACT_CODES = {"silu": 0, "relu": 1, "gelu_pytorch_tanh": 2, "clamped_swiglu": 3}


@triton.jit
def _act_mul_kernel(gu_ptr, out_ptr, bias_ptr, ex_ptr, R, I, stride_g, stride_o, stride_b, alpha, limit,
                    ACT: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr, BR: tl.constexpr,
                    BC: tl.constexpr):
    """out[r, c] = act(gate[r, c]) * up[r, c] in float32, stored in out's dtype (one pass over the gate/up product
    instead of a conversion, the activation, the product and a conversion back). Gate and up are columns c and
    I + c of gu, or with INTERLEAVED 2c and 2c + 1; HAS_BIAS: row r's expert `ex[r]` adds its bias row to both
    first. ACT 3: the clamped SwiGLU, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    rr = tl.program_id(0) * BR + tl.arange(0, BR)
    cc = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = (rr < R)[:, None] & (cc < I)[None, :]
    row = rr.to(tl.int64)[:, None]
    if INTERLEAVED:
        gcol = 2 * cc[None, :]
        ucol = gcol + 1
    else:
        gcol = cc[None, :]
        ucol = I + gcol
    gate = tl.load(gu_ptr + row * stride_g + gcol, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_g + ucol, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        ex = tl.load(ex_ptr + rr, mask=rr < R, other=0).to(tl.int64)[:, None]
        gate += tl.load(bias_ptr + ex * stride_b + gcol, mask=mask, other=0.0).to(tl.float32)
        up += tl.load(bias_ptr + ex * stride_b + ucol, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        a = gate * tl.sigmoid(gate)
    elif ACT == 1:
        a = tl.maximum(gate, 0.0)
    elif ACT == 2:  # tanh-approximated GELU; tanh(z) = 2 sigmoid(2z) - 1
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        a = gate * tl.sigmoid(2.0 * z)
    else:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit) + 1.0
        a = gate * tl.sigmoid(gate * alpha)
    tl.store(out_ptr + row * stride_o + cc[None, :], (a * up).to(out_ptr.dtype.element_ty), mask=mask)


def act_mul(gu: torch.Tensor, inter: int, activation: str, out_dtype: torch.dtype, epi: Epilogue = PLAIN,
            experts: torch.Tensor | None = None) -> torch.Tensor:
    """`act(gate) * up` of the `(R, 2I)` gate/up product computed in float32, in `out_dtype`: one kernel for the
    activations of `_ACT_CODES`, torch ops otherwise. With `epi.gate_up_bias`, `experts` (`(R,)` int) names each
    row's expert, whose bias row is added first; `epi.interleaved`: the gate/up columns alternate."""
    r = gu.shape[0]
    code = _ACT_CODES.get(activation)
    bias = epi.gate_up_bias
    if code is None or gu.stride(-1) != 1 or (bias is not None and bias.stride(-1) != 1):
        from turboquant_hf.modeling.activations import gated

        gf = gu.float() if bias is None else gu.float() + bias[experts.long()].float()
        return gated(gf, activation, epi.interleaved, epi.alpha, epi.limit).to(out_dtype)
    out = torch.empty(r, inter, dtype=out_dtype, device=gu.device)
    if r:
        br, bc = 16, min(256, next_power_of_2(inter))
        launch(_act_mul_kernel, (cdiv(r, br), cdiv(inter, bc)), gu, out, gu if bias is None else bias,
               gu if experts is None else experts, r, inter, gu.stride(0), out.stride(0),
               0 if bias is None else bias.stride(0), float(epi.alpha), float(epi.limit), ACT=code,
               INTERLEAVED=bool(epi.interleaved), HAS_BIAS=bias is not None, BR=br, BC=bc, num_warps=4)
    return out


@triton.jit
def _combine_kernel(y_ptr, pos_ptr, w_ptr, out_ptr, bias_ptr, idx_ptr, H, stride_y, stride_o, stride_b,
                    K: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr):
    """out[t] = sum over slots j of w[t, j] * (y[pos[t, j]] + bias[idx[t, j]]) in float32 (pos -1: the slot routed
    nowhere; the bias with HAS_BIAS only), stored in out's dtype: each token reads its own rows of the expert-sorted
    results, so no scatter and no atomics."""
    t = tl.program_id(0).to(tl.int64)
    cc = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = cc < H
    acc = tl.zeros([BC], dtype=tl.float32)
    for j in tl.static_range(K):
        p = tl.load(pos_ptr + t * K + j).to(tl.int64)
        w = tl.load(w_ptr + t * K + j).to(tl.float32)
        live = (tl.zeros([BC], dtype=tl.int64) + p) >= 0
        v = tl.load(y_ptr + tl.maximum(p, 0) * stride_y + cc, mask=cmask & live, other=0.0).to(tl.float32)
        if HAS_BIAS:  # (a routed pair's expert is in [0, E))
            ex = tl.where(p >= 0, tl.load(idx_ptr + t * K + j).to(tl.int64), 0)
            v += tl.load(bias_ptr + ex * stride_b + cc, mask=cmask & live, other=0.0).to(tl.float32)
        acc += w * v
    tl.store(out_ptr + t * stride_o + cc, acc.to(out_ptr.dtype.element_ty), mask=cmask)


def positions(tok: torch.Tensor, slot: torch.Tensor, t: int, k: int) -> torch.Tensor:
    """`(t * k,)` int32: for pair (token, slot) its row among the expert-sorted pairs `(tok, slot)`, -1 where the
    pair is routed to no expert."""
    pos = torch.full((t * k,), -1, dtype=torch.int32, device=tok.device)
    return pos.index_copy_(0, tok * k + slot, torch.arange(tok.numel(), dtype=torch.int32, device=tok.device))


def row_experts(top_k_index: torch.Tensor, pos: torch.Tensor, rows: int) -> torch.Tensor:
    """`(rows,)` int32: the expert of each row of the expert-sorted pairs (`pos`: `positions`; rows no routed pair
    fills, 0). On the device, no host synchronisation."""
    out = torch.zeros(rows + 1, dtype=torch.int32, device=pos.device)
    dest = torch.where(pos >= 0, pos, rows).long()  # (pairs routed nowhere: the spare last entry)
    return out.index_copy_(0, dest, top_k_index.reshape(-1).to(torch.int32))[:rows]


def combine(y: torch.Tensor, pos: torch.Tensor, top_k_weights: torch.Tensor, out_dtype: torch.dtype,
            bias: torch.Tensor | None = None, top_k_index: torch.Tensor | None = None) -> torch.Tensor:
    """The layer's output from the expert-sorted pair results `y`: per token the routing-weighted sum of its pairs'
    rows (`pos`: row of pair (token, slot), -1 for none; see `positions`), each plus its expert's `bias` row (`(E,
    H)`, experts from `top_k_index`) where given, in float32, stored in `out_dtype`. One kernel, each token gathering
    its own rows."""
    t, k = top_k_weights.shape
    h = y.shape[1]
    w = top_k_weights if top_k_weights.is_contiguous() else top_k_weights.contiguous()
    out = torch.empty(t, h, dtype=out_dtype, device=y.device)
    if bias is not None:
        bias = bias if bias.stride(-1) == 1 else bias.contiguous()
        idx = top_k_index if top_k_index.is_contiguous() else top_k_index.contiguous()
    if t:
        bc = min(1024, next_power_of_2(h))
        launch(_combine_kernel, (t, cdiv(h, bc)), y, pos, w, out, y if bias is None else bias,
               pos if bias is None else idx, h, y.stride(0), out.stride(0), 0 if bias is None else bias.stride(0),
               K=k, BC=bc, HAS_BIAS=bias is not None, num_warps=4)
    return out


def moe_experts(hidden, top_k_index, top_k_weights, gate_up_packed, gate_up_norms, gate_up_codebook,
                down_packed, down_norms, down_codebook, signs1, signs2, group_size: int, num_experts: int,
                activation: str, gate_up_bias=None, down_bias=None, interleaved: bool = False, alpha: float = 1.0,
                limit: float = 0.0) -> torch.Tensor:
    from turboquant_hf.modeling.activations import check_activation

    check_activation(activation, limit)
    t, h = hidden.shape
    k = top_k_index.shape[1]
    e = num_experts
    inter = gate_up_norms.shape[0] // e // 2
    epi = Epilogue(gate_up_bias, down_bias, interleaved, alpha, limit)
    s1, s2 = L._f32(signs1), L._f32(signs2)
    unit_gu = L.lut_unit(gate_up_codebook.numel(), group_size)
    unit_d = L.lut_unit(down_codebook.numel(), group_size)
    if t == 0:
        return torch.zeros_like(hidden)
    sixteen = hidden.dtype in (torch.bfloat16, torch.float16)
    if t * k <= T.PAIR_MAX_ROWS:
        idx = top_k_index.reshape(-1)
        gu = _pairs(hidden, idx, k, gate_up_packed, gate_up_norms, gate_up_codebook, s1, s2, group_size, e,
                    unit_gu if sixteen else 0)
        mid = _pair_gate(gu, idx, e, activation, epi)
        y = _pairs(mid, idx, 1, down_packed, down_norms, down_codebook, s1, s2, group_size, e,
                   unit_d if sixteen else 0)
        if down_bias is not None:  # (pairs routed to no expert: no bias, as no output)
            routed = ((idx >= 0) & (idx < e))[:, None]
            y = y + torch.where(routed, down_bias[idx.clamp(0, e - 1)].float(), 0.0)
        out = (y.view(t, k, h) * top_k_weights.reshape(t, k, 1).to(torch.float32)).sum(1)
        return out.to(hidden.dtype)
    if sixteen and unit_gu and unit_d:
        plan = _fused_routed if t * k <= T.FUSED_MAX_PAIRS else _grouped_decoded
        return plan(hidden, top_k_index, top_k_weights, gate_up_packed, gate_up_norms, gate_up_codebook, down_packed,
                    down_norms, down_codebook, s1, s2, group_size, e, activation, inter, epi)
    return _grouped(hidden, top_k_index, top_k_weights, gate_up_packed, gate_up_norms, gate_up_codebook,
                    down_packed, down_norms, down_codebook, s1, s2, group_size, e, activation, inter, epi)


def _pair_gate(gu: torch.Tensor, idx: torch.Tensor, e: int, activation: str, epi: Epilogue) -> torch.Tensor:
    """The routed pairs' `act(gate) * up` (float32) from their gate/up rows `gu` (row p: pair p, of expert idx[p]),
    the gate/up bias added first where there is one."""
    from turboquant_hf.modeling.activations import gated

    if epi.gate_up_bias is not None:
        gu = gu + epi.gate_up_bias[idx.clamp(0, e - 1)].float()  # (a pair routed nowhere: its result is unused)
    return gated(gu, activation, epi.interleaved, epi.alpha, epi.limit)


def _grouped_mm_ok(x: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` serves these activations: bfloat16 on a CUDA device of compute capability 8.0
    or later (9.x before torch 2.9), not under the Triton interpreter."""
    if x.dtype != torch.bfloat16 or x.device.type != "cuda" or L._interpreting() or not hasattr(torch, "_grouped_mm"):
        return False
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    cap = torch.cuda.get_device_capability(x.device)
    return cap[0] == 9 if (major, minor) < (2, 9) else cap >= (8, 0)


def _expert_chunks(counts, per_expert_bytes: int, grouped: bool):
    """The routed experts (those with tokens, in order) in chunks whose decoded matrices fit
    `tuning.PREFILL_SCRATCH_BYTES`: yields (start, stop) of the chunk's rows among the pairs sorted by expert, the
    expert numbers (int32 tensor), for `torch._grouped_mm` their end offsets (else None), and the row count per
    expert.

    `counts`: the per-expert counts as a device tensor and as a list (`routing.expert_groups`). The expert numbers of every
    chunk come from one host-to-device copy (pinned, queued without waiting) and the offsets are summed on the
    device: a copy from pageable memory per chunk could wait for the stream, leaving the GPU idle while the host
    queues the next chunk's kernels."""
    counts_dev, counts = counts
    active = [ex for ex, c in enumerate(counts) if c]
    step = max(1, T.PREFILL_SCRATCH_BYTES // per_expert_bytes)
    host = torch.tensor(active, dtype=torch.int32)
    if counts_dev.device.type == "cuda":
        active_dev = host.pin_memory().to(counts_dev.device, non_blocking=True)
    else:
        active_dev = host.to(counts_dev.device)
    start = 0
    for c0 in range(0, len(active), step):
        sizes = [counts[ex] for ex in active[c0:c0 + step]]
        sel = active_dev[c0:c0 + len(sizes)]
        offs = counts_dev.index_select(0, sel).cumsum(0, dtype=torch.int32) if grouped else None
        yield start, start + sum(sizes), sel, offs, sizes
        start += sum(sizes)


def _expert_products(a: torch.Tensor, w: torch.Tensor, offs, sizes, grouped: bool) -> torch.Tensor:
    """Rows `a` grouped by expert times their experts' matrices `w` `(n, out, in)`: `torch._grouped_mm` with the
    groups' end offsets `offs` (a device tensor), or where it does not serve a product per expert over `sizes`
    rows each (the host's counts; fetched from `offs` when None)."""
    if grouped:
        return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)
    if sizes is None:
        sizes = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
    return torch.cat([torch.nn.functional.linear(part, w[i]) for i, part in enumerate(a.split(sizes))])


@triton.jit
def _route_count_kernel(idx_ptr, counts_ptr, P, E: tl.constexpr, BLOCK: tl.constexpr):
    """counts[e] += the pairs routed to expert e; counts[E]: those routed to no expert (indices outside [0, E))."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = p < P
    ex = tl.load(idx_ptr + p, mask=live, other=0)
    ex = tl.where((ex >= 0) & (ex < E), ex, E)
    tl.atomic_add(counts_ptr + ex, 1, mask=live)


@triton.jit
def _route_scan_kernel(counts_ptr, cursor_ptr, sel_ptr, offs_ptr, P, E: tl.constexpr, EP: tl.constexpr):
    """From the counts: each group's first row (into `cursor`, which the placing kernel advances), the matrices to
    decode (-1 for an empty group) and the groups' end offsets; the pairs routed to no expert join the last group."""
    ee = tl.arange(0, EP)
    cnt = tl.load(counts_ptr + ee, mask=ee <= E, other=0)
    ends = tl.cumsum(cnt, 0)
    tl.store(cursor_ptr + ee, ends - cnt, mask=ee <= E)
    last = ee == E - 1
    group = tl.where(last, cnt + tl.sum(tl.where(ee == E, cnt, 0), 0), cnt)
    tl.store(sel_ptr + ee, tl.where(group > 0, ee, -1), mask=ee < E)
    tl.store(offs_ptr + ee, tl.where(last, P, ends), mask=ee < E)


@triton.jit
def _route_place_kernel(idx_ptr, cursor_ptr, tok_ptr, pos_ptr, P, K: tl.constexpr, E: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Each pair takes the next free row of its group (an atomic ticket on the group's cursor): tok[row] = its
    token, pos[pair] = row (-1 for a pair routed to no expert, whose row follows every routed one)."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = p < P
    ex = tl.load(idx_ptr + p, mask=live, other=0)
    routed = (ex >= 0) & (ex < E)
    row = tl.atomic_add(cursor_ptr + tl.where(routed, ex, E), 1, mask=live)
    tl.store(tok_ptr + row, p // K, mask=live)
    tl.store(pos_ptr + p, tl.where(routed, row, -1), mask=live)


def _device_routing(top_k_index: torch.Tensor, e: int):
    """The routed pairs grouped by expert, computed on the device with no host synchronisation: (token ids of the
    rows, the row of each (token, slot) pair (-1 for none: `positions`), the matrices to decode (`(E,)` int32, -1
    for an expert no pair needs, which is neither read nor written), the grouped products' end offsets `(E,)`
    int32).

    A counting sort in three small kernels (count, scan, place). Pairs routed to no expert (indices outside
    [0, E)) come after every routed pair and join the last expert's group, so that every row lies inside the
    offsets (their results are never read). Inside a group the pairs' order follows the atomics' timing; each
    row's result does not (every row is its own product), so the layer's output is the same on every run.

    Three launches and four allocations, fewer than a stable sort and torch ops (`benchmarks/E2E.md`)."""
    t, k = top_k_index.shape
    p = t * k
    dev = top_k_index.device
    idx = top_k_index if top_k_index.is_contiguous() else top_k_index.contiguous()
    scratch = torch.zeros(2 * (e + 1), dtype=torch.int32, device=dev)  # counts, then the groups' cursors
    meta = torch.empty(2 * e, dtype=torch.int32, device=dev)  # sel, then offs
    tok = torch.empty(p, dtype=torch.int64, device=dev)
    pos = torch.empty(p, dtype=torch.int32, device=dev)
    block = 1024
    grid = (cdiv(p, block),)
    if p:
        launch(_route_count_kernel, grid, idx, scratch, p, E=e, BLOCK=block, num_warps=4)
    launch(_route_scan_kernel, (1,), scratch, scratch[e + 1:], meta, meta[e:], p, E=e, EP=next_power_of_2(e + 1),
           num_warps=4)
    if p:
        launch(_route_place_kernel, grid, idx, scratch[e + 1:], tok, pos, p, K=k, E=e, BLOCK=block, num_warps=4)
    return tok, pos, meta[:e], meta[e:]


def _decoded_on_device(pairs: int, e: int, widest_bytes: int) -> bool:
    """Whether the decoded prefill keeps its routing on the device: at least as many pairs as experts, and every
    expert's largest decoded matrix (`widest_bytes` each) fits `tuning.PREFILL_SCRATCH_BYTES` at once."""
    return pairs >= e and e * widest_bytes <= T.PREFILL_SCRATCH_BYTES


def host_waits(pairs: int, e: int, widest_bytes: int, lookup: bool = True) -> bool:
    """Whether `moe_experts` over `pairs` (token, slot) pairs waits for the host (so cannot be captured in a CUDA
    graph): never at decode (`tuning.PAIR_MAX_ROWS`) or in the fused routed products (`lookup`: 16-bit activations and
    2-, 3-, 4-bit or runtime-layout ternary experts, up to `tuning.FUSED_MAX_PAIRS`); in the decoded prefill unless
    `_decoded_on_device` (`widest_bytes`: an expert's decoded gate/up matrix); always in the per-expert products of
    the other tiers."""
    if pairs <= T.PAIR_MAX_ROWS or (lookup and pairs <= T.FUSED_MAX_PAIRS):
        return False
    return not (lookup and _decoded_on_device(pairs, e, widest_bytes))


def _prefill_plan(hidden, top_k_index, e: int, widest: int, per_expert: int, wdt: torch.dtype):
    """How a prefill runs its routed experts: (token id of each sorted pair, `positions` of the pairs, the chunks
    as (start row, stop row, matrices to decode, end offsets, row counts or None), whether `torch._grouped_mm`
    serves the products (`_expert_products`)).

    `widest`: the elements of an expert's largest matrix (decoded one projection at a time); `per_expert`: of all
    its matrices. One chunk with the routing on the device (no host synchronisation; `_device_routing`) where the
    pairs are at least as many as the experts and every expert's largest matrix fits `tuning.PREFILL_SCRATCH_BYTES` at
    once; otherwise the counts come to the host (`routing.expert_groups`, one synchronisation) and the routed experts
    are decoded in chunks of `per_expert`-sized experts that fit."""
    from turboquant_hf.modeling.routing import expert_groups

    t, k = top_k_index.shape
    nbytes = torch.finfo(wdt).bits // 8
    grouped = _grouped_mm_ok(hidden)
    if _decoded_on_device(t * k, e, widest * nbytes):
        tok, pos, sel, offs = _device_routing(top_k_index, e)
        return tok, pos, [(0, t * k, sel, offs, None)], grouped
    tok, slot, counts, counts_list = expert_groups(top_k_index, e)
    chunks = list(_expert_chunks((counts, counts_list), per_expert * nbytes, grouped))
    return tok, positions(tok, slot, t, k), chunks, grouped


def _grouped_decoded(hidden, top_k_index, top_k_weights, gu_packed, gu_norms, gu_cb, d_packed, d_norms, d_cb, s1,
                     s2, g, e, activation, inter, epi: Epilogue = PLAIN):
    """Prefill over the routed experts' decoded weights (see the module docstring). With `tuning.PREFILL_ROTATED_BASIS`
    the activations are rotated instead (the tokens once, the intermediate rows once per chunk) and the weights
    decoded in the rotated basis, with no Walsh-Hadamard product per weight.

    Where the pairs are at least as many as the experts and every expert's gate/up matrix fits the scratch budget
    at once, the routing stays on the device (`_device_routing`): no host synchronisation, every routed expert
    decoded in one pass (the others skipped), two grouped products. Otherwise the counts come to the host and the
    routed experts are decoded in chunks that fit the budget."""
    h = hidden.shape[1]
    wdt = torch.float32 if L._interpreting() else hidden.dtype  # (the interpreter computes in float32)
    rotated = T.PREFILL_ROTATED_BASIS
    x_all = L.rotate(hidden, s1, s2, g, wdt) if rotated else hidden.to(wdt)
    tok, pos, chunks, grouped = _prefill_plan(hidden, top_k_index, e, 2 * inter * h, 3 * inter * h, wdt)
    x = x_all[tok]  # the routed pairs' tokens, sorted by expert
    experts = row_experts(top_k_index, pos, tok.numel()) if epi.gate_up_bias is not None else None

    def chunk(start, stop, sel, offs, sizes):
        n_mat = sel.numel()
        unrot = () if rotated else (s1, s2, h)
        w_gu = L.dequantize_lut(gu_packed, gu_norms, gu_cb, g, wdt, *unrot, select=sel, select_rows=2 * inter)
        gu = _expert_products(x[start:stop], w_gu.view(n_mat, 2 * inter, -1), offs, sizes, grouped)
        del w_gu
        mid = act_mul(gu, inter, activation, wdt, epi, None if experts is None else experts[start:stop])
        del gu
        if rotated:
            mid = L.rotate(mid, s1, s2, g, wdt)
        unrot = () if rotated else (s1, s2, inter)
        w_d = L.dequantize_lut(d_packed, d_norms, d_cb, g, wdt, *unrot, select=sel, select_rows=h)
        return _expert_products(mid, w_d.view(n_mat, h, -1), offs, sizes, grouped)

    y = _chunk_rows(chunks, chunk, tok.numel(), h, wdt, hidden.device)
    return combine(y, pos, top_k_weights, hidden.dtype, epi.down_bias, top_k_index)


def _chunk_rows(chunks, chunk, rows: int, h: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The `(rows, h)` output rows of a decoded prefill: `chunk(start, stop, sel, offs, sizes)` for each of the
    `_prefill_plan` chunks, written at rows start..stop (a single chunk's result returned as it is)."""
    if len(chunks) == 1:
        return chunk(*chunks[0])
    y = torch.empty(rows, h, dtype=dtype, device=device)
    for start, stop, sel, offs, sizes in chunks:
        y[start:stop] = chunk(start, stop, sel, offs, sizes)
    return y


def _fused_routed(hidden, top_k_index, top_k_weights, gu_packed, gu_norms, gu_cb, d_packed, d_norms, d_cb, s1, s2, g,
                  e, activation, inter, epi: Epilogue = PLAIN):
    """Prefill with the experts decoded inside the products: the tokens rotated once, the pairs sorted by expert on
    the device (`_device_routing`), the gate/up product reading each pair's token row directly (`routed_lut_mm`),
    `act_mul`, the intermediate rows rotated, the down product, `combine`. No host synchronisation, no scratch
    buffer; only the routed experts' weights are read (a block of rows of one expert at a time)."""
    if _routed_on_gemm(top_k_index.numel(), e, g, gu_packed, gu_cb, d_packed, d_cb):
        return _routed_gemm(hidden, top_k_index, top_k_weights, gu_packed, gu_norms, gu_cb, d_packed, d_norms, d_cb,
                            s1, s2, g, e, activation, inter, epi)
    wdt = torch.float32 if L._interpreting() else hidden.dtype  # (the interpreter computes in float32)
    x = L.rotate(hidden, s1, s2, g, wdt)
    tok, pos, _, offs = _device_routing(top_k_index, e)
    gu = routed_lut_mm(x, offs, gu_packed, gu_norms, gu_cb, g, e, wdt, xrow=tok)
    experts = row_experts(top_k_index, pos, tok.numel()) if epi.gate_up_bias is not None else None
    mid = L.rotate(act_mul(gu, inter, activation, wdt, epi, experts), s1, s2, g, wdt)
    del gu
    y = routed_lut_mm(mid, offs, d_packed, d_norms, d_cb, g, e, wdt)
    return combine(y, pos, top_k_weights, hidden.dtype, epi.down_bias, top_k_index)


def _routed_on_gemm(pairs: int, e: int, g: int, gu_packed, gu_cb, d_packed, d_cb) -> bool:
    """Whether a fused prefill of `pairs` routed (token, slot) pairs over `e` experts runs its grouped products on
    the packed-weight GEMM (`gemm.routed_gemm`): from `tuning.ROUTED_GEMM_MIN_PAIRS` pairs up to
    `tuning.ROUTED_GEMM_MAX_ROWS` pairs an expert on average, for experts the dispatch routes to the GEMM
    (`gemm.dispatched`, as `linear.path` decides for a dense layer)."""
    return (T.ROUTED_GEMM_MIN_PAIRS <= pairs <= T.ROUTED_GEMM_MAX_ROWS * e
            and gemm.dispatched(gu_cb.numel(), g, gu_packed) and gemm.dispatched(d_cb.numel(), g, d_packed))


def _routed_gemm(hidden, top_k_index, top_k_weights, gu_packed, gu_norms, gu_cb, d_packed, d_norms, d_cb, s1, s2, g,
                 e, activation, inter, epi: Epilogue = PLAIN):
    """`_fused_routed` with both grouped products on the packed-weight GEMM (`gemm.routed_gemm`): the tokens and
    then the intermediate rows rotated into the GEMM's lane order where its configuration takes it."""
    interp = L._interpreting()  # (the interpreter runs the GEMM in float32)
    wdt = torch.float32 if interp else hidden.dtype
    tok, pos, _, offs = _device_routing(top_k_index, e)
    p, h = tok.numel(), hidden.shape[1]

    def product(x, packed, norms, codebook, n, xrow):
        nl = codebook.numel()
        runtime = packed.dtype == torch.int32
        bm, bn, bk, swap, lanes, warps, stages = gemm.routed_config(p, e, n, nl, g)
        lanes = lanes and runtime
        x_rot = L.rotate(x, s1, s2, g, wdt, lane_unit=gemm.lane_unit(nl) if lanes else 0, lane_block=bk)
        return gemm.routed_gemm(x_rot, offs, packed, norms, L._f32(codebook), g, e, wdt, xrow=xrow,
                                config=(bm, bn, bk, swap, lanes, warps, stages), runtime_layout=runtime,
                                use_asm=not interp, lanes_first=L._lanes_first())

    gu = product(hidden, gu_packed, gu_norms, gu_cb, 2 * inter, tok)
    experts = row_experts(top_k_index, pos, p) if epi.gate_up_bias is not None else None
    y = product(act_mul(gu, inter, activation, wdt, epi, experts), d_packed, d_norms, d_cb, h, None)
    return combine(y, pos, top_k_weights, hidden.dtype, epi.down_bias, top_k_index)


def _pairs(x, idx, x_div, packed, norms, codebook, s1, s2, g, e, unit):
    """Routed pairs: row p = expert idx[p]'s matrix times row p // x_div of x (float32 result). The pair GEMV
    where the codebook allows it (`unit` > 0), else the select/codebook-load GEMV (ternary in its published
    bytes, float32 activations)."""
    if unit:
        x2, xs = L.rotate(x, s1, s2, g, torch.float32, unit=unit)
        return L.gemv_pairs(x2, xs, packed, norms, codebook, g, torch.float32, experts=e, expert_index=idx,
                            x_div=x_div)
    x_rot = L.rotate(x, s1, s2, g, torch.float32)
    return L.gemv_fma(x_rot, packed, norms.contiguous(), L._f32(codebook), g, torch.float32, experts=e,
                      expert_index=idx, x_div=x_div)


def _grouped(hidden, top_k_index, top_k_weights, gu_packed, gu_norms, gu_cb, d_packed, d_norms, d_cb, s1, s2,
             g, e, activation, inter, epi: Epilogue = PLAIN):
    from turboquant_hf.modeling.activations import gated
    from turboquant_hf.modeling.routing import routed_groups

    t, h = hidden.shape
    dt = hidden.dtype  # the products run in the activations' dtype (float32 accumulation); sums in float32
    gu_rows = 2 * inter
    ng_h = gu_norms.shape[1]
    ng_i = d_norms.shape[1]
    x_rot = L.rotate(hidden, s1, s2, g, torch.float32)
    out = torch.zeros(t, h, dtype=torch.float32, device=hidden.device)
    for ex, tok, slot in routed_groups(top_k_index, e):
        gu = L.product(x_rot[tok], gu_packed[ex * gu_rows * ng_h:(ex + 1) * gu_rows * ng_h],
                       gu_norms[ex * gu_rows:(ex + 1) * gu_rows], gu_cb, g, dt).float()
        if epi.gate_up_bias is not None:
            gu = gu + epi.gate_up_bias[ex].float()
        mid = gated(gu, activation, epi.interleaved, epi.alpha, epi.limit)
        y = L.product(L.rotate(mid, s1, s2, g, torch.float32), d_packed[ex * h * ng_i:(ex + 1) * h * ng_i],
                      d_norms[ex * h:(ex + 1) * h], d_cb, g, dt).float()
        if epi.down_bias is not None:
            y = y + epi.down_bias[ex].float()
        out.index_add_(0, tok, y * top_k_weights[tok, slot, None].float())
    return out.to(hidden.dtype)


def hadamard_moe_experts(hidden, top_k_index, top_k_weights, gate_packed, gate_norms, gate_codebook, gate_signs,
                         up_packed, up_norms, up_codebook, up_signs, down_packed, down_norms, down_codebook,
                         down_signs, num_experts: int, activation: str) -> torch.Tensor:
    """CUDA implementation of `turboquant::hadamard_moe_experts` (turboquant-mlx experts: gate, up and down
    each with their own whole-row rotation signs, codebook and group size).

    Decode (at most `tuning.PAIR_MAX_ROWS` routed pairs): the rotations in torch (`hadamard.rotate_rows`, no host
    synchronisation), the routed-pair GEMVs of `_pairs` (LUT or select GEMV), so the layer can be captured
    in a CUDA graph. Longer prompts with 16-bit activations and lookup-decodable projections (2-, 3-, 4-bit,
    ternary in its runtime layout): the rotations in torch, once per token, and the routed experts' rotated-basis
    matrices decoded in chunks for grouped products (`_hadamard_grouped_decoded`). Otherwise, and for groups
    smaller than a kernel unit (3-bit groups of 16), the torch reference, which groups tokens by expert."""
    from turboquant_hf.format import hadamard
    from turboquant_hf.modeling import ops

    t, h = hidden.shape
    k = top_k_index.shape[1]
    e = num_experts
    inter = gate_norms.shape[0] // e
    g_h = h // gate_norms.shape[1]
    g_i = inter // down_norms.shape[1]
    args = (hidden, top_k_index, top_k_weights, gate_packed, gate_norms, gate_codebook, gate_signs, up_packed,
            up_norms, up_codebook, up_signs, down_packed, down_norms, down_codebook, down_signs, num_experts,
            activation)
    whole_units = all(cb.numel() != 8 or g >= 32 for cb, g in
                      ((gate_codebook, g_h), (up_codebook, g_h), (down_codebook, g_i)))
    act = _activation(activation)
    sixteen = hidden.dtype in (torch.bfloat16, torch.float16)
    if t and t * k > T.PAIR_MAX_ROWS and sixteen and all(  # (lut_unit: 0 where a group is smaller than a unit)
            L.lut_unit(cb.numel(), g) for cb, g in ((gate_codebook, g_h), (up_codebook, g_h), (down_codebook, g_i))):
        plan = _hadamard_fused_routed if t * k <= T.FUSED_MAX_PAIRS else _hadamard_grouped_decoded
        return plan(*args[:15], e, act)
    if t == 0 or t * k > T.PAIR_MAX_ROWS or not whole_units:
        return ops.turboquant_hadamard_moe_experts(*args)
    idx = top_k_index.reshape(-1)
    x = hidden.to(torch.float32)

    def pairs(x_rot, x_div, packed, norms, codebook, g):
        unit = L.lut_unit(codebook.numel(), g) if sixteen else 0
        if unit:
            x2, xs = L.pack_pairs(x_rot, unit, g)
            return L.gemv_pairs(x2, xs, packed, norms, codebook, g, torch.float32, experts=e, expert_index=idx,
                                x_div=x_div)
        return L.gemv_fma(x_rot.contiguous(), packed, norms.contiguous(), L._f32(codebook), g, torch.float32,
                          experts=e, expert_index=idx, x_div=x_div)

    gate = pairs(hadamard.rotate_rows(x, gate_signs.float()), k, gate_packed, gate_norms, gate_codebook, g_h)
    up = pairs(hadamard.rotate_rows(x, up_signs.float()), k, up_packed, up_norms, up_codebook, g_h)
    mid = act(gate) * up
    y = pairs(hadamard.rotate_rows(mid, down_signs.float()), 1, down_packed, down_norms, down_codebook, g_i)
    out = (y.view(t, k, h) * top_k_weights.reshape(t, k, 1).to(torch.float32)).sum(1)
    return out.to(hidden.dtype)


def _hadamard_setup(hidden, gate_norms, gate_signs, up_signs, down_norms, e):
    """What both prefills of whole-row-Hadamard experts start from: (intermediate width, gate/up and down group
    sizes, the products' operand dtype, the tokens rotated with the gate's signs and with the up projection's
    (the same tensor where the signs are), in float32)."""
    from turboquant_hf.format import hadamard

    h = hidden.shape[1]
    inter = gate_norms.shape[0] // e
    wdt = torch.float32 if L._interpreting() else hidden.dtype
    x = hidden.to(torch.float32)
    xg = hadamard.rotate_rows(x, gate_signs.float())
    xu = xg if up_signs is gate_signs else hadamard.rotate_rows(x, up_signs.float())
    return inter, h // gate_norms.shape[1], inter // down_norms.shape[1], wdt, xg, xu


def _hadamard_fused_routed(hidden, top_k_index, top_k_weights, gate_packed, gate_norms, gate_codebook, gate_signs,
                           up_packed, up_norms, up_codebook, up_signs, down_packed, down_norms, down_codebook,
                           down_signs, e, act):
    """Prefill of whole-row-Hadamard experts with the experts decoded inside the products (`routed_lut_mm`): the
    tokens rotated once per projection's signs, the pairs sorted by expert on the device, gate and up products
    reading each pair's token row directly, the intermediate rows rotated with the down projection's signs, the
    down product, `combine`. No host synchronisation and no scratch buffer."""
    from turboquant_hf.format import hadamard

    _, g_h, g_i, wdt, xg, xu = _hadamard_setup(hidden, gate_norms, gate_signs, up_signs, down_norms, e)
    tok, pos, _, offs = _device_routing(top_k_index, e)
    xg = xg.to(wdt)
    xu = xg if up_signs is gate_signs else xu.to(wdt)
    gate = routed_lut_mm(xg, offs, gate_packed, gate_norms, gate_codebook, g_h, e, wdt, xrow=tok).float()
    up = routed_lut_mm(xu, offs, up_packed, up_norms, up_codebook, g_h, e, wdt, xrow=tok).float()
    mid = hadamard.rotate_rows(act(gate) * up, down_signs.float()).to(wdt)
    del gate, up
    y = routed_lut_mm(mid, offs, down_packed, down_norms, down_codebook, g_i, e, wdt)
    return combine(y, pos, top_k_weights, hidden.dtype)


def _hadamard_grouped_decoded(hidden, top_k_index, top_k_weights, gate_packed, gate_norms, gate_codebook, gate_signs,
                              up_packed, up_norms, up_codebook, up_signs, down_packed, down_norms, down_codebook,
                              down_signs, e, act):
    """Prefill of whole-row-Hadamard experts: the tokens rotated once per projection's signs (shared by every
    expert), the routed experts' rotated-basis matrices (`norm * codebook[idx]`) decoded in chunks of at most
    `tuning.PREFILL_SCRATCH_BYTES`, grouped products as in `_grouped_decoded`, the intermediate rows rotated with
    the down projection's signs between the two."""
    from turboquant_hf.format import hadamard

    h = hidden.shape[1]
    inter, g_h, g_i, wdt, xg, xu = _hadamard_setup(hidden, gate_norms, gate_signs, up_signs, down_norms, e)
    tok, pos, chunks, grouped = _prefill_plan(hidden, top_k_index, e, inter * h, 3 * inter * h, wdt)
    xg, xu = xg[tok].to(wdt), xu[tok].to(wdt)  # the routed pairs' rows, sorted by expert
    d_signs = down_signs.float()

    def chunk(start, stop, sel, offs, sizes):
        n = sel.numel()
        w_g = L.dequantize_lut(gate_packed, gate_norms, gate_codebook, g_h, wdt, select=sel, select_rows=inter)
        gate = _expert_products(xg[start:stop], w_g.view(n, inter, h), offs, sizes, grouped).float()
        del w_g
        w_u = L.dequantize_lut(up_packed, up_norms, up_codebook, g_h, wdt, select=sel, select_rows=inter)
        up = _expert_products(xu[start:stop], w_u.view(n, inter, h), offs, sizes, grouped).float()
        del w_u
        mid = hadamard.rotate_rows(act(gate) * up, d_signs).to(wdt)
        w_d = L.dequantize_lut(down_packed, down_norms, down_codebook, g_i, wdt, select=sel, select_rows=h)
        return _expert_products(mid, w_d.view(n, h, inter), offs, sizes, grouped)

    y = _chunk_rows(chunks, chunk, tok.numel(), h, wdt, hidden.device)
    return combine(y, pos, top_k_weights, hidden.dtype)


# ---------------------------------------------------------------------------
# fused routed products: the experts decoded inside a grouped matrix product
# ---------------------------------------------------------------------------

@triton.jit
def _routed_lut_mm_kernel(x_ptr, xrow_ptr, offs_ptr, pk_ptr, nrm_ptr, cb_ptr, out_ptr, N, stride_x, stride_o,
                          E: tl.constexpr, EP: tl.constexpr, NG: tl.constexpr, NLEV: tl.constexpr, G: tl.constexpr,
                          UPG: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, RUNTIME_LAYOUT: tl.constexpr,
                          USE_ASM: tl.constexpr, GATHER: tl.constexpr):
    """Rows grouped by expert (group e ends at `offs[e]`) times their experts' rotated-basis matrices, each weight
    tile decoded in registers (byte-permute lookups, group norm) and fed straight to the tensor cores as the left
    operand: `out[r, n] = sum_k x[src(r), k] * norm * codebook[idx]` of row n of expert e(r), with no decoded
    weight in memory.

    Program (b, j): block b of BM rows inside one expert's group (the block's expert is found from the group
    sizes, so the grid is a bound known without the counts: blocks past the last group return at once), weight
    rows j*BN ... of that expert. GATHER: row r reads x row `xrow[r]` (the routed pairs' tokens), else row r."""
    WPU: tl.constexpr = 3 if NLEV == 8 else 1
    NUT: tl.constexpr = NG * UPG
    ex, rows, rmask = _routed_block(offs_ptr, E, EP, BM)
    if ex >= E:
        return
    if GATHER:
        src = tl.load(xrow_ptr + rows).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    nn = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = nn < N
    wrow = ex.to(tl.int64) * N + tl.minimum(nn, N - 1)  # (clamped: loads in bounds, extra rows not stored)
    t0, t1, t2, t3, t4, t5, t6, t7 = _byte_tables(cb_ptr, NLEV)
    kk = tl.arange(0, G)
    ru = tl.arange(0, UPG)
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for gi in tl.range(0, NG):
        rs = wrow * NG + gi
        w0, w1, w2 = _load_units(pk_ptr, rs[:, None] * UPG + ru[None, :], None, WPU, RUNTIME_LAYOUT, wrow[:, None], NUT)
        v = tl.reshape(_lut_tile(w0, w1, w2, t0, t1, t2, t3, t4, t5, t6, t7, NLEV, RUNTIME_LAYOUT, USE_ASM), [BN, G])
        v = v * tl.load(nrm_ptr + rs).to(tl.float32)[:, None]
        xt = tl.load(x_ptr + src[None, :] * stride_x + (gi * G + kk)[:, None])
        if USE_ASM:  # 16-bit operands, float32 accumulation
            acc = tl.dot(v.to(xt.dtype), xt, acc)
        else:  # (the interpreter: float32 throughout)
            acc = tl.dot(v, xt.to(tl.float32), acc, input_precision="ieee")
    optr = out_ptr + rows.to(tl.int64)[None, :] * stride_o + nn[:, None]
    tl.store(optr, acc.to(out_ptr.dtype.element_ty), mask=nmask[:, None] & rmask[None, :])


def _routed_config(pairs: int, e: int) -> tuple[int, int]:
    """(rows per block, weight rows per program) of `routed_lut_mm`: blocks of `gemm.routed_block_rows`, 64 weight
    rows for the smallest blocks and 128 otherwise; four warps (eight were slower, 256-row blocks spill)."""
    bm = gemm.routed_block_rows(pairs, e)
    return bm, 64 if bm == 16 else 128


def routed_lut_mm(x: torch.Tensor, offs: torch.Tensor, packed: torch.Tensor, norms: torch.Tensor,
                  codebook: torch.Tensor, group_size: int, num_experts: int, out_dtype: torch.dtype,
                  xrow: torch.Tensor | None = None, block_rows: int = 0, block_n: int = 0,
                  warps: int = 4) -> torch.Tensor:
    """Rows grouped by expert times their experts' packed matrices, decoded inside the product (no scratch
    buffer, no host synchronisation): `(P, rows per expert)` in `out_dtype`.

    `x`: rotated-basis activations `(T, n_groups*G)`; `xrow` (int32 `(P,)`): row r of the product reads x row
    `xrow[r]` (default: row r, and then P = T); `offs` (int32 `(E,)`): the groups' end offsets, rows `offs[e-1]
    ... offs[e]` belong to expert e (rows past `offs[-1]` are not written). `packed`/`norms`: E stacked
    matrices, 2-, 3- or 4-bit (ternary in its runtime layout), as `dequantize_lut` reads them."""
    rows, ng = norms.shape
    n = rows // num_experts
    p = xrow.numel() if xrow is not None else x.shape[0]
    if x.shape[1] != ng * group_size:
        raise ValueError(f"activations of width {x.shape[1]} for a weight of {ng} groups of {group_size}")
    out = torch.empty(p, n, dtype=out_dtype, device=x.device)
    per = L.lut_unit(codebook.numel(), group_size)
    if not per:
        raise ValueError(f"the fused routed product serves 4-, 8- and 16-entry codebooks, not {codebook.numel()}")
    if p == 0 or n == 0:
        return out
    bm, bn = _routed_config(p, num_experts)
    bm, bn = block_rows or bm, block_n or bn
    grid = (min(num_experts, p) + p // bm, cdiv(n, bn))
    xs = x if x.stride(-1) == 1 else x.contiguous()
    launch(_routed_lut_mm_kernel, grid, xs, xrow if xrow is not None else offs, offs, L._packed_view(packed, 1),
           norms.contiguous(), L._f32(codebook), out, n, xs.stride(0), out.stride(0),
           E=num_experts, EP=next_power_of_2(num_experts), NG=ng,
           NLEV=codebook.numel(), G=group_size, UPG=group_size // per, BN=bn, BM=bm,
           RUNTIME_LAYOUT=L._runtime_layout(packed, codebook.numel()), USE_ASM=not L._interpreting(),
           GATHER=xrow is not None, num_warps=warps)
    return out
