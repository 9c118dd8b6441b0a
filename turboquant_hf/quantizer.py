"""`TurboQuantHfQuantizer`: the loader hooks transformers calls. The math lives in codec/modules."""

from __future__ import annotations

import json
import os
import re
import types

import torch
from torch import nn
from transformers.quantizers.base import HfQuantizer

from . import checkpoint as ckpt
from . import codec
from . import format as fmt
from .config import DEFAULT_MODULES_TO_NOT_CONVERT, TurboQuantConfig
from .modules import TurboQuantLinear, TurboQuantWeight, replace_linear_modules

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
            module = model.get_submodule(key.rpartition(".")[0])
            if missing_keys is not None:
                missing_keys.discard(key)
            try:
                packed, norms = codec.quantize_weight(value, module.bits, module.group_size, name=key)
            except ValueError as e:
                # transformers swallows exceptions raised here into a generic report; keep ours for after loading.
                self.hf_quantizer.conversion_failures[key] = str(e)
                continue
            module.awaiting_weight_dtype = None
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

    # -- environment ---------------------------------------------------------------------------------------------
    def validate_environment(self, *args, **kwargs):
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("TurboQuant: offloading layers to disk is not supported; use cpu or cuda devices")

    def update_dtype(self, dtype):
        return dtype

    # -- before loading ------------------------------------------------------------------------------------------
    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        cfg = self.quantization_config
        self.checkpoint_index = ckpt.read_checkpoint_index(checkpoint_files)
        packed_keys = ckpt.packed_weight_keys(self.checkpoint_index)
        if packed_keys and not self.pre_quantized:
            # A tq3_native checkpoint whose config.json has no quantization_config: the files decide.
            self.pre_quantized = True
            for directory in ckpt.checkpoint_dirs(checkpoint_files):
                tq = ckpt.read_tq_config(directory)
                if tq is not None:
                    self.quantization_config = cfg = TurboQuantConfig.from_tq_config(tq)
        elif self.pre_quantized and not packed_keys and self.checkpoint_index:
            raise ckpt.CheckpointError(
                "TurboQuant: config.json declares a turboquant quantization_config but the checkpoint holds no "
                "*.tq_packed tensors"
            )
        if self.pre_quantized:
            plan = self._plan_from_checkpoint(model, packed_keys)
        else:
            plan = self._plan_from_config(model)
        self.modules_to_not_convert = None
        replace_linear_modules(model, plan, awaiting_weights=not self.pre_quantized)
        model._turboquant_original_model = getattr(model.config, "_name_or_path", None)

    def _skip_patterns(self, model) -> list[str]:
        skip = self.quantization_config.modules_to_not_convert
        return self.get_modules_to_not_convert(
            model,
            list(DEFAULT_MODULES_TO_NOT_CONVERT) if skip is None else skip,
            getattr(model, "_keep_in_fp32_modules", None),
            add_default_skips=skip is None,
        )

    def _plan_from_config(self, model) -> dict[str, tuple]:
        cfg = self.quantization_config
        skip = self._skip_patterns(model)
        plan = {}
        for name, module in model.named_modules():
            if type(module) is nn.Linear and not _matches(name, skip):
                plan[name] = (cfg.bits_for(name), cfg.group_size)
        return plan

    def _checkpoint_to_model_key(self, model, key: str, meta_keys) -> str | None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        if key in meta_keys:
            return key
        renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
        renamed, _ = rename_source_key(key, renamings, [], model.base_model_prefix, meta_keys)
        return renamed if renamed in meta_keys else None

    def _plan_from_checkpoint(self, model, packed_keys) -> dict[str, tuple]:
        group_size = self.quantization_config.group_size
        meta_keys = model.state_dict()
        plan = {}
        for key in packed_keys:
            model_key = self._checkpoint_to_model_key(model, key, meta_keys)
            if model_key is None or not model_key.endswith(".weight"):
                raise ckpt.CheckpointError(
                    f"{key}{fmt.PACKED_SUFFIX}: no matching Linear layer in {type(model).__name__}; "
                    "the checkpoint does not belong to this architecture or names a layer type this version "
                    "cannot load quantized"
                )
            name = model_key[: -len(".weight")]
            module = model.get_submodule(name)
            if type(module) is not nn.Linear:
                raise ckpt.CheckpointError(
                    f"{key}{fmt.PACKED_SUFFIX}: {name} is a {type(module).__name__}, not a Linear layer; this version "
                    "loads quantized Linear weights only"
                )
            n_levels = ckpt.check_packed_tensor(
                self.checkpoint_index, key, module.out_features, module.in_features, group_size
            )
            plan[name] = (fmt.bits_for_levels(n_levels), group_size)
        return plan

    # -- during loading ------------------------------------------------------------------------------------------
    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        if self.pre_quantized or not param_name.endswith(".weight"):
            return False
        try:
            module = model.get_submodule(param_name[: -len(".weight")])
        except AttributeError:
            return False
        return isinstance(module, TurboQuantLinear)

    def param_element_size(self, model, param_name: str, param) -> float:
        if self.param_needs_quantization(model, param_name):
            module = model.get_submodule(param_name[: -len(".weight")])
            w = module.weight
            return (fmt.bytes_per_group(w.n_levels, w.group_size) + 4) / w.group_size
        return super().param_element_size(model, param_name, param)

    def get_quantize_ops(self):
        return TurboQuantize(self)

    # -- after loading -------------------------------------------------------------------------------------------
    def _process_model_after_weight_loading(self, model, **kwargs):
        if self.conversion_failures:
            raise ValueError("TurboQuant could not quantize: " + "; ".join(self.conversion_failures.values()))
        for name, module in model.named_modules():
            if isinstance(module, TurboQuantLinear) and module.awaiting_weight_dtype is not None:
                raise ckpt.CheckpointError(f"checkpoint is missing {name}.weight (needed to quantize {name})")
            if isinstance(module, TurboQuantWeight):
                for attr, shape in module.expected_shapes().items():
                    t = getattr(module, attr)
                    if t.is_meta or tuple(t.shape) != shape:
                        raise ckpt.CheckpointError(
                            f"{name}.{attr}: expected shape {shape}, got {tuple(t.shape)} on {t.device}"
                        )
        for p in model.parameters():
            p.requires_grad_(False)
        _install_save_hook(model)
        return model

    # -- saving --------------------------------------------------------------------------------------------------
    def is_serializable(self, *args, **kwargs):
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True


def describe_quantized_model(model) -> dict:
    """The `tq_config.json` that describes `model`'s TurboQuant layers."""
    cfg = model.config.quantization_config
    if isinstance(cfg, dict):
        cfg = TurboQuantConfig.from_dict(cfg)
    layers, orig_in_dims = 0, {}
    for name, module in model.named_modules():
        if isinstance(module, TurboQuantWeight):
            layers += 1
            if module.in_features % module.group_size:
                orig_in_dims[name] = module.in_features
    out = {
        "format": fmt.FORMAT_NAME,
        "bits": cfg.bits,
        "group_size": cfg.group_size,
        "quantizer_seed": fmt.QUANTIZER_SEED,
        "compressed_layers": layers,
        "original_model": getattr(model, "_turboquant_original_model", None),
    }
    if cfg.sensitive_patterns:
        out["sensitive_bits"] = cfg.sensitive_bits
        out["sensitive_patterns"] = list(cfg.sensitive_patterns)
    if cfg.module_bits:
        out["module_bits"] = dict(cfg.module_bits)
    if cfg.modules_to_not_convert is not None:
        out["modules_to_not_convert"] = list(cfg.modules_to_not_convert)
    if orig_in_dims:
        out["orig_in_dims"] = orig_in_dims
    return out


def _save_pretrained_with_tq_config(self, save_directory, *args, **kwargs):
    result = type(self).save_pretrained(self, save_directory, *args, **kwargs)
    is_main = kwargs.get("is_main_process", True)
    if is_main and not os.path.isfile(save_directory):
        path = os.path.join(save_directory, fmt.TQ_CONFIG_NAME)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(describe_quantized_model(self), f, indent=2)
        os.replace(tmp, path)
    return result


def _install_save_hook(model) -> None:
    # transformers has no save hook for quantizers; an instance attribute keeps the class (and its name) intact.
    model.save_pretrained = types.MethodType(_save_pretrained_with_tq_config, model)
