"""TurboQuant weight quantization for Hugging Face transformers.

Importing this package registers the `turboquant` quantization method with
transformers, so `from_pretrained(..., quantization_config=TurboQuantConfig())`
and `from_pretrained(saved_dir)` work.
"""

from __future__ import annotations

from . import format
from .codec import dequantize_weight, quantize_weight
from .config import CalibrationConfig, TurboQuantConfig
from .modules import TurboQuantExperts, TurboQuantLinear, TurboQuantWeight
from .quantizer import TurboQuantHfQuantizer
from .recipes import get_recipe
from .registration import register

__version__ = "0.1.0"

register()

__all__ = [
    "CalibrationConfig",
    "TurboQuantConfig",
    "TurboQuantExperts",
    "TurboQuantHfQuantizer",
    "TurboQuantLinear",
    "TurboQuantWeight",
    "dequantize_weight",
    "format",
    "get_recipe",
    "quantize_weight",
    "register",
]
