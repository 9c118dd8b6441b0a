"""Sibling projections that read the same input, fused into one packed weight for decoding.

At batch-1 decode each projection is a short GEMV, and q/k/v (or gate/up) each rotate the same activations
and launch their own kernel. `fuse_projections(model)` stacks the rows of such siblings into one packed weight
per group, and the siblings' own buffers become views of it (no extra memory). The first sibling called with
an input computes every sibling's output in one op (one rotation, one GEMV) and the others take theirs. A
sibling called with another input while outputs are pending (siblings that read different inputs, as in
cross-attention), or after its buffers were replaced, dissolves the group and computes its own rows, so the
results never depend on the call order. `state_dict()` and `save_pretrained` are unchanged (each module
still writes its own tensors, never views of the fused ones), and `unfuse_projections` undoes it.

The fused call is an ordinary `torch.ops.turboquant.linear`, so it runs under CUDA graphs and
`torch.compile(fullgraph=True)` like any other.

Inputs of more than `FUSED_MAX_ROWS` rows (a prompt's prefill) run each member on its own rows, views of the
same storage: there the weight is decoded for a matrix product whatever the grouping, and splitting one wide
output into contiguous per-member tensors would copy it once more.
"""

from __future__ import annotations

import torch
from torch import nn

from ..modeling.modules import TurboQuantLinear, group_linear

# Most input rows (tokens) that one fused product serves; longer inputs run the members apart. 64 is the last row
# count the CUDA kernels multiply without decoding the weight to a scratch buffer (`kernels.tuning.MID_MAX_M`);
# above it the fused product's wide output would be copied into per-member tensors, slower than running the members
# apart (measured at prefill: benchmarks/E2E.md, "Fused projections run apart above 64 input rows").
FUSED_MAX_ROWS = 64

# child names of one parent that read the same input, in output order: attention, gated MLPs (Llama-style,
# Mixtral's experts-as-modules), and the gated-delta-net input projections (Qwen3.5 / Qwen3.6, Qwen3-Next)
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"),
            ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), ("in_proj_qkvz", "in_proj_ba"))


def _signature(m: TurboQuantLinear) -> tuple:
    w = m.weight
    return (w.rotation, w.n_levels, w.group_size, m.in_features, w.tq_packed.dtype, w.tq_packed.device,
            w.tq_norms.dtype, w.runtime_layout, m.bias is None or (m.bias.dtype, m.bias.device))


def _buffers(m: TurboQuantLinear) -> tuple:
    return m.weight.tq_packed, m.weight.tq_norms, m.bias


class FusedProjections:
    """The fused packed weight of sibling `TurboQuantLinear`s and, between their calls, the outputs of one input."""

    def __init__(self, members: list[TurboQuantLinear]):
        first = members[0]
        self.members = members
        self.splits = [m.out_features for m in members]
        self.in_features = first.in_features
        self.group_size = first.weight.group_size
        self.n_levels = first.weight.n_levels
        self.runtime = first.weight.runtime_layout
        self.packed = torch.cat([m.weight.tq_packed for m in members])
        self.norms = torch.cat([m.weight.tq_norms for m in members])
        self.bias = None if first.bias is None else torch.cat([m.bias.detach() for m in members])
        # the members' tensors become views of the fused ones
        rows = pk = 0
        for m in members:
            w = m.weight
            n_pk = w.tq_packed.shape[0]
            w.tq_packed = self.packed[pk:pk + n_pk]
            w.tq_norms = self.norms[rows:rows + m.out_features]
            if m.bias is not None:
                m.bias = nn.Parameter(self.bias[rows:rows + m.out_features], requires_grad=m.bias.requires_grad)
            pk += n_pk
            rows += m.out_features
        self.views = [_buffers(m) for m in members]
        self._x = None
        self._outs = None
        self._left = 0

    def intact(self) -> bool:
        """Whether every member still holds the views made at fusion (nothing replaced its tensors since)."""
        return all(a is b for m, v in zip(self.members, self.views) for a, b in zip(_buffers(m), v))

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor | None:
        """Member `index`'s output for input `x`: taken from the outputs the group computed for `x` when a
        sibling asked first, else computed for every member now. None where siblings turn out to read different
        inputs (outputs of another input still pending, as in cross-attention): the group dissolves (outside
        compiled code) and the member computes its own rows. Also None for inputs of more than `FUSED_MAX_ROWS`
        rows, leaving the group as it is: the member computes its own rows."""
        if x.numel() > FUSED_MAX_ROWS * self.in_features:
            return None
        if self._outs is not None and self._x is not x:
            if not torch.compiler.is_compiling():
                self.dissolve()
            return None
        if self._outs is None or self._outs[index] is None:
            y = group_linear(x, self.packed, self.norms, self.bias, self.n_levels, self.group_size, self.in_features,
                             self.runtime)
            self._outs = list(torch.split(y, self.splits, dim=-1))
            self._x = x
            self._left = len(self.members)
        out = self._outs[index]
        self._outs[index] = None
        self._left -= 1
        if self._left == 0:  # every sibling took its output: hold no tensors between forwards
            self._x = None
            self._outs = None
        return out if out.is_contiguous() else out.contiguous()

    def dissolve(self) -> None:
        for m in self.members:
            m.__dict__.pop("_tq_group", None)
            m.__dict__.pop("_tq_index", None)
        self._x = self._outs = None


def fuse_projections(model: nn.Module, siblings=SIBLINGS, device_type: str | None = None) -> int:
    """Fuse sibling projections named in `siblings` (children of one module, e.g. an attention block's q_proj,
    k_proj and v_proj): those of a set that are `TurboQuantLinear`s alike in bits, group size, input width,
    device, layout and bias (and, with `device_type`, on a device of that type), two or more, become one group;
    the rest of the set stays as it is. Returns the number of groups fused. Call it after the weights are loaded and the model is on its device (`from_pretrained` does, for
    weights on a CUDA device, unless `TURBOQUANT_FUSE=0`); moving the model or replacing a member's tensors
    dissolves its group, and the next forward runs the members one by one. Loading weights in place (a state
    dict into the loaded model) keeps it."""
    count = 0
    for parent in model.modules():
        for names in siblings:
            alike: dict[tuple, list[TurboQuantLinear]] = {}  # the members that can share one weight, in order
            for n in names:
                m = getattr(parent, n, None)
                if (isinstance(m, TurboQuantLinear) and "_tq_group" not in m.__dict__
                        and m.weight.rotation == "groups"):
                    kind = m.weight.tq_packed.device.type
                    if kind != "meta" and (device_type is None or kind == device_type):
                        alike.setdefault(_signature(m), []).append(m)
            for members in alike.values():
                if len(members) < 2:
                    continue
                group = FusedProjections(members)
                for i, m in enumerate(members):
                    m.__dict__["_tq_group"] = group
                    m.__dict__["_tq_index"] = i
                count += 1
    return count


def unfuse_projections(model: nn.Module) -> int:
    """Give every fused member its own tensors again (copies of its rows); returns the number of groups undone."""
    groups = {id(m.__dict__["_tq_group"]): m.__dict__["_tq_group"] for m in model.modules()
              if "_tq_group" in m.__dict__}
    for g in groups.values():
        intact = g.intact()
        g.dissolve()
        if intact:
            for m in g.members:
                m.weight.tq_packed = m.weight.tq_packed.clone()
                m.weight.tq_norms = m.weight.tq_norms.clone()
                if m.bias is not None:
                    m.bias = nn.Parameter(m.bias.detach().clone(), requires_grad=m.bias.requires_grad)
    return len(groups)
