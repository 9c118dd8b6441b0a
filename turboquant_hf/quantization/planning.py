"""What gets quantized, and how: typed plans, and the one rule that builds them from each source.

A `Plan` names every module to replace (a Linear by a `TurboQuantLinear`, a fused experts module by a
`TurboQuantExperts`) with its bit widths, group size, norms dtype and rotation. It is built

- from a `TurboQuantConfig` (`from_config`: quantizing on the fly, and every size estimate);
- from the TurboQuant tensors of a checkpoint (`from_checkpoint`: bit widths from each tensor's geometry);
- from a turboquant-mlx layout (`turboquant_hf.integration.mlx.MLXLayout.plan`, which returns a `Plan` too);
- from safetensors headers alone (`from_headers`: the model is built on the meta device from its config, planned
  `from_config`, and each checkpoint tensor is matched to the module it feeds).

The HF quantizer, the streaming converter, `sizing` and `turboquant-hf plan` all call these.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..format import checkpoint as ckpt
from ..format import constants as fmt
from ..modeling.experts_layout import (
    DEFAULT_LAYOUT,
    ExpertsLayout,
    UnsupportedExperts,
    read_experts,
    stored_shape,
)
from ..modeling.modules import (
    fused_experts_geometry,
    is_conv1d,
    linear_kind,
    replace_experts_modules,
    replace_linear_modules,
)
from .config import DEFAULT_MODULES_TO_NOT_CONVERT, TurboQuantConfig

GROUPS = "groups"  # rotation per quantization group (tq3_native)
HADAMARD = "hadamard"  # whole-row rotation (turboquant-mlx)


@dataclass(frozen=True)
class LinearPlan:
    """One `nn.Linear` replaced by a `TurboQuantLinear`."""

    bits: Any
    group_size: int
    norms_dtype: torch.dtype | None = None  # None: the format's default for the tier
    rotation: str = GROUPS


@dataclass(frozen=True)
class ExpertsPlan:
    """One fused experts module replaced by `TurboQuantExperts`: `layout` says how transformers stores and applies
    it (`experts_layout.ExpertsLayout`; the default: `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I], gate rows
    then up rows, no biases).

    With whole-row rotation (MLX) gate and up may differ: `gate_up_bits` is then a (gate, up) pair, `group_size`
    a `{projection: G}` dict and `norms_dtypes` has three entries (gate, up, down)."""

    gate_up_bits: Any
    down_bits: Any
    group_size: Any
    activation: str
    norms_dtypes: tuple = (None, None)
    rotation: str = GROUPS
    layout: ExpertsLayout = DEFAULT_LAYOUT


@dataclass
class Plan:
    linears: dict[str, LinearPlan] = field(default_factory=dict)
    experts: dict[str, ExpertsPlan] = field(default_factory=dict)
    # model parameter -> checkpoint key: packed by a writer that quantizes more than this package keeps packed
    # (routers, ...); dequantized into the full-precision parameter after loading
    dequantize_into: dict[str, str] = field(default_factory=dict)
    # linear layers left in full precision that a user could expect quantized -> why
    kept: dict[str, str] = field(default_factory=dict)

    def apply(self, model: nn.Module, awaiting_weights: bool) -> None:
        """Swap the planned modules in (`awaiting_weights`: their weights will be quantized while loading)."""
        replace_linear_modules(model, self.linears, awaiting_weights=awaiting_weights)
        replace_experts_modules(model, self.experts, awaiting_weights=awaiting_weights)


# ---------------------------------------------------------------------------------------------------------------
# shared rules
def matches_any(name: str, patterns) -> bool:
    """transformers' skip rules (prefix, regex from the start, suffix), plus a match on whole name components
    anywhere in the name, so that `"mlp"` skips every `*.mlp.*` module."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    if not should_convert_module(name, list(patterns)):
        return True
    return any(re.search(rf"(^|\.){pattern}(\.|$)", name) for pattern in patterns)


def skip_patterns(model, config: TurboQuantConfig) -> list[str]:
    """The modules `config` keeps in full precision in `model`: the user's list, or by default the package's
    defaults, transformers' own (tied and output embeddings) and the model's output heads (`head_modules`)."""
    from transformers.quantizers.base import HfQuantizer

    skip = config.modules_to_not_convert
    patterns = HfQuantizer.get_modules_to_not_convert(
        model,
        list(DEFAULT_MODULES_TO_NOT_CONVERT) if skip is None else skip,
        getattr(model, "_keep_in_fp32_modules", None),
        add_default_skips=skip is None,
    )
    return patterns + sorted(head_modules(model)) if skip is None else patterns


def head_modules(model) -> set[str]:
    """The output heads of a task model: its output embeddings, every Linear outside its base model (`lm_head`,
    `classifier`, `score`, `qa_outputs`, ...), and the module of its last parameter."""
    heads = set()
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    prefix = getattr(model, "base_model_prefix", "")
    has_base = bool(prefix) and isinstance(getattr(model, prefix, None), nn.Module)
    for name, module in model.named_modules():
        if output is not None and module is output:
            heads.add(name)
        elif has_base and isinstance(module, nn.Linear) and name != prefix and not name.startswith(prefix + "."):
            heads.add(name)
    names = [n for n, _ in model.named_parameters()]
    if names:
        heads.add(names[-1].rpartition(".")[0])
    return {h for h in heads if h}


def _text_config(model):
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def activation_of(model) -> str:
    """The MLP activation of a model (its text config's `hidden_act` / `hidden_activation`)."""
    config = _text_config(model)
    return getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None) or "silu"


def experts_form(model, module):
    """`experts_layout.read_experts` of an experts module of `model`, with the model's activation and experts per
    token; raises `UnsupportedExperts` with the reason."""
    top_k = getattr(_text_config(model), "num_experts_per_tok", None)
    return read_experts(module, activation_of(model), top_k if isinstance(top_k, int) else 0)


def checkpoint_to_model_keys(model, keys, meta=None) -> dict[str, str]:
    """Map checkpoint tensor names to the model's names with transformers' own renamings (prefix changes, ...)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    meta = model.state_dict() if meta is None else meta
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    out = {}
    for key in keys:
        out[key] = key if key in meta else rename_source_key(key, renamings, [], model.base_model_prefix, meta)[0]
    return out


# ---------------------------------------------------------------------------------------------------------------
# from a config
def from_config(model, config: TurboQuantConfig, logger=None) -> Plan:
    """The plan of quantizing `model` with `config`: every `nn.Linear` and fused experts module not skipped."""
    skip = skip_patterns(model, config)
    fp32 = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    tied = tied_linears(model)
    plan = Plan()
    for name, module in model.named_modules():
        if matches_any(name, skip):
            if fp32 and linear_kind(module) and matches_any(name, fp32):
                plan.kept[name] = f"{type(model).__name__} keeps it in float32 (_keep_in_fp32_modules)"
            continue
        kind = linear_kind(module)
        if kind == "other":
            plan.kept[name] = (f"{type(module).__name__} is an nn.Linear subclass with a forward or parameters of its "
                               "own, not a plain linear map")
            continue
        if kind:
            if name in tied:
                _warn_if_named(name, config, logger)
                continue
            plan.linears[name] = LinearPlan(config.bits_for(name), config.group_size)
        elif name.rpartition(".")[2] == "experts" and not isinstance(module, nn.ModuleList):
            try:
                form = experts_form(model, module)
            except UnsupportedExperts as e:
                if logger is not None:
                    logger.warning("TurboQuant: %s (%s) stays in full precision: %s (docs/moe.md lists the expert "
                                   "layouts this version quantizes)", name, type(module).__name__, e)
                continue
            plan.experts[name] = ExpertsPlan(config.bits_for(name + ".gate_up_proj"),
                                             config.bits_for(name + ".down_proj"), config.group_size, form.activation,
                                             layout=form.layout)
    return plan


def kept_summary(plan: Plan) -> str:
    """The layers a plan leaves in full precision, by reason (a few names each), for messages."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in plan.kept.items():
        by_reason.setdefault(reason, []).append(name)
    parts = []
    for reason, names in by_reason.items():
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        parts.append(f"{shown} ({reason})")
    return "; ".join(parts)


def tied_linears(model) -> set[str]:
    """Linear modules whose weight transformers ties to another parameter (an output head tied to the input
    embeddings)."""
    keys = getattr(model, "all_tied_weights_keys", None) or {}
    return {k[: -len(".weight")] for k in keys if k.endswith(".weight")}


def _warn_if_named(name: str, config: TurboQuantConfig, logger) -> None:
    """A tied head stays tied and in full precision (a tied checkpoint stores only the embeddings, so there is no
    head weight of its own to quantize); say so when the config asks for it by name."""
    if logger is not None and any(re.search(pattern, name) for pattern in config.module_bits):
        logger.warning("TurboQuant: %s is tied to the input embeddings and stays in full precision, although "
                       "module_bits names it", name)


# ---------------------------------------------------------------------------------------------------------------
# from checkpoint tensors
def from_checkpoint(model, index: dict, config: TurboQuantConfig) -> Plan:
    """Which modules a checkpoint (`index`: its safetensors headers) holds packed, with bit widths from each
    tensor's geometry. Packed tensors of parts the class does not load (`_keys_to_ignore_on_load_unexpected`, e.g.
    a vision tower) are added to that list; any other packed tensor without a place raises `CheckpointError`."""
    packed_keys = ckpt.packed_weight_keys(index)
    _check_pairs(index)
    meta = model.state_dict()
    plan = Plan()
    hadamard_keys = [k for k in packed_keys if k + ".tq_signs" in index]
    if hadamard_keys:
        _plan_hadamard_keys(model, index, hadamard_keys, meta, plan)
        packed_keys = [k for k in packed_keys if k not in set(hadamard_keys)]
    group_size = config.group_size
    ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())]
    experts_keys: dict[str, dict] = {}
    forms: dict = {}
    for key, model_key in checkpoint_to_model_keys(model, packed_keys, meta).items():
        if model_key not in meta:
            if any(p.search(key) or p.search(model_key) for p in ignore):
                _ignore_packed(model, key, model_key)  # e.g. the vision tower of a text-only class
                continue
            raise ckpt.CheckpointError(
                f"{key}{fmt.PACKED_SUFFIX}: no matching layer in {type(model).__name__}; the checkpoint does "
                "not belong to this architecture or names a layer type this version cannot load quantized"
            )
        owner_name, _, attr = model_key.rpartition(".")
        owner = model.get_submodule(owner_name)
        source_shape = tuple(meta[model_key].shape)
        if is_conv1d(owner) and attr == "weight":
            source_shape = source_shape[::-1]  # stored (in, out)
        form = _checkpoint_experts_form(model, owner_name, owner, forms) if attr in ("gate_up_proj", "down_proj") \
            else None
        if form is not None:
            source_shape = stored_shape(source_shape, form.layout)  # packed [E, out, in] whatever the storage
        rows = 1
        for d in source_shape[:-1]:
            rows *= d
        n_levels, norms_dtype = ckpt.check_packed_tensor(index, key, rows, source_shape[-1], group_size)
        bits = fmt.bits_for_levels(n_levels)
        if linear_kind(owner) in ("linear", "conv1d") and attr == "weight":
            plan.linears[owner_name] = LinearPlan(bits, group_size, norms_dtype)
        elif form is not None:
            experts_keys.setdefault(owner_name, {})[attr] = (key, bits, norms_dtype)
        elif len(source_shape) == 2:
            plan.dequantize_into[model_key] = key
            _ignore_packed(model, key, model_key)
            model._keys_to_ignore_on_load_missing.add(re.escape(model_key))
        else:
            raise ckpt.CheckpointError(
                f"{key}{fmt.PACKED_SUFFIX}: {owner_name} is a {type(owner).__name__}; this version cannot load "
                f"a packed {attr} of shape {source_shape} into it"
            )
    for name, parts in experts_keys.items():
        for attr in ("gate_up_proj", "down_proj"):
            if attr not in parts:
                other = next(iter(parts.values()))[0]
                raise ckpt.CheckpointError(
                    f"checkpoint is missing {other.rpartition('.')[0]}.{attr}{fmt.PACKED_SUFFIX} "
                    f"(needed for the quantized experts {name})"
                )
        form = forms[name]
        plan.experts[name] = ExpertsPlan(parts["gate_up_proj"][1], parts["down_proj"][1], group_size, form.activation,
                                         (parts["gate_up_proj"][2], parts["down_proj"][2]), layout=form.layout)
    return plan


def _checkpoint_experts_form(model, name: str, owner, forms: dict):
    """The form of the experts module `name` that a checkpoint holds packed tensors of (cached in `forms`), or None
    where `owner` is no fused experts module; an experts module in a form TurboQuant does not compute is an error
    naming the reason."""
    if name not in forms:
        if not isinstance(getattr(owner, "gate_up_proj", None), torch.Tensor):
            forms[name] = None
        else:
            try:
                forms[name] = experts_form(model, owner)
            except UnsupportedExperts as e:
                raise ckpt.CheckpointError(f"{name}: the checkpoint holds its experts packed, but {e}") from e
    return forms[name]


def _check_pairs(index: dict) -> None:
    """Every `.tq_packed` has its `.tq_norms` and the reverse: a renamed or deleted tensor is named here."""
    missing = []
    for name in sorted(index):
        for suffix, other in ((fmt.PACKED_SUFFIX, fmt.NORMS_SUFFIX), (fmt.NORMS_SUFFIX, fmt.PACKED_SUFFIX)):
            partner = name[: -len(suffix)] + other
            if name.endswith(suffix) and partner not in index:
                missing.append(f"{partner} (partner of {name})")
    if missing:
        raise ckpt.CheckpointError("checkpoint is missing " + ", ".join(missing[:5])
                                   + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def _ignore_packed(model, key: str, model_key: str) -> None:
    names = set()
    for k in (key, model_key):
        names.update({re.escape(k + fmt.PACKED_SUFFIX), re.escape(k + fmt.NORMS_SUFFIX)})
    if not isinstance(getattr(model, "_keys_to_ignore_on_load_unexpected", None), set):
        model._keys_to_ignore_on_load_unexpected = set(model._keys_to_ignore_on_load_unexpected or ())
    model._keys_to_ignore_on_load_unexpected.update(names)


def _plan_hadamard_keys(model, index, keys, meta, plan: Plan) -> None:
    """Modules saved with whole-row Hadamard rotation (models loaded from turboquant-mlx checkpoints)."""
    activation = activation_of(model)
    probes, is_experts = {}, {}
    for key in keys:
        parent, _, leaf = key.rpartition(".")
        is_experts[key] = parent.endswith(".experts") and leaf in ("gate_proj", "up_proj", "down_proj")
        # (the model has no `experts.gate_proj`: rename a name it has, like its siblings)
        probes[key] = (parent + ".down_proj") if is_experts[key] else key
    renamed = checkpoint_to_model_keys(model, list(probes.values()), meta)
    experts_parts: dict[str, dict] = {}
    for key in keys:
        model_key = renamed[probes[key]]
        owner_name = model_key.rpartition(".")[0]
        try:
            owner = model.get_submodule(owner_name)
        except AttributeError:
            owner = None
        if is_experts[key]:
            geometry = fused_experts_geometry(owner) if owner is not None else None
            if geometry is None:
                raise ckpt.CheckpointError(f"{key}.tq_packed: no fused experts module {owner_name} in "
                                           f"{type(model).__name__}")
            e, h, i = geometry
            leaf = key.rpartition(".")[2]
            rows, width = (e * h, i) if leaf == "down_proj" else (e * i, h)
            experts_parts.setdefault(owner_name, {})[leaf] = (key,) + ckpt.check_hadamard_tensor(index, key, rows,
                                                                                                  width)
        elif linear_kind(owner) == "linear" and model_key.endswith(".weight"):
            n_levels, group_size, norms_dtype = ckpt.check_hadamard_tensor(index, key, owner.out_features,
                                                                           owner.in_features)
            plan.linears[owner_name] = LinearPlan(fmt.bits_for_levels(n_levels), group_size, norms_dtype, HADAMARD)
        else:
            raise ckpt.CheckpointError(f"{key}.tq_packed: no matching Linear layer in {type(model).__name__}")
    for name, parts in experts_parts.items():
        for leaf in ("gate_proj", "up_proj", "down_proj"):
            if leaf not in parts:
                raise ckpt.CheckpointError(f"checkpoint is missing {name}.{leaf}.tq_packed (needed for the "
                                           f"quantized experts {name})")
        plan.experts[name] = ExpertsPlan(
            (fmt.bits_for_levels(parts["gate_proj"][1]), fmt.bits_for_levels(parts["up_proj"][1])),
            fmt.bits_for_levels(parts["down_proj"][1]),
            {leaf: parts[leaf][2] for leaf in parts},
            activation,
            tuple(parts[leaf][3] for leaf in ("gate_proj", "up_proj", "down_proj")),
            HADAMARD,
        )


# ---------------------------------------------------------------------------------------------------------------
# from safetensors headers (no weights)
_PER_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.(\w+)\.weight$")
_DOWN_LEAVES = ("down_proj", "w2")


def meta_model(config_dict: dict, dtype=torch.bfloat16):
    """The causal LM `config_dict` describes, built on the meta device (no memory, no weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = {k: v for k, v in config_dict.items() if k != "quantization_config"}
    config = AutoConfig.for_model(**config_dict)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def from_headers(config_dict: dict, tensors: dict, config: TurboQuantConfig) -> dict[str, tuple]:
    """`{checkpoint tensor: (module name, bits, rows, in_features)}` for the tensors of `tensors`
    (`{name: (dtype, shape)}`, from safetensors headers) that quantizing with `config` packs: the model is
    built on the meta device and planned `from_config`, so the answer is the one `from_pretrained` gives."""
    model = meta_model(config_dict)
    plan = from_config(model, config)
    meta = model.state_dict()
    probes = {}
    for name in tensors:
        m = _PER_EXPERT.match(name)
        probes[name] = m.group(1) + ".down_proj" if m else name  # per-expert tensors: the fused parameter's name
    renamed = checkpoint_to_model_keys(model, sorted(set(probes.values())), meta)
    out = {}
    for name, (_, shape) in tensors.items():
        model_key = renamed[probes[name]]
        owner, _, attr = model_key.rpartition(".")
        m = _PER_EXPERT.match(name)
        if m and owner in plan.experts and len(shape) == 2:
            p = plan.experts[owner]
            out[name] = (owner, p.down_bits if m.group(2) in _DOWN_LEAVES else p.gate_up_bits, shape[0], shape[1])
        elif owner in plan.linears and attr == "weight" and len(shape) == 2:
            out[name] = (owner, plan.linears[owner].bits, shape[0], shape[1])
        elif owner in plan.experts and attr in ("gate_up_proj", "down_proj") and len(shape) == 3:
            p = plan.experts[owner]
            e, rows, width = stored_shape(shape, p.layout)  # (packed [E, out, in], whatever the storage)
            out[name] = (owner, p.down_bits if attr == "down_proj" else p.gate_up_bits, e * rows, width)
    return out
