"""`TurboQuantHfQuantizer`: the loader hooks transformers calls. The math lives in codec/modules."""

from __future__ import annotations

import json
import os
import re
import types
import warnings

import torch
from huggingface_hub import ModelCard
from torch import nn
from transformers.quantizers.base import HfQuantizer
from transformers.utils import logging

from . import checkpoint as ckpt
from . import codec
from . import format as fmt
from . import mlx
from .config import DEFAULT_MODULES_TO_NOT_CONVERT, TurboQuantConfig
from .fusion import fuse_projections
from .modules import (
    TurboQuantExperts,
    TurboQuantWeight,
    fused_experts_geometry,
    replace_experts_modules,
    replace_linear_modules,
    to_norms_dtype,
)
from .ops import ACTIVATIONS

logger = logging.get_logger(__name__)

try:  # transformers >= 5
    from transformers.core_model_loading import ConversionOps
except ImportError as e:  # pragma: no cover - guarded by setup.py's requirement
    raise ImportError("turboquant_hf needs transformers >= 5.17") from e


def _matches(name: str, patterns) -> bool:
    """transformers' skip rules (prefix, regex from the start, suffix), plus a match on whole name components
    anywhere in the name, so that `"mlp"` skips every `*.mlp.*` module."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    if not should_convert_module(name, list(patterns)):
        return True
    return any(re.search(rf"(^|\.){pattern}(\.|$)", name) for pattern in patterns)


class TurboQuantize(ConversionOps):
    """On-the-fly conversion of one full-precision `X.weight` into `X.weight.tq_packed` + `X.weight.tq_norms`."""

    def __init__(self, hf_quantizer: "TurboQuantHfQuantizer"):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict, full_layer_name=None, model=None, missing_keys=None, **kwargs):
        out = {}
        for key, value in input_dict.items():
            value = value[0] if isinstance(value, list) else value
            target = model.get_submodule(key)  # the TurboQuantWeight that replaces this tensor
            if missing_keys is not None:
                missing_keys.discard(key)
            if tuple(value.shape) != target.source_shape:
                self.hf_quantizer.conversion_failures[key] = (
                    f"{key}: checkpoint tensor has shape {tuple(value.shape)}, the model expects {target.source_shape}"
                )
                continue
            try:
                packed, norms = codec.quantize_weight(value, target.bits, target.group_size, name=key)
            except ValueError as e:
                # transformers swallows exceptions raised here into a generic report; keep ours for after loading.
                self.hf_quantizer.conversion_failures[key] = str(e)
                continue
            try:
                norms = to_norms_dtype(norms, target.norms_dtype, name=key)
            except ValueError as e:
                self.hf_quantizer.conversion_failures[key] = str(e)
                continue
            target.awaiting_dtype = None
            out[key + fmt.PACKED_SUFFIX] = packed
            out[key + fmt.NORMS_SUFFIX] = norms
        return out


class TurboQuantHfQuantizer(HfQuantizer):
    """Quantizes Linear weights while `from_pretrained` loads them, or loads tq3_native checkpoints."""

    requires_calibration = False
    required_packages = ["safetensors"]

    def __init__(self, quantization_config: TurboQuantConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.checkpoint_index: dict = {}
        self.conversion_failures: dict[str, str] = {}
        self.dequantize_into: dict[str, str] = {}
        self.mlx_layout: mlx.MLXLayout | None = None

    # -- environment ---------------------------------------------------------------------------------------------
    def validate_environment(self, *args, **kwargs):
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("TurboQuant: offloading layers to disk is not supported; use cpu or cuda devices")

    def update_dtype(self, dtype):
        self.load_dtype = dtype
        return dtype

    # -- before loading ------------------------------------------------------------------------------------------
    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        model.__dict__["_turboquant_quantizer"] = self  # read by `loading.check_loaded_keys`
        self.checkpoint_index = ckpt.read_checkpoint_index(checkpoint_files)
        if mlx.is_mlx_checkpoint(self.checkpoint_index):
            self._prepare_mlx_checkpoint(model)
            return
        packed_keys = ckpt.packed_weight_keys(self.checkpoint_index)
        if packed_keys and not self.pre_quantized:
            # A tq3_native checkpoint whose config.json has no quantization_config: the files decide.
            self.pre_quantized = True
            for directory in ckpt.checkpoint_dirs(checkpoint_files):
                tq = ckpt.read_tq_config(directory)
                if tq is not None:
                    self.quantization_config = TurboQuantConfig.from_tq_config(tq)
        elif self.pre_quantized and not packed_keys and self.checkpoint_index:
            raise ckpt.CheckpointError(
                "TurboQuant: config.json declares a turboquant quantization_config but the checkpoint holds no "
                "*.tq_packed tensors"
            )
        if self.pre_quantized:
            linear_plan, experts_plan = self._plan_from_checkpoint(model, packed_keys)
        else:
            linear_plan, experts_plan = self.plan_from_config(model)
        self.modules_to_not_convert = None
        replace_linear_modules(model, linear_plan, awaiting_weights=not self.pre_quantized)
        replace_experts_modules(model, experts_plan, awaiting_weights=not self.pre_quantized)
        if not self.pre_quantized:
            _resolve_placeholders_while_loading(model)
        model._turboquant_original_model = getattr(model.config, "_name_or_path", None)

    def _prepare_mlx_checkpoint(self, model) -> None:
        """A turboquant-mlx checkpoint: plan its modules, and read every tensor ourselves after loading."""
        from collections import Counter

        from .rotation import HADAMARD_FORMAT

        config = model.config
        layout = mlx.MLXLayout(self.checkpoint_index, model_type=getattr(config, "model_type", None))
        linear_plan, experts_plan = layout.plan(model)
        self.pre_quantized = True
        if self.quantization_config.format != HADAMARD_FORMAT:
            # (config.json without its MLX quantization block): describe what the files hold
            tiers = Counter((i["levels"], i["group_size"]) for i in layout.quantized.values())
            (levels, group_size), _ = tiers.most_common(1)[0]
            self.quantization_config = TurboQuantConfig(bits=fmt.bits_for_levels(levels), group_size=group_size,
                                                        format=HADAMARD_FORMAT)
            config.quantization_config = self.quantization_config
        self.modules_to_not_convert = None
        replace_linear_modules(model, linear_plan, awaiting_weights=False)
        replace_experts_modules(model, experts_plan, awaiting_weights=False)
        unexpected, missing = layout.ignore_patterns()
        model._keys_to_ignore_on_load_unexpected = set(model._keys_to_ignore_on_load_unexpected or ()) | unexpected
        model._keys_to_ignore_on_load_missing = set(model._keys_to_ignore_on_load_missing or ()) | missing
        self.mlx_layout = layout
        model._turboquant_original_model = getattr(config, "_name_or_path", None)

    def _skip_patterns(self, model) -> list[str]:
        skip = self.quantization_config.modules_to_not_convert
        return self.get_modules_to_not_convert(
            model,
            list(DEFAULT_MODULES_TO_NOT_CONVERT) if skip is None else skip,
            getattr(model, "_keep_in_fp32_modules", None),
            add_default_skips=skip is None,
        )

    @staticmethod
    def _activation(model) -> str:
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        return getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None) or "silu"

    def plan_from_config(self, model):
        """({Linear name: (bits, G)}, {experts name: (gate_up bits, down bits, G, activation)}) for on-the-fly
        quantization; also used on the meta device by `sizing` and the streaming converter."""
        cfg = self.quantization_config
        skip = self._skip_patterns(model)
        activation = self._activation(model)
        linear_plan, experts_plan = {}, {}
        for name, module in model.named_modules():
            if _matches(name, skip):
                continue
            if type(module) is nn.Linear:
                linear_plan[name] = (cfg.bits_for(name), cfg.group_size)
            elif name.rpartition(".")[2] == "experts" and not isinstance(module, nn.ModuleList):
                if fused_experts_geometry(module) is None or activation not in ACTIVATIONS:
                    logger.warning(
                        "TurboQuant: %s (%s) is not in the fused-experts layout this version quantizes "
                        "(gate_up_proj [E, 2I, H], down_proj [E, H, I], activation one of %s; found %s); "
                        "it stays in full precision",
                        name, type(module).__name__, ", ".join(ACTIVATIONS), activation,
                    )
                    continue
                experts_plan[name] = (
                    cfg.bits_for(name + ".gate_up_proj"), cfg.bits_for(name + ".down_proj"), cfg.group_size, activation
                )
        return linear_plan, experts_plan

    def _plan_from_checkpoint(self, model, packed_keys):
        """Which modules the checkpoint holds packed, with bit widths from each tensor's geometry."""
        group_size = self.quantization_config.group_size
        meta = model.state_dict()
        ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())]
        activation = self._activation(model)
        linear_plan, experts_plan, experts_keys = {}, {}, {}
        self.dequantize_into = {}
        hadamard_keys = [k for k in packed_keys if k + ".tq_signs" in self.checkpoint_index]
        if hadamard_keys:
            self._plan_hadamard_keys(model, hadamard_keys, meta, activation, linear_plan, experts_plan)
            packed_keys = [k for k in packed_keys if k not in set(hadamard_keys)]
        for key, model_key in checkpoint_to_model_keys(model, packed_keys, meta).items():
            if model_key not in meta:
                if any(p.search(key) or p.search(model_key) for p in ignore):
                    # a part of the checkpoint this class does not load (e.g. the vision tower of a text-only class)
                    _ignore_packed(model, key, model_key)
                    continue
                raise ckpt.CheckpointError(
                    f"{key}{fmt.PACKED_SUFFIX}: no matching layer in {type(model).__name__}; the checkpoint does "
                    "not belong to this architecture or names a layer type this version cannot load quantized"
                )
            owner_name, _, attr = model_key.rpartition(".")
            owner = model.get_submodule(owner_name)
            source_shape = tuple(meta[model_key].shape)
            rows = 1
            for d in source_shape[:-1]:
                rows *= d
            n_levels, norms_dtype = ckpt.check_packed_tensor(
                self.checkpoint_index, key, rows, source_shape[-1], group_size
            )
            bits = fmt.bits_for_levels(n_levels)
            if type(owner) is nn.Linear and attr == "weight":
                linear_plan[owner_name] = (bits, group_size, norms_dtype)
            elif attr in ("gate_up_proj", "down_proj") and fused_experts_geometry(owner) is not None:
                experts_keys.setdefault(owner_name, {})[attr] = (key, bits, norms_dtype)
            elif len(source_shape) == 2:
                # packed by a writer that quantizes more than this version keeps packed (routers, ...):
                # dequantized into the full-precision parameter after loading
                self.dequantize_into[model_key] = key
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
            if activation not in ACTIVATIONS:
                raise ckpt.CheckpointError(f"{name}: activation {activation!r} is not supported by TurboQuantExperts")
            experts_plan[name] = (
                parts["gate_up_proj"][1], parts["down_proj"][1], group_size, activation,
                (parts["gate_up_proj"][2], parts["down_proj"][2]),
            )
        return linear_plan, experts_plan

    def _plan_hadamard_keys(self, model, keys, meta, activation, linear_plan, experts_plan) -> None:
        """Modules saved with whole-row Hadamard rotation (models loaded from turboquant-mlx checkpoints)."""
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
                experts_parts.setdefault(owner_name, {})[leaf] = (key,) + ckpt.check_hadamard_tensor(
                    self.checkpoint_index, key, rows, width)
            elif type(owner) is nn.Linear and model_key.endswith(".weight"):
                n_levels, group_size, norms_dtype = ckpt.check_hadamard_tensor(
                    self.checkpoint_index, key, owner.out_features, owner.in_features)
                linear_plan[owner_name] = (fmt.bits_for_levels(n_levels), group_size, norms_dtype, "hadamard")
            else:
                raise ckpt.CheckpointError(f"{key}.tq_packed: no matching Linear layer in {type(model).__name__}")
        for name, parts in experts_parts.items():
            for leaf in ("gate_proj", "up_proj", "down_proj"):
                if leaf not in parts:
                    raise ckpt.CheckpointError(f"checkpoint is missing {name}.{leaf}.tq_packed (needed for the "
                                               f"quantized experts {name})")
            experts_plan[name] = (
                (fmt.bits_for_levels(parts["gate_proj"][1]), fmt.bits_for_levels(parts["up_proj"][1])),
                fmt.bits_for_levels(parts["down_proj"][1]),
                {leaf: parts[leaf][2] for leaf in parts},
                activation,
                tuple(parts[leaf][3] for leaf in ("gate_proj", "up_proj", "down_proj")),
                "hadamard",
            )

    # -- during loading ------------------------------------------------------------------------------------------
    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        if self.pre_quantized:
            return False
        try:
            target = model.get_submodule(param_name)
        except AttributeError:
            return False
        return isinstance(target, TurboQuantWeight)

    def param_element_size(self, model, param_name: str, param) -> float:
        if self.param_needs_quantization(model, param_name):
            w = model.get_submodule(param_name)
            return (fmt.bytes_per_group(w.n_levels, w.group_size) + w.tq_norms.element_size()) / w.group_size
        return super().param_element_size(model, param_name, param)

    def get_quantize_ops(self):
        return TurboQuantize(self)

    # -- after loading -------------------------------------------------------------------------------------------
    def _process_model_after_weight_loading(self, model, **kwargs):
        model.__dict__.pop("_turboquant_quantizer", None)
        if self.mlx_layout is not None:
            self.mlx_layout.load_into(model)
            # the MLX block would describe the saved files wrongly; quantization_config describes them
            model.config.__dict__.pop("quantization", None)
        self.raise_conversion_failures()
        for name, module in model.named_modules():
            if isinstance(module, TurboQuantWeight) and module.awaiting_dtype is not None:
                raise ckpt.CheckpointError(f"checkpoint is missing {name} (needed to quantize it)")
            if isinstance(module, TurboQuantWeight):
                for attr, shape in module.expected_shapes().items():
                    t = getattr(module, attr)
                    got = module.packed_shape() if attr == "tq_packed" else tuple(t.shape)
                    if t.is_meta or got != shape:
                        raise ckpt.CheckpointError(
                            f"{name}.{attr}: expected shape {shape}, got {got} on {t.device}"
                        )
        model.__dict__.pop("get_parameter_or_buffer", None)
        for module in model.modules():  # weights on a GPU: the kernels' runtime layout (`layout.wanted`)
            if isinstance(module, TurboQuantWeight):
                module.use_runtime_layout_()
        self._restore_requested_dtype(model)
        self._dequantize_into_parameters(model)
        if os.environ.get("TURBOQUANT_FUSE", "1") != "0":  # q/k/v and gate/up as one op each on a GPU
            fuse_projections(model, device_type="cuda")
        _drop_expert_converters_for_saving(model)
        for p in model.parameters():
            p.requires_grad_(False)
        _install_save_hook(model)
        return model

    def raise_conversion_failures(self) -> None:
        if self.conversion_failures:
            raise ValueError("TurboQuant could not quantize: " + "; ".join(self.conversion_failures.values()))

    def _restore_requested_dtype(self, model) -> None:
        """transformers before `HfQuantizer.get_new_dtype` (5.17) loads every renamed key of a pre-quantized
        checkpoint in its on-disk dtype (e.g. the float16 of `model.language_model.*` tensors), ignoring `dtype`.
        Cast those parameters back to the dtype transformers resolved for the model."""
        dtype = getattr(self, "load_dtype", None)
        if hasattr(HfQuantizer, "get_new_dtype") or not self.pre_quantized or not isinstance(dtype, torch.dtype):
            return
        keep = list(getattr(model, "_keep_in_fp32_modules", None) or []) + list(
            getattr(model, "_keep_in_fp32_modules_strict", None) or []
        )
        for name, p in model.named_parameters():
            if p.is_floating_point() and p.dtype != dtype and not any(k in name for k in keep):
                p.data = p.data.to(dtype)

    def _dequantize_into_parameters(self, model) -> None:
        from safetensors import safe_open

        for param_name, key in self.dequantize_into.items():
            owner_name, _, attr = param_name.rpartition(".")
            owner = model.get_submodule(owner_name)
            param = getattr(owner, attr)
            tensors = {}
            for suffix in (fmt.PACKED_SUFFIX, fmt.NORMS_SUFFIX):
                with safe_open(self.checkpoint_index[key + suffix]["file"], "pt") as f:
                    tensors[suffix] = f.get_tensor(key + suffix)
            dtype = model.get_input_embeddings().weight.dtype
            w = codec.dequantize_weight(
                tensors[fmt.PACKED_SUFFIX], tensors[fmt.NORMS_SUFFIX], param.shape[-1],
                self.quantization_config.group_size, dtype=dtype,
            )
            setattr(owner, attr, nn.Parameter(w.view(param.shape).to(param.device), requires_grad=False))

    # -- saving --------------------------------------------------------------------------------------------------
    def is_serializable(self, *args, **kwargs):
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True


def _resolve_placeholders_while_loading(model) -> None:
    """While quantizing on the fly, the state dict advertises each replaced tensor (`q_proj.weight`) as a meta
    placeholder; transformers' loader also looks such names up (device-map sizing, allocator warm-up), so
    answer those look-ups with the same placeholder until loading is over."""
    original = model.get_parameter_or_buffer

    def get_parameter_or_buffer(self, target: str):
        try:
            return original(target)
        except AttributeError:
            try:
                sub = self.get_submodule(target)
            except AttributeError:
                sub = None
            if isinstance(sub, TurboQuantWeight) and sub.awaiting_dtype is not None:
                return torch.empty(sub.source_shape, dtype=sub.awaiting_dtype, device="meta")
            raise

    model.get_parameter_or_buffer = types.MethodType(get_parameter_or_buffer, model)


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


def _ignore_packed(model, key: str, model_key: str) -> None:
    names = set()
    for k in (key, model_key):
        names.update({re.escape(k + fmt.PACKED_SUFFIX), re.escape(k + fmt.NORMS_SUFFIX)})
    model._keys_to_ignore_on_load_unexpected.update(names)


def _drop_expert_converters_for_saving(model) -> None:
    """Packed experts are saved pre-fused, whatever the source layout: transformers must not split them back
    into per-expert tensors on save (its reverse converters would also match `...gate_up_proj.tq_packed`)."""
    from transformers.core_model_loading import WeightConverter

    conversions = getattr(model, "_weight_conversions", None)
    if not conversions:
        return
    packed_owners = [n for n, m in model.named_modules() if isinstance(m, TurboQuantExperts)]
    if not packed_owners:
        return
    model._weight_conversions = [
        c for c in conversions
        if not (isinstance(c, WeightConverter) and any("experts" in str(t) for t in c.target_patterns))
    ]


def describe_quantized_model(model, save_directory: str) -> dict:
    """The `tq_config.json` that describes `model` as saved in `save_directory` (names as written there)."""
    cfg = model.config.quantization_config
    if isinstance(cfg, dict):
        cfg = TurboQuantConfig.from_dict(cfg)
    files = [os.path.join(save_directory, f) for f in os.listdir(save_directory) if f.endswith(".safetensors")]
    saved = ckpt.packed_weight_keys(ckpt.read_checkpoint_index(files))
    modules = dict(model.named_modules())
    layers, orig_in_dims = 0, {}
    for key, model_key in checkpoint_to_model_keys(model, saved).items():
        module = modules.get(model_key)
        if not isinstance(module, TurboQuantWeight):
            continue
        layers += 1
        if module.in_features % module.group_size:
            orig_in_dims[key] = module.in_features
    return cfg.to_tq_config(layers, orig_in_dims, getattr(model, "_turboquant_original_model", None))


def _save_pretrained_with_tq_config(self, save_directory, *args, model_card: bool = True, base_model=None, **kwargs):
    """transformers' save_pretrained, then tq_config.json and (unless `model_card=False`) the model card README.md.

    `base_model`: the Hub id of the model this was quantized from, for the card (default: tq_config's
    original_model when it is a Hub id). With `push_to_hub=True` the folder is uploaded after the card is
    written, so the Hub gets this card and not transformers' generic one.
    """
    push = kwargs.pop("push_to_hub", False)
    tags = kwargs.pop("tags", None)
    hub_kwargs = {k: kwargs.pop(k) for k in ("repo_id", "commit_message", "create_pr", "private") if k in kwargs}
    result = type(self).save_pretrained(self, save_directory, *args, **kwargs)
    if not kwargs.get("is_main_process", True) or os.path.isfile(save_directory):
        return result
    path = os.path.join(save_directory, fmt.TQ_CONFIG_NAME)
    with open(path + ".tmp", "w") as f:
        json.dump(describe_quantized_model(self, save_directory), f, indent=2)
    os.replace(path + ".tmp", path)
    _save_source_tokenizer(self, save_directory)
    repo_id = None
    if push:
        from huggingface_hub import HfApi

        api = HfApi()
        repo_id = hub_kwargs.get("repo_id") or os.path.basename(os.path.normpath(str(save_directory)))
        repo_id = api.create_repo(repo_id, private=hub_kwargs.get("private"), token=kwargs.get("token"),
                                  exist_ok=True).repo_id
    if model_card:
        _write_card(self, save_directory, repo_id=repo_id, base_model=base_model, tags=tags)
    if push:
        api.upload_folder(folder_path=str(save_directory), repo_id=repo_id, token=kwargs.get("token"),
                          commit_message=hub_kwargs.get("commit_message") or "Upload TurboQuant model",
                          create_pr=hub_kwargs.get("create_pr", False))
    return result


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _save_source_tokenizer(model, save_directory) -> None:
    """The tokenizer of the model this one was loaded from, saved beside it when the folder has none, so that
    `pipeline(model=save_directory)` and a pushed repo work on their own."""
    source = getattr(model, "_turboquant_original_model", None)
    if not source or any(os.path.isfile(os.path.join(save_directory, f)) for f in _TOKENIZER_FILES):
        return
    if os.path.isdir(source) and not any(os.path.isfile(os.path.join(source, f)) for f in _TOKENIZER_FILES):
        return
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as e:  # no tokenizer where the weights came from: the folder is complete without one
        logger.info("TurboQuant: no tokenizer saved beside the model (%s: %s)", source, e)
        return
    tokenizer.save_pretrained(save_directory)


def _write_card(model, save_directory, repo_id=None, base_model=None, tags=None) -> None:
    from . import card as tq_card

    try:
        build_path = os.path.join(save_directory, tq_card.BUILD_NAME)
        with open(build_path + ".tmp", "w") as f:
            json.dump(tq_card.build_record(base_model=base_model,
                                           source=getattr(model, "_turboquant_original_model", None)), f, indent=2)
        os.replace(build_path + ".tmp", build_path)
        source = getattr(model, "_turboquant_original_model", None)
        text = tq_card.render_card(str(save_directory), repo_id=repo_id, base_model=base_model,
                                   source_dir=source if source and os.path.isdir(source) else None)
        if tags:
            card = ModelCard(text)
            card.data.tags = list(card.data.tags or []) + [t for t in tags if t not in (card.data.tags or [])]
            text = str(card)
    except Exception as e:  # the weights are saved; a card that cannot be rendered must not lose them
        warnings.warn(f"TurboQuant: saved the model but could not write its model card: {e}")
        return
    with open(os.path.join(save_directory, "README.md"), "w", encoding="utf-8") as f:
        f.write(text)


def _push_to_hub(self, repo_id: str, *, commit_message: str | None = None, private: bool | None = None,
                 token=None, create_pr: bool = False, revision: str | None = None, tags=None,
                 base_model=None, **save_kwargs):
    """Push weights, config, tq_config.json and the TurboQuant model card in one commit.

    transformers' own push_to_hub would replace the README with its generic card; this one uploads the
    folder that `save_pretrained` wrote, card included.
    """
    import tempfile

    from huggingface_hub import HfApi

    api = HfApi()
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    with tempfile.TemporaryDirectory() as tmp:
        self.save_pretrained(tmp, model_card=False, **save_kwargs)
        _write_card(self, tmp, repo_id=repo_id, base_model=base_model, tags=tags)
        return api.upload_folder(folder_path=tmp, repo_id=repo_id, token=token, revision=revision,
                                 create_pr=create_pr, commit_message=commit_message or "Upload TurboQuant model")


def _install_save_hook(model) -> None:
    # transformers has no save hook for quantizers; instance attributes keep the class (and its name) intact.
    model.save_pretrained = types.MethodType(_save_pretrained_with_tq_config, model)
    model.push_to_hub = types.MethodType(_push_to_hub, model)
