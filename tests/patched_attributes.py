"""What a process that uses turboquant_hf has replaced in transformers and PEFT (run by tests/test_patches.py).

    python patched_attributes.py WORKDIR

prints one JSON object. The process first runs the same kind of work with transformers alone (a tiny Llama and a
tiny Qwen3-MoE saved, loaded, run, a PEFT adapter on one), so that transformers' own lazily filled state is in
place; then it records every attribute of every transformers and peft module, of every class those modules
define, and every item of their dicts (registries such as the quantizer mappings and the parallel styles); then
it imports turboquant_hf and quantizes, saves, reloads (the written form and the published form), runs, counts,
puts LoRA adapters on, dequantizes; then it records again. Reported:

- `replaced`: names whose value is no longer the same object (or is gone);
- `added`: names that are new and hold something of turboquant_hf's (a function, class or instance of it);
- `on_models`: per model loaded with TurboQuant, the methods its instance holds in place of its class's.
"""

from __future__ import annotations

import json
import os
import sys

ROOTS = ("transformers", "peft")


def _ours(value) -> bool:
    for attr in ("__func__", "func", "__wrapped__"):
        value = getattr(value, attr, value) if not isinstance(value, type) else value
    module = getattr(value, "__module__", None) if isinstance(value, type) or callable(value) else None
    if module is None:
        module = getattr(type(value), "__module__", None)
    return isinstance(module, str) and module.split(".")[0] in ("turboquant_hf", "turboquant_hf_autoload")


def _snapshot() -> dict:
    out = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name in ROOTS or name.startswith(tuple(r + "." for r in ROOTS))):
            continue
        for key, value in list(getattr(module, "__dict__", {}).items()):
            if key == "__warningregistry__":  # (the warnings module's record of the warnings shown, no replacement)
                continue
            where = f"{name}.{key}"
            out[where] = value
            items = []
            if isinstance(value, type) and value.__module__ == name and value.__name__ == key:  # (not aliases)
                for ckey, cvalue in list(vars(value).items()):
                    out[f"{where}.{ckey}"] = cvalue
                    if type(cvalue) is dict:  # (plain dicts only: lazy mappings import on iteration)
                        items.append((f"{where}.{ckey}", cvalue))
            elif type(value) is dict:
                items.append((where, value))
            for prefix, mapping in items:
                for k, v in list(mapping.items()):
                    if isinstance(k, str):
                        out[f"{prefix}[{k!r}]"] = v
    return out


def _tiny_models(workdir: str):
    """A tiny Llama and a tiny Qwen3-MoE saved in bf16 (transformers only)."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False))
    dirs = {}
    for name, model in (("llama", llama), ("moe", moe)):
        dirs[name] = os.path.join(workdir, name)
        model.to(torch.bfloat16).save_pretrained(dirs[name])
    return dirs


def _work_without_us(dirs: dict, workdir: str) -> None:
    import peft
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    ids = torch.tensor([[1, 5, 9, 17, 33]])
    for name, d in dirs.items():
        AutoConfig.from_pretrained(d)
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        model(ids)
        model.save_pretrained(os.path.join(workdir, "plain-" + name))
        model.num_parameters()
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(dirs["llama"], dtype=torch.float32),
                                peft.LoraConfig(r=2, target_modules=["q_proj"]))
    model(input_ids=ids, labels=ids).loss.backward()


def _work_with_us(dirs: dict, workdir: str) -> dict:
    import peft
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import turboquant_hf
    import turboquant_hf.integration.lora

    ids = torch.tensor([[1, 5, 9, 17, 33]])
    models = {}
    for name, d in dirs.items():
        q = AutoModelForCausalLM.from_pretrained(d, quantization_config=turboquant_hf.TurboQuantConfig(bits=3),
                                                 dtype=torch.float32)
        q(ids)
        saved = os.path.join(workdir, "tq-" + name)
        q.save_pretrained(saved, model_card=False)
        q.num_parameters()
        AutoConfig.from_pretrained(saved)
        models[name] = q
        models[name + " reloaded"] = again = AutoModelForCausalLM.from_pretrained(saved)
        again(ids)
    published = os.path.join(workdir, "tq-llama")  # the published form: tq_config.json, config.json without one
    with open(os.path.join(published, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config")
    with open(os.path.join(published, "config.json"), "w") as f:
        json.dump(config, f)
    models["llama published"] = AutoModelForCausalLM.from_pretrained(published)
    try:
        peft.get_peft_model(models["llama published"], peft.LoraConfig(r=2, target_modules=["q_proj"]))
    except ValueError:
        pass
    adapted = turboquant_hf.integration.lora.get_peft_model(models["llama"],
                                                            peft.LoraConfig(r=2, target_modules=["q_proj"]))
    adapted(input_ids=ids, labels=ids).loss.backward()
    models["llama reloaded"].dequantize()
    return models


def main(workdir: str) -> None:
    import importlib

    import torch  # noqa: F401

    for name in ("transformers.modeling_utils", "transformers.configuration_utils", "transformers.quantizers.auto",
                 "transformers.quantizers.base", "transformers.core_model_loading", "transformers.utils.hub",
                 "transformers.distributed.tensor_parallel", "transformers.integrations.tensor_parallel",
                 "peft", "peft.tuners.lora.model", "peft.tuners.lora.layer", "peft.tuners.tuners_utils"):
        importlib.import_module(name)
    dirs = _tiny_models(workdir)
    _work_without_us(dirs, workdir)
    before = _snapshot()
    models = _work_with_us(dirs, workdir)
    after = _snapshot()
    replaced = sorted(k for k, v in before.items() if k not in after or after[k] is not v)
    added = sorted(k for k, v in after.items() if k not in before and _ours(v))
    on_models = {name: sorted(k for k, v in vars(m).items() if callable(v) and hasattr(type(m), k))
                 for name, m in models.items()}
    json.dump({"replaced": replaced, "added": added, "on_models": on_models,
               "transformers": __import__("transformers").__version__}, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])
