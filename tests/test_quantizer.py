"""End to end on a tiny Llama built from config: quantize on the fly, save, reload, generate, bad input."""

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

from turboquant_hf import TurboQuantConfig, TurboQuantLinear
from turboquant_hf.format import codec
from turboquant_hf.format import constants as fmt
from turboquant_hf.format.checkpoint import CheckpointError

DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _load(path, **kw):
    kw.setdefault("dtype", torch.float32)
    return AutoModelForCausalLM.from_pretrained(path, **kw)


@pytest.fixture(scope="module")
def base(tiny_llama_dir):
    return _load(tiny_llama_dir)


@pytest.fixture(scope="module")
def quantized(tiny_llama_dir):
    return _load(tiny_llama_dir, quantization_config=TurboQuantConfig(bits=3, group_size=64))


@pytest.fixture(scope="module")
def saved_dir(quantized, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tq_saved"))
    quantized.save_pretrained(d)
    return d


def _ids(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (2, n), generator=g)


def test_every_decoder_linear_is_quantized(base, quantized):
    names = [n for n, m in quantized.named_modules() if isinstance(m, TurboQuantLinear)]
    assert len(names) == 2 * len(DECODER_LINEARS)
    assert all(n.rsplit(".", 1)[1] in DECODER_LINEARS for n in names)
    assert not any(isinstance(m, torch.nn.Linear) and n != "lm_head" for n, m in quantized.named_modules())
    assert type(quantized.lm_head) is torch.nn.Linear
    assert torch.equal(quantized.lm_head.weight, base.lm_head.weight)
    assert torch.equal(quantized.model.embed_tokens.weight, base.model.embed_tokens.weight)
    assert torch.equal(quantized.model.norm.weight, base.model.norm.weight)
    assert not any(p.requires_grad for p in quantized.parameters())


def test_weights_are_the_codec_output_of_the_checkpoint(tiny_llama_dir, quantized):
    with safe_open(os.path.join(tiny_llama_dir, "model.safetensors"), "pt") as f:
        for name, m in quantized.named_modules():
            if isinstance(m, TurboQuantLinear):
                packed, norms = codec.quantize_weight(f.get_tensor(name + ".weight").float(), 3, 64)
                assert torch.equal(m.weight.tq_packed, packed), name
                assert torch.equal(m.weight.tq_norms, norms), name


def test_memory_footprint_counts_packed_bytes(base, quantized):
    expected = 0
    for name, p in list(quantized.named_parameters()) + list(quantized.named_buffers()):
        if not name.endswith((".tq_packed", ".tq_norms")):
            expected += p.numel() * p.element_size()
    for name, m in quantized.named_modules():
        if isinstance(m, TurboQuantLinear):
            n_groups = -(-m.in_features // 64)
            expected += m.out_features * n_groups * (fmt.bytes_per_group(8, 64) + 4)
    assert quantized.get_memory_footprint() == expected
    assert quantized.get_memory_footprint() < base.get_memory_footprint()


def test_forward_equals_dequantized_weights(base, quantized):
    """The rotated-domain product equals x @ dequantize(W).T: only float rounding separates them."""
    import copy

    deq = copy.deepcopy(base)
    for name, m in quantized.named_modules():
        if isinstance(m, TurboQuantLinear):
            deq.get_submodule(name).weight.data = m.weight.dequantize()
    with torch.no_grad():
        a, b = deq(_ids()).logits, quantized(_ids()).logits
    assert ((a - b).norm() / a.norm()).item() < 1e-5


def test_layer_error_matches_theory(base, quantized):
    """Each quantized projection's output error is the codebook's relative error (rotation makes it isotropic)."""
    x = torch.randn(64, 128)
    for name, m in quantized.named_modules():
        if isinstance(m, TurboQuantLinear) and m.in_features == 128:
            ref = x @ base.get_submodule(name).weight.T
            rel = ((m(x) - ref).norm() / ref.norm()).item()
            assert 0.15 < rel < 0.22, (name, rel)  # 3-bit Lloyd-Max: 0.186


def test_logits_close_to_unquantized(tiny_llama_dir, base):
    """Quantization perturbs the logits like isotropic weight noise of the Lloyd-Max size, not more.

    A random tiny model amplifies any weight error (its logits move ~3x the weight error), so a fixed
    bound would say little. The reference is the same model with Gaussian noise of relative size e_b
    (the codebook's theoretical error) added to every quantized weight: TurboQuant's rotation makes
    its error behave like that noise, so the logit error must land within [0.5, 1.2] of the noise's.
    """
    import copy

    with torch.no_grad():
        ref = base(_ids()).logits
        for bits, eb in ((4, 0.0975), (3, 0.1859)):
            q = _load(tiny_llama_dir, quantization_config=TurboQuantConfig(bits=bits, group_size=64))
            rel_q = ((q(_ids()).logits - ref).norm() / ref.norm()).item()
            rel_noise = []
            for seed in range(3):
                g = torch.Generator().manual_seed(100 + seed)
                noisy = copy.deepcopy(base)
                for name, m in q.named_modules():
                    if isinstance(m, TurboQuantLinear):
                        w = noisy.get_submodule(name).weight
                        w += eb * w.norm() / w.numel() ** 0.5 * torch.randn(w.shape, generator=g)
                rel_noise.append(((noisy(_ids()).logits - ref).norm() / ref.norm()).item())
            noise = sum(rel_noise) / len(rel_noise)
            assert 0.5 * noise < rel_q < 1.2 * noise, (bits, rel_q, rel_noise)


def test_save_layout(tiny_llama_dir, saved_dir, quantized):
    tensors = load_file(os.path.join(saved_dir, "model.safetensors"))
    original = load_file(os.path.join(tiny_llama_dir, "model.safetensors"))
    for name, m in quantized.named_modules():
        if isinstance(m, TurboQuantLinear):
            packed, norms = tensors.pop(name + ".weight.tq_packed"), tensors.pop(name + ".weight.tq_norms")
            n_groups = -(-m.in_features // 64)
            assert packed.dtype == torch.uint8 and packed.shape == (m.out_features * n_groups, 24)
            assert norms.dtype == torch.float32 and norms.shape == (m.out_features, n_groups)
            original.pop(name + ".weight")
    # every other tensor unchanged (saved in the dtype the model was loaded in: float32 here)
    assert set(tensors) == set(original)
    for k in tensors:
        assert torch.equal(tensors[k], original[k].float()), k
    config = json.load(open(os.path.join(saved_dir, "config.json")))
    assert config["quantization_config"]["quant_method"] == "turboquant"
    assert config["quantization_config"]["bits"] == 3 and config["quantization_config"]["group_size"] == 64
    tq = json.load(open(os.path.join(saved_dir, "tq_config.json")))
    assert tq["format"] == "tq3_native" and tq["group_size"] == 64 and tq["quantizer_seed"] == 42
    assert tq["compressed_layers"] == 14
    assert tq["orig_in_dims"] == {f"model.layers.{i}.mlp.down_proj.weight": 352 for i in range(2)}


def test_reload_is_bit_exact(saved_dir, quantized):
    again = AutoModelForCausalLM.from_pretrained(saved_dir)
    assert again.dtype == torch.float32
    for (n1, b1), (n2, b2) in zip(quantized.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and b1.dtype == b2.dtype and torch.equal(b1, b2), n1
    with torch.no_grad():
        assert torch.equal(quantized(_ids()).logits, again(_ids()).logits)
    # and saving the reloaded model again writes the same bytes
    d2 = saved_dir + "_again"
    again.save_pretrained(d2)
    a, b = load_file(os.path.join(saved_dir, "model.safetensors")), load_file(os.path.join(d2, "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_mixed_bits_recovered_from_geometry(tiny_llama_dir, tmp_path):
    cfg = TurboQuantConfig(bits=3, group_size=128, module_bits={"down_proj": 4, r"layers\.1\..*v_proj": 2},
                           sensitive_bits=1.58, sensitive_patterns=["k_proj"])
    q = _load(tiny_llama_dir, quantization_config=cfg)
    q.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    bits = {n: m.bits for n, m in again.named_modules() if isinstance(m, TurboQuantLinear)}
    assert bits["model.layers.0.mlp.down_proj"] == 4 and bits["model.layers.1.self_attn.v_proj"] == 2
    assert bits["model.layers.0.self_attn.v_proj"] == 3 and bits["model.layers.1.self_attn.k_proj"] == 1.58
    packed = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert packed["model.layers.1.self_attn.k_proj.weight.tq_packed"].shape[1] == 26  # ternary, G=128
    assert packed["model.layers.1.self_attn.k_proj.weight.tq_norms"].dtype == torch.float16  # ternary tier
    assert packed["model.layers.0.mlp.down_proj.weight.tq_norms"].dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(q(_ids()).logits, again(_ids()).logits)


def test_modules_to_not_convert(tiny_llama_dir):
    q = _load(tiny_llama_dir, quantization_config=TurboQuantConfig(modules_to_not_convert=["lm_head", "mlp"]))
    kinds = {n.rsplit(".", 1)[1]: type(m).__name__ for n, m in q.named_modules() if n.startswith("model.layers.0.")}
    assert kinds["q_proj"] == "TurboQuantLinear" and kinds["down_proj"] == "Linear"


def test_generate_and_pipeline(tiny_llama_dir, saved_dir, quantized):
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    shutil.copy(os.path.join(tiny_llama_dir, "tokenizer.json"), saved_dir)
    shutil.copy(os.path.join(tiny_llama_dir, "tokenizer_config.json"), saved_dir)
    expected = quantized.generate(tok("the a of", return_tensors="pt").input_ids, max_new_tokens=8, do_sample=False)
    prompt = "the a of"
    runs = [
        pipeline("text-generation", model=quantized, tokenizer=tok),
        pipeline("text-generation", model=saved_dir, model_kwargs={"dtype": torch.float32}),
        pipeline("text-generation", model=tiny_llama_dir,
                 model_kwargs={"quantization_config": TurboQuantConfig(bits=3, group_size=64), "dtype": torch.float32}),
    ]
    outs = [p(prompt, max_new_tokens=8, do_sample=False, return_tensors=True)[0]["generated_token_ids"] for p in runs]
    for p in runs:
        assert isinstance(p.model.model.layers[0].self_attn.q_proj, TurboQuantLinear)
    assert outs[0] == outs[1] == outs[2] == expected[0].tolist()
    assert len(outs[0]) == 3 + 8


# ---------------------------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------------------------

def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_missing_norms_named(saved_dir, tmp_path):
    d = _copy(saved_dir, tmp_path / "c")
    t = load_file(os.path.join(d, "model.safetensors"))
    del t["model.layers.1.mlp.up_proj.weight.tq_norms"]
    save_file(t, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing model\.layers\.1\.mlp\.up_proj\.weight\.tq_norms"):
        AutoModelForCausalLM.from_pretrained(d)


def test_wrong_shape_named(saved_dir, tmp_path):
    d = _copy(saved_dir, tmp_path / "c")
    t = load_file(os.path.join(d, "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.weight.tq_packed"
    t[name] = t[name][:-1]
    save_file(t, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        AutoModelForCausalLM.from_pretrained(d)
    t = load_file(os.path.join(saved_dir, "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.weight.tq_norms"
    t[name] = t[name].to(torch.bfloat16)
    save_file(t, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + ".*float32 \\(or float16\\)"):
        AutoModelForCausalLM.from_pretrained(d)


def test_truncated_file_named(saved_dir, tmp_path):
    d = _copy(saved_dir, tmp_path / "c")
    path = os.path.join(d, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 1000)
    with pytest.raises(CheckpointError, match="truncated"):
        AutoModelForCausalLM.from_pretrained(d)


def test_quantization_config_without_packed_tensors(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path / "c")
    config = json.load(open(os.path.join(d, "config.json")))
    config["quantization_config"] = TurboQuantConfig().to_dict()
    json.dump(config, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(CheckpointError, match="no \\*\\.tq_packed tensors"):
        AutoModelForCausalLM.from_pretrained(d)


def test_nan_weight_named(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path / "c")
    t = load_file(os.path.join(d, "model.safetensors"))
    t["model.layers.1.self_attn.o_proj.weight"][3, 5] = float("nan")
    save_file(t, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.o_proj\.weight.*NaN"):
        _load(d, quantization_config=TurboQuantConfig())


def test_checkpoint_for_another_architecture(saved_dir, tmp_path):
    d = _copy(saved_dir, tmp_path / "c")
    t = load_file(os.path.join(d, "model.safetensors"))
    t["model.layers.0.mlp.extra_proj.weight.tq_packed"] = t["model.layers.0.mlp.up_proj.weight.tq_packed"].clone()
    t["model.layers.0.mlp.extra_proj.weight.tq_norms"] = t["model.layers.0.mlp.up_proj.weight.tq_norms"].clone()
    save_file(t, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"extra_proj\.weight\.tq_packed: no matching layer"):
        AutoModelForCausalLM.from_pretrained(d)


@pytest.mark.parametrize("skip", [["down_proj"], []], ids=["down_proj", "empty"])
def test_tied_head_with_a_custom_skip_list(skip, tmp_path):
    """A tied output head stays tied and in full precision whatever modules_to_not_convert says; the model
    saves and reloads to the same logits."""
    from conftest import tiny_llama_config
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=True)).save_pretrained(tmp_path / "src")
    q = AutoModelForCausalLM.from_pretrained(tmp_path / "src",
                                             quantization_config=TurboQuantConfig(bits=4, modules_to_not_convert=skip))
    assert type(q.lm_head) is torch.nn.Linear and q.lm_head.weight is q.model.embed_tokens.weight
    assert isinstance(q.model.layers[0].mlp.up_proj, TurboQuantLinear)
    assert isinstance(q.model.layers[0].mlp.down_proj, TurboQuantLinear) == (skip == [])
    q.save_pretrained(tmp_path / "q")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert again.lm_head.weight is again.model.embed_tokens.weight
    ids = torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, q(ids).logits)


def test_tied_head_named_in_module_bits_stays_tied(tmp_path, caplog):
    from conftest import tiny_llama_config
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=True)).save_pretrained(tmp_path / "src")
    cfg = TurboQuantConfig(bits=3, modules_to_not_convert=[], module_bits={"lm_head": 4})
    q = AutoModelForCausalLM.from_pretrained(tmp_path / "src", quantization_config=cfg)
    assert type(q.lm_head) is torch.nn.Linear and q.lm_head.weight is q.model.embed_tokens.weight
    assert "lm_head is tied to the input embeddings and stays in full precision" in caplog.text


def test_task_heads_stay_in_full_precision_by_default():
    """The default skip list keeps every model's output head: classification, QA and LM heads alike; a user list
    replaces the default."""
    from transformers import (
        BertConfig,
        BertForQuestionAnswering,
        BertForSequenceClassification,
        LlamaConfig,
        LlamaForSequenceClassification,
    )

    from turboquant_hf.quantization import planning

    bert = BertConfig(vocab_size=100, hidden_size=128, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=256, num_labels=3)
    llama = LlamaConfig(vocab_size=100, hidden_size=128, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=2, intermediate_size=256, num_labels=3, pad_token_id=0)
    for model, head in ((BertForSequenceClassification(bert), "classifier"), (BertForQuestionAnswering(bert), "qa_outputs"),
                        (LlamaForSequenceClassification(llama), "score")):
        plan = planning.from_config(model, TurboQuantConfig(bits=4))
        assert head not in plan.linears and len(plan.linears) >= 6, (type(model).__name__, sorted(plan.linears))
        assert head in planning.from_config(model, TurboQuantConfig(bits=4, modules_to_not_convert=[])).linears


def test_num_parameters_counts_the_weights_packed_tensors_encode(tiny_llama_dir, tmp_path):
    from test_moe import qwen3_5_moe

    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    q = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=TurboQuantConfig(bits=3))
    assert q.num_parameters() == base.num_parameters() == sum(p.numel() for p in base.parameters())
    assert q.num_parameters(only_trainable=True) == 0  # everything is frozen after loading
    assert q.num_parameters(exclude_embeddings=True) == base.num_parameters(exclude_embeddings=True)
    torch.manual_seed(0)
    moe = qwen3_5_moe()
    moe.save_pretrained(tmp_path / "moe")
    qm = AutoModelForCausalLM.from_pretrained(tmp_path / "moe", quantization_config=TurboQuantConfig(bits=3))
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "moe")
    assert qm.num_parameters() == plain.num_parameters()
    assert qm.dequantize().num_parameters() == plain.num_parameters()


def test_gpt2_conv1d_layers(tmp_path):
    """GPT-2's Conv1D layers (weights stored (in, out)) quantize like Linears: the layer error of 4 bits, a
    bit-exact save and reload, a pipeline, the parameter count, and dequantize() back to Conv1D."""
    from conftest import make_tokenizer
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=128, n_layer=2, n_head=4, n_positions=64,
                                      bos_token_id=1, eos_token_id=2))
    base.save_pretrained(tmp_path / "src")
    make_tokenizer(str(tmp_path / "src"))
    q = AutoModelForCausalLM.from_pretrained(tmp_path / "src", quantization_config=TurboQuantConfig(bits=4))
    layers = [n for n, m in q.named_modules() if isinstance(m, TurboQuantLinear)]
    assert len(layers) == 8 and not any(isinstance(m, Conv1D) for m in q.modules())
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = q.transformer.h[0].attn.c_attn(x), base.transformer.h[0].attn.c_attn(x)
    assert 0.05 < ((got - want).norm() / want.norm()).item() < 0.15  # 4-bit Lloyd-Max: about 0.1
    assert q.num_parameters() == base.num_parameters()
    q.save_pretrained(tmp_path / "q")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    ids = torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = q(ids).logits
        assert torch.equal(again(ids).logits, expected)
    out = pipeline("text-generation", model=str(tmp_path / "q"))("the a of", max_new_tokens=3, do_sample=False)
    assert out[0]["generated_text"].startswith("the a of")
    plain = again.dequantize(dtype=torch.float32)
    assert isinstance(plain.transformer.h[0].attn.c_attn, Conv1D)
    with torch.no_grad():
        assert ((plain(ids).logits - expected).norm() / expected.norm()).item() < 1e-4


def test_model_with_nothing_to_quantize_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="LlamaForCausalLM has no layer this version quantizes"):
        AutoModelForCausalLM.from_pretrained(
            tiny_llama_dir, quantization_config=TurboQuantConfig(modules_to_not_convert=["model", "lm_head"]))
