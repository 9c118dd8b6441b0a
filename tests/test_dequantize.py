"""`model.dequantize()` and `turboquant-hf dequantize`: every TurboQuant module back to the plain module it
replaced, holding the weights it computed with; the result is an ordinary checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from turboquant_hf import TurboQuantConfig, TurboQuantExperts, TurboQuantLinear
from turboquant_hf.cli import commands as cli

IDS = torch.randint(3, 256, (2, 10), generator=torch.Generator().manual_seed(3))
# float32 logits of the dequantized model against the packed one: the same weights, multiplied in another order
RTOL = 1e-4


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()


def _close(a, b):
    return ((a - b).norm() / b.norm()).item() < RTOL


def _plain_reload_in_fresh_process(directory: str, expected: torch.Tensor, tmp_path) -> None:
    """Load `directory` with transformers alone (turboquant_hf never imported) and compare logits."""
    save_file({"logits": expected.contiguous()}, str(tmp_path / "expected.safetensors"))
    code = f"""
import sys, torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({directory!r}, dtype=torch.float32)
assert "turboquant_hf" not in sys.modules
with torch.no_grad():
    got = model(input_ids=torch.tensor({IDS.tolist()})).logits.float()
expected = load_file({str(tmp_path / "expected.safetensors")!r})["logits"]
print(((got - expected).norm() / expected.norm()).item())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tempfile.gettempdir(),
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.split()[-1]) < RTOL


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    from conftest import tiny_qwen3_5_moe_model

    d = str(tmp_path_factory.mktemp("qwen"))
    tiny_qwen3_5_moe_model().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def transposed_dirs(tmp_path_factory):
    """Tiny gpt-oss and Llama 4 (text) models, whose experts transformers stores [E, in, out] (gpt-oss: interleaved
    gate/up, biases)."""
    from conftest import spread_weights_
    from test_moe import gpt_oss, llama4

    out = {}
    for kind, build in (("gpt_oss", gpt_oss), ("llama4", llama4)):
        torch.manual_seed(0)
        model = spread_weights_(build())
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("_bias"):
                    p.normal_(0, 0.5)
        out[kind] = str(tmp_path_factory.mktemp(kind))
        model.to(torch.bfloat16).save_pretrained(out[kind])
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen3_5_moe", "gpt_oss", "llama4"])
def test_dequantize_round_trip(kind, tiny_llama_dir, qwen_dir, transposed_dirs, tmp_path):
    """Also for experts stored transposed, interleaved and biased (gpt-oss, Llama 4): the dequantized model saves as
    an ordinary checkpoint that transformers alone loads, with the same logits."""
    src = {"llama": tiny_llama_dir, "qwen3_5_moe": qwen_dir}.get(kind) or transposed_dirs[kind]
    q = AutoModelForCausalLM.from_pretrained(src, quantization_config=TurboQuantConfig(bits=3, group_size=64),
                                             dtype=torch.float32)
    expected = _logits(q)
    assert any(isinstance(m, TurboQuantExperts) for m in q.modules()) == (kind != "llama")
    model = q.dequantize()
    assert model is q and not getattr(model, "is_quantized", False)
    assert not any(isinstance(m, (TurboQuantLinear, TurboQuantExperts)) for m in model.modules())
    assert "quantization_config" not in model.config.to_dict()
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())
    assert _close(_logits(model), expected)
    model.save_pretrained(tmp_path / "plain")
    names = load_file(str(tmp_path / "plain" / "model.safetensors")).keys()
    assert not any(".tq_" in n for n in names)
    assert "quantization_config" not in json.load(open(tmp_path / "plain" / "config.json"))
    assert not os.path.exists(tmp_path / "plain" / "tq_config.json")
    _plain_reload_in_fresh_process(str(tmp_path / "plain"), expected, tmp_path)


def test_dequantize_in_bfloat16(tiny_llama_dir):
    q = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=TurboQuantConfig(bits=4))
    model = q.dequantize(dtype=torch.bfloat16)
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16


def test_cli_dequantize(tiny_llama_dir, tmp_path, capsys):
    assert cli.main(["quantize", tiny_llama_dir, "--out", str(tmp_path / "q"), "--bits", "3"]) == 0
    quantized = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32)
    expected = _logits(quantized)
    assert cli.main(["dequantize", str(tmp_path / "q"), "--out", str(tmp_path / "plain"), "--dtype", "float32"]) == 0
    assert os.path.isfile(tmp_path / "plain" / "tokenizer.json")
    _plain_reload_in_fresh_process(str(tmp_path / "plain"), expected, tmp_path)
    # the output exists: refused without --force
    assert cli.main(["dequantize", str(tmp_path / "q"), "--out", str(tmp_path / "plain")]) == cli.EXIT_USAGE
