"""Rounding chosen from data, and what feeds it: `sequential` (one block of layers at a time), `gptq` (error
feedback in the rotated basis), `budget` (bit widths under `target_bits_per_weight`), `distillation`, `data`
(calibration batches), `quantize_loaded` (a float model after loading) and `calibrate_streaming` (the streaming
converter's pass).

`calibrate_model` and `rtn_quantize` are also here, where `turboquant_hf.calibration` has always given them.
"""

from .sequential import calibrate_model, rtn_quantize

__all__ = ["calibrate_model", "rtn_quantize"]
