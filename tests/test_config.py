"""TurboQuantConfig: validation, per-module bits, serialisation."""

import json

import pytest
from transformers import AutoConfig
from transformers.quantizers.auto import AutoQuantizationConfig

from turboquant_hf import TurboQuantConfig


def test_round_trip_to_dict_from_dict():
    cfg = TurboQuantConfig(
        bits=3,
        group_size=64,
        modules_to_not_convert=["lm_head", "mlp.gate"],
        module_bits={r"\.v_proj$": 4, "down_proj": 4},
        sensitive_bits=4,
        sensitive_patterns=["o_proj"],
    )
    d = json.loads(json.dumps(cfg.to_dict()))
    again = TurboQuantConfig.from_dict(d)
    assert again.to_dict() == d
    assert d["quant_method"] == "turboquant" and d["group_size"] == 64
    auto = AutoQuantizationConfig.from_dict(d)
    assert isinstance(auto, TurboQuantConfig) and auto.to_dict() == d


def test_legacy_dict_accepted():
    cfg = TurboQuantConfig.from_dict({"quant_method": "turboquant", "bits": 3, "group_size": 128})
    assert (cfg.bits, cfg.group_size, cfg.modules_to_not_convert) == (3, 128, None)


def test_bits_for_module_order():
    cfg = TurboQuantConfig(bits=3, module_bits={r"layers\.0\..*v_proj": 2, "v_proj": 4},
                           sensitive_bits=4, sensitive_patterns=["down_proj"])
    assert cfg.bits_for("model.layers.0.self_attn.v_proj") == 2
    assert cfg.bits_for("model.layers.1.self_attn.v_proj") == 4
    assert cfg.bits_for("model.layers.1.mlp.down_proj") == 4
    assert cfg.bits_for("model.layers.1.mlp.up_proj") == 3
    assert TurboQuantConfig(bits="ternary").bits == 1.58


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"bits": 5}, "bits must be one of 2, 3, 4 or 1.58"),
        ({"group_size": 32}, "group_size must be one of 64, 128, 256"),
        ({"module_bits": {"v_proj": 6}}, "bits must be one of"),
        ({"module_bits": {"(": 4}}, "not a valid regex"),
        ({"format": "mlx"}, "format 'mlx' is not supported"),
        ({"quantizer_seed": 7}, "quantizer_seed 7 is not supported"),
        ({"rotation": "planar"}, "unsupported setting.*rotation"),
        ({"sensitive_patterns": ["o_proj"]}, "needs sensitive_bits"),
    ],
)
def test_bad_settings_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TurboQuantConfig(**kwargs)


def test_config_json_with_unsupported_setting_fails_on_load(tiny_llama_dir, tmp_path):
    import shutil

    from transformers import AutoModelForCausalLM

    d = tmp_path / "ckpt"
    shutil.copytree(tiny_llama_dir, d)
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "turboquant", "bits": 3, "group_size": 128, "kv_bits": 4}
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported setting.*kv_bits"):
        AutoModelForCausalLM.from_pretrained(d)
    assert AutoConfig.from_pretrained(tiny_llama_dir).model_type == "llama"
