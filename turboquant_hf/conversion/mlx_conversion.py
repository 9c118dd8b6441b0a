"""turboquant-mlx models (whole-row Hadamard rotation, loaded by `mlx`) converted to tq3_native in place: each
module's effective weight quantized again with the per-group rotation, the error this adds measured."""

from __future__ import annotations

import math
from collections import Counter

import torch
from torch import nn

from ..format import codec
from ..format import constants as fmt
from ..integration.mlx import EXPERT_PROJECTIONS
from ..modeling.modules import TurboQuantExperts, TurboQuantLinear
from ..quantization.config import TurboQuantConfig


def _native_group_size(group_size: int) -> int:
    return group_size if group_size in fmt.GROUP_SIZES else fmt.GROUP_SIZES[0]


def _relative(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(||a - b||^2, ||b||^2) in float64."""
    return float((a.double() - b.double()).pow(2).sum()), float(b.double().pow(2).sum())


def to_tq3_native(model: nn.Module, group_size: int | None = None) -> dict:
    """Requantize every whole-row-Hadamard module of `model` (loaded from a turboquant-mlx checkpoint) into the
    tq3_native layout, in place, keeping each module's tier (ternary, 2, 3 or 4 bits). Lossy: each effective
    weight is quantized again. Returns the measured error added, per layer and overall
    (`||W_native - W_mlx|| / ||W_mlx||`).

    `group_size`: tq3_native's G (64, 128, 256); default: each module's own when valid, else 64."""
    if group_size is not None:
        fmt.check_group_size(group_size)
    layers, total_err, total_ref = [], 0.0, 0.0
    tiers = Counter()

    def requantize(name, source: torch.Tensor, bits, g):
        nonlocal total_err, total_ref
        packed, norms = codec.quantize_weight(source, bits, g, name=name)
        native = codec.dequantize_weight(packed, norms, source.shape[-1], g).view(source.shape)
        err, ref = _relative(native, source)
        total_err, total_ref = total_err + err, total_ref + ref
        layers.append({"name": name, "bits": bits, "group_size": g,
                       "relative_error": math.sqrt(err / ref) if ref else 0.0})
        tiers[bits, g] += source.numel()
        return packed, norms

    for name, module in list(model.named_modules()):
        if isinstance(module, TurboQuantLinear) and module.weight.rotation == "hadamard":
            w = module.weight
            g = group_size or _native_group_size(w.group_size)
            bias = module.bias
            new = TurboQuantLinear(module.in_features, module.out_features, bias=bias is not None, bits=w.bits,
                                   group_size=g, dtype=bias.dtype if bias is not None else torch.float32,
                                   device=w.device)
            if bias is not None:
                new.bias = bias
            new.weight.load_packed_(*requantize(name + ".weight", w.dequantize(), w.bits, g))
            model.set_submodule(name, new)
        elif isinstance(module, TurboQuantExperts) and module.rotation == "hadamard":
            parts = {leaf: getattr(module, leaf) for leaf in EXPERT_PROJECTIONS}
            e, h, i = module.num_experts, module.hidden_size, module.intermediate_size
            g = group_size or _native_group_size(parts["gate_proj"].group_size)
            gate_up = torch.cat([parts["gate_proj"].dequantize().view(e, i, h),
                                 parts["up_proj"].dequantize().view(e, i, h)], dim=1)
            # tq3_native fuses gate and up into one tensor of one tier: the finer of the two
            gu_bits = max(parts["gate_proj"].bits, parts["up_proj"].bits)
            down_bits = parts["down_proj"].bits
            new = TurboQuantExperts(e, h, i, gu_bits, down_bits, g, module.activation, device=parts["down_proj"].device)
            new.gate_up_proj.load_packed_(*requantize(name + ".gate_up_proj", gate_up, gu_bits, g))
            new.down_proj.load_packed_(*requantize(name + ".down_proj", parts["down_proj"].dequantize().view(e, h, i),
                                                   down_bits, g))
            model.set_submodule(name, new)
    if not layers:
        raise ValueError("the model holds no whole-row-Hadamard (turboquant-mlx) modules to convert")
    (bits, g), _ = tiers.most_common(1)[0]
    cfg = TurboQuantConfig(bits=bits, group_size=g)
    model.config.quantization_config = cfg
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.quantization_config = cfg
    return {"layers": layers, "relative_error": math.sqrt(total_err / total_ref) if total_ref else 0.0,
            "max_relative_error": max(x["relative_error"] for x in layers)}
