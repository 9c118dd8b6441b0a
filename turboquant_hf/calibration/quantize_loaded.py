"""Quantizing a model loaded in float, after transformers has read its weights: bit budgets
(`target_bits_per_weight`), then calibrated rounding or round-to-nearest, and the record of the data used."""

from __future__ import annotations

import re

from transformers.utils import logging

from ..quantization import planning
from ..quantization.config import CalibrationConfig, TurboQuantConfig
from . import distillation
from .budget import allocate_bits
from .data import calibration_batches, describe
from .sequential import calibrate_model, resolve_options, rtn_quantize

logger = logging.get_logger(__name__)


def quantize_after_loading(model, config: TurboQuantConfig) -> None:
    """Quantize a model loaded in float: bits allocated under `config.target_bits_per_weight`, then calibrated
    rounding (`config.calibration`, each block tuned after its rounding with `CalibrationConfig.block_steps`) or
    round-to-nearest, then distillation (`CalibrationConfig.distill_steps`);
    the data used and what each step did are recorded in `config.calibrated_with`."""
    cal = config.calibration if config.calibration is not None else CalibrationConfig()
    resolve_options(cal.options)  # a bad option is reported before any work
    batches = calibration_batches(cal, model)
    distilling = config.calibration is not None and cal.distill_steps > 0
    if distilling:
        distillation.held_out(len(batches))  # (too few sequences: refused before any work)
    allocation = None
    if config.target_bits_per_weight is not None:
        allocation = {}
        chosen = allocate_bits(model, config, batches, report=allocation)
        config.module_bits = {**{f"^{re.escape(name)}$": bits for name, bits in chosen.items()},
                              **config.module_bits}
        logger.info("TurboQuant: bits allocated by the %s measure%s", allocation["measure"],
                    "".join(f"; mean KL on the calibration batches, {m}: {v:.4f}"
                            for m, v in allocation.get("kl", {}).items()))
    targets = distillation.teacher_targets(model, batches) if distilling else None
    record = describe(cal, batches)
    if allocation is not None:
        record["bit_allocation"] = {"measure": allocation["measure"],
                                    **{f"kl_{m}": round(v, 6) for m, v in allocation.get("kl", {}).items()}}
    if config.calibration is not None:
        summary = calibrate_model(model, config, batches)
        record.update(method=summary["method"], damping=summary["damping"])
        if summary["options"]:
            record["options"] = summary["options"]
        logger.info("TurboQuant: calibrated %d blocks in %.1f s", summary["blocks"], summary["seconds"])
        if "block_tuned" in summary:
            record["block_tuned"] = t = summary["block_tuned"]
            logger.info("TurboQuant: %d steps a block tuned %d of %d blocks: relative error of the block outputs "
                        "on the checking sequences %.4f -> %.4f", t["steps"], t["kept"], t["blocks"],
                        t["error_before"], t["error_after"])
    else:
        rtn_quantize(model, planning.from_config(model, config))
        record["method"] = "round-to-nearest"
    if targets is not None:
        record["distilled"] = distillation.distill(model, batches, targets, cal.distill_steps, cal.distill_lr)
        d = record["distilled"]
        logger.info("TurboQuant: %d distillation steps (%.1f s): KL on held-out calibration sequences %.4f -> "
                    "%.4f, %s", d["steps"], d["seconds"], d["held_out_kl_before"], d["held_out_kl_after"],
                    "kept" if d["kept"] else "not lower: the rounded model kept")
    config.calibrated_with = record
