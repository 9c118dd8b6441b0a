"""turboquant_hf's registration with transformers' quantizer registry."""

from __future__ import annotations

import warnings

import pytest

from turboquant_hf import registration
from turboquant_hf.config import QUANT_METHOD, TurboQuantConfig
from turboquant_hf.quantizer import TurboQuantHfQuantizer


class ForeignConfig:  # (another package's `turboquant`: its module is not turboquant_hf)
    pass


class ForeignQuantizer:
    pass


def _tables():
    from transformers.quantizers import auto

    return auto.AUTO_QUANTIZATION_CONFIG_MAPPING, auto.AUTO_QUANTIZER_MAPPING


@pytest.mark.parametrize("which", ["config", "quantizer", "both"])
def test_registration_leaves_another_packages_entry_in_place(monkeypatch, which):
    configs, quantizers = _tables()
    if which in ("config", "both"):
        monkeypatch.setitem(configs, QUANT_METHOD, ForeignConfig)
    if which in ("quantizer", "both"):
        monkeypatch.setitem(quantizers, QUANT_METHOD, ForeignQuantizer)
    before = (dict(configs), dict(quantizers))
    with pytest.warns(UserWarning, match=r"already has a 'turboquant' quantization method \(test_patches\.Foreign"):
        assert registration.register() is False
    after = (dict(configs), dict(quantizers))
    for b, a in zip(before, after):
        assert a.keys() == b.keys() and all(a[k] is b[k] for k in b)


def test_registration_is_idempotent_and_replaces_only_its_own(monkeypatch):
    """Registering again changes nothing; the start-up hook's stand-ins (ours) are replaced by the real classes,
    every other entry staying the same object."""
    import turboquant_hf_autoload
    from transformers.quantizers import auto

    configs, quantizers = _tables()
    others = ({k: v for k, v in configs.items() if k != QUANT_METHOD},
              {k: v for k, v in quantizers.items() if k != QUANT_METHOD})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert registration.register() is True and registration.register() is True
    assert configs[QUANT_METHOD] is TurboQuantConfig and quantizers[QUANT_METHOD] is TurboQuantHfQuantizer
    monkeypatch.delitem(configs, QUANT_METHOD)
    monkeypatch.delitem(quantizers, QUANT_METHOD)
    turboquant_hf_autoload.register_stand_ins(auto)
    assert configs[QUANT_METHOD].__module__ == "turboquant_hf_autoload"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert registration.register() is True
    assert configs[QUANT_METHOD] is TurboQuantConfig and quantizers[QUANT_METHOD] is TurboQuantHfQuantizer
    for table, other in zip((configs, quantizers), others):
        assert {k: v for k, v in table.items() if k != QUANT_METHOD}.keys() == other.keys()
        assert all(table[k] is v for k, v in other.items())
