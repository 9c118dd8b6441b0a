"""The generated model card: metadata, true numbers, sections, and save_pretrained writing it."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import yaml

from turboquant_hf import TurboQuantConfig
from turboquant_hf.reporting import card as tq_card
from turboquant_hf.reporting import model_shape

SECTIONS = ["## Size", "## How to use", "## Memory plan", "## Recipe", "## Limitations", "## Citation"]


def _front(text):
    m = re.match(r"^---\n(.*?)\n---\n", text, re.S)
    assert m
    return yaml.safe_load(m.group(1))


@pytest.fixture(scope="module")
def base_with_card(tiny_llama_dir, tmp_path_factory):
    """The tiny base with a model card of its own (a custom licence), as a downloaded snapshot would have."""
    d = str(tmp_path_factory.mktemp("base_with_card"))
    shutil.copytree(tiny_llama_dir, d, dirs_exist_ok=True)
    with open(os.path.join(d, "README.md"), "w") as f:
        f.write("---\nlicense: other\nlicense_name: tiny-license\nlicense_link: https://example.org/LICENSE\n"
                "language:\n- en\n- fr\n---\n# Tiny\n")
    return d


@pytest.fixture(scope="module")
def mixed_dir(base_with_card, tmp_path_factory):
    """Saved with plain save_pretrained: 3 bits, down_proj at 4 (a second tier), lm_head in full precision."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        base_with_card, quantization_config=TurboQuantConfig(bits=3, module_bits={"down_proj": 4})
    )
    d = str(tmp_path_factory.mktemp("mixed"))
    model.save_pretrained(d, base_model="tester/tiny-base")
    return d


def test_save_pretrained_writes_the_card(mixed_dir):
    text = open(os.path.join(mixed_dir, "README.md"), encoding="utf-8").read()
    positions = [text.index(s) for s in SECTIONS]
    assert positions == sorted(positions)
    assert "## Quality" not in text  # no evaluation was run
    assert "{{" not in text and "{%" not in text and "None" not in text
    front = _front(text)
    assert front["base_model"] == "tester/tiny-base" and front["base_model_relation"] == "quantized"
    # copied from the base model's own card (the source folder's README.md)
    assert front["license"] == "other" and front["license_name"] == "tiny-license"
    assert front["license_link"] == "https://example.org/LICENSE" and front["language"] == ["en", "fr"]
    assert front["library_name"] == "transformers" and front["pipeline_tag"] == "text-generation"
    assert {"turboquant", "quantized", "3-bit", "4-bit"} <= set(front["tags"])
    from huggingface_hub import ModelCard, ModelCardData

    ModelCardData(**front, ignore_metadata_errors=False)
    assert ModelCard(text).data.base_model == "tester/tiny-base"
    assert "TurboQuant: Online Vector Quantization" in text and "Linearity Theorem" in text
    assert "ICLR" in text and "NAACL" in text
    build = json.load(open(os.path.join(mixed_dir, tq_card.BUILD_NAME)))
    assert "transformers" in build["versions"] and "torch" in build["versions"]


def test_card_numbers_match_the_files(mixed_dir):
    from safetensors import safe_open

    per_bits, fp = {}, 0
    with safe_open(os.path.join(mixed_dir, "model.safetensors"), "pt") as f:
        for k in f.keys():
            t = f.get_tensor(k)
            if k.endswith(".tq_packed"):
                norms = f.get_tensor(k.replace(".tq_packed", ".tq_norms"))
                bits = {48: 3, 64: 4}[t.shape[1]]  # bytes per group of 128
                in_features = 352 if "down_proj" in k else 128  # tiny Llama: MLP 352 (padded to 384), hidden 128
                b = per_bits.setdefault(bits, [0, 0, 0])
                b[0] += 1
                b[1] += norms.shape[0] * in_features
                b[2] += t.numel() + 4 * norms.numel()
            elif not k.endswith(".tq_norms"):
                fp += t.numel() * t.element_size()
    s = tq_card.checkpoint_summary(mixed_dir)
    assert {t["bits"]: [t["layers"], t["params"], t["bytes"]] for t in s["tiers"]} == per_bits
    assert per_bits[4][0] == 2 and per_bits[3][0] == 12
    assert s["full_precision_bytes"] == fp
    total = fp + sum(b[2] for b in per_bits.values())
    assert s["total_bytes"] == total
    text = open(os.path.join(mixed_dir, "README.md"), encoding="utf-8").read()
    h = tq_card.human_bytes
    for bits, (layers, params, nbytes) in per_bits.items():
        assert f"| {bits}-bit | {layers} | {tq_card.human_count(params)} | {h(nbytes)} | " \
               f"{round(8 * nbytes / params, 3)} |" in text
    assert f"**{h(total)}**" in text
    assert "`lm_head.weight`" in text  # stays in full precision, and the card says so
    # memory plan: 2 layers x 2 KV heads x 32 x 2 x 2 bytes
    assert "| KV cache per token (bf16) | 512 bytes |" in text
    qc = json.load(open(os.path.join(mixed_dir, "config.json")))["quantization_config"]
    assert json.dumps(qc, indent=2) in text
    assert "module_bits={'down_proj': 4}" in text


def test_card_states_the_gpu_size_of_ternary_weights(base_with_card, mixed_dir, tmp_path):
    """Ternary tensors: a GPU holds them as 2-bit codes (32 instead of 26 bytes a group of 128), and the card's
    memory plan says so with the exact size; a checkpoint without ternary tensors gets no such row."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        base_with_card, quantization_config=TurboQuantConfig(bits=3, module_bits={"down_proj": 1.58}))
    d = str(tmp_path / "ternary")
    model.save_pretrained(d)
    s = tq_card.checkpoint_summary(d)
    # tiny Llama: 2 layers of down_proj, 128 rows over 352 inputs = 3 groups of 128; 6 more bytes a group
    assert s["gpu_bytes"] - s["total_bytes"] == 2 * 128 * 3 * (32 - 26)
    text = open(os.path.join(d, "README.md"), encoding="utf-8").read()
    assert f"| weights on a GPU (ternary as 2-bit codes) | {tq_card.human_bytes(s['gpu_bytes'])} |" in text
    assert "TURBOQUANT_COMPACT_TERNARY=1" in text
    plain = open(os.path.join(mixed_dir, "README.md"), encoding="utf-8").read()
    assert "weights on a GPU" not in plain and "TURBOQUANT_COMPACT_TERNARY" not in plain
    assert tq_card.checkpoint_summary(mixed_dir)["gpu_bytes"] == tq_card.checkpoint_summary(mixed_dir)["total_bytes"]


def test_quality_section_comes_from_the_eval_record(mixed_dir, tmp_path):
    d = str(tmp_path / "m")
    shutil.copytree(mixed_dir, d)
    record = {"tokens": 1023, "base_perplexity": 21.987654, "quantized_perplexity": 25.5, "mean_kl": 0.123456,
              "text": "hamlet.txt", "window": 512, "dtype": "float32"}
    with open(os.path.join(d, tq_card.EVAL_NAME), "w") as f:
        json.dump(record, f)
    tq_card.write_card(d, repo_id="tester/m")
    text = open(os.path.join(d, "README.md"), encoding="utf-8").read()
    assert "## Quality" in text and "1,023 predicted tokens of `hamlet.txt`" in text
    assert "| perplexity | 21.988 | 25.500 |" in text and "| 0 | 0.1235 |" in text
    assert 'from_pretrained("tester/m"' in text


def test_quality_section_shows_top1_agreement_and_the_calibration_source(mixed_dir, tmp_path):
    d = str(tmp_path / "m")
    shutil.copytree(mixed_dir, d)
    with open(os.path.join(d, tq_card.EVAL_NAME), "w") as f:
        json.dump({"tokens": 2047, "base_perplexity": 20.0, "quantized_perplexity": 22.0, "mean_kl": 0.1,
                   "top1_agreement": 0.81234, "text": "hamlet_gut.txt", "window": 512, "dtype": "float32"}, f)
    text = tq_card.render_card(d, repo_id="tester/m")
    assert "| top-1 agreement with the base (same most likely next token) | 100% | 81.2% |" in text
    assert "Rounded to the nearest codebook value (no calibration data)." in text
    with open(os.path.join(d, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"]["calibrated_with"] = {
        "kind": "text-file", "source": "othello_gut.txt", "source_sha256": "ab" * 32, "samples": 128,
        "sequence_length": 512, "tokens": 65536, "seed": 0, "method": "gptq-rotated"}
    with open(os.path.join(d, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    text = tq_card.render_card(d, repo_id="tester/m")
    assert ("Calibrated (gptq-rotated) on `othello_gut.txt` (sha256 abababababab…): 128 sequences of 512 tokens "
            "(65,536 tokens), seed 0.") in text
    assert "no calibration data" not in text
    distilled = dict(config["quantization_config"]["calibrated_with"], distilled={
        "steps": 40, "train_sequences": 12, "held_out_sequences": 4, "top_tokens": 64, "held_out_kl_before": 0.19,
        "held_out_kl_after": 0.15, "kept": True})
    assert tq_card.calibration_text(distilled).endswith(
        " Then 40 distillation steps tuned the group norms and the vector parameters kept in full precision to the "
        "base model's next-token distributions on 12 of the sequences (mean KL on the other 4, over each position's "
        "64 likeliest tokens: 0.19 before, 0.15 after).")
    distilled["distilled"]["kept"] = False  # (undone: the card says nothing of it)
    assert "distillation" not in tq_card.calibration_text(distilled)
    free = {"kind": "data-free", "prompts": ["", "The"], "sampling": {"temperature": 1.0, "top_p": 0.95},
            "samples": 32, "sequence_length": 512, "tokens": 16384, "seed": 0}
    assert tq_card.calibration_text(free) == (
        "Calibrated on text the base model wrote itself (data-free mode: sampled from BOS alone, `The`; temperature "
        "1.0, top_p 0.95): 32 sequences of 512 tokens (16,384 tokens), seed 0.")


def test_save_pretrained_model_card_opt_out(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=TurboQuantConfig(bits=4))
    model.save_pretrained(str(tmp_path), model_card=False)
    assert not (tmp_path / "README.md").exists()
    assert (tmp_path / "tq_config.json").exists()
    # without a Hub id for the base (a local folder), the card makes no base_model claim
    text = tq_card.render_card(str(tmp_path))
    front = _front(text)
    assert "base_model" not in front and "base_model_relation" not in front
    assert "Quantized from a local checkpoint" in text


def test_memory_helpers():
    text = {"num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
            "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
    by_interval = {"text_config": text}
    by_types = {"text_config": dict(text, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 10)}
    del by_types["text_config"]["full_attention_interval"]
    for cfg in (by_interval, by_types):
        assert model_shape.kv_cache_per_token(cfg, 2)["bytes"] == 20480
        assert model_shape.recurrent_state_bytes(cfg, 2)["layers"] == 30
    llama = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    assert model_shape.kv_cache_per_token(llama, 2)["bytes"] == 30 * 3 * 64 * 2 * 2
    assert model_shape.recurrent_state_bytes(llama)["bytes"] == 0


def test_not_a_turboquant_checkpoint(tiny_llama_dir, tmp_path):
    with pytest.raises(tq_card.CardError, match="not a TurboQuant checkpoint"):
        tq_card.render_card(tiny_llama_dir)
    with pytest.raises(tq_card.CardError, match="no config.json"):
        tq_card.render_card(str(tmp_path))
