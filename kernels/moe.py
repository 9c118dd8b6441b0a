"""CUDA implementation of `torch.ops.turboquant.moe_experts` (routed experts, packed weights).

Decode (at most `PAIR_MAX_ROWS` routed (token, slot) pairs; any bit width): five launches and no host
synchronisation, so the layer can be captured in a CUDA graph:

1. `rotate` the tokens once (every expert of a token reads the same rotated row);
2. a GEMV over pairs (the pair GEMV for 2-, 3- and 4-bit experts and 16-bit activations, else the
   select/codebook-load GEMV): row p of the result is expert `top_k_index[p]`'s gate/up matrix times token
   `p // top_k` (only routed experts are read; an index outside [0, E) gives zeros);
3. `act(gate) * up` in float32;
4. `rotate` each pair's intermediate row;
5. the GEMV over pairs with the down matrices, then the top-k weighted sum per token.

Otherwise (prefill): the (token, slot) pairs are sorted by expert (one host synchronisation for the counts,
as transformers' own expert loop does). For 2-, 3- and 4-bit experts (ternary in its runtime layout) and 16-bit
activations, the routed experts' matrices are decoded, rotation undone, into a scratch buffer of at most
`PREFILL_SCRATCH_BYTES` (a chunk of experts at a time; only routed experts are read), and each chunk runs as two
grouped matrix products (`torch._grouped_mm`, bfloat16 on CUDA; a product per expert otherwise) around the
activation: a few launches per chunk instead of a dozen per expert. Other tiers (ternary in its published bytes,
float32 activations) run `linear.product` per routed expert on its tokens.
"""

from __future__ import annotations

import torch

from . import linear as L

# Most (token, slot) pairs served by the pair GEMV path.
PAIR_MAX_ROWS = 64
# Largest scratch buffer of decoded expert weights at prefill (bytes); the routed experts are decoded in chunks
# that fit (at least one expert at a time).
PREFILL_SCRATCH_BYTES = 256 << 20


def _activation(name: str):
    from turboquant_hf.ops import ACTIVATIONS

    return ACTIVATIONS[name]


def moe_experts(hidden, top_k_index, top_k_weights, gate_up_packed, gate_up_norms, gate_up_codebook,
                down_packed, down_norms, down_codebook, signs1, signs2, group_size: int, num_experts: int,
                activation: str) -> torch.Tensor:
    t, h = hidden.shape
    k = top_k_index.shape[1]
    e = num_experts
    inter = gate_up_norms.shape[0] // e // 2
    act = _activation(activation)
    s1, s2 = L._f32(signs1), L._f32(signs2)
    unit_gu = L.lut_unit(gate_up_codebook.numel(), group_size)
    unit_d = L.lut_unit(down_codebook.numel(), group_size)
    if t == 0:
        return torch.zeros_like(hidden)
    sixteen = hidden.dtype in (torch.bfloat16, torch.float16)
    if t * k <= PAIR_MAX_ROWS:
        idx = top_k_index.reshape(-1)
        gu = _pairs(hidden, idx, k, gate_up_packed, gate_up_norms, gate_up_codebook, s1, s2, group_size, e,
                    unit_gu if sixteen else 0)
        mid = act(gu[:, :inter]) * gu[:, inter:]
        y = _pairs(mid, idx, 1, down_packed, down_norms, down_codebook, s1, s2, group_size, e,
                   unit_d if sixteen else 0)
        out = (y.view(t, k, h) * top_k_weights.reshape(t, k, 1).to(torch.float32)).sum(1)
        return out.to(hidden.dtype)
    if sixteen and unit_gu and unit_d:
        return _grouped_decoded(hidden, top_k_index, top_k_weights, gate_up_packed, gate_up_norms, gate_up_codebook,
                                down_packed, down_norms, down_codebook, s1, s2, group_size, e, act, inter)
    return _grouped(hidden, top_k_index, top_k_weights, gate_up_packed, gate_up_norms, gate_up_codebook,
                    down_packed, down_norms, down_codebook, s1, s2, group_size, e, act, inter)


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
    `PREFILL_SCRATCH_BYTES`: yields (start, stop) of the chunk's rows among the pairs sorted by expert, the
    expert numbers (int32 tensor), the row count per expert and, for `torch._grouped_mm`, their end offsets.

    `counts`: the per-expert counts as a device tensor and as a list (`_sorted_pairs`). The expert numbers of every
    chunk come from one host-to-device copy (pinned, queued without waiting) and the offsets are summed on the
    device: a copy from pageable memory per chunk could wait for the stream, leaving the GPU idle while the host
    queues the next chunk's kernels."""
    counts_dev, counts = counts
    active = [ex for ex, c in enumerate(counts) if c]
    step = max(1, PREFILL_SCRATCH_BYTES // per_expert_bytes)
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
        yield start, start + sum(sizes), sel, sizes, offs
        start += sum(sizes)


def _expert_products(a: torch.Tensor, w: torch.Tensor, sizes: list, offs, grouped: bool) -> torch.Tensor:
    """Rows `a` (grouped by expert, `sizes` rows each) times their experts' matrices `w` `(n, out, in)`."""
    if grouped:
        return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)
    return torch.cat([torch.nn.functional.linear(part, w[i]) for i, part in enumerate(a.split(sizes))])


def _sorted_pairs(hidden, top_k_index, top_k_weights, e):
    """The routed (token, slot) pairs sorted by expert (`ops.expert_groups`, one host synchronisation): their
    token ids, routing weights (float32), per-expert counts (the device tensor and a list), and whether
    `torch._grouped_mm` serves them."""
    from turboquant_hf.ops import expert_groups

    tok, slot, counts, counts_list = expert_groups(top_k_index, e)
    return tok, top_k_weights[tok, slot].to(torch.float32), (counts, counts_list), _grouped_mm_ok(hidden)


def _weighted_sum(y, w, tok, hidden):
    """Per token, the sum of its pairs' rows `y` times their routing weights `w`, in the activations' dtype."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    out.index_add_(0, tok, y * w[:, None])
    return out.to(hidden.dtype)


def _grouped_decoded(hidden, top_k_index, top_k_weights, gu_packed, gu_norms, gu_cb, d_packed, d_norms, d_cb, s1,
                     s2, g, e, act, inter):
    """Prefill over the routed experts' decoded weights (see the module docstring)."""
    h = hidden.shape[1]
    wdt = torch.float32 if L._interpreting() else hidden.dtype  # (the interpreter computes in float32)
    tok, w, counts, grouped = _sorted_pairs(hidden, top_k_index, top_k_weights, e)
    x = hidden[tok].to(wdt)  # the routed pairs' tokens, sorted by expert
    y = torch.empty(tok.numel(), h, dtype=torch.float32, device=hidden.device)
    per_expert = 3 * inter * h * torch.finfo(wdt).bits // 8
    for start, stop, sel, sizes, offs in _expert_chunks(counts, per_expert, grouped):
        w_gu = L.dequantize_lut(gu_packed, gu_norms, gu_cb, g, wdt, s1, s2, h, select=sel, select_rows=2 * inter)
        gu = _expert_products(x[start:stop], w_gu.view(len(sizes), 2 * inter, h), sizes, offs, grouped).float()
        del w_gu
        mid = (act(gu[:, :inter]) * gu[:, inter:]).to(wdt)
        w_d = L.dequantize_lut(d_packed, d_norms, d_cb, g, wdt, s1, s2, inter, select=sel, select_rows=h)
        y[start:stop] = _expert_products(mid, w_d.view(len(sizes), h, inter), sizes, offs, grouped)
        del w_d
    return _weighted_sum(y, w, tok, hidden)


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
             g, e, act, inter):
    from turboquant_hf.ops import routed_groups

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
        mid = act(gu[:, :inter]) * gu[:, inter:]
        y = L.product(L.rotate(mid, s1, s2, g, torch.float32), d_packed[ex * h * ng_i:(ex + 1) * h * ng_i],
                      d_norms[ex * h:(ex + 1) * h], d_cb, g, dt).float()
        out.index_add_(0, tok, y * top_k_weights[tok, slot, None].float())
    return out.to(hidden.dtype)


def hadamard_moe_experts(hidden, top_k_index, top_k_weights, gate_packed, gate_norms, gate_codebook, gate_signs,
                         up_packed, up_norms, up_codebook, up_signs, down_packed, down_norms, down_codebook,
                         down_signs, num_experts: int, activation: str) -> torch.Tensor:
    """CUDA implementation of `turboquant::hadamard_moe_experts` (turboquant-mlx experts: gate, up and down
    each with their own whole-row rotation signs, codebook and group size).

    Decode (at most `PAIR_MAX_ROWS` routed pairs): the rotations in torch (`rotation.rotate_rows`, no host
    synchronisation), the routed-pair GEMVs of `_pairs` (LUT or select GEMV), so the layer can be captured
    in a CUDA graph. Longer prompts with 16-bit activations and lookup-decodable projections (2-, 3-, 4-bit,
    ternary in its runtime layout): the rotations in torch, once per token, and the routed experts' rotated-basis
    matrices decoded in chunks for grouped products (`_hadamard_grouped_decoded`). Otherwise, and for groups
    smaller than a kernel unit (3-bit groups of 16), the torch reference, which groups tokens by expert."""
    from turboquant_hf import ops, rotation

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
    if t and t * k > PAIR_MAX_ROWS and sixteen and all(  # (lut_unit: 0 where a group is smaller than a unit)
            L.lut_unit(cb.numel(), g) for cb, g in ((gate_codebook, g_h), (up_codebook, g_h), (down_codebook, g_i))):
        return _hadamard_grouped_decoded(*args[:15], e, act)
    if t == 0 or t * k > PAIR_MAX_ROWS or not whole_units:
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

    gate = pairs(rotation.rotate_rows(x, gate_signs.float()), k, gate_packed, gate_norms, gate_codebook, g_h)
    up = pairs(rotation.rotate_rows(x, up_signs.float()), k, up_packed, up_norms, up_codebook, g_h)
    mid = act(gate) * up
    y = pairs(rotation.rotate_rows(mid, down_signs.float()), 1, down_packed, down_norms, down_codebook, g_i)
    out = (y.view(t, k, h) * top_k_weights.reshape(t, k, 1).to(torch.float32)).sum(1)
    return out.to(hidden.dtype)


def _hadamard_grouped_decoded(hidden, top_k_index, top_k_weights, gate_packed, gate_norms, gate_codebook, gate_signs,
                              up_packed, up_norms, up_codebook, up_signs, down_packed, down_norms, down_codebook,
                              down_signs, e, act):
    """Prefill of whole-row-Hadamard experts: the tokens rotated once per projection's signs (shared by every
    expert), the routed experts' rotated-basis matrices (`norm * codebook[idx]`) decoded in chunks of at most
    `PREFILL_SCRATCH_BYTES`, grouped products as in `_grouped_decoded`, the intermediate rows rotated with the down
    projection's signs between the two."""
    from turboquant_hf import rotation

    h = hidden.shape[1]
    inter = gate_norms.shape[0] // e
    g_h, g_i = h // gate_norms.shape[1], inter // down_norms.shape[1]
    wdt = torch.float32 if L._interpreting() else hidden.dtype
    tok, w, counts, grouped = _sorted_pairs(hidden, top_k_index, top_k_weights, e)
    x = hidden.to(torch.float32)
    xg = rotation.rotate_rows(x, gate_signs.float())
    xu = xg if torch.equal(gate_signs, up_signs) else rotation.rotate_rows(x, up_signs.float())
    xg, xu = xg[tok].to(wdt), xu[tok].to(wdt)  # the routed pairs' rows, sorted by expert
    d_signs = down_signs.float()
    y = torch.empty(tok.numel(), h, dtype=torch.float32, device=hidden.device)
    per_expert = 3 * inter * h * torch.finfo(wdt).bits // 8
    for start, stop, sel, sizes, offs in _expert_chunks(counts, per_expert, grouped):
        n = len(sizes)
        w_g = L.dequantize_lut(gate_packed, gate_norms, gate_codebook, g_h, wdt, select=sel, select_rows=inter)
        gate = _expert_products(xg[start:stop], w_g.view(n, inter, h), sizes, offs, grouped).float()
        del w_g
        w_u = L.dequantize_lut(up_packed, up_norms, up_codebook, g_h, wdt, select=sel, select_rows=inter)
        up = _expert_products(xu[start:stop], w_u.view(n, inter, h), sizes, offs, grouped).float()
        del w_u
        mid = rotation.rotate_rows(act(gate) * up, d_signs).to(wdt)
        w_d = L.dequantize_lut(down_packed, down_norms, down_codebook, g_i, wdt, select=sel, select_rows=h)
        y[start:stop] = _expert_products(mid, w_d.view(n, h, inter), sizes, offs, grouped)
        del w_d
    return _weighted_sum(y, w, tok, hidden)
