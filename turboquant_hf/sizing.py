"""Exact quantized sizes of a model before any weight is loaded (the model may live on the meta device)."""

from __future__ import annotations

from collections import defaultdict

import torch

from . import planning
from .config import TurboQuantConfig
from .modules import TurboQuantWeight


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
