"""Calibrated rounding in the streaming converter: the bytes of the in-memory calibrated path, one block resident."""

import json
import os

import pytest
import torch
from conftest import (
    assert_same_tensors,
    safetensors_tensors,
    spread_weights_,
    tiny_qwen3_5_moe_model,
)
from transformers import AutoModelForCausalLM

from turboquant_hf import CalibrationConfig, TurboQuantConfig
from turboquant_hf.calibration.calibrate_streaming import (
    parameters_on_meta,
    resident_bytes,
)
from turboquant_hf.cli import commands as cli
from turboquant_hf.conversion.streaming import ConversionError, StreamingQuantizer


def _batches(n, length=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (1, length), generator=g) for _ in range(n)]


def _config(n=4, **kw):
    cal = CalibrationConfig(data=_batches(n), samples=n, sequence_length=64)
    return TurboQuantConfig(bits=3, group_size=64, calibration=cal, **kw)


def _convert(src, out, cfg, **kw):
    return StreamingQuantizer.from_pretrained(src).quantize(out, quantization_config=cfg, progress=False, **kw)


def _float_bytes(module) -> int:
    return sum(p.numel() * 4 for p in module.parameters())


def test_dense_llama_equals_the_in_memory_path(tiny_llama_dir, tmp_path):
    cfg = _config(module_bits={"down_proj": 4})
    summary = _convert(tiny_llama_dir, tmp_path / "out", cfg, dtype=torch.float32, max_shard_size=200_000)
    ref_cfg = _config(module_bits={"down_proj": 4})
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32, quantization_config=ref_cfg)
    ref.save_pretrained(tmp_path / "ref")
    out = assert_same_tensors(tmp_path / "out", tmp_path / "ref")
    assert len(summary.shards) > 1  # calibrated and copied tensors share shards
    _convert(tiny_llama_dir, tmp_path / "rtn", TurboQuantConfig(bits=3, group_size=64, module_bits={"down_proj": 4}),
             dtype=torch.float32)
    rtn = safetensors_tensors(tmp_path / "rtn")
    assert not torch.equal(out["model.layers.1.mlp.down_proj.weight.tq_packed"],
                           rtn["model.layers.1.mlp.down_proj.weight.tq_packed"])  # calibrated, not rounded
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc == json.loads((tmp_path / "ref" / "config.json").read_text())["quantization_config"]
    assert qc["calibrated_with"]["method"] == "gptq-rotated" and qc["calibrated_with"]["tokens"] == 256
    # resident weights: the embeddings, or one block, never the model
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    buffers = sum(b.numel() * b.element_size() for b in base.buffers())
    embeddings, block = _float_bytes(base.model.embed_tokens), _float_bytes(base.model.layers[0])
    assert summary.calibrated_blocks == 2 and "calibrated 2 blocks" in summary.text()
    assert max(embeddings, block) <= summary.peak_resident_weights <= max(embeddings, block) + buffers
    assert summary.peak_resident_weights < _float_bytes(base) / 2
    with torch.no_grad():
        ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(0))
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
        assert torch.equal(again(ids).logits, ref(ids).logits)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_5_moe"])
def test_moe_equals_the_in_memory_path(kind, tmp_path):
    """Qwen3-MoE from per-expert tensors (fused while streaming) and the multimodal Qwen3.5-MoE (fused experts,
    linear-attention and full-attention blocks with their own masks)."""
    import test_moe

    if kind == "qwen3_moe":
        torch.manual_seed(0)
        spread_weights_(test_moe.qwen3_moe()).to(torch.bfloat16).save_pretrained(tmp_path / "src")
        model_class = AutoModelForCausalLM
    else:
        from transformers import Qwen3_5MoeForConditionalGeneration as model_class

        tiny_qwen3_5_moe_model().save_pretrained(tmp_path / "src")
    summary = _convert(tmp_path / "src", tmp_path / "out", _config(8), dtype=torch.float32)
    model_class.from_pretrained(tmp_path / "src", dtype=torch.float32,
                                quantization_config=_config(8)).save_pretrained(tmp_path / "ref")
    out = assert_same_tensors(tmp_path / "out", tmp_path / "ref")
    assert summary.calibrated_blocks == (2 if kind == "qwen3_moe" else 4)
    assert any(k.endswith("experts.gate_up_proj.tq_packed") for k in out)


def test_cli_streaming_calibration_equals_loading_whole(tiny_llama_dir, tmp_path, capsys):
    """`quantize --calibration FILE`: the streaming converter and the model loaded whole write the same tensors
    (bfloat16, the CLI's default dtype)."""
    text = tmp_path / "calibration.txt"
    text.write_text(" ".join(["the a of to and in is it you that he was for on are with as his they"] * 40))
    args = ["--bits", "3", "--calibration", str(text), "--calibration-samples", "4", "--calibration-length", "32",
            "--json"]
    assert cli.main(["quantize", tiny_llama_dir, "--out", str(tmp_path / "s"), "--streaming", *args]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["calibrated_blocks"] == 2
    assert cli.main(["quantize", tiny_llama_dir, "--out", str(tmp_path / "w"), *args]) == 0
    assert_same_tensors(tmp_path / "s", tmp_path / "w")
    record = json.loads((tmp_path / "s" / "config.json").read_text())["quantization_config"]["calibrated_with"]
    assert record["source"] == "calibration.txt" and record["samples"] == 4


def test_refusals_before_any_work(tiny_llama_dir, tmp_path, capsys):
    with pytest.raises(ConversionError, match="data-free"):
        _convert(tiny_llama_dir, tmp_path / "a", TurboQuantConfig(bits=3, calibration="data-free"))
    with pytest.raises(ConversionError, match="target_bits_per_weight.*gradient"):
        _convert(tiny_llama_dir, tmp_path / "b", TurboQuantConfig(bits=3, target_bits_per_weight=3.5))
    with pytest.raises(ConversionError, match="target_bits_per_weight"):
        _convert(tiny_llama_dir, tmp_path / "c", _config(target_bits_per_weight=3.5))
    with pytest.raises(ConversionError, match="block_steps"):
        _convert(tiny_llama_dir, tmp_path / "tuned", TurboQuantConfig(bits=3, calibration=CalibrationConfig(
            data=_config().calibration.data, block_steps=4)))
    with pytest.raises(ConversionError, match="distill_steps"):
        _convert(tiny_llama_dir, tmp_path / "f", TurboQuantConfig(bits=3, calibration=CalibrationConfig(
            data=_config().calibration.data, distill_steps=4)))
    assert cli.main(["quantize", tiny_llama_dir, "--out", str(tmp_path / "d"), "--streaming", "--calibration",
                     "data-free"]) != 0
    assert "cannot generate text" in capsys.readouterr().err
    assert cli.main(["quantize", tiny_llama_dir, "--out", str(tmp_path / "e"), "--streaming", "--target-bits",
                     "3.5"]) != 0
    assert "--target-bits" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


def test_parameters_on_meta_keep_buffers(tiny_llama_dir):
    from transformers import AutoConfig

    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_llama_dir))
    assert all(p.is_meta for p in model.parameters())
    assert model.model.rotary_emb.inv_freq.device.type == "cpu"
    assert resident_bytes(model) == sum(b.numel() * b.element_size() for b in model.buffers())
    assert not torch.nn.Linear(2, 2).weight.is_meta  # the patch is gone


def test_interrupted_calibration_resumes_to_the_same_bytes(tiny_llama_dir, tmp_path, monkeypatch):
    from turboquant_hf.calibration import calibrate_streaming

    _convert(tiny_llama_dir, tmp_path / "ref", _config(), dtype=torch.float32, max_shard_size=100_000)
    release = calibrate_streaming.StreamingCalibration._release

    def interrupt(self, prefix, module):
        if prefix.endswith(".1"):
            raise KeyboardInterrupt
        release(self, prefix, module)

    monkeypatch.setattr(calibrate_streaming.StreamingCalibration, "_release", interrupt)
    with pytest.raises(KeyboardInterrupt):
        _convert(tiny_llama_dir, tmp_path / "out", _config(), dtype=torch.float32, max_shard_size=100_000)
    assert not (tmp_path / "out").exists() and (tmp_path / ".out.partial").is_dir()
    monkeypatch.setattr(calibrate_streaming.StreamingCalibration, "_release", release)
    with pytest.raises(ConversionError, match="cannot resume.*configuration"):  # other calibration data
        _convert(tiny_llama_dir, tmp_path / "out", _config(n=3), dtype=torch.float32, max_shard_size=100_000,
                 resume=True)
    _convert(tiny_llama_dir, tmp_path / "out", _config(), dtype=torch.float32, max_shard_size=100_000, resume=True)
    assert_same_tensors(tmp_path / "out", tmp_path / "ref")
