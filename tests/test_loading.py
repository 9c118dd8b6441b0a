"""No load returns random weights: every class that loads a bf16 checkpoint loads its TurboQuant version to the
saved model's exact logits, with or without a `quantization_config` in config.json, or raises `CheckpointError`."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM, pipeline

from turboquant_hf import TurboQuantConfig, TurboQuantLinear
from turboquant_hf.format.checkpoint import CheckpointError

IDS = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(7))


def _qwen_classes():
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration

    return {"multimodal": Qwen3_5MoeForConditionalGeneration, "text": Qwen3_5MoeForCausalLM,
            "auto": AutoModelForCausalLM}


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _strip_quantization_config(src: str, dst: str) -> str:
    """A copy of a saved folder in the published form: tq_config.json only, nothing in config.json."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    config = json.load(open(path))
    config.pop("quantization_config")
    json.dump(config, open(path, "w"), indent=2)
    assert os.path.isfile(os.path.join(dst, "tq_config.json"))
    return dst


def _builds_from(cls, directory) -> bool:
    """False where the class would ignore the saved config (the multimodal class on a text-only config builds
    its default full-size model): such pairs are not loads at all."""
    config = json.load(open(os.path.join(directory, "config.json")))
    wanted = getattr(getattr(cls, "config_class", None), "model_type", None)
    return not wanted or wanted == config["model_type"] or any(
        isinstance(v, dict) and v.get("model_type") == wanted for v in config.values())


def _bf16_loads_cleanly(cls, directory) -> bool:
    try:
        _, info = cls.from_pretrained(directory, output_loading_info=True)
    except Exception:
        return False
    return not info["missing_keys"] and not info["mismatched_keys"]


def _check_matrix(sources, savers, loaders, tmp_path):
    """For each bf16 source, each saving class and each loading class: identical logits or CheckpointError."""
    outcomes = {}
    for source_name, src in sources.items():
        for saver_name, saver in savers.items():
            quantized = saver.from_pretrained(src, quantization_config=TurboQuantConfig(bits=3, group_size=64))
            expected = _logits(quantized)
            saved = str(tmp_path / f"{source_name}-{saver_name}")
            quantized.save_pretrained(saved)
            plain = str(tmp_path / f"{source_name}-{saver_name}-bf16")
            # the same model unquantized, saved by the same class: which classes load it decides what must load
            saver.from_pretrained(src).save_pretrained(plain)
            published = _strip_quantization_config(saved, saved + "-tq_config_only")
            for loader_name, loader in loaders.items():
                if not _builds_from(loader, plain):
                    continue
                must_load = _bf16_loads_cleanly(loader, plain)
                for directory in (saved, published):
                    case = (source_name, saver_name, loader_name, os.path.basename(directory))
                    try:
                        model = loader.from_pretrained(directory)
                    except CheckpointError as e:
                        assert not must_load, (case, e)
                        outcomes[case] = "refused"
                        continue
                    assert any(isinstance(m, TurboQuantLinear) for m in model.modules()), case
                    assert torch.equal(_logits(model), expected), case
                    outcomes[case] = "loaded"
    return outcomes


def test_llama_load_matrix(tiny_llama_dir, tmp_path):
    outcomes = _check_matrix({"llama": tiny_llama_dir}, {"llama": LlamaForCausalLM},
                             {"llama": LlamaForCausalLM, "auto": AutoModelForCausalLM}, tmp_path)
    assert set(outcomes.values()) == {"loaded"}, outcomes


@pytest.fixture(scope="module")
def qwen_sources(tmp_path_factory):
    from conftest import tiny_qwen3_5_moe_model

    model = tiny_qwen3_5_moe_model()
    out = {}
    for layout, original in (("per_expert", True), ("fused", False)):
        d = str(tmp_path_factory.mktemp(f"qwen_{layout}"))
        model.save_pretrained(d, save_original_format=original)
        out[layout] = d
    return out


def test_qwen3_5_moe_load_matrix(qwen_sources, tmp_path):
    classes = _qwen_classes()
    savers = {k: classes[k] for k in ("multimodal", "text")}
    outcomes = _check_matrix(qwen_sources, savers, classes, tmp_path)
    # every class loads the multimodal save and the text classes the text save, with and without config.json's
    # block: 2 layouts x (3 + 2 loaders) x 2 folders (the multimodal class does not build from a text config)
    assert len(outcomes) == 20 and set(outcomes.values()) == {"loaded"}, outcomes


def test_pipeline_loads_a_tq_config_only_folder(tiny_llama_dir, tmp_path):
    quantized = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=TurboQuantConfig(bits=4))
    quantized.save_pretrained(tmp_path / "q")
    folder = _strip_quantization_config(str(tmp_path / "q"), str(tmp_path / "published"))
    for name in os.listdir(tiny_llama_dir):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(tiny_llama_dir, name), folder)
    generator = pipeline("text-generation", model=folder)
    assert isinstance(generator.model.model.layers[0].mlp.down_proj, TurboQuantLinear)
    assert torch.equal(_logits(generator.model), _logits(quantized))


ref_ckpt = pytest.importorskip("turboquant_vllm.checkpoint")


def test_reference_writer_checkpoint_loads_with_no_arguments(tiny_llama_dir, tmp_path):
    """The published form, written by the reference package itself: tq_config.json only."""
    out = str(tmp_path / "ref")
    ref_ckpt.save_tq3_checkpoint(tiny_llama_dir, out, bits=3, group_size=128)
    assert "quantization_config" not in json.load(open(os.path.join(out, "config.json")))
    explicit = AutoModelForCausalLM.from_pretrained(out, quantization_config=TurboQuantConfig())
    expected = _logits(explicit)
    for loader in (AutoModelForCausalLM, LlamaForCausalLM):
        model = loader.from_pretrained(out)
        assert model.config.quantization_config.group_size == 128
        assert sum(isinstance(m, TurboQuantLinear) for m in model.modules()) == 14
        assert torch.equal(_logits(model), expected), loader.__name__


@pytest.fixture
def quantized_llama(tiny_llama_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=TurboQuantConfig(bits=3))
    model.save_pretrained(tmp_path / "q")
    return str(tmp_path / "q")


def _edit_tensors(directory, edit):
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


NORMS = "model.layers.1.self_attn.k_proj.weight.tq_norms"
PACKED = "model.layers.1.mlp.up_proj.weight.tq_packed"


@pytest.mark.parametrize("published", [False, True], ids=["config_json", "tq_config_only"])
def test_deleted_norms_named(quantized_llama, tmp_path, published):
    directory = _strip_quantization_config(quantized_llama, str(tmp_path / "p")) if published else quantized_llama
    _edit_tensors(directory, lambda t: t.pop(NORMS))
    with pytest.raises(CheckpointError, match=NORMS.replace(".", r"\.")):
        AutoModelForCausalLM.from_pretrained(directory)


@pytest.mark.parametrize("published", [False, True], ids=["config_json", "tq_config_only"])
def test_renamed_packed_named(quantized_llama, tmp_path, published):
    directory = _strip_quantization_config(quantized_llama, str(tmp_path / "p")) if published else quantized_llama
    renamed = PACKED.replace("up_proj", "upp_proj")
    _edit_tensors(directory, lambda t: t.__setitem__(renamed, t.pop(PACKED)))
    with pytest.raises(CheckpointError, match="upp_proj"):
        AutoModelForCausalLM.from_pretrained(directory)


def test_tensors_without_any_description_named(quantized_llama, tmp_path):
    """TurboQuant tensors, but neither config.json nor tq_config.json says so: an error with the fix."""
    directory = _strip_quantization_config(quantized_llama, str(tmp_path / "p"))
    os.remove(os.path.join(directory, "tq_config.json"))
    with pytest.raises(CheckpointError, match=r"tq_packed.*quantization_config=TurboQuantConfig"):
        AutoModelForCausalLM.from_pretrained(directory)
    # the fix the message names works
    model = AutoModelForCausalLM.from_pretrained(directory, quantization_config=TurboQuantConfig(bits=3))
    assert isinstance(model.model.layers[0].mlp.down_proj, TurboQuantLinear)


def test_qwen_checkpoint_into_llama_class_named(qwen_sources, tmp_path):
    from transformers import Qwen3_5MoeForCausalLM

    q = Qwen3_5MoeForCausalLM.from_pretrained(qwen_sources["fused"], quantization_config=TurboQuantConfig(bits=3))
    q.save_pretrained(tmp_path / "q")
    for directory in (str(tmp_path / "q"), _strip_quantization_config(str(tmp_path / "q"), str(tmp_path / "p"))):
        with pytest.raises(CheckpointError, match=r"linear_attn\.\w+\.weight.*LlamaForCausalLM|LlamaForCausalLM.*"
                                                  r"linear_attn"):
            LlamaForCausalLM.from_pretrained(directory)


def test_documented_flow_save_then_pipeline(tiny_llama_dir, tmp_path):
    """The README's flow as written: quantize, save_pretrained, pipeline(model=folder). The tokenizer of the
    source folder is saved beside the model."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=TurboQuantConfig(bits=3))
    model.save_pretrained(tmp_path / "my-model-tq3")
    assert os.path.isfile(tmp_path / "my-model-tq3" / "tokenizer.json")
    generator = pipeline("text-generation", model=str(tmp_path / "my-model-tq3"))
    out = generator("the a of", max_new_tokens=4, do_sample=False)
    assert out[0]["generated_text"].startswith("the a of")
    assert torch.equal(_logits(generator.model), _logits(model))
