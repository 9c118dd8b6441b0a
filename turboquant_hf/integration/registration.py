"""Registration of the `turboquant` method with transformers' quantizer registry."""

from __future__ import annotations

import warnings

from ..quantization.config import QUANT_METHOD, TurboQuantConfig
from .quantizer import TurboQuantHfQuantizer

# Modules whose classes are this package's own: an earlier copy of its classes (a reloaded module), or the stand-ins
# that the start-up hook registers until the package is imported (`turboquant_hf_autoload`).
_OURS = ("turboquant_hf", "turboquant_hf_autoload")


def _ours(entry) -> bool:
    return (getattr(entry, "__module__", None) or "").split(".")[0] in _OURS


def register() -> bool:
    """Make transformers resolve `quant_method="turboquant"` to this package and install its patches
    (`integration.patches`); idempotent. An entry under that name that is not this package's (another package,
    or a future transformers release, registered its own) is left in place, with a warning: returns False then."""
    from transformers.quantizers import auto

    tables = ((auto.AUTO_QUANTIZATION_CONFIG_MAPPING, auto.register_quantization_config, TurboQuantConfig),
              (auto.AUTO_QUANTIZER_MAPPING, auto.register_quantizer, TurboQuantHfQuantizer))
    foreign = [table[QUANT_METHOD] for table, _, _ in tables
               if QUANT_METHOD in table and not _ours(table[QUANT_METHOD])]
    if foreign:
        names = ", ".join(f"{c.__module__}.{getattr(c, '__qualname__', c)}" for c in foreign)
        warnings.warn(f"turboquant_hf: transformers already has a {QUANT_METHOD!r} quantization method ({names}); "
                      "it is left in place, and this package's TurboQuantConfig and quantizer are not registered",
                      stacklevel=2)
        return False
    for table, register_with, cls in tables:
        if table.get(QUANT_METHOD) is not cls:
            table.pop(QUANT_METHOD, None)  # (ours: a stand-in or an earlier copy; transformers refuses a second one)
            register_with(QUANT_METHOD)(cls)
    from . import patches

    patches.install()
    return True
