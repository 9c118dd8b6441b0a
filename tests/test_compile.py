"""torch.compile(fullgraph=True) traces whole quantized models: the custom ops' fake implementations are enough."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from turboquant_hf import TurboQuantConfig, TurboQuantExperts, TurboQuantLinear


def _llama():
    from conftest import tiny_llama_config

    return LlamaForCausalLM(tiny_llama_config())


def _qwen3_moe():
    from test_moe import qwen3_moe

    return qwen3_moe()


@pytest.mark.parametrize("build", [_llama, _qwen3_moe], ids=["llama", "qwen3_moe"])
def test_fullgraph_compile_matches_eager(build, tmp_path):
    torch.manual_seed(0)
    build().save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=TurboQuantConfig(group_size=64),
                                                 dtype=torch.float32)
    kinds = {type(m) for m in model.modules()}
    assert TurboQuantLinear in kinds
    if build is _qwen3_moe:
        assert TurboQuantExperts in kinds
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(ids).logits
    assert torch.equal(eager, compiled)
