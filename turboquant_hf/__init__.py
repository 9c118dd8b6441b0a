"""TurboQuant weight quantization for Hugging Face transformers.

Importing this package registers the `turboquant` quantization method with
transformers, so `from_pretrained(..., quantization_config=TurboQuantConfig())`
and `from_pretrained(saved_dir)` work.
"""

from __future__ import annotations

from . import checkpoint, codec, config, format, modules, ops, quantizer, recipes  # noqa: F401  (old paths)
from .calibration.gptq import gptq_rotated
from .calibration.sequential import calibrate_model
from .format.codec import dequantize_weight, quantize_weight
from .integration.quantizer import TurboQuantHfQuantizer
from .integration.registration import register
from .modeling.modules import TurboQuantExperts, TurboQuantLinear, TurboQuantWeight
from .quantization.config import CalibrationConfig, TurboQuantConfig
from .quantization.recipes import get_recipe

__version__ = "0.1.0"

register()

__all__ = [
    "CalibrationConfig",
    "TurboQuantConfig",
    "TurboQuantExperts",
    "TurboQuantHfQuantizer",
    "TurboQuantLinear",
    "TurboQuantWeight",
    "calibrate_model",
    "dequantize_weight",
    "format",
    "get_recipe",
    "gptq_rotated",
    "quantize_weight",
    "register",
]
