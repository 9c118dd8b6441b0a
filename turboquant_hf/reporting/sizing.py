"""Exact sizes before any weight is loaded: of a model on the meta device (`size_report`), and the memory plan of
a checkpoint from its safetensors headers (`plan_memory` for quantizing it, `plan_stored_memory` for one already
quantized): weights per tier, KV cache per token, recurrent state."""

from __future__ import annotations

import math
import re
from collections import defaultdict
from typing import Any

import torch

from ..format import checkpoint as ckpt
from ..format import constants as fmt
from ..format import runtime_layout
from ..modeling.modules import TurboQuantWeight
from ..quantization import planning
from ..quantization.config import TurboQuantConfig
from . import card as tq_card
from . import model_shape


def apply_plan(model, config: TurboQuantConfig):
    """Swap in TurboQuant modules exactly as `from_pretrained(..., quantization_config=config)` would."""
    planning.from_config(model, config).apply(model, awaiting_weights=False)
    return model


def size_report(model) -> dict:
    """Bytes and weight counts per tier of a (possibly meta) model that holds TurboQuant modules.

    Returns `{"tiers": {bits: {"weights", "bytes", "bits_per_weight"}}, "full_precision": {"params", "bytes"},
    "total_bytes"}`; full-precision parameters count at their own dtype.
    """
    tiers = defaultdict(lambda: {"weights": 0, "bytes": 0})
    packed_buffers = set()
    for name, m in model.named_modules():
        if isinstance(m, TurboQuantWeight):
            t = tiers[m.bits]
            t["weights"] += m.rows * m.in_features
            t["bytes"] += m.tq_packed.numel() * m.tq_packed.element_size() + m.tq_norms.numel() * m.tq_norms.element_size()
            packed_buffers.update({id(m.tq_packed), id(m.tq_norms)})
    fp_params = fp_bytes = 0
    seen = set()
    for p in list(model.parameters()) + list(model.buffers()):
        if id(p) in packed_buffers or id(p) in seen:
            continue
        seen.add(id(p))
        fp_params += p.numel()
        fp_bytes += p.numel() * p.element_size()
    for t in tiers.values():
        t["bits_per_weight"] = 8 * t["bytes"] / t["weights"]
    total = fp_bytes + sum(t["bytes"] for t in tiers.values())
    return {"tiers": dict(tiers), "full_precision": {"params": fp_params, "bytes": fp_bytes}, "total_bytes": total}


def size_from_config(model_config, config: TurboQuantConfig, model_class=None, dtype=torch.bfloat16) -> dict:
    """`size_report` of the model `model_config` describes, built on the meta device (no memory, no weights)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        if model_class is None:
            model = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
        else:
            model = model_class._from_config(model_config, dtype=dtype)
    return size_report(apply_plan(model, config))


KV_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}  # the KV cache's element size, by `--kv-dtype`


class PlanError(ValueError):
    """The headers describe nothing this version can plan."""


def _norm_bytes(n_levels: int) -> int:
    """Bytes of one group norm as written for new tensors (float16 for the ternary tier, float32 otherwise)."""

    dtype = getattr(fmt, "default_norms_dtype", None)
    return dtype(n_levels).itemsize if dtype is not None else 4


def plan_memory(config: dict, tensors: dict, cfg, kv_dtype: str = "bf16", context: int | None = None,
                batch: int = 1, gpus: int = 1) -> dict[str, Any]:
    """The memory projection of `tensors` quantized with `cfg`: weights per tier (exact), KV cache, recurrent state.

    Sizes are those of the checkpoint (and of the model in CPU memory); `*gpu_bytes` are those on a CUDA device,
    where ternary weights take the 2-bit runtime layout unless TURBOQUANT_COMPACT_TERNARY is set
    (`turboquant_hf.format.runtime_layout`). `gpus` > 1 adds `tensor_parallel` (`tensor_parallel_share`)."""


    split = TensorParallelSplit(config, gpus, cfg.group_size)
    try:
        quantized = planning.from_headers(config, tensors, cfg)
    except (ValueError, KeyError) as e:
        raise PlanError(f"transformers cannot build this model from its config.json ({e})") from e
    G = cfg.group_size
    tiers: dict[Any, dict] = {}
    full_bytes = base_bytes = full_count = 0
    for name, (dtype, shape) in tensors.items():
        nbytes = ckpt.DTYPE_BYTES.get(dtype, 2) * math.prod(shape)
        base_bytes += nbytes
        if name not in quantized:
            full_bytes += nbytes
            full_count += 1
            split.add(name, nbytes, nbytes)
            continue
        _, bits, rows, in_features = quantized[name]
        n_levels = fmt.levels_for_bits(bits)
        groups = rows * -(-in_features // G)
        packed = groups * (fmt.bytes_per_group(n_levels, G) + _norm_bytes(n_levels))
        on_gpu = runtime_layout.gpu_bytes_per_group(n_levels, G)
        split.add(name, packed, groups * (on_gpu + _norm_bytes(n_levels)), in_features=in_features)
        t = tiers.setdefault(bits, {"bits": bits, "tensors": 0, "params": 0, "bytes": 0, "gpu_bytes": 0,
                                    "base_bytes": 0})
        t["tensors"] += 1
        t["params"] += rows * in_features
        t["bytes"] += packed
        t["gpu_bytes"] += groups * (on_gpu + _norm_bytes(n_levels))
        t["base_bytes"] += nbytes
    plan = _plan_weights(tiers, full_bytes, full_count, base_bytes)
    plan = {"quantization_config": cfg.to_dict(), "already_quantized": False, **plan}
    return split.finish(_plan_runtime(plan, config, kv_dtype, context, batch))


def _plan_weights(tiers: dict, full_bytes: int, full_count: int, base_bytes: int) -> dict[str, Any]:
    """The weights part of a plan from its tiers (`{bits: {"bits", "tensors", "params", "bytes", "gpu_bytes",
    "base_bytes"}}`) and its full-precision tensors."""

    q_bytes = sum(t["bytes"] for t in tiers.values())
    q_gpu = sum(t["gpu_bytes"] for t in tiers.values())
    q_params = sum(t["params"] for t in tiers.values())
    tier_list = [dict(t, label=tq_card.bits_label(t["bits"]), bits_per_weight=round(8 * t["bytes"] / t["params"], 3))
                 for _, t in sorted(tiers.items(), key=lambda kv_: -kv_[0])]
    return {
        "tiers": tier_list, "quantized_bytes": q_bytes, "quantized_params": q_params,
        "full_precision_bytes": full_bytes, "full_precision_tensors": full_count,
        "weights_bytes": q_bytes + full_bytes, "weights_gpu_bytes": q_gpu + full_bytes, "base_weights_bytes": base_bytes,
        "bits_per_weight": round(8 * q_bytes / q_params, 3) if q_params else None,
    }


def _plan_runtime(plan: dict, config: dict, kv_dtype: str, context: int | None, batch: int) -> dict[str, Any]:
    """`plan` (its weights part) with the KV cache, the recurrent state and the totals added."""

    kv = model_shape.kv_cache_per_token(config, KV_DTYPE_BYTES[kv_dtype])
    rec = model_shape.recurrent_state_bytes(config, KV_DTYPE_BYTES[kv_dtype])
    tc = model_shape.text_config(config)
    context = context or int(tc.get("max_position_embeddings") or 4096)
    kv_total = kv["bytes"] * context * batch
    total = plan["weights_bytes"] + kv_total + rec["bytes"] * batch
    return dict(
        plan, kv_dtype=kv_dtype, kv_cache_bytes_per_token=kv["bytes"], kv_cache=kv, recurrent_state_bytes=rec["bytes"],
        recurrent_state=rec, context=context, batch=batch, kv_cache_bytes=kv_total, total_bytes=total,
        total_gpu_bytes=total - plan["weights_bytes"] + plan["weights_gpu_bytes"])


def _stored_quantization_config(config: dict, tq_config: dict | None) -> dict:
    """The TurboQuant quantization_config a checkpoint declares: config.json's (or its text_config's), else
    tq_config.json."""

    for cfg in (config, model_shape.text_config(config)):
        qc = cfg.get("quantization_config")
        if isinstance(qc, dict) and qc.get("quant_method") == "turboquant":
            return qc
    return {k: v for k, v in (tq_config or {}).items() if k != "orig_in_dims"}  # (one entry per padded layer)


def plan_stored_memory(config: dict, tensors: dict, tq_config: dict | None = None, kv_dtype: str = "bf16",
                       context: int | None = None, batch: int = 1, gpus: int = 1) -> dict[str, Any]:
    """The memory plan of a checkpoint that is already TurboQuant-quantized, as it is stored: every tensor at its
    stored bytes (packed uint8 and norms for the quantized weights, the others at their own dtype), each quantized
    weight in the tier its packed geometry says (`format.levels_from_geometry`), KV cache and state as
    `plan_memory`. `tensors` is `{name: (safetensors dtype, shape)}`; `tq_config` the checkpoint's tq_config.json
    (its `orig_in_dims` give the unpadded width of padded layers; without it the padded width counts)."""


    qc = _stored_quantization_config(config, tq_config)
    group_size = int(qc.get("group_size") or (tq_config or {}).get("group_size") or 128)
    orig_in = (tq_config or {}).get("orig_in_dims") or {}
    tc = model_shape.text_config(config)
    base_dtype = str(tc.get("dtype") or tc.get("torch_dtype") or config.get("dtype") or config.get("torch_dtype")
                     or "bfloat16").replace("torch.", "")
    base_dtype_bytes = {"float32": 4, "float16": 2, "bfloat16": 2}.get(base_dtype, 2)
    index = {name: {"dtype": dtype, "shape": tuple(shape)} for name, (dtype, shape) in tensors.items()}
    split = TensorParallelSplit(config, gpus, group_size)

    def nbytes(name: str) -> int:
        dtype = index[name]["dtype"]
        if dtype not in ckpt.DTYPE_BYTES:
            raise PlanError(f"tensor {name} has the unknown safetensors dtype {dtype}")
        return ckpt.DTYPE_BYTES[dtype] * math.prod(index[name]["shape"])

    tiers: dict[Any, dict] = {}
    quantized_names: set[str] = set()
    base_bytes = 0
    for key in ckpt.packed_weight_keys(index):
        norms = index.get(key + fmt.NORMS_SUFFIX)
        if norms is None or len(norms["shape"]) != 2:
            raise PlanError(f"{key}{fmt.PACKED_SUFFIX} has no {fmt.NORMS_SUFFIX} of shape (rows, groups) beside "
                           f"it (found {norms['shape'] if norms else 'none'})")
        rows, n_groups = norms["shape"]
        names = [key + fmt.PACKED_SUFFIX, key + fmt.NORMS_SUFFIX]
        try:
            if key + ".tq_codebook" in index and key + ".tq_signs" in index:
                # whole-row Hadamard modules (from turboquant-mlx): their own codebook, signs and group size
                in_features = index[key + ".tq_signs"]["shape"][0]
                n_levels, g, _ = ckpt.check_hadamard_tensor(index, key, rows, in_features)
                names += [key + ".tq_codebook", key + ".tq_signs"]
            else:
                module = key[: -len(".weight")] if key.endswith(".weight") else key
                g = group_size
                in_features = orig_in.get(key) or orig_in.get(module) or n_groups * g
                n_levels, _ = ckpt.check_packed_tensor(index, key, rows, in_features, g)
        except ckpt.CheckpointError as e:
            raise PlanError(f"{e}") from e
        bits = fmt.bits_for_levels(n_levels)
        stored = sum(nbytes(n) for n in names)
        # a CUDA device holds the packed codes in the runtime layout where one exists (ternary: 2-bit codes)
        extra_per_group = runtime_layout.gpu_bytes_per_group(n_levels, g) - fmt.bytes_per_group(n_levels, g)
        gpu_extra = rows * n_groups * extra_per_group
        t = tiers.setdefault(bits, {"bits": bits, "tensors": 0, "params": 0, "bytes": 0, "gpu_bytes": 0,
                                    "base_bytes": 0})
        t["tensors"] += 1
        t["params"] += rows * in_features
        t["bytes"] += stored
        t["gpu_bytes"] += stored + gpu_extra
        t["base_bytes"] += rows * in_features * base_dtype_bytes
        base_bytes += rows * in_features * base_dtype_bytes
        quantized_names.update(names)
        split.add(key, stored, stored + gpu_extra, in_features=in_features, group_size=g)
    full = [n for n in index if n not in quantized_names]
    full_bytes = sum(nbytes(n) for n in full)
    for n in full:
        split.add(n, nbytes(n), nbytes(n))
    plan = _plan_weights(tiers, full_bytes, len(full), base_bytes + full_bytes)
    plan = {"quantization_config": qc, "already_quantized": True, "group_size": group_size, **plan}
    return split.finish(_plan_runtime(plan, config, kv_dtype, context, batch))


# -- tensor parallelism ------------------------------------------------------------------------------------------
COLUMN_STYLES = ("colwise", "colwise_rep", "colwise_gather_output", "packed_colwise", "unit_colwise")
ROW_STYLES = ("rowwise", "rowwise_rep", "rowwise_split_input", "unit_rowwise")
EMBEDDING_STYLES = ("embedding_rowwise", "embedding_colwise")
_SUFFIXES = (".tq_packed", ".tq_norms", ".tq_codebook", ".tq_signs", ".weight", ".bias")


WHOLE_EXPERTS = "whole experts"  # (a rule's style: experts that tensor parallelism keeps whole on every rank)


def tensor_parallel_rules(config: dict) -> list[tuple[re.Pattern, str]]:
    """The tensor parallel plan the installed transformers applies to this model's language model (`model.tp_plan`
    of the model built on the meta device from the text config, with at most 8 layers: the plan names layers by
    `*`), as (regex on module names, style); it matches under any prefix (`model.`, `model.language_model.`).
    Fused experts that stay whole on every rank come first, with the style WHOLE_EXPERTS (their tensors too)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    tc = dict(model_shape.text_config(config))
    model_type = tc.get("model_type") or config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise PlanError(f"transformers does not know the model type {model_type!r}")
    layers = min(int(tc.get("num_hidden_layers") or 1), 8)
    tc["num_hidden_layers"] = layers
    if isinstance(tc.get("layer_types"), list):
        tc["layer_types"] = tc["layer_types"][:layers]
    tc.pop("quantization_config", None)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type].from_dict(tc))
    except (ValueError, KeyError, TypeError) as e:
        raise PlanError(f"transformers cannot build {model_type!r} from its config.json ({e})") from e
    plan = dict(getattr(model, "tp_plan", None) or {})
    rules = [(re.compile(r"(^|\.)" + re.escape(k).replace(r"\*", r"\d+") + "$"), v) for k, v in plan.items()]
    # fused experts in another layout than gate rows then up rows, unbiased, [E, out, in] (gpt-oss, Llama 4), that
    # the plan does not name: kept whole on every rank (`tensor_parallel.splittable`)
    from ..modeling.experts_layout import fused_experts_geometry

    whole = set()
    for name, module in model.named_modules():
        gu = getattr(module, "gate_up_proj", None)
        if isinstance(gu, torch.Tensor) and gu.dim() == 3 and fused_experts_geometry(module) is None and \
                not any(rx.search(name) for rx, _ in rules):
            whole.add(re.sub(r"\.\d+\.", ".*.", name))
    return [(re.compile(r"(^|\.)" + re.escape(k).replace(r"\*", r"\d+") + r"(\.|$)"), WHOLE_EXPERTS)
            for k in sorted(whole)] + rules


class TensorParallelSplit:
    """Per-GPU bytes of a model split over `gpus` ranks by its tp plan, tensor by tensor, as TurboQuant splits them
    (`integration.tensor_parallel`): column-wise tensors by output rows, row-wise ones by input width on group
    boundaries (a split that would cut a group is listed in `refused`), quantized fused experts by their
    intermediate width, every other tensor replicated on each GPU. Each share is the largest rank's (`torch.chunk`
    sizes)."""

    def __init__(self, config: dict, gpus: int, group_size: int):
        self.config, self.gpus, self.group_size = config, int(gpus), group_size
        if self.gpus < 1:
            raise PlanError(f"--gpus must be at least 1, got {gpus}")
        self.rules = tensor_parallel_rules(config) if self.gpus > 1 else []
        if self.gpus > 1 and not self.rules:
            raise PlanError(f"{config.get('model_type')!r} has no tensor parallel plan in transformers "
                            "(base_model_tp_plan): it cannot be split over GPUs with tp_plan")
        self.bytes = self.gpu_bytes = self.split_bytes = 0
        self.refused: list[str] = []

    def style(self, name: str, quantized: bool = False) -> str | None:
        module = name
        for suffix in _SUFFIXES:
            module = module.removesuffix(suffix)
        if any(style == WHOLE_EXPERTS and rx.search(module) for rx, style in self.rules):
            return None
        if quantized and re.search(r"\.experts(\.|$)", module):
            return "experts"
        for rx, style in self.rules:
            if rx.search(module):
                return style
        return None

    def add(self, name: str, nbytes: int, gpu_bytes: int, in_features: int | None = None,
            group_size: int | None = None) -> None:
        """One tensor (a quantized weight: `name` its checkpoint name, `in_features` its input width)."""
        style = self.style(name, quantized=in_features is not None) if self.gpus > 1 else None
        is_bias = name.endswith(".bias")
        split = style in COLUMN_STYLES or style in EMBEDDING_STYLES or style == "experts" or (
            style in ROW_STYLES and not is_bias)
        g = group_size or self.group_size
        if in_features and (style in ROW_STYLES or (style == "experts" and ".down_proj" in name)):
            chunk = -(-in_features // self.gpus)
            if chunk % g and chunk < in_features:
                self.refused.append(f"{name}: input width {in_features} splits into {chunk} per GPU, not a multiple "
                                    f"of the group size {g}")
        share = (lambda b: -(-b // self.gpus)) if split else (lambda b: b)
        self.bytes += share(nbytes)
        self.gpu_bytes += share(gpu_bytes)
        self.split_bytes += nbytes if split else 0

    def finish(self, plan: dict) -> dict:
        """`plan` with `tensor_parallel` added when `gpus` > 1: per-GPU weights, KV cache and totals."""
        if self.gpus == 1:
            return plan
        kv = plan["kv_cache"]
        heads = int(kv.get("kv_heads") or 0)
        kv_share = -(-heads // self.gpus) / heads if heads else 1.0  # whole KV heads per GPU
        kv_bytes = int(plan["kv_cache_bytes"] * kv_share)
        state = plan["recurrent_state_bytes"] * plan["batch"]  # linear attention gathers its projections: replicated
        plan["tensor_parallel"] = {
            "gpus": self.gpus, "weights_bytes_per_gpu": self.bytes, "weights_gpu_bytes_per_gpu": self.gpu_bytes,
            "split_bytes": self.split_bytes, "replicated_bytes": plan["weights_bytes"] - self.split_bytes,
            "kv_cache_bytes_per_gpu": kv_bytes, "kv_cache_bytes_per_token_per_gpu":
                int(plan["kv_cache_bytes_per_token"] * kv_share),
            "total_bytes_per_gpu": self.bytes + kv_bytes + state,
            "total_gpu_bytes_per_gpu": self.gpu_bytes + kv_bytes + state, "refused": self.refused,
        }
        return plan
