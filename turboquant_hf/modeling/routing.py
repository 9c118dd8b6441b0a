"""Grouping routed (token, slot) pairs by expert: shared by the reference MoE op and the CUDA kernels."""

from __future__ import annotations

import torch


def sort_routing(top_k_index: torch.Tensor, num_experts: int):
    """The (token, slot) pairs sorted by expert, on the indices' device with no host synchronisation: (the flat
    pair numbers `token * top_k + slot` in sorted order, the per-expert counts `(num_experts + 1,)` int64, the last
    counting the pairs routed to no expert).

    Indices outside [0, num_experts) (some routers use num_experts as "no expert") become num_experts and sort
    last; the counts are summed with a scatter, which needs no output size from the host."""
    flat = top_k_index.reshape(-1)
    keys = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts).to(torch.int64)
    # (the keys fit 16 bits for a shorter sort)
    order = torch.argsort(keys.to(torch.int16) if num_experts < 2**15 - 1 else keys, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    return order, counts


def expert_groups(top_k_index: torch.Tensor, num_experts: int):
    """Routed (token, slot) pairs grouped by expert: (sorted token ids, sorted slot ids, per-expert counts as a
    tensor on the indices' device and as a list). One host synchronisation (`sort_routing`, then the counts).

    Indices outside [0, num_experts) (some routers use num_experts as "no expert") are dropped.
    """
    k = top_k_index.shape[1]
    order, counts = sort_routing(top_k_index, num_experts)
    counts_list = counts.tolist()[:-1]
    order = order[: sum(counts_list)]
    return order // k, order % k, counts[:-1], counts_list


def routed_groups(top_k_index: torch.Tensor, num_experts: int):
    """For each expert some token was routed to: (expert, token ids, slot ids). One host synchronisation."""
    tokens, slots, _, counts = expert_groups(top_k_index, num_experts)
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, tokens[start : start + n], slots[start : start + n]
            start += n
