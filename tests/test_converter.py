"""The streaming converter writes what from_pretrained + save_pretrained would, without holding the model."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from turboquant_hf import TurboQuantConfig
from turboquant_hf.checkpoint import CheckpointError
from turboquant_hf.converter import TurboQuantizer


def _tensors(directory):
    out = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, f)))
    return out


def _assert_same_tensors(a_dir, b_dir):
    a, b = _tensors(a_dir), _tensors(b_dir)
    assert a.keys() == b.keys(), set(a) ^ set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_optimum_interface():
    from optimum.quantization_base import OptimumQuantizer

    assert issubclass(TurboQuantizer, OptimumQuantizer)


def test_dense_llama_matches_from_pretrained(tiny_llama_dir, tmp_path):
    cfg = TurboQuantConfig(bits=3, group_size=64, module_bits={"down_proj": 4})
    summary = TurboQuantizer.from_pretrained(tiny_llama_dir).quantize(
        tmp_path / "out", quantization_config=cfg, progress=False, max_shard_size=200_000
    )
    AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=cfg).save_pretrained(tmp_path / "ref")
    _assert_same_tensors(tmp_path / "out", tmp_path / "ref")
    assert len(summary.shards) > 1 and os.path.isfile(tmp_path / "out" / "model.safetensors.index.json")
    assert summary.params_quantized > 0 and summary.bytes_out < summary.bytes_in
    assert os.path.isfile(tmp_path / "out" / "tokenizer.json")
    tq = json.load(open(tmp_path / "out" / "tq_config.json"))
    ref_tq = json.load(open(tmp_path / "ref" / "tq_config.json"))
    assert tq == ref_tq and tq["module_bits"] == {"down_proj": 4}  # original_model: the same source folder
    ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(tmp_path / "out")(ids).logits
        b = AutoModelForCausalLM.from_pretrained(tmp_path / "ref")(ids).logits
    assert torch.equal(a, b)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temporary folder left behind


def test_fused_qwen3_5_moe_matches_from_pretrained(tmp_path):
    from test_moe import qwen3_5_moe
    from transformers import Qwen3_5MoeForConditionalGeneration

    from turboquant_hf.recipes import get_recipe

    torch.manual_seed(0)
    qwen3_5_moe().to(torch.bfloat16).save_pretrained(tmp_path / "src", save_original_format=False)
    cfg = get_recipe("tq3a-tqTe", group_size=64)
    TurboQuantizer.from_pretrained(tmp_path / "src").quantize(tmp_path / "out", quantization_config=cfg,
                                                              progress=False)
    Qwen3_5MoeForConditionalGeneration.from_pretrained(tmp_path / "src", quantization_config=cfg).save_pretrained(
        tmp_path / "ref")
    _assert_same_tensors(tmp_path / "out", tmp_path / "ref")
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj.tq_packed" in _tensors(tmp_path / "out")


def test_refusals_leave_nothing(tiny_llama_dir, tmp_path):
    with pytest.raises(ValueError, match="smaller than the float32 copy of the largest tensor"):
        TurboQuantizer.from_pretrained(tiny_llama_dir).quantize(tmp_path / "out", max_memory=1000, progress=False)
    assert not os.listdir(tmp_path)
    # a NaN half way through: an error naming the tensor, no output and no temporary folder
    src = tmp_path / "src"
    src.mkdir()
    for f in os.listdir(tiny_llama_dir):
        if f != "model.safetensors":
            (src / f).write_bytes(open(os.path.join(tiny_llama_dir, f), "rb").read())
    t = load_file(os.path.join(tiny_llama_dir, "model.safetensors"))
    t["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(t, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*NaN"):
        TurboQuantizer.from_pretrained(src).quantize(tmp_path / "out", progress=False)
    assert sorted(os.listdir(tmp_path)) == ["src"]


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "qwen3_5_moe"])
def test_per_expert_sources_are_fused(kind, tmp_path):
    """Per-expert source tensors are regrouped into the published pre-fused layout, exactly as loading does."""
    import test_moe
    from transformers import Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(0)
    getattr(test_moe, kind)().to(torch.bfloat16).save_pretrained(tmp_path / "src")  # per-expert (default save)
    assert any(".experts.0." in k for k in _tensors(tmp_path / "src"))
    cfg = TurboQuantConfig(bits=3, group_size=64, module_bits={r"experts\.down_proj": 4})
    TurboQuantizer.from_pretrained(tmp_path / "src").quantize(tmp_path / "out", quantization_config=cfg,
                                                              progress=False)
    cls = Qwen3_5MoeForConditionalGeneration if kind == "qwen3_5_moe" else AutoModelForCausalLM
    cls.from_pretrained(tmp_path / "src", quantization_config=cfg).save_pretrained(tmp_path / "ref")
    _assert_same_tensors(tmp_path / "out", tmp_path / "ref")
    out = _tensors(tmp_path / "out")
    assert not any(".experts.0." in k for k in out)
    assert sum(k.endswith("experts.gate_up_proj.tq_packed") for k in out) == (4 if kind == "qwen3_5_moe" else 2)


def test_incomplete_experts_named(tmp_path):
    from test_moe import qwen3_moe

    qwen3_moe().save_pretrained(tmp_path / "src")
    t = load_file(tmp_path / "src" / "model.safetensors")
    del t["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(t, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts: the per-expert tensors"):
        TurboQuantizer.from_pretrained(tmp_path / "src").quantize(tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
