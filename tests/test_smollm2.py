"""The real SmolLM2-135M (pretrained weights from the package registry): structure, round trip, quality."""

import copy
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from turboquant_hf import TurboQuantConfig, TurboQuantLinear
from turboquant_hf.reporting.evaluation import (
    compare_log_probs,
    tokenize_text,
    window_log_probs,
)

ref_ops = pytest.importorskip("turboquant_vllm.torch_ops")

TOKENS = 1024


@pytest.fixture(scope="module")
def base(smollm2_dir):
    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def ids(smollm2_dir, shakespeare):
    return tokenize_text(AutoTokenizer.from_pretrained(smollm2_dir), shakespeare, TOKENS)


@pytest.fixture(scope="module")
def base_log_probs(base, ids):
    return window_log_probs(base, ids)


@pytest.fixture(scope="module")
def q3(smollm2_dir):
    return AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32, quantization_config=TurboQuantConfig(bits=3)
    )


def _reference_quant_dequant(base, bits, group_size=128):
    """The independent reference's quantize -> dequantize of every decoder Linear (rows zero-padded to G)."""
    model = copy.deepcopy(base)
    q = ref_ops.PolarQuantTorch(group_size, bits, seed=42, device="cpu")
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name != "lm_head":
            w = m.weight.data
            rows, in_features = w.shape
            padded = -(-in_features // group_size) * group_size
            wp = torch.nn.functional.pad(w, (0, padded - in_features)).reshape(-1, group_size)
            idx, norms = q.quantize(wp, norm_correction=True)
            m.weight.data = q.dequantize(idx, norms).reshape(rows, padded)[:, :in_features].contiguous()
    return model


def test_structure_and_footprint(base, q3):
    quantized = [n for n, m in q3.named_modules() if isinstance(m, TurboQuantLinear)]
    assert len(quantized) == 30 * 7
    assert not any(type(m) is torch.nn.Linear for n, m in q3.named_modules() if n.startswith("model.layers"))
    assert torch.equal(q3.model.embed_tokens.weight, base.model.embed_tokens.weight)
    assert q3.config.tie_word_embeddings and q3.lm_head.weight is q3.model.embed_tokens.weight
    packed = sum(
        m.weight.tq_packed.numel() + 4 * m.weight.tq_norms.numel()
        for m in q3.modules() if isinstance(m, TurboQuantLinear)
    )
    plain = sum(p.numel() * p.element_size() for p in q3.parameters())  # embeddings and norms (lm_head tied)
    assert q3.get_memory_footprint() == packed + plain + sum(b.numel() * b.element_size() for n, b in q3.named_buffers()
                                                             if not n.endswith((".tq_packed", ".tq_norms")))
    # 3-bit G=128: 48 packed bytes + a float32 norm per group of each row (576-wide inputs pad to 640)
    assert packed == sum(
        m.out_features * -(-m.in_features // 128) * (48 + 4) for m in q3.modules() if isinstance(m, TurboQuantLinear)
    )


def test_save_reload_bit_identical(q3, ids, tmp_path):
    q3.save_pretrained(tmp_path)
    assert os.path.getsize(tmp_path / "model.safetensors") < 0.45 * 4 * 134.5e6  # vs the float32 model
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        a = q3(ids[None, :128]).logits
        b = again(ids[None, :128]).logits
    assert torch.equal(a, b)


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_quality_equals_reference_algorithm(smollm2_dir, base, base_log_probs, ids, bits):
    """Perplexity and KL against the base on Shakespeare; the same algorithm in the reference package must give
    the same numbers (1 % slack covers float rounding of the rotation and the different product order)."""
    ours = AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32, quantization_config=TurboQuantConfig(bits=bits)
    )
    mine = compare_log_probs(base_log_probs, window_log_probs(ours, ids), ids)
    ref = compare_log_probs(base_log_probs, window_log_probs(_reference_quant_dequant(base, bits), ids), ids)
    print(f"bits={bits} ours={mine} reference={ref}")
    assert mine.tokens == TOKENS - 1
    assert mine.quantized_perplexity <= ref.quantized_perplexity * 1.01
    assert mine.mean_kl <= ref.mean_kl * 1.01
    # and more bits is better: a sanity bound from the measured table in the README
    assert mine.mean_kl < {4: 0.6, 3: 1.8, 2: 7.0}[bits]
    assert mine.quantized_perplexity > mine.base_perplexity
