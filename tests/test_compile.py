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


def test_fullgraph_compile_with_ternary_in_the_runtime_layout(tmp_path, monkeypatch):
    """Ternary experts and layers as a GPU holds them (2-bit codes, read with `kernel_codebook()`'s padded
    codebook) trace under fullgraph compile and give exactly the published layout's logits (both through the torch
    reference: the compiled CPU kernel reads the published layout only)."""
    from turboquant_hf.format import runtime_layout as layout
    from turboquant_hf.modeling.modules import TurboQuantWeight

    monkeypatch.setenv("TURBOQUANT_CPU_KERNEL", "0")
    torch.manual_seed(0)
    _qwen3_moe().save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=TurboQuantConfig(bits=1.58, group_size=64), dtype=torch.float32)
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        published = model(ids).logits
        weights = [m for m in model.modules() if isinstance(m, TurboQuantWeight) and m.n_levels == 3]
        assert weights and any(w.source_shape[0] > 1 and len(w.source_shape) == 3 for w in weights)  # experts too
        for w in weights:  # (on CPU nothing converts by itself: as `use_runtime_layout_` does on a GPU)
            w.tq_packed = layout.to_runtime(w.tq_packed, 3, w.group_size, w.n_groups)
            assert w.runtime_layout and w.kernel_codebook().numel() == 4
        eager = model(ids).logits
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(ids).logits
    assert torch.equal(eager, published) and torch.equal(compiled, eager)
