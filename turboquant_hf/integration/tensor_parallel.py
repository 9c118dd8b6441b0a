"""Tensor parallelism for TurboQuant modules under transformers' tp plans (`from_pretrained(..., tp_plan="auto")`).

transformers shards parameters as DTensors and wraps module forwards by the style names of the model's tp plan.
TurboQuant weights are packed buffers of a child module, which those styles cannot split, so when a TurboQuant model
loads, the styles its plans name are wrapped in `TurboQuantStyle`, registered under the same names (so that
transformers' checks by style name still hold): for any other module it does exactly what transformers' style
does; for a TurboQuant module it keeps this rank's slice of the packed rows and norms as plain tensors and computes
with them:

- column-wise (`colwise`, `colwise_rep`, `colwise_gather_output`): the output rows are split (packed rows and
  norms together, `torch.chunk` sizes like transformers' `Shard(0)`); `*_rep` / `*_gather_output` gather the
  output afterwards.
- row-wise (`rowwise`, `rowwise_rep`, `rowwise_split_input`): the input width is split on group boundaries; a
  split that would cut a group is refused (`TensorParallelError`, naming the layer and the sizes). The partial
  products are summed across ranks (all-reduce), then the bias is added once.
- fused MoE experts (`moe_tp_experts`, and every TurboQuant experts module in the default layout that the plan
  does not name, as `turboquant_experts`): each expert's intermediate width is split: its gate and up rows, and
  down's input width on group boundaries; the partial outputs are summed across ranks. Experts in another layout
  that the plan does not name (gpt-oss's, whose plan names no experts) stay whole on every rank, as transformers
  keeps them in bf16; named by a plan, they are refused.
- expert parallelism (the model's expert plan: `ep_dispatch_experts` from transformers 5.21, 5.17's
  `enable_expert_parallel` plan): each rank keeps whole experts, `num_experts / world` of them.

Each rank reads only its slice of a pre-quantized checkpoint (`load_shards`, byte ranges of the safetensors files
through a memory map); quantizing on the fly, each rank quantizes only its slice of the full-precision tensor
(`local_source`), which equals the same slice of the whole weight quantized (groups are independent).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..format import constants as fmt
from ..modeling.experts_layout import DEFAULT_LAYOUT
from ..modeling.modules import (
    TurboQuantExperts,
    TurboQuantLinear,
    TurboQuantWeight,
    group_linear,
)

ADDED_EXPERTS_STYLE = "turboquant_experts"  # the plan entry given to TurboQuant experts the plan does not name
COLUMN_STYLES = {"colwise": False, "colwise_rep": True, "colwise_gather_output": True}  # style: gathers the output
ROW_STYLES = {"rowwise": False, "rowwise_rep": True, "rowwise_split_input": True}  # style: input is replicated
EXPERT_STYLES = ("moe_tp_experts",)
# styles a TurboQuant child weight may carry in a plan (`experts.gate_up_proj`): its experts module shards it
CHILD_STYLES = ("packed_colwise", "rowwise", "colwise", "grouped_gemm")
_TORCH_DTYPES = {"U8": torch.uint8, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class TensorParallelError(ValueError):
    """A TurboQuant module cannot be split the way the tensor parallel plan asks."""


@dataclass(frozen=True)
class ShardSpec:
    """This rank's slice of a weight viewed as `(blocks, rows, in_features)` (blocks: experts, or 1 for a Linear):
    the blocks `[block_start, block_stop)` (expert parallelism), in each the rows `row_ranges` (concatenated, in
    order) and the input columns `[col_start, col_stop)`."""

    full_shape: tuple  # the whole weight's `source_shape`
    row_ranges: tuple
    col_start: int
    col_stop: int
    block_start: int = 0
    block_stop: int | None = None

    @property
    def blocks(self) -> int:
        """Blocks of the whole weight."""
        return self.full_shape[0] if len(self.full_shape) == 3 else 1

    @property
    def block_range(self) -> tuple[int, int]:
        return self.block_start, self.blocks if self.block_stop is None else self.block_stop

    def local_shape(self) -> tuple:
        rows = sum(b - a for a, b in self.row_ranges)
        shape = (rows, self.col_stop - self.col_start)
        b0, b1 = self.block_range
        return (b1 - b0, *shape) if len(self.full_shape) == 3 else shape


def chunk_range(size: int, rank: int, world: int) -> tuple[int, int]:
    """`[start, stop)` of rank `rank` when `size` is split like `torch.chunk` (ceil-sized pieces, the last shorter)."""
    chunk = -(-size // world)
    start = min(size, rank * chunk)
    return start, min(size, start + chunk)


def group_aligned_range(name: str, what: str, size: int, group_size: int, rank: int, world: int) -> tuple[int, int]:
    """`chunk_range` of an input width that TurboQuant groups: refused when a split point falls inside a group."""
    chunk = -(-size // world)
    if world > 1 and chunk % group_size and chunk < size:
        raise TensorParallelError(
            f"TurboQuant: tensor parallel size {world} would cut a group of {name}: its {what} of {size} split into "
            f"pieces of {chunk}, which is not a multiple of the group size {group_size}. Use a tensor parallel size "
            f"that splits {size} into multiples of {group_size}, keep {name} unquantized (modules_to_not_convert), "
            "or quantize with a group size that divides the split"
        )
    return chunk_range(size, rank, world)


# -- the plan ---------------------------------------------------------------------------------------------------------
def route_parallel_plans(model: nn.Module) -> dict:
    """When the model is loaded with a `distributed_config` (a tp or ep plan in use): name the TurboQuant modules
    (for errors), record the model config on them (5.17 sets `distributed_config.enable_expert_parallel` on it
    before sharding), give every TurboQuant experts module the tp plan has no entry for the intermediate split, and
    return the styles to wrap, `{name: TurboQuantStyle or ExpertDispatchStyle}` (`patches.wrap_parallel_styles`
    wraps them: transformers looks styles up by name). Without a `distributed_config`: nothing, `{}`."""
    plan = getattr(model, "_tp_plan", None)
    if plan is None or getattr(model.config, "distributed_config", None) is None:
        return {}
    for name, module in model.named_modules():
        if isinstance(module, (TurboQuantLinear, TurboQuantExperts)):
            module.__dict__["_tq_name"] = name
            module.__dict__["_tq_model_config"] = model.config
    styles = {}
    for plan_ in (plan, getattr(model, "_ep_plan", None) or {}):
        for style in set(plan_.values()):
            if style in COLUMN_STYLES or style in ROW_STYLES or style in EXPERT_STYLES or style in CHILD_STYLES:
                styles[style] = TurboQuantStyle
    if "ep_dispatch_experts" in (getattr(model, "_ep_plan", None) or {}).values():
        styles["ep_dispatch_experts"] = ExpertDispatchStyle
    patterns = [re.compile(re.escape(k).replace(r"\*", r"\d+") + "$") for k in plan]
    for name, module in model.named_modules():
        if isinstance(module, TurboQuantExperts) and not any(p.match(name) for p in patterns) and splittable(module):
            plan[re.sub(r"\.\d+\.", ".*.", name)] = ADDED_EXPERTS_STYLE
            styles[ADDED_EXPERTS_STYLE] = TurboQuantStyle
    return styles


def splittable(module: TurboQuantExperts) -> bool:
    """Whether tensor parallelism can split this experts module (the default layout, per-group rotation). The plan
    is given an entry only for those; others the plan does not name stay whole on every rank, as transformers
    keeps the bf16 experts of a model whose plan does not name them (gpt-oss)."""
    return module.layout == DEFAULT_LAYOUT and module.rotation == "groups"


class TurboQuantStyle:
    """A transformers tensor parallel style for TurboQuant modules; other modules get the original style (it
    takes the original's place in transformers' registry under the same name: `patches.wrap_parallel_styles`)."""

    def __init__(self, style: str, original):
        self.style = style
        self.original = original

    def __getattr__(self, attr):
        original = self.__dict__.get("original")
        if original is None:
            raise AttributeError(attr)
        return getattr(original, attr)

    def _owns(self, module) -> bool:
        return isinstance(module, (TurboQuantLinear, TurboQuantExperts, TurboQuantWeight))

    def validate_param(self, module, param, mesh, *args, **kwargs):
        if self._owns(module) or self.original is None:
            return None
        return self.original.validate_param(module, param, mesh, *args, **kwargs)

    def shard_param(self, module, param, mesh, *args, **kwargs):
        if isinstance(module, TurboQuantLinear) and param == "bias":  # the bias splits like transformers' own
            return self.original.shard_param(module, param, mesh, *args, **kwargs)
        if self._owns(module) or self.original is None:
            return None
        return self.original.shard_param(module, param, mesh, *args, **kwargs)

    def install_forward(self, module, mesh, *args, **kwargs):
        if isinstance(module, TurboQuantWeight):
            return module  # a child weight named by the plan: its experts module splits it
        if isinstance(module, TurboQuantLinear):
            return shard_linear_(module, self.style, mesh)
        if isinstance(module, TurboQuantExperts):
            if self.style not in (*EXPERT_STYLES, ADDED_EXPERTS_STYLE):
                raise TensorParallelError(f"TurboQuant: {_name(module)} (fused experts) has the tensor parallel "
                                          f"style {self.style!r}; experts split only as {EXPERT_STYLES}")
            distributed = getattr(module.__dict__.get("_tq_model_config"), "distributed_config", None)
            if getattr(distributed, "enable_expert_parallel", False):  # 5.17's expert plan (after its ep_router)
                return shard_experts_by_expert_(module, mesh, all_reduce=True)
            return shard_experts_(module, mesh)
        if self.original is None:
            raise TensorParallelError(f"TurboQuant: tensor parallel style {self.style!r} is unknown to transformers")
        return self.original.install_forward(module, mesh, *args, **kwargs)


def _name(module) -> str:
    return module.__dict__.get("_tq_name", type(module).__name__)


def _mesh_info(mesh) -> tuple[int, int, object]:
    group = mesh.get_group() if mesh.ndim == 1 else mesh.get_group("tp")
    return dist.get_rank(group), dist.get_world_size(group), group


# -- sharding modules -------------------------------------------------------------------------------------------------
def _shard_weight_(owner: nn.Module, attr: str, spec: ShardSpec, mesh=None, placement=None) -> TurboQuantWeight:
    """Replace `owner.<attr>` by a TurboQuantWeight of this rank's slice (on the device of the whole one). Quantizing
    on the fly, `placement` (of the source as the model holds it, `(out, in)` or `(E, out, in)`) lets the loader
    read only this rank's slice of the full-precision tensor."""
    old: TurboQuantWeight = getattr(owner, attr)
    if old.rotation != "groups":
        raise TensorParallelError(f"TurboQuant: {_name(owner)}.{attr} uses a whole-row Hadamard rotation "
                                  "(a turboquant-mlx checkpoint), which tensor parallelism cannot split")
    new = TurboQuantWeight(spec.local_shape(), old.bits, old.group_size, device=old.tq_packed.device,
                           norms_dtype=old.norms_dtype)
    new.awaiting_dtype = old.awaiting_dtype
    new.source_transposed = old.source_transposed
    new.tp_shard = spec
    if new.awaiting_dtype is not None and placement is not None:
        new.__dict__["tp_source_placeholder"] = lambda dtype: _source_placeholder(new, mesh, placement, dtype)
    setattr(owner, attr, new)
    return new


def _source_placeholder(w: TurboQuantWeight, mesh, placement, dtype):
    """The full-precision source of `w` as a meta DTensor split by `placement`: transformers' loader then reads
    only this rank's slice from the checkpoint (`DtensorShardOperation`)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    if w.source_transposed and isinstance(placement, Shard):  # GPT-2 Conv1D stores (in, out)
        placement = Shard(1 - placement.dim)
    return distribute_tensor(torch.empty(w.checkpoint_shape, dtype=dtype, device="meta"), mesh, [placement],
                             src_data_rank=None)


def is_local_slice(target: TurboQuantWeight, value: torch.Tensor) -> bool:
    """Whether `value` already is this rank's slice of `target`'s full-precision source (as stored)."""
    spec = getattr(target, "tp_shard", None)
    if spec is None:
        return False
    local = spec.local_shape()
    return tuple(value.shape) == (local[::-1] if target.source_transposed else local)


def shard_linear_(module: TurboQuantLinear, style: str, mesh) -> TurboQuantLinear:
    """Keep this rank's slice of a TurboQuantLinear and wrap its forward for `style`."""
    rank, world, group = _mesh_info(mesh)
    w = module.weight
    out_features, in_features = w.source_shape
    name = _name(module)
    if style in COLUMN_STYLES:
        start, stop = chunk_range(out_features, rank, world)
        spec = ShardSpec(w.source_shape, ((start, stop),), 0, in_features)
    elif style in ROW_STYLES:
        start, stop = group_aligned_range(name, "input width", in_features, w.group_size, rank, world)
        spec = ShardSpec(w.source_shape, ((0, out_features),), start, stop)
    else:
        raise TensorParallelError(f"TurboQuant: {name} has the tensor parallel style {style!r}; quantized linear "
                                  f"layers split as {sorted(COLUMN_STYLES) + sorted(ROW_STYLES)}")
    from torch.distributed.tensor import Shard

    _shard_weight_(module, "weight", spec, mesh, Shard(0 if style in COLUMN_STYLES else 1))
    column = style in COLUMN_STYLES
    gather = COLUMN_STYLES.get(style, False)
    replicated_input = ROW_STYLES.get(style, False)

    def tp_forward(x, *args, **kwargs):
        x = _local(x)
        weight = module.weight
        if not column and replicated_input:
            x = x[..., spec.col_start:spec.col_stop]
        bias = module.bias  # this rank's slice (column-wise) or the whole bias (row-wise)
        bias = getattr(bias, "_local_tensor", bias)
        y = group_linear(x, weight.tq_packed, weight.tq_norms, bias if column else None, weight.n_levels,
                         weight.group_size, weight.in_features, weight.runtime_layout)
        if column:
            return _all_gather_last(y, out_features, group, world) if gather else y
        dist.all_reduce(y, group=group)
        return y if bias is None else y + bias.to(y.dtype)

    module.forward = tp_forward
    return module


def shard_experts_(module: TurboQuantExperts, mesh) -> TurboQuantExperts:
    """Split every expert's intermediate width across ranks: gate and up rows, and down's input columns."""
    _refuse_layout(module)
    rank, world, group = _mesh_info(mesh)
    if module.rotation != "groups":
        raise TensorParallelError(f"TurboQuant: {_name(module)} uses a whole-row Hadamard rotation "
                                  "(a turboquant-mlx checkpoint), which tensor parallelism cannot split")
    e, h, i = module.num_experts, module.hidden_size, module.intermediate_size
    start, stop = group_aligned_range(_name(module), "intermediate width", i, module.down_proj.group_size, rank, world)
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    _shard_weight_(module, "gate_up_proj", ShardSpec((e, 2 * i, h), ((start, stop), (i + start, i + stop)), 0, h),
                   mesh, _StridedShard(1, split_factor=2))  # each expert's gate rows, then its up rows
    _shard_weight_(module, "down_proj", ShardSpec((e, h, i), ((0, h),), start, stop), mesh, Shard(2))
    module.__dict__["tp_intermediate"] = (start, stop)
    _sum_outputs_over_ranks(module, group)
    return module


def _refuse_layout(module: TurboQuantExperts) -> None:
    """Tensor and expert parallelism split experts in the default layout only (gate rows then up rows, no biases, the
    routed forward): the splits above follow that layout."""
    if module.layout != DEFAULT_LAYOUT:
        raise TensorParallelError(f"TurboQuant: {_name(module)} holds its experts in a layout "
                                  f"({module.layout.describe()}) that tensor and expert parallelism do not split in "
                                  "this version; load it on one device or with a device_map")


def _sum_outputs_over_ranks(module, group) -> None:
    """The experts' forward on local tensors, its partial output summed over the ranks of `group`."""
    original = module.forward

    def forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        y = original(_local(hidden_states), _local(top_k_index), _local(top_k_weights), *args, **kwargs)
        dist.all_reduce(y, group=group)
        return y

    module.forward = forward


def shard_experts_by_expert_(module: TurboQuantExperts, mesh, all_reduce: bool = False) -> TurboQuantExperts:
    """Expert parallelism: keep this rank's experts (`num_experts / world` consecutive ones, whole), as
    transformers' `grouped_gemm` does; `num_experts` becomes the local count (routers hand local ids, the count
    itself meaning "not on this rank"). `all_reduce`: the forward sums the ranks' partial outputs itself (5.17's
    plan; from 5.21 the `ep_dispatch_experts` implementation does)."""
    from torch.distributed.tensor import Shard

    _refuse_layout(module)
    rank, world, group = _mesh_info(mesh)
    e, h, i = module.num_experts, module.hidden_size, module.intermediate_size
    if module.rotation != "groups":
        raise TensorParallelError(f"TurboQuant: {_name(module)} uses a whole-row Hadamard rotation "
                                  "(a turboquant-mlx checkpoint), which expert parallelism does not split")
    if e % world:
        raise TensorParallelError(f"TurboQuant: {_name(module)} has {e} experts, which {world} expert-parallel "
                                  "ranks cannot share evenly")
    b0, b1 = rank * (e // world), (rank + 1) * (e // world)
    _shard_weight_(module, "gate_up_proj", ShardSpec((e, 2 * i, h), ((0, 2 * i),), 0, h, b0, b1), mesh, Shard(0))
    _shard_weight_(module, "down_proj", ShardSpec((e, h, i), ((0, h),), 0, i, b0, b1), mesh, Shard(0))
    module.num_experts = b1 - b0
    module.__dict__["tp_experts"] = (b0, b1)
    if all_reduce:
        _sum_outputs_over_ranks(module, group)
    return module


class ExpertDispatchStyle:
    """transformers' `ep_dispatch_experts` (5.21 and later): for a TurboQuant experts module, keep its own experts
    first, then let transformers' dispatch (which reads the local expert count) wrap it; other modules unchanged."""

    def __init__(self, style: str, original):
        self.style = style
        self.original = original

    def __getattr__(self, attr):
        return getattr(self.__dict__["original"], attr)

    def install_forward(self, module, ep_mesh, *args, **kwargs):
        if isinstance(module, TurboQuantExperts):
            shard_experts_by_expert_(module, ep_mesh)
        return self.original.install_forward(module, ep_mesh, *args, **kwargs)


def _local(t):
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(t, DTensor):
        if any(not p.is_replicate() for p in t.placements):
            t = t.redistribute(placements=[Replicate()] * t.device_mesh.ndim)
        return t.to_local()
    return t


def _all_gather_last(y: torch.Tensor, size: int, group, world: int) -> torch.Tensor:
    """The whole output from each rank's `chunk_range` slice of its last dimension."""
    chunk = -(-size // world)
    padded = torch.nn.functional.pad(y, (0, chunk - y.shape[-1])).contiguous()
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat(parts, dim=-1)[..., :size]


# -- loading -----------------------------------------------------------------------------------------------------------
def sharded_weights(model: nn.Module) -> dict[str, TurboQuantWeight]:
    """`{module name: weight}` of the TurboQuant weights holding one rank's slice."""
    return {n: m for n, m in model.named_modules()
            if isinstance(m, TurboQuantWeight) and getattr(m, "tp_shard", None) is not None}


def local_source(target: TurboQuantWeight, value: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a full-precision checkpoint tensor for `target` (as stored: transposed for Conv1D);
    the tensor unchanged when `target` holds a whole weight, when it is the slice already (the loader read only
    that, see `_source_placeholder`) or when its shape is not the whole weight's (the caller reports that)."""
    spec = getattr(target, "tp_shard", None)
    if spec is None or is_local_slice(target, value):
        return value
    full = spec.full_shape[::-1] if target.source_transposed else spec.full_shape
    if tuple(value.shape) != tuple(full):
        return value
    v = value.t() if target.source_transposed else value
    b0, b1 = spec.block_range
    v = v.reshape(spec.blocks, *spec.full_shape[-2:])[b0:b1]
    v = torch.cat([v[:, a:b, spec.col_start:spec.col_stop] for a, b in spec.row_ranges], dim=1)
    v = v.reshape(spec.local_shape())
    return v.t().contiguous() if target.source_transposed else v.contiguous()


def checkpoint_shape_of(target: TurboQuantWeight) -> tuple:
    """The shape of the full-precision tensor `target` is quantized from, for the whole weight."""
    spec = getattr(target, "tp_shard", None)
    if spec is None:
        return target.checkpoint_shape
    return spec.full_shape[::-1] if target.source_transposed else spec.full_shape


def checkpoint_key(name: str, index: dict) -> str | None:
    """The checkpoint name of the weight module `name` (`X.weight`), allowing a different leading prefix
    (`model.language_model.` for `model.`)."""
    if name + fmt.PACKED_SUFFIX in index:
        return name
    parts = name.split(".")
    for i in range(1, len(parts)):
        tail = "." + ".".join(parts[i:]) + fmt.PACKED_SUFFIX
        found = [k[: -len(fmt.PACKED_SUFFIX)] for k in index if k.endswith(tail)]
        if len(found) == 1:
            return found[0]
        if found:
            return None
    return None


def _read_slices(info: dict, spec: ShardSpec, group_size: int, per_group: int) -> torch.Tensor:
    """Read this rank's rows and groups of a stored `(blocks*rows*n_groups, per_group)` (packed) or
    `(blocks*rows, n_groups)` (norms, per_group=1) tensor through a memory map: only those bytes are touched."""
    dtype = _TORCH_DTYPES[info["dtype"]]
    item = torch.empty((), dtype=dtype).element_size()
    blocks, rows, in_features = spec.blocks, *spec.full_shape[-2:]
    n_groups = -(-in_features // group_size)
    g0, g1 = spec.col_start // group_size, -(-spec.col_stop // group_size)
    raw = np.memmap(info["file"], dtype=np.uint8, mode="r", offset=info["start"],
                    shape=(blocks, rows, n_groups, per_group * item))
    b0, b1 = spec.block_range
    parts = [np.ascontiguousarray(raw[b0:b1, a:b, g0:g1]) for a, b in spec.row_ranges]
    out = torch.from_numpy(np.concatenate(parts, axis=1)).view(dtype)
    del raw
    return out.reshape(-1, per_group) if per_group > 1 else out.reshape(-1, g1 - g0)


def load_shards(model: nn.Module, index: dict) -> None:
    """Fill every sharded TurboQuant weight still on the meta device from a pre-quantized checkpoint, on the device
    the rest of the model was loaded to (this rank's)."""
    device = next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))
    for name, w in sharded_weights(model).items():
        if not w.tq_packed.is_meta:
            continue
        key = checkpoint_key(name, index)
        if key is None:
            raise TensorParallelError(f"TurboQuant: no {name}{fmt.PACKED_SUFFIX} (or one under another prefix) in "
                                      "the checkpoint for this rank's shard")
        spec = w.tp_shard
        bpg = fmt.bytes_per_group(w.n_levels, w.group_size)
        packed = _read_slices(index[key + fmt.PACKED_SUFFIX], spec, w.group_size, bpg)
        norms = _read_slices(index[key + fmt.NORMS_SUFFIX], spec, w.group_size, 1)
        w.tq_packed = packed.to(device)
        w.tq_norms = norms.to(device=device, dtype=w.norms_dtype)


def deferred_keys(model: nn.Module, index: dict) -> set[str]:
    """Names of the packed tensors `load_shards` reads itself (the loader skips them), as the checkpoint and as the
    model name them (the loader reports them under the model's names when it renames a prefix)."""
    keys = set()
    for name, w in sharded_weights(model).items():
        key = checkpoint_key(name, index) if w.awaiting_dtype is None else None
        if key is not None:
            keys.update(k + s for k in (key, name) for s in (fmt.PACKED_SUFFIX, fmt.NORMS_SUFFIX))
    return keys


def resident_packed_bytes(model: nn.Module) -> int:
    """Bytes of the packed indices and norms this process holds."""
    return sum(m.tq_packed.numel() * m.tq_packed.element_size() + m.tq_norms.numel() * m.tq_norms.element_size()
               for m in model.modules() if isinstance(m, TurboQuantWeight))


def local_state_bytes(model: nn.Module) -> int:
    """Bytes of this process's part of every tensor of the model's state dict: the local shard of a DTensor, the
    whole of any other tensor (what `turboquant-hf plan --gpus N` predicts per GPU)."""
    total = 0
    for t in model.state_dict().values():
        t = getattr(t, "_local_tensor", t)
        total += t.numel() * t.element_size()
    return total


def refuse_saving_slices(*args, **kwargs):
    """`save_pretrained` and `push_to_hub` of a model holding one rank's slices (`patches.patch_model`): a
    checkpoint saved from it would be partial."""
    raise TensorParallelError(
        "TurboQuant: this model holds one tensor-parallel rank's slices of its packed weights, so a checkpoint "
        "saved from it would be partial; save from one process (from_pretrained without tp_plan), where the "
        "whole weights are"
    )
