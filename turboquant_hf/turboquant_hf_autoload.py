"""The start-up hook that makes an installed turboquant_hf known to transformers in programs that never import it.

Installed as the top-level module `turboquant_hf_autoload` and run by `turboquant_hf.pth` (site-packages) when
Python starts. It imports nothing but `sys` and `os` and adds one meta-path finder that waits for
`transformers.quantizers.auto` (transformers' quantizer registry) to be imported. Once that module has run, the
`turboquant` method is registered there through transformers' public `register_quantization_config` /
`register_quantizer`, as two stand-ins that import `turboquant_hf` the first time a TurboQuant checkpoint's
quantization config is read (at that point `turboquant_hf.register` replaces them with the real classes and
installs its load checks). A process that never imports transformers pays one string comparison per import; one
that never loads a TurboQuant checkpoint never imports turboquant_hf.

`TURBOQUANT_AUTOLOAD=0` in the environment turns the hook off. Checkpoints in the published form without a
`quantization_config` in config.json (only a `tq_config.json`) still need `import turboquant_hf`.
"""

from __future__ import annotations

import os
import sys

QUANT_METHOD = "turboquant"
_REGISTRY = "transformers.quantizers.auto"


def enabled() -> bool:
    return os.environ.get("TURBOQUANT_AUTOLOAD", "1").strip().lower() not in ("0", "false", "no", "off")


def _real():
    import turboquant_hf  # (registers the real classes in place of the stand-ins)

    return turboquant_hf


def register_stand_ins(auto) -> None:
    """Register the `turboquant` stand-ins in transformers' registry module `auto` (nothing if the method is
    registered already, by turboquant_hf itself or by an earlier call)."""
    from transformers.quantizers.base import HfQuantizer
    from transformers.utils.quantization_config import QuantizationConfigMixin

    class TurboQuantConfigStandIn(QuantizationConfigMixin):
        """Reads a `turboquant` quantization config by importing turboquant_hf (`turboquant_hf_autoload`)."""

        @classmethod
        def from_dict(cls, config_dict, return_unused_kwargs=False, **kwargs):
            return _real().TurboQuantConfig.from_dict(config_dict, return_unused_kwargs=return_unused_kwargs,
                                                      **kwargs)

    class TurboQuantQuantizerStandIn(HfQuantizer):
        """Builds turboquant_hf's quantizer (`turboquant_hf_autoload`)."""

        def __new__(cls, quantization_config, **kwargs):
            return _real().TurboQuantHfQuantizer(quantization_config, **kwargs)

    if QUANT_METHOD not in auto.AUTO_QUANTIZATION_CONFIG_MAPPING:
        auto.register_quantization_config(QUANT_METHOD)(TurboQuantConfigStandIn)
    if QUANT_METHOD not in auto.AUTO_QUANTIZER_MAPPING:
        auto.register_quantizer(QUANT_METHOD)(TurboQuantQuantizerStandIn)


class _Loader:
    """The registry module's own loader, with the stand-ins registered right after the module has run."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            register_stand_ins(module)
        except Exception as exc:  # noqa: BLE001  (never break importing transformers)
            import warnings

            warnings.warn(f"turboquant_hf_autoload: TurboQuant checkpoints need `import turboquant_hf` ({exc!r})")

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _Finder:
    """A one-shot meta-path finder for transformers' quantizer registry module."""

    def find_spec(self, name, path=None, target=None):
        if name != _REGISTRY:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Wait for transformers' registry (or register at once if it is already imported); idempotent."""
    if not enabled():
        return
    if _REGISTRY in sys.modules:
        register_stand_ins(sys.modules[_REGISTRY])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
