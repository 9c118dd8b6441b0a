"""`device_map` across devices on CPU: whole layers on "cpu" and others offloaded to "disk" (accelerate's hooks bring
a layer's tensors in for its forward), for a dense and an MoE TurboQuant model, quantized on the fly and
pre-quantized. The offloaded model's logits equal the resident model's exactly, `generate` runs, the packed tensors
of disk layers are not resident (`offload_buffers=True`) and are counted by `get_memory_footprint` as packed bytes;
saved from the offloaded model and loaded again, the checkpoint holds the same bytes; `device_map="auto"` sizes
layers by their packed bytes."""

import pytest
import torch

import turboquant_hf
from turboquant_hf.modeling.modules import TurboQuantWeight

IDS = torch.arange(3, 19).unsqueeze(0)


def _config():
    return turboquant_hf.TurboQuantConfig(bits=3, group_size=64)


def _spread(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.05)
    return model


def _llama():
    from conftest import tiny_llama_config
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(tiny_llama_config(intermediate_size=384))


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=256))


DEVICE_MAP = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
              "model.layers.1": "disk", "model.norm": "cpu", "lm_head": "cpu"}


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def sources(request, tmp_path_factory):
    """(float checkpoint, pre-quantized checkpoint, the resident quantized model)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp(request.param)
    build = {"llama": _llama, "qwen3_moe": _qwen3_moe}[request.param]
    _spread(build()).save_pretrained(root / "float")
    model = AutoModelForCausalLM.from_pretrained(root / "float", dtype=torch.float32, quantization_config=_config())
    model.save_pretrained(root / "tq")
    model.float_footprint = AutoModelForCausalLM.from_pretrained(root / "float", dtype=torch.float32).get_memory_footprint()
    return root, model


def _offloaded(path, folder, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map=DEVICE_MAP,
                                                offload_folder=str(folder), offload_buffers=True, **kw)


def _packed(model) -> dict:
    return {n: (m.tq_packed, m.tq_norms) for n, m in model.named_modules() if isinstance(m, TurboQuantWeight)}


@pytest.mark.parametrize("source", ["fly", "pre"])
def test_disk_offload_matches_resident_model(sources, source, tmp_path):
    root, resident = sources
    kw = {"quantization_config": _config()} if source == "fly" else {}
    model = _offloaded(root / ("float" if source == "fly" else "tq"), tmp_path / "offload", **kw)
    on_disk = [n for n, (p, _) in _packed(model).items() if p.is_meta]
    assert on_disk and all(n.startswith("model.layers.1.") for n in on_disk)
    assert not any(p.is_meta for n, (p, _) in _packed(model).items() if n.startswith("model.layers.0."))
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, resident(IDS).logits)
        assert torch.equal(model.generate(IDS[:, :8], max_new_tokens=4, do_sample=False),
                           resident.generate(IDS[:, :8], max_new_tokens=4, do_sample=False))
    # the footprint counts the packed bytes of every layer, offloaded or not, in place of the float32 weights
    packed = sum(p.numel() + n.numel() * n.element_size() for p, n in _packed(resident).values())
    floats = sum(m.rows * m.in_features * 4 for m in resident.modules() if isinstance(m, TurboQuantWeight))
    assert model.get_memory_footprint() == resident.float_footprint - floats + packed


def test_offloaded_model_saves_and_reloads(sources, tmp_path):
    from transformers import AutoModelForCausalLM

    root, resident = sources
    model = _offloaded(root / "tq", tmp_path / "offload")
    model.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    want, got = _packed(resident), _packed(again)
    assert want.keys() == got.keys()
    for name, (p, n) in want.items():
        assert torch.equal(got[name][0], p) and torch.equal(got[name][1], n), name


def test_disk_without_offload_buffers_keeps_packed_tensors_resident(sources, tmp_path):
    """accelerate offloads only parameters unless `offload_buffers=True`: the packed tensors (buffers) of a "disk"
    layer then stay in CPU memory, and the model computes the same."""
    from transformers import AutoModelForCausalLM

    root, resident = sources
    model = AutoModelForCausalLM.from_pretrained(root / "tq", dtype=torch.float32, device_map=DEVICE_MAP,
                                                 offload_folder=str(tmp_path / "o"))
    assert not any(p.is_meta for p, _ in _packed(model).values())
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, resident(IDS).logits)


def test_auto_device_map_sizes_layers_by_their_packed_bytes(sources, tmp_path):
    """`device_map="auto"` under a CPU budget: a budget the packed model fits (but not its float32 weights) keeps
    every layer in memory, quantized on the fly or pre-quantized alike; a smaller one offloads the later layers, and
    the model computes the same."""
    from transformers import AutoModelForCausalLM

    root, resident = sources
    footprint = resident.get_memory_footprint()
    assert footprint * 2 < resident.float_footprint
    maps = {}
    for budget in (int(footprint * 1.5), int(footprint * 0.8)):
        for source, kw in (("fly", {"quantization_config": _config()}), ("pre", {})):
            model = AutoModelForCausalLM.from_pretrained(
                root / ("float" if source == "fly" else "tq"), dtype=torch.float32, device_map="auto",
                max_memory={"cpu": budget}, offload_folder=str(tmp_path / f"{source}{budget}"), offload_buffers=True,
                **kw)
            maps[budget, source] = set(getattr(model, "hf_device_map", {"": "cpu"}).values())
            with torch.no_grad():
                assert torch.equal(model(IDS).logits, resident(IDS).logits), (budget, source)
    assert maps[int(footprint * 1.5), "fly"] == maps[int(footprint * 1.5), "pre"] == {"cpu"}
    assert maps[int(footprint * 0.8), "fly"] == maps[int(footprint * 0.8), "pre"] == {"cpu", "disk"}
