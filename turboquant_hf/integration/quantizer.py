"""`TurboQuantHfQuantizer`: the loader hooks transformers calls. The math lives in codec/modules."""

from __future__ import annotations

import torch
from torch import nn
from transformers.quantizers.base import HfQuantizer
from transformers.utils import logging

from .. import settings
from ..format import checkpoint as ckpt
from ..format import codec
from ..format import constants as fmt
from ..modeling.modules import TurboQuantWeight, to_norms_dtype
from ..quantization import planning
from ..quantization.config import TurboQuantConfig
from . import mlx, offload, patches, saving, tensor_parallel
from .fusion import fuse_projections

logger = logging.get_logger(__name__)

try:  # transformers >= 5
    from transformers.core_model_loading import ConversionOps
except ImportError as e:  # pragma: no cover - guarded by setup.py's requirement
    raise ImportError("turboquant_hf needs transformers >= 5.17") from e


class QuantizeOnLoad(ConversionOps):
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
            if tuple(value.shape) != target.checkpoint_shape and not tensor_parallel.is_local_slice(target, value):
                self.hf_quantizer.conversion_failures[key] = (
                    f"{key}: checkpoint tensor has shape {tuple(value.shape)}, the model expects "
                    f"{target.checkpoint_shape}"
                )
                continue
            value = tensor_parallel.local_source(target, value)  # one rank's slice under tensor parallelism
            if target.source_transposed:  # (in, out) or (E, in, out): quantized as (out, in) rows
                value = value.transpose(-1, -2)
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
        # calibrated rounding or a bit budget: the model loads in float and is quantized after loading
        self.deferred = False

    # -- environment ---------------------------------------------------------------------------------------------
    def validate_environment(self, *args, **kwargs):
        """Every device_map works: layers offloaded to "disk" keep their packed tensors (buffers) in CPU memory
        unless `offload_buffers=True`, which offloads them too (see `offload.onload_weights_with_owner`)."""

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
            plan = planning.from_checkpoint(model, self.checkpoint_index, self.quantization_config)
            self.dequantize_into = plan.dequantize_into
        else:
            plan = planning.from_config(model, self.quantization_config, logger=logger)
            kept = planning.kept_summary(plan)
            if not plan.linears and not plan.experts:
                raise ValueError(
                    f"TurboQuant: {type(model).__name__} has no layer this version quantizes (nn.Linear, GPT-2 Conv1D "
                    "or fused MoE experts) outside modules_to_not_convert; nothing would be quantized"
                    + (f". Kept in full precision: {kept}" if kept else ""))
            if kept:
                logger.warning("TurboQuant: kept in full precision: %s", kept)
            config = self.quantization_config
            if config.calibration is not None or config.target_bits_per_weight is not None:
                self.deferred = True
                self.modules_to_not_convert = None
                model._turboquant_original_model = getattr(model.config, "_name_or_path", None)
                return
        self.modules_to_not_convert = None
        plan.apply(model, awaiting_weights=not self.pre_quantized)
        if not self.pre_quantized:
            patches.answer_placeholder_lookups(model)
        _route_parallel_plans(model)
        model._turboquant_original_model = getattr(model.config, "_name_or_path", None)

    def _prepare_mlx_checkpoint(self, model) -> None:
        """A turboquant-mlx checkpoint: plan its modules, and read every tensor ourselves after loading."""
        from collections import Counter

        
        config = model.config
        layout = mlx.MLXLayout(self.checkpoint_index, model_type=getattr(config, "model_type", None))
        plan = layout.plan(model)
        self.pre_quantized = True
        if self.quantization_config.format != fmt.HADAMARD_FORMAT:
            # (config.json without its MLX quantization block): describe what the files hold
            tiers = Counter((i["levels"], i["group_size"]) for i in layout.quantized.values())
            (levels, group_size), _ = tiers.most_common(1)[0]
            self.quantization_config = TurboQuantConfig(bits=fmt.bits_for_levels(levels), group_size=group_size,
                                                        format=fmt.HADAMARD_FORMAT)
            config.quantization_config = self.quantization_config
        self.modules_to_not_convert = None
        plan.apply(model, awaiting_weights=False)
        unexpected, missing = layout.ignore_patterns()
        model._keys_to_ignore_on_load_unexpected = set(model._keys_to_ignore_on_load_unexpected or ()) | unexpected
        model._keys_to_ignore_on_load_missing = set(model._keys_to_ignore_on_load_missing or ()) | missing
        self.mlx_layout = layout
        _route_parallel_plans(model)  # (whole-row rotations: refused by name under tp_plan)
        model._turboquant_original_model = getattr(config, "_name_or_path", None)

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
        return QuantizeOnLoad(self)

    # -- after loading -------------------------------------------------------------------------------------------
    def _process_model_after_weight_loading(self, model, **kwargs):
        model.__dict__.pop("_turboquant_quantizer", None)
        if self.mlx_layout is not None:
            self.mlx_layout.load_into(model)
            # the MLX block would describe the saved files wrongly; quantization_config describes them
            model.config.__dict__.pop("quantization", None)
        self.raise_conversion_failures()
        if self.deferred:
            if getattr(model, "_tp_size", None) not in (None, 1):
                raise ValueError(
                    "TurboQuant: calibration and target_bits_per_weight quantize after loading, which tensor "
                    "parallelism (tp_plan) does not support: quantize in one process, save_pretrained, and load the "
                    "saved checkpoint with tp_plan"
                )
            from ..calibration.quantize_loaded import (
                quantize_after_loading,  # (calibration and budgets: loaded when used)
            )

            quantize_after_loading(model, self.quantization_config)
        tensor_parallel.load_shards(model, self.checkpoint_index)
        offloaded = offload.disk_offloaded_modules(model)
        offload.onload_weights_with_owner(model)
        for name, module in model.named_modules():
            if isinstance(module, TurboQuantWeight) and module.awaiting_dtype is not None:
                raise ckpt.CheckpointError(f"checkpoint is missing {name} (needed to quantize it)")
            if isinstance(module, TurboQuantWeight):
                for attr, shape in module.expected_shapes().items():
                    t = getattr(module, attr)
                    got = module.packed_shape() if attr == "tq_packed" else tuple(t.shape)
                    if (t.is_meta and not offload.under(name, offloaded)) or got != shape:
                        raise ckpt.CheckpointError(
                            f"{name}.{attr}: expected shape {shape}, got {got} on {t.device}"
                        )
        patches.end_placeholder_lookups(model)
        for module in model.modules():  # weights on a GPU: the kernels' runtime layout (`runtime_layout.wanted`)
            if isinstance(module, TurboQuantWeight):
                module.use_runtime_layout_()
        self._restore_requested_dtype(model)
        self._dequantize_into_parameters(model)
        # q/k/v and gate/up as one op each on a GPU (not for one rank's slices: their forward is tensor_parallel's)
        if settings.fuse_projections() and not tensor_parallel.sharded_weights(model):
            fuse_projections(model, device_type="cuda")
        saving.drop_expert_converters(model)
        for p in model.parameters():
            p.requires_grad_(False)
        sharded = bool(tensor_parallel.sharded_weights(model))
        patches.patch_model(model, refuse_saving=tensor_parallel.refuse_saving_slices if sharded else None)
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

    # -- dequantize() --------------------------------------------------------------------------------------------
    def _dequantize(self, model, dtype=None):
        """`model.dequantize()`: every TurboQuant module becomes the plain module it replaced, holding the weights it
        computed with, in `dtype`; the model then saves as an ordinary checkpoint."""
        from .dequantization import restore_plain_modules

        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        restore_plain_modules(model, dtype if isinstance(dtype, torch.dtype) else torch.float32)
        patches.unpatch_model(model)
        return model

    # -- saving --------------------------------------------------------------------------------------------------
    def is_serializable(self, *args, **kwargs):
        return True

    @property
    def is_trainable(self) -> bool:
        """Adapters train on a frozen TurboQuant base (`turboquant_hf.integration.lora`)."""
        return True

    @property
    def is_compileable(self) -> bool:
        return True


def _route_parallel_plans(model) -> None:
    """TurboQuant modules under the model's tp and expert plans, when a `distributed_config` puts them in use
    (`tensor_parallel.route_parallel_plans`; the styles are wrapped by `patches.wrap_parallel_styles`)."""
    styles = tensor_parallel.route_parallel_plans(model)
    if styles:
        patches.wrap_parallel_styles(styles)
