"""`nn.Linear` subclasses: quantized when their forward is the plain linear map (Falcon's `FalconLinear`), kept in
full precision with the reason named when it is not (routers, decoupled or grouped projections); layers a model
keeps in float32 are reported the same way."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from turboquant_hf import TurboQuantConfig, TurboQuantLinear
from turboquant_hf.modeling.modules import linear_kind
from turboquant_hf.quantization import planning


def test_linear_kind():
    from transformers.models.falcon.modeling_falcon import FalconLinear
    from transformers.models.idefics.modeling_idefics import IdeficsDecoupledLinear
    from transformers.models.phimoe.modeling_phimoe import PhimoeTopKRouter
    from transformers.pytorch_utils import Conv1D

    class Renamed(nn.Linear):  # a subclass that changes nothing of nn.Linear's computation
        pass

    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    class WithExtra(nn.Linear):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.gain = nn.Parameter(torch.ones(1))

    assert linear_kind(nn.Linear(4, 4)) == "linear" and linear_kind(Renamed(4, 4)) == "linear"
    assert linear_kind(FalconLinear(4, 4)) == "linear"
    assert linear_kind(Conv1D(4, 4)) == "conv1d"
    assert linear_kind(Scaled(4, 4)) == "other" and linear_kind(WithExtra(4, 4)) == "other"
    assert linear_kind(IdeficsDecoupledLinear(4, 4, out_additional_features=2)) == "other"
    assert linear_kind(nn.Embedding(4, 4)) == ""
    router = PhimoeTopKRouter.__new__(PhimoeTopKRouter)
    nn.Linear.__init__(router, 8, 4, bias=False)
    assert linear_kind(router) == "other"


@pytest.fixture(scope="module")
def falcon_dir(tmp_path_factory):
    from conftest import make_tokenizer, spread_weights_
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(0)
    model = spread_weights_(FalconForCausalLM(FalconConfig(
        vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=True,
        num_kv_heads=2))).to(torch.bfloat16)
    d = str(tmp_path_factory.mktemp("falcon"))
    model.save_pretrained(d)
    make_tokenizer(d)
    return d


def test_falcon_quantized_reloaded_and_dequantized(falcon_dir, tmp_path):
    """Every FalconLinear of the decoder is quantized; the checkpoint reloads with the same logits; dequantizing
    gives FalconLinear modules back with the quantized model's weights; generate runs."""
    from transformers import AutoModelForCausalLM
    from transformers.models.falcon.modeling_falcon import FalconLinear

    model = AutoModelForCausalLM.from_pretrained(falcon_dir, quantization_config=TurboQuantConfig(bits=4),
                                                 dtype=torch.bfloat16)
    decoder = [m for n, m in model.named_modules() if n.startswith("transformer.h.")]
    assert sum(isinstance(m, TurboQuantLinear) for m in decoder) == 2 * 4  # qkv, dense, h_to_4h, 4h_to_h a layer
    assert not any(isinstance(m, FalconLinear) for m in decoder)
    ids = torch.arange(3, 19).view(1, -1)
    with torch.no_grad():
        want = model(ids).logits
    model.save_pretrained(tmp_path / "tq4")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "tq4", dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, want)
    plain = again.dequantize()
    restored = [m for n, m in plain.named_modules() if n.startswith("transformer.h.") and isinstance(m, nn.Linear)]
    assert len(restored) == 8 and all(type(m) is FalconLinear for m in restored)
    with torch.no_grad():
        y = plain(ids).logits.float()
    assert ((y - want.float()).norm() / want.float().norm()).item() < 1e-2
    assert again.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 19)


def test_subclasses_with_their_own_forward_are_kept_and_named(caplog):
    """A model whose projections are nn.Linear subclasses with their own forward: nothing quantized is an error
    that names the class and the reason; alongside plain layers, they are kept and the warning says so."""
    from conftest import tiny_llama_config
    from transformers import LlamaForCausalLM

    from turboquant_hf.integration.quantizer import TurboQuantHfQuantizer

    class Doubled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=1))
    mlp = model.model.layers[0].mlp
    old = mlp.up_proj
    mlp.up_proj = Doubled(old.in_features, old.out_features, bias=False)
    plan = planning.from_config(model, TurboQuantConfig(bits=4))
    assert "model.layers.0.mlp.up_proj" not in plan.linears and "model.layers.0.mlp.gate_proj" in plan.linears
    assert "Doubled is an nn.Linear subclass" in planning.kept_summary(plan)
    with caplog.at_level(logging.WARNING):
        TurboQuantHfQuantizer(TurboQuantConfig(bits=4), pre_quantized=False)._process_model_before_weight_loading(model)
    assert "kept in full precision" in caplog.text and "Doubled" in caplog.text, caplog.text


def test_float32_modules_of_the_model_are_reported():
    """T5 keeps its feed-forward output projections in float32 (`_keep_in_fp32_modules`): they stay unquantized,
    and the plan says so for each, with the reason, instead of leaving them out silently."""
    from transformers import T5Config, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(T5Config(vocab_size=256, d_model=128, d_ff=256, num_layers=2, num_heads=4,
                                                d_kv=32))
    plan = planning.from_config(model, TurboQuantConfig(bits=4))
    wo = {n for n, _ in model.named_modules() if n.endswith("DenseReluDense.wo")}
    assert len(wo) == 4 and set(plan.kept) == wo and not wo & set(plan.linears)
    assert all("_keep_in_fp32_modules" in reason for reason in plan.kept.values())
    assert "wo" in planning.kept_summary(plan)
    assert len(plan.linears) == 28  # the attention projections and wi of 2 encoder and 2 decoder blocks
