import os
import sys

# The suite runs on machines without a network: transformers 5.25 fetches Hub kernels on CUDA by default and raises
# offline (the tests' subprocesses inherit this).
os.environ.setdefault("USE_HUB_KERNELS", "0")

import pytest  # noqa: E402
import torch
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# Test the installed package, not the source tree: `python -m pytest` puts the checkout on sys.path, where
# `kernels/` would shadow Hugging Face's `kernels` package (it is installed as `turboquant_hf.kernels`).
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != ROOT]
sys.path.insert(0, os.path.join(ROOT, "examples"))

import turboquant_hf  # noqa: E402,F401  (registers the quantizer)


def make_tokenizer(directory: str, vocab_size: int = 256):
    """A small word-level tokenizer saved as tokenizer.json (enough for pipelines and the reference writer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    words = "the a of to and in is it you that he was for on are with as his they be at one have this".split()
    for w in words:
        vocab.setdefault(w, len(vocab))
    while len(vocab) < vocab_size:
        vocab[f"w{len(vocab)}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)
    return fast


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=352,  # not a multiple of 64 or 128: exercises padding of down_proj
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_qwen3_5_moe_config(**overrides):
    """A small Qwen3.5/3.6-style hybrid MoE text config: three gated-delta-net layers, then one attention layer."""
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    kw = dict(
        vocab_size=256, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, moe_intermediate_size=64, shared_expert_intermediate_size=128, num_experts=8,
        num_experts_per_tok=2, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
        linear_value_head_dim=48, linear_conv_kernel_dim=4, full_attention_interval=4, max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return Qwen3_5MoeTextConfig(**kw)


def spread_weights_(model, std: float = 0.05):
    """Draw every matrix (and expert stack) of a model built from config with a realistic spread, in place (the
    convolutions of gated delta nets keep their init); returns the model."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "conv1d" not in name:
                p.normal_(0, std)
    return model


def qwen3_5_moe():
    """A tiny multimodal Qwen3.5-MoE (8 experts, top 2, hidden 128, expert width 64) built from config."""
    from transformers.models.qwen3_5_moe import (
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    text = dict(vocab_size=256, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=64, moe_intermediate_size=64, shared_expert_intermediate_size=96, num_experts=8,
                num_experts_per_tok=2, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
                linear_value_head_dim=40,  # out_proj reads 4 x 40 = 160 inputs: not a multiple of G
                linear_conv_kernel_dim=4, full_attention_interval=4, max_position_embeddings=256)
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    return Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text, vision_config=vision))


def tiny_qwen3_5_moe_model(seed: int = 0):
    """The tiny multimodal Qwen3.5-MoE (`qwen3_5_moe`), weights spread (`spread_weights_`), in bfloat16."""
    torch.manual_seed(seed)
    return spread_weights_(qwen3_5_moe()).to(torch.bfloat16)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny Llama saved in bf16 with a tokenizer; weights drawn with a realistic spread (std 0.05)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.05)
    d = str(tmp_path_factory.mktemp("tiny_llama"))
    model.to(torch.bfloat16).save_pretrained(d)
    make_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def smollm2_dir():
    from offline_assets import smollm2_base

    return smollm2_base()


@pytest.fixture(scope="session")
def shakespeare():
    from offline_assets import shakespeare_text

    return shakespeare_text()


def pytest_addoption(parser):
    parser.addoption("--record-launches", metavar="DIR", default=None,
                     help="under TRITON_INTERPRET=1: record every kernel launch into DIR (one JSON per worker) for "
                          "tests/sm90_compile.py compile DIR")


def pytest_configure(config):
    folder = config.getoption("--record-launches")
    if folder:
        from sm90_compile import Recorder

        config._tq_launches = (folder, Recorder())
        config._tq_launches[1].install()


def pytest_unconfigure(config):
    recording = getattr(config, "_tq_launches", None)
    if recording:
        folder, recorder = recording
        recorder.uninstall()
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        recorder.dump(os.path.join(folder, f"launches-{worker}.json"))


def pytest_collection_modifyitems(config, items):
    """Tests that take an interpreted kernels module (the `L` / `M` fixtures of test_kernels.py) form the
    `interpreter` group."""
    for item in items:
        if {"L", "M"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.interpreter)


def safetensors_tensors(directory) -> dict:
    """Every tensor of the safetensors files in `directory`, by name."""
    out = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, f)))
    return out


def assert_same_tensors(a_dir, b_dir) -> dict:
    """The two folders hold the same tensor names with equal dtypes and values; returns the first folder's."""
    a, b = safetensors_tensors(a_dir), safetensors_tensors(b_dir)
    assert a.keys() == b.keys(), set(a) ^ set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    return a
