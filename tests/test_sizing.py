"""Exact sizes at full scale without weights: Qwen3.6-35B-A3B's text model on the meta device."""

import pytest

from turboquant_hf.format import constants as fmt
from turboquant_hf.quantization.recipes import get_recipe
from turboquant_hf.reporting.sizing import size_from_config


def _packed(rows, in_features, bits, g=128):
    norm_bytes = 2 if bits == fmt.TERNARY else 4  # float16 norms for the ternary tier, float32 otherwise
    return rows * -(-in_features // g) * (fmt.bytes_per_group(fmt.levels_for_bits(bits), g) + norm_bytes)


def _expected(attn_bits, expert_bits, g=128):
    """Bytes by hand from the published architecture (hidden 2048, 40 layers: 30 GatedDeltaNet + 10 attention,
    256 experts of 512, shared expert 512, vocab 248320), independent of the module code."""
    h, e, i = 2048, 256, 512
    per_linear = 0
    per_full = 0
    # GatedDeltaNet: in_proj_qkv (2*16*128 + 32*128 = 8192), in_proj_z (4096), in_proj_b/a (32), out_proj 4096->2048
    per_linear += _packed(8192, h, attn_bits, g) + _packed(4096, h, attn_bits, g)
    per_linear += 2 * _packed(32, h, attn_bits, g) + _packed(h, 4096, attn_bits, g)
    # attention: q_proj (16 heads * 256 * 2 for the output gate), k/v (2 * 256), o_proj 4096 -> 2048
    per_full += _packed(8192, h, attn_bits, g) + 2 * _packed(512, h, attn_bits, g) + _packed(h, 4096, attn_bits, g)
    moe = _packed(e * 2 * i, h, expert_bits, g) + _packed(e * h, i, expert_bits, g)
    shared = 2 * _packed(512, h, attn_bits, g) + _packed(h, 512, attn_bits, g)
    quantized = 30 * per_linear + 10 * per_full + 40 * (moe + shared)
    # full precision, bf16: embeddings, lm_head, routers, shared_expert_gate, norms, conv1d, A_log, dt_bias, ...
    return quantized


@pytest.mark.parametrize("recipe, attn_bits, expert_bits", [("tq3", 3, 3), ("tq3a-tqTe", 3, fmt.TERNARY)])
def test_qwen3_6_35b_a3b_sizes(recipe, attn_bits, expert_bits):
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    report = size_from_config(Qwen3_5MoeTextConfig(), get_recipe(recipe))
    quantized = sum(t["bytes"] for t in report["tiers"].values())
    assert quantized == _expected(attn_bits, expert_bits)
    fp = report["full_precision"]
    # embeddings and lm_head dominate what stays in bf16: 2 * 248320 * 2048 * 2 bytes
    assert 2 * 248320 * 2048 * 2 < fp["bytes"] < 2 * 248320 * 2048 * 2 * 1.05
    tiers = ", ".join(
        "%s-bit %.3f bpw over %.2fB weights" % (b, t["bits_per_weight"], t["weights"] / 1e9)
        for b, t in report["tiers"].items()
    )
    print(f"\n{recipe}: total {report['total_bytes'] / 1e9:.2f} GB; quantized {quantized / 1e9:.2f} GB ({tiers}); "
          f"full precision {fp['bytes'] / 1e9:.2f} GB")
