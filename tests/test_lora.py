"""QLoRA-style fine-tuning: LoRA adapters on a frozen TurboQuant base, through PEFT's custom-module mechanism."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from turboquant_hf import TurboQuantConfig, TurboQuantLinear

peft = pytest.importorskip("peft")
lora = pytest.importorskip("turboquant_hf.integration.lora")

TARGETS = ["q_proj", "v_proj", "down_proj"]
# gradients of the same adapter on the packed base and on a plain copy holding its dequantized weights: the same
# function, multiplied in another order (float32)
GRAD_RTOL = 1e-4


def _config():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False)


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, 256, (4, 24), generator=g)


def _adapter_gradients(quantized, config: dict) -> tuple[dict, dict, object]:
    """The adapter gradients of one batch on the quantized model and on a copy holding its dequantized weights
    (the same adapter initialisation on both); returns both and the quantized PEFT model."""
    plain = copy.deepcopy(quantized).dequantize(dtype=torch.float32)
    torch.manual_seed(0)
    model = lora.get_peft_model(quantized, peft.LoraConfig(**config))
    torch.manual_seed(0)
    reference = peft.get_peft_model(plain, peft.LoraConfig(**config))
    ids = _batch()
    for m in (model, reference):
        m(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    ref = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    assert grads.keys() == ref.keys()
    for n in grads:
        assert ((grads[n] - ref[n]).norm() / ref[n].norm()).item() < GRAD_RTOL, n
    return grads, ref, model


@pytest.fixture
def base(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=TurboQuantConfig(bits=4),
                                                dtype=torch.float32)


def test_adapter_gradients_match_the_dequantized_model(base):
    config = dict(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False)
    grads, _, model = _adapter_gradients(base, config)
    wrapped = [m for m in model.modules() if isinstance(m, lora.TurboQuantLoraLinear)]
    assert len(wrapped) == 3 * 2 and all(isinstance(m.base_layer, TurboQuantLinear) for m in wrapped)
    assert grads and all("lora_" in n for n in grads)


def test_plain_peft_recipe_names_the_fix_and_the_fix_trains(base, tiny_llama_dir):
    """`peft.get_peft_model(model, LoraConfig(...))` (what TRL's SFTTrainer(peft_config=...) calls) on a TurboQuant
    model: PEFT refuses the layer type, and its message names the one-line fix (PEFT offers no registry or hook
    that would make the plain recipe work without changing PEFT). Applied to the same config object, the fix
    gives adapter gradients equal to those on the dequantized model; `print(model)` is unchanged."""
    config = dict(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False)
    assert "turboquant_hf.lora" not in repr(base)
    with pytest.raises(ValueError, match=r"(?s)Target module TurboQuantLinear\(.*is not supported") as refused:
        peft.get_peft_model(base, peft.LoraConfig(**config))
    assert "`turboquant_hf.lora.register(lora_config)` in place of the LoraConfig" in str(refused.value)
    fresh = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=TurboQuantConfig(bits=4),
                                                 dtype=torch.float32)
    plain = copy.deepcopy(fresh).dequantize(dtype=torch.float32)
    lora_config = peft.LoraConfig(**config)
    torch.manual_seed(0)
    model = peft.get_peft_model(fresh, lora.register(lora_config))  # the fix, as the message words it
    torch.manual_seed(0)
    reference = peft.get_peft_model(plain, peft.LoraConfig(**config))
    ids = _batch()
    for m in (model, reference):
        m(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    ref = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    assert grads.keys() == ref.keys() and len(grads) == 2 * 3 * 2  # lora_A and lora_B, 3 targets, 2 layers
    for n in grads:
        assert ((grads[n] - ref[n]).norm() / ref[n].norm()).item() < GRAD_RTOL, n


def test_train_save_reload_merge(base, tiny_llama_dir, tmp_path):
    import warnings

    torch.manual_seed(0)
    model = lora.get_peft_model(base, _config())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = _batch()
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecated autograd fallback on the TurboQuant op
        for _ in range(12):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "adapter")
    fresh = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=TurboQuantConfig(bits=4),
                                                 dtype=torch.float32)
    again = lora.load_adapter(fresh, str(tmp_path / "adapter"))
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, expected)
    merged = again.merge_and_unload()
    assert not any(isinstance(m, TurboQuantLinear) for n, m in merged.named_modules() if n.endswith(tuple(TARGETS)))
    assert isinstance(merged.model.layers[0].mlp.up_proj, TurboQuantLinear)  # layers without adapters stay packed
    with torch.no_grad():
        got = merged(input_ids=ids).logits
    assert ((got - expected).norm() / expected.norm()).item() < 1e-4


def test_trainer_accepts_the_adapter_model(base, tmp_path):
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments

    class Tokens(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            ids = _batch()[i % 4]
            return {"input_ids": ids, "labels": ids}

    model = lora.get_peft_model(base, _config())
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=2,
                             report_to=[], use_cpu=True, save_strategy="no", logging_steps=1)
    result = Trainer(model=model, args=args, train_dataset=Tokens()).train()
    assert result.global_step == 2


def test_dora_matches_the_dequantized_model_and_merges(base, tiny_llama_dir, tmp_path):
    """DoRA: the same gradients as PEFT's DoRA on the dequantized model, a saved adapter reloads to the same
    logits, and merge_and_unload gives them too (float32)."""
    config = dict(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False,
                  use_dora=True)
    grads, _, model = _adapter_gradients(base, config)
    assert any("lora_magnitude_vector" in n for n in grads)
    ids = _batch()
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "dora")
    fresh = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=TurboQuantConfig(bits=4),
                                                 dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(lora.load_adapter(fresh, str(tmp_path / "dora"))(input_ids=ids).logits, expected)
    merged = model.merge_and_unload()
    with torch.no_grad():
        got = merged(input_ids=ids).logits
    assert ((got - expected).norm() / expected.norm()).item() < 1e-4


def test_moe_model_adapters_train_through_packed_experts(tmp_path):
    """On a hybrid MoE model the adapters' gradients flow back through the packed routed experts (the experts
    op's backward) and equal those on the dequantized model."""
    from test_moe import qwen3_5_moe

    torch.manual_seed(0)
    qwen3_5_moe().save_pretrained(tmp_path / "src")
    q = AutoModelForCausalLM.from_pretrained(tmp_path / "src", quantization_config=TurboQuantConfig(bits=4, group_size=64),
                                             dtype=torch.float32)
    config = dict(r=4, lora_alpha=8, target_modules=["in_proj_qkv", "out_proj", "o_proj"], init_lora_weights=False)
    grads, _, _ = _adapter_gradients(q, config)
    assert any("layers.0." in n for n in grads)
