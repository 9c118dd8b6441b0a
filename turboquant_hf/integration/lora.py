"""LoRA adapters on TurboQuant layers (QLoRA-style fine-tuning with PEFT).

The packed base weight stays frozen; the adapter's `lora_B(lora_A(x))` is added to the base output, and the
gradient flows through the base layer into earlier layers through `turboquant::linear`'s backward
(`ops.turboquant_linear_input_grad`). PEFT is told about the layer type through its custom-module mechanism
(`LoraConfig._register_custom_module`), which `register` applies to a config:

    from peft import LoraConfig, get_peft_model
    import turboquant_hf.lora

    config = turboquant_hf.lora.register(LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    model = get_peft_model(model, config)                     # or turboquant_hf.lora.get_peft_model(model, config)
    ...
    model = turboquant_hf.lora.load_adapter(base, "adapter")  # a saved adapter onto a TurboQuant base

The plain recipe, `peft.get_peft_model(model, LoraConfig(...))` (what TRL's `SFTTrainer(peft_config=...)` calls),
cannot work unchanged without changing PEFT: its dispatch takes layer types it does not know only from the config
itself (`_register_custom_module`, per config object), and it has no registry or hook a package could fill once.
Its refusal ("Target module ... is not supported") shows the layer as `str(layer)`, which names the fix
(`TurboQuantLinear.__str__`): pass `turboquant_hf.lora.register(LoraConfig(...))` instead, to TRL as well.
`target_modules="all-linear"` finds no TurboQuant layer (PEFT expands it to `nn.Linear` and `Conv1D` modules
only): name the projections.

DoRA (`LoraConfig(use_dora=True)`) works the same way: PEFT's DoRA layer, given the rebuilt base weight for its
per-row norms. `merge_and_unload()` merges into a dequantized layer: the base weight is rebuilt from its packed
form, the adapter's update added (and, for DoRA, each row rescaled to its learned magnitude), and the layer becomes
a plain `nn.Linear` (`unmerge` gives the packed layer back).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

try:
    from peft.tuners.lora import LoraConfig
    from peft.tuners.lora.dora import DoraLinearLayer
    from peft.tuners.lora.layer import LoraLayer
    from peft.tuners.lora.variants import DoraLinearVariant
    from peft.tuners.tuners_utils import check_adapters_to_merge
except ImportError as e:  # pragma: no cover - peft is optional
    raise ImportError("turboquant_hf.lora needs the peft package: pip install peft") from e

from ..modeling.modules import TurboQuantLinear


class TurboQuantLoraLinear(nn.Module, LoraLayer):
    """A LoRA adapter around a `TurboQuantLinear` (or, once merged, the plain `nn.Linear` it became)."""

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: LoraConfig, r: int = 0,
                 lora_alpha: int = 1, **kwargs) -> None:
        if config.lora_bias:
            raise ValueError("TurboQuantLoraLinear does not support lora_bias; set it to False")
        super().__init__()
        LoraLayer.__init__(self, base_layer)
        self.fan_in_fan_out = False
        self._quantized_base: TurboQuantLinear | None = None
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config)

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        return module.in_features, module.out_features

    def _get_base_layer_device_and_dtype(self, base_layer):
        """The device of the packed weight; no dtype (the adapter keeps its own, float32 unless cast)."""
        if isinstance(base_layer, TurboQuantLinear):
            return base_layer.weight.tq_packed.device, None
        return super()._get_base_layer_device_and_dtype(base_layer)

    def resolve_lora_variant(self, *, config: LoraConfig, **kwargs):
        if getattr(config, "velora_config", None) is not None:
            raise ValueError("VeLoRA is not supported on TurboQuant layers; use LoRA or DoRA")
        return TurboQuantDoraVariant() if config.use_dora else None

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        return (self.lora_B[adapter].weight @ self.lora_A[adapter].weight) * self.scaling[adapter]

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Merge into a dequantized layer: the packed base becomes an `nn.Linear` holding its weights plus the
        adapters' updates (the packed layer is kept for `unmerge`)."""
        adapter_names = check_adapters_to_merge(self, adapter_names)
        if not adapter_names:
            return
        base = self.get_base_layer()
        if isinstance(base, TurboQuantLinear):
            dtype = base.bias.dtype if base.bias is not None else self.lora_A[adapter_names[0]].weight.dtype
            plain = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None,
                              device=base.weight.device, dtype=dtype)
            plain.weight = nn.Parameter(base.weight.dequantize(dtype), requires_grad=False)
            if base.bias is not None:
                plain.bias = nn.Parameter(base.bias.detach().clone(), requires_grad=False)
            self._quantized_base = base
            self.base_layer = base = plain
        for adapter in adapter_names:
            if adapter not in self.lora_A:
                continue
            delta = self.get_delta_weight(adapter).to(base.weight.dtype)
            merged = base.weight.data + delta
            if adapter in self.lora_variant:  # DoRA: rescaled to the learned magnitude of each output row
                magnitude = self.lora_magnitude_vector[adapter]
                norm = magnitude.get_weight_norm(base.weight.data, delta, scaling=1).detach()
                merged = (magnitude.weight / norm).view(-1, 1).to(merged.dtype) * merged
            if safe_merge and not torch.isfinite(merged).all():
                raise ValueError(f"NaNs detected in the merged weights. The adapter {adapter} seems to be broken")
            base.weight.data = merged
            self.merged_adapters.append(adapter)

    def unmerge(self) -> None:
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
            return
        self.merged_adapters.clear()
        if self._quantized_base is not None:
            self.base_layer, self._quantized_base = self._quantized_base, None

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        self._check_forward_args(x, *args, **kwargs)
        if kwargs.pop("adapter_names", None) is not None:
            raise ValueError("TurboQuantLoraLinear does not support mixed adapter batches (adapter_names)")
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        result = self.base_layer(x, *args, **kwargs)
        if self.merged:
            return result
        for adapter in self.active_adapters:
            if adapter not in self.lora_A:
                continue
            lora_A, lora_B = self.lora_A[adapter], self.lora_B[adapter]
            xa = self._cast_input_dtype(x, lora_A.weight.dtype)
            if adapter in self.lora_variant:
                result = self.lora_variant[adapter].forward(self, active_adapter=adapter, x=xa, result=result)
                continue
            update = lora_B(lora_A(self.lora_dropout[adapter](xa)))
            result = result + (update * self.scaling[adapter]).to(result.dtype)
        return result

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


class _DequantizedView:
    """What PEFT's DoRA layer reads of a base layer: its weight as one tensor (the packed weight rebuilt, in
    float32) and its bias."""

    def __init__(self, layer: TurboQuantLinear):
        self.layer = layer

    @property
    def weight(self) -> torch.Tensor:
        return self.layer.weight.dequantize(torch.float32)

    @property
    def bias(self):
        return self.layer.bias

    def parameters(self):
        return self.layer.parameters()


class TurboQuantDoraVariant(DoraLinearVariant):
    """PEFT's DoRA on a TurboQuant base: the same layer and formulas, given the base's rebuilt weight (for the
    per-row weight norm) through `_DequantizedView`."""

    @staticmethod
    def init(module: TurboQuantLoraLinear, adapter_name: str, **kwargs) -> None:
        if not module.lora_magnitude_vector:
            module.adapter_layer_names = module.adapter_layer_names[:] + ("lora_magnitude_vector",)
        dora_layer = DoraLinearLayer(fan_in_fan_out=False)
        dora_layer.update_layer(base_layer=_DequantizedView(module.get_base_layer()),
                                lora_A=module.lora_A[adapter_name].weight, lora_B=module.lora_B[adapter_name].weight,
                                scaling=module.scaling[adapter_name])
        module.lora_magnitude_vector[adapter_name] = dora_layer

    @staticmethod
    def forward(module: TurboQuantLoraLinear, active_adapter: str, x: torch.Tensor, result: torch.Tensor,
                **kwargs) -> torch.Tensor:
        dropout = module.lora_dropout[active_adapter]
        base_result = result if isinstance(dropout, nn.Identity) or not module.training else None
        base = module.get_base_layer()
        return result + module.lora_magnitude_vector[active_adapter](
            dropout(x) if base_result is None else x, lora_A=module.lora_A[active_adapter],
            lora_B=module.lora_B[active_adapter], scaling=module.scaling[active_adapter],
            base_layer=_DequantizedView(base) if isinstance(base, TurboQuantLinear) else base,
            base_result=base_result, adapter_name=active_adapter).to(result.dtype)


def register(config: LoraConfig) -> LoraConfig:
    """Tell PEFT to wrap `TurboQuantLinear` targets of `config` in `TurboQuantLoraLinear`; returns `config`."""
    config._register_custom_module({TurboQuantLinear: TurboQuantLoraLinear})
    return config


def get_peft_model(model, config: LoraConfig, **kwargs):
    """`peft.get_peft_model` with the TurboQuant layers registered in `config`."""
    import peft

    return peft.get_peft_model(model, register(config), **kwargs)


def load_adapter(model, adapter: str, is_trainable: bool = False, **kwargs):
    """`PeftModel.from_pretrained(model, adapter)` onto a TurboQuant base (a folder or Hub repo of an adapter)."""
    from peft import PeftConfig, PeftModel

    config = register(PeftConfig.from_pretrained(adapter, **{k: v for k, v in kwargs.items() if k in ("revision",
                                                                                                     "token")}))
    return PeftModel.from_pretrained(model, adapter, config=config, is_trainable=is_trainable, **kwargs)
