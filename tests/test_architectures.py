"""Coverage over the model families transformers ships: each built from a tiny config (weights spread as a trained
model's are), quantized on the fly at 4 bits, then checked the way a user relies on it — how many of its
Linears and fused experts became TurboQuant modules (and that whatever stays in full precision is a head, a
router, a vision tower or a layer the plan names with its reason), the saved checkpoint reloads bit-exactly with
the same logits, the quantized logits match the dequantized model's, and generation runs.

    python tests/test_architectures.py      # the table of docs/architectures.md, with seconds per architecture
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from turboquant_hf import TurboQuantConfig, TurboQuantExperts, TurboQuantLinear
from turboquant_hf.modeling.modules import linear_kind
from turboquant_hf.quantization import planning
from turboquant_hf.quantization.config import DEFAULT_MODULES_TO_NOT_CONVERT

_DIMS = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
_HEAD16 = dict(_DIMS, head_dim=16)
_MOE = dict(num_local_experts=4, num_experts_per_tok=2)


@dataclass(frozen=True)
class Arch:
    config: str  # a transformers config class
    model: str  # the task model class
    kwargs: dict
    linears: int  # TurboQuantLinear modules the quantized model holds
    experts: int = 0  # TurboQuantExperts modules
    kind: str = "causal"  # causal | seq2seq | classifier | image-text
    sub_configs: dict = field(default_factory=dict)  # name -> (config class, kwargs)


ARCHS = {
    "Llama": Arch("LlamaConfig", "LlamaForCausalLM", _DIMS, 14),
    "Mistral": Arch("MistralConfig", "MistralForCausalLM", _DIMS, 14),
    "Qwen2": Arch("Qwen2Config", "Qwen2ForCausalLM", _DIMS, 14),
    "Qwen3": Arch("Qwen3Config", "Qwen3ForCausalLM", _HEAD16, 14),
    "Qwen3-MoE": Arch("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                      dict(_HEAD16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64), 8, 2),
    "Qwen3.5-MoE (multimodal)": Arch("", "Qwen3_5MoeForConditionalGeneration", {}, 0, 0, "qwen3_5_moe"),
    "Gemma 2": Arch("Gemma2Config", "Gemma2ForCausalLM", _HEAD16, 14),
    "Gemma 3 (text)": Arch("Gemma3TextConfig", "Gemma3ForCausalLM", _HEAD16, 14),
    "Gemma 3 (multimodal)": Arch(
        "Gemma3Config", "Gemma3ForConditionalGeneration",
        dict(mm_tokens_per_image=4, image_token_index=255, boi_token_index=253, eoi_token_index=254), 14,
        kind="image-text",
        sub_configs=dict(text_config=("Gemma3TextConfig", _HEAD16),
                         vision_config=("SiglipVisionConfig", dict(hidden_size=32, intermediate_size=64,
                                                                   num_hidden_layers=1, num_attention_heads=2,
                                                                   image_size=32, patch_size=8)))),
    "Phi-3": Arch("Phi3Config", "Phi3ForCausalLM", dict(_DIMS, pad_token_id=0), 8),
    "PhiMoE": Arch("PhimoeConfig", "PhimoeForCausalLM", dict(_DIMS, **_MOE), 8, 2),
    "Mixtral": Arch("MixtralConfig", "MixtralForCausalLM", dict(_DIMS, **_MOE), 8, 2),
    "OLMo 2": Arch("Olmo2Config", "Olmo2ForCausalLM", _DIMS, 14),
    "OLMoE": Arch("OlmoeConfig", "OlmoeForCausalLM", dict(_DIMS, num_experts=4, num_experts_per_tok=2), 8, 2),
    "GPT-2": Arch("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4), 8),
    "GPT-NeoX": Arch("GPTNeoXConfig", "GPTNeoXForCausalLM", _DIMS, 8),
    "Falcon": Arch("FalconConfig", "FalconForCausalLM",
                   dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        new_decoder_architecture=True, num_kv_heads=2), 8),
    "OPT": Arch("OPTConfig", "OPTForCausalLM",
                dict(vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                     word_embed_proj_dim=64), 12),
    "BLOOM": Arch("BloomConfig", "BloomForCausalLM", dict(vocab_size=256, hidden_size=64, n_layer=2, n_head=4), 8),
    "GPT-OSS": Arch("GptOssConfig", "GptOssForCausalLM", dict(_HEAD16, **_MOE), 8, 2),
    "DeepSeek-V3": Arch("DeepseekV3Config", "DeepseekV3ForCausalLM",
                        dict(_DIMS, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                             topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32,
                             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16), 16, 1),
    "GLM-4-MoE": Arch("Glm4MoeConfig", "Glm4MoeForCausalLM",
                      dict(_HEAD16, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                           topk_group=1, first_k_dense_replace=1), 14, 1),
    "Granite": Arch("GraniteConfig", "GraniteForCausalLM", _DIMS, 14),
    "GraniteMoE": Arch("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(_DIMS, **_MOE), 8, 2),
    "Llama 4 (text)": Arch("Llama4TextConfig", "Llama4ForCausalLM",
                           dict(_HEAD16, intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1), 14, 2),
    "Ernie 4.5-MoE": Arch("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
                          dict(_DIMS, moe_intermediate_size=64, moe_num_experts=4, moe_k=2), 14, 1),
    "BERT (classification)": Arch("BertConfig", "BertForSequenceClassification",
                                  dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4), 13, kind="classifier"),
    "T5": Arch("T5Config", "T5ForConditionalGeneration",
               dict(vocab_size=256, d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, decoder_start_token_id=0,
                    pad_token_id=0), 28, kind="seq2seq"),
}


def build(name: str):
    """The architecture's model from its tiny config, seeded, weights spread, in bfloat16."""
    import transformers
    from conftest import spread_weights_

    arch = ARCHS[name]
    torch.manual_seed(0)
    if arch.kind == "qwen3_5_moe":
        from conftest import tiny_qwen3_5_moe_model

        return tiny_qwen3_5_moe_model()
    kwargs = dict(arch.kwargs)
    for key, (cls, sub) in arch.sub_configs.items():
        kwargs[key] = getattr(transformers, cls)(**sub).to_dict()
    config = getattr(transformers, arch.config)(**kwargs)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        if isinstance(getattr(config, attr, None), int) and getattr(config, attr) >= 250:
            setattr(config, attr, 2)
    return spread_weights_(getattr(transformers, arch.model)(config)).to(torch.bfloat16)


def inputs(name: str, model) -> dict:
    ids = torch.arange(3, 19).view(1, -1) % 250
    kind = ARCHS[name].kind
    if kind == "seq2seq":
        return dict(input_ids=ids, decoder_input_ids=ids[:, :5])
    return dict(input_ids=ids)


def full_precision_reason(name: str, model, plan) -> str | None:
    """Why a Linear stays in full precision: a head, a router or vision tower (the default skip list), a layer the
    plan names; None when nothing explains it."""
    if name in plan.kept:
        return plan.kept[name]
    if name in planning.head_modules(model) or name in planning.tied_linears(model):
        return "output head"
    if planning.matches_any(name, DEFAULT_MODULES_TO_NOT_CONVERT):
        return "default skip list (" + next(p for p in DEFAULT_MODULES_TO_NOT_CONVERT
                                           if planning.matches_any(name, [p])) + ")"
    return None


def _logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits.float()


def check(name: str, tmp_path) -> dict:
    """Every check of the module docstring on one architecture; returns its row of the table."""
    t0 = time.perf_counter()
    arch = ARCHS[name]
    model = build(name)
    cls = type(model)
    plan = planning.from_config(model, TurboQuantConfig(bits=4))
    candidates = [n for n, m in model.named_modules() if linear_kind(m)]
    experts = [n for n, m in model.named_modules() if n.rpartition(".")[2] == "experts" and
               not isinstance(m, nn.ModuleList)]
    unexplained = [n for n in candidates if n not in plan.linears and full_precision_reason(n, model, plan) is None]
    assert not unexplained, f"{name}: Linears left in full precision for no stated reason: {unexplained}"
    assert set(experts) == set(plan.experts), f"{name}: experts left in full precision: {set(experts) - set(plan.experts)}"
    model.save_pretrained(tmp_path / "float")
    del model

    quantized = cls.from_pretrained(tmp_path / "float", quantization_config=TurboQuantConfig(bits=4),
                                    dtype=torch.bfloat16)
    n_linear = sum(isinstance(m, TurboQuantLinear) for m in quantized.modules())
    n_experts = sum(isinstance(m, TurboQuantExperts) for m in quantized.modules())
    assert (n_linear, n_experts) == (len(plan.linears), len(plan.experts))
    if arch.kind != "qwen3_5_moe":
        assert (n_linear, n_experts) == (arch.linears, arch.experts), (name, n_linear, n_experts)
    batch = inputs(name, quantized)
    want = _logits(quantized, batch)
    assert torch.isfinite(want).all()

    quantized.save_pretrained(tmp_path / "tq4")
    again = cls.from_pretrained(tmp_path / "tq4", dtype=torch.bfloat16)
    saved, loaded = quantized.state_dict(), again.state_dict()
    assert saved.keys() == loaded.keys()
    for key, value in saved.items():
        assert torch.equal(value, loaded[key]), f"{name}: {key} differs after save and reload"
    assert torch.equal(_logits(again, batch), want)

    if arch.kind in ("causal", "seq2seq", "image-text", "qwen3_5_moe"):
        out = again.generate(input_ids=batch["input_ids"], max_new_tokens=3, min_new_tokens=3, do_sample=False)
        prompt = 1 if arch.kind == "seq2seq" else batch["input_ids"].shape[-1]  # (the decoder's start token)
        assert out.shape == (1, prompt + 3)

    again.dequantize()
    assert not any(isinstance(m, (TurboQuantLinear, TurboQuantExperts)) for m in again.modules())
    got = _logits(again, batch)
    err = ((got - want).norm() / want.norm()).item()
    assert err < 5e-2, f"{name}: dequantized logits differ from the quantized model's by {err:.2e}"
    kept = sorted({full_precision_reason(n, quantized, plan) or "" for n in candidates if n not in plan.linears})
    return dict(arch=name, model=cls.__name__, linears=f"{n_linear}/{len(candidates)}",
                experts=f"{n_experts}/{len(experts)}", kept="; ".join(k for k in kept if k), err=err,
                seconds=time.perf_counter() - t0)


@pytest.mark.parametrize("name", list(ARCHS))
def test_architecture(name, tmp_path):
    check(name, tmp_path)


def main() -> int:
    import tempfile
    from pathlib import Path

    import transformers

    print(f"transformers {transformers.__version__}, torch {torch.__version__}\n")
    print("| architecture | model class | Linears quantized | experts quantized | left in full precision | "
          "logits vs dequantized (rel.) | s |")
    print("|---|---|---:|---:|---|---:|---:|")
    for name in ARCHS:
        with tempfile.TemporaryDirectory() as d:
            r = check(name, Path(d))
        print(f"| {r['arch']} | `{r['model']}` | {r['linears']} | {r['experts']} | {r['kept']} | {r['err']:.1e} | "
              f"{r['seconds']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    sys.exit(main())
