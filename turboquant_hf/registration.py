"""Registration of the `turboquant` method with transformers' quantizer registry."""

from __future__ import annotations

from .config import QUANT_METHOD, TurboQuantConfig
from .quantizer import TurboQuantHfQuantizer


def register() -> None:
    """Make transformers resolve `quant_method="turboquant"` to this package (idempotent)."""
    from transformers.quantizers import auto

    if auto.AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD) is not TurboQuantConfig:
        if QUANT_METHOD in auto.AUTO_QUANTIZATION_CONFIG_MAPPING:
            del auto.AUTO_QUANTIZATION_CONFIG_MAPPING[QUANT_METHOD]
        auto.register_quantization_config(QUANT_METHOD)(TurboQuantConfig)
    if auto.AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is not TurboQuantHfQuantizer:
        if QUANT_METHOD in auto.AUTO_QUANTIZER_MAPPING:
            del auto.AUTO_QUANTIZER_MAPPING[QUANT_METHOD]
        auto.register_quantizer(QUANT_METHOD)(TurboQuantHfQuantizer)
    from . import patches

    patches.install()
