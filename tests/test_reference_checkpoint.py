"""Checkpoints written by the independent reference package's own CPU writer load here unchanged."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from turboquant_hf import TurboQuantConfig, TurboQuantLinear

ref_ckpt = pytest.importorskip("turboquant_vllm.checkpoint")
ref_ops = pytest.importorskip("turboquant_vllm.torch_ops")
ref_wq = pytest.importorskip("turboquant_vllm.weight_quant")


@pytest.fixture(scope="module", params=[(3, 128, None), (2, 64, 4)], ids=["3bit-g128", "2bit-g64-sensitive4"])
def reference_dir(request, tiny_llama_dir, tmp_path_factory):
    bits, group_size, sensitive = request.param
    out = str(tmp_path_factory.mktemp("reference_tq3"))
    ref_ckpt.save_tq3_checkpoint(tiny_llama_dir, out, bits=bits, group_size=group_size, sensitive_bits=sensitive)
    return out, bits, group_size, sensitive


def _reference_dequantized_model(directory, group_size):
    """A plain float32 model holding the reference package's own dequantization of every packed tensor."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    config.__dict__.pop("quantization_config", None)  # (found from tq_config.json): the plain architecture
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return _reference_dequantize_into(plain, directory, group_size)


def test_reference_checkpoint_loads_and_matches(reference_dir):
    directory, bits, group_size, sensitive = reference_dir
    config = json.load(open(os.path.join(directory, "config.json")))
    assert "quantization_config" not in config  # as the published checkpoints
    ours = AutoModelForCausalLM.from_pretrained(
        directory, quantization_config=TurboQuantConfig(), dtype=torch.float32
    )
    # bits and group size come from the files, not from the default config passed in
    assert ours.config.quantization_config.group_size == group_size
    layers = {n: m for n, m in ours.named_modules() if isinstance(m, TurboQuantLinear)}
    assert len(layers) == 14
    for name, m in layers.items():
        expect = sensitive if sensitive and name.endswith(("o_proj", "down_proj")) else bits
        assert (m.bits, m.group_size) == (expect, group_size), name
    reference = _reference_dequantized_model(directory, group_size)
    ids = torch.randint(3, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = reference(ids).logits, ours(ids).logits
    assert ((a - b).norm() / a.norm()).item() < 1e-5


def test_reference_checkpoint_round_trips_byte_identical(reference_dir, tmp_path):
    directory, bits, group_size, _ = reference_dir
    ours = AutoModelForCausalLM.from_pretrained(directory, quantization_config=TurboQuantConfig(), dtype=torch.float16)
    ours.save_pretrained(tmp_path)
    a = load_file(os.path.join(directory, "model.safetensors"))
    b = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    tq = json.load(open(os.path.join(tmp_path, "tq_config.json")))
    ref_tq = json.load(open(os.path.join(directory, "tq_config.json")))
    for key in ("format", "bits", "group_size", "quantizer_seed", "compressed_layers", "orig_in_dims",
                "sensitive_bits", "sensitive_patterns"):
        assert tq.get(key) == ref_tq.get(key), key
    # and now config.json records it: no arguments needed any more
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(again.model.layers[0].mlp.down_proj, TurboQuantLinear)


def _reference_dequantize_into(model, directory, group_size):
    """Fill a plain model with the reference package's dequantization of every packed tensor in `directory`."""
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    params = dict(model.named_parameters())
    state = {}
    for name in [k for k in tensors if k.endswith(".tq_packed")]:
        key = name[: -len(".tq_packed")]
        packed, norms = tensors[name], tensors[key + ".tq_norms"]
        bits = ref_wq.bits_from_packed_group_bytes(packed.shape[1], group_size)
        q = ref_ops.PolarQuantTorch(group_size, bits, seed=42, device="cpu")
        rows, n_groups = norms.shape
        shape = params[key].shape
        w = q.dequantize(ref_wq.unpack_indices(packed, bits, group_size), norms.flatten())
        state[key] = w.reshape(rows, n_groups * group_size)[:, : shape[-1]].reshape(shape)
    for k, v in tensors.items():
        if not k.endswith((".tq_packed", ".tq_norms")):
            state[k] = v.float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    return model


def test_reference_qwen3_5_moe_checkpoint(tmp_path):
    """The reference writer's tiny Qwen3.5-MoE (pre-fused experts, packed routers, shared_expert_gate and vision
    Linears, no quantization_config) loads into both classes and matches the reference's dequantization."""
    from conftest import make_tokenizer
    from test_moe import qwen3_5_moe
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration

    from turboquant_hf.modeling.modules import TurboQuantExperts

    torch.manual_seed(0)
    src, out = str(tmp_path / "src"), str(tmp_path / "ref")
    model = qwen3_5_moe()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "conv1d" not in name:
                p.normal_(0, 0.05)
    model.to(torch.bfloat16).save_pretrained(src, save_original_format=False)
    make_tokenizer(src)
    ref_ckpt.save_tq3_checkpoint(src, out, bits=3, group_size=128)
    assert "model.language_model.layers.0.mlp.gate.weight.tq_packed" in load_file(os.path.join(out, "model.safetensors"))

    plain = Qwen3_5MoeForConditionalGeneration.from_pretrained(src, dtype=torch.float32)
    reference = _reference_dequantize_into(plain, out, 128)
    full = Qwen3_5MoeForConditionalGeneration.from_pretrained(out, quantization_config=TurboQuantConfig(),
                                                              dtype=torch.float32)
    text = AutoModelForCausalLM.from_pretrained(out, quantization_config=TurboQuantConfig(), dtype=torch.float32)
    assert type(text) is Qwen3_5MoeForCausalLM
    for m in (full, text):
        layers = m.model.language_model.layers if m is full else m.model.layers
        assert all(isinstance(layer.mlp.experts, TurboQuantExperts) for layer in layers)
        # routers were packed by the writer: dequantized into their full-precision parameter
        assert layers[0].mlp.gate.weight.dtype == torch.float32
    ref_router = reference.model.language_model.layers[0].mlp.gate.weight
    ours = full.model.language_model.layers[0].mlp.gate.weight
    assert torch.allclose(ours, ref_router, rtol=0, atol=1e-6 * ref_router.abs().max().item())
    assert isinstance(full.model.visual.blocks[0].attn.qkv, TurboQuantLinear)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = reference(input_ids=ids).logits
        for m in (full, text):
            b = m(input_ids=ids).logits
            assert ((a - b).norm() / a.norm()).item() < 1e-4


def test_distilled_checkpoint_dequantizes_alike_in_the_reference_package(tiny_llama_dir, tmp_path):
    """A checkpoint whose norms and vector parameters were tuned block by block and then by distillation is an
    ordinary tq3_native one: the reference package's dequantization of its tensors gives the logits of our load of
    it."""
    from turboquant_hf import CalibrationConfig

    seq = torch.randint(3, 256, (1, 64), generator=torch.Generator().manual_seed(3))
    cal = CalibrationConfig(data=[seq] * 4, samples=4, sequence_length=64, distill_steps=20, block_steps=20)
    tuned = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32,
                                                 quantization_config=TurboQuantConfig(bits=3, calibration=cal))
    record = tuned.config.quantization_config.calibrated_with
    assert record["distilled"]["kept"] and record["block_tuned"]["kept"] == 2
    tuned.save_pretrained(tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    reference = _reference_dequantized_model(str(tmp_path), 128)
    with torch.no_grad():
        a, b = reference(seq).logits, ours(seq).logits
    assert ((a - b).norm() / a.norm()).item() < 1e-5
