"""What turboquant_hf replaces in transformers (turboquant_hf/integration/patches.py), and its registration.

The census (`tests/patched_attributes.py`, in a fresh process) compares every attribute of transformers' and
PEFT's modules and classes, and every item of their dicts (the registries), before and after a run that quantizes,
saves, reloads, fine-tunes and dequantizes tiny models: what changed must be exactly what patches.py names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest

from turboquant_hf.integration import patches, registration
from turboquant_hf.integration.quantizer import TurboQuantHfQuantizer
from turboquant_hf.quantization.config import QUANT_METHOD, TurboQuantConfig

HERE = os.path.dirname(os.path.abspath(__file__))
REGISTRY = "transformers.quantizers.auto"
OUR_ENTRIES = {f"{REGISTRY}.AUTO_QUANTIZATION_CONFIG_MAPPING['turboquant']",
               f"{REGISTRY}.AUTO_QUANTIZER_MAPPING['turboquant']"}


def _census(tmp_path, autoload: bool) -> dict:
    env = dict(os.environ, TURBOQUANT_AUTOLOAD="1" if autoload else "0", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "patched_attributes.py"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("autoload", [False, True], ids=["plain", "start-up-hook"])
def test_replaced_attributes_are_the_documented_ones(tmp_path, autoload):
    """Replaced: the two process-wide patches patches.py names (and, when the start-up hook registered its
    stand-ins first, those registry entries, now this package's classes); added: the `turboquant` entries of the
    quantizer registry; on each loaded TurboQuant model: the methods patches.py names, none left once dequantized.
    Nothing of PEFT's, and no parallel style (no tp plan in use)."""
    found = _census(tmp_path, autoload)
    expected = set(patches.PROCESS_WIDE) | (OUR_ENTRIES if autoload else set())
    assert set(found["replaced"]) == expected, found["transformers"]
    assert set(found["added"]) == (set() if autoload else OUR_ENTRIES)
    on_models = found["on_models"]
    assert on_models.pop("llama reloaded") == []  # dequantized: an ordinary model again
    assert on_models and all(names == sorted(patches.ON_MODELS) for names in on_models.values()), on_models


def test_census_sees_a_replacement(monkeypatch):
    """The census's comparison finds a replaced class attribute, a replaced registry item and a deleted one."""
    import patched_attributes
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES
    from transformers.quantizers import auto

    before = patched_attributes._snapshot()
    monkeypatch.setattr(auto.AutoHfQuantizer, "supports_quant_method", staticmethod(lambda d: True))
    monkeypatch.setitem(type(ALL_PARALLEL_STYLES)._global_mapping, "colwise", object())
    monkeypatch.delitem(auto.AUTO_QUANTIZATION_CONFIG_MAPPING, "bitsandbytes_4bit")
    after = patched_attributes._snapshot()
    replaced = {k for k, v in before.items() if k not in after or after[k] is not v}
    parallel = f"{type(ALL_PARALLEL_STYLES).__module__}.{type(ALL_PARALLEL_STYLES).__name__}._global_mapping['colwise']"
    assert replaced == {f"{REGISTRY}.AutoHfQuantizer.supports_quant_method", parallel,
                        f"{REGISTRY}.AUTO_QUANTIZATION_CONFIG_MAPPING['bitsandbytes_4bit']"}


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
