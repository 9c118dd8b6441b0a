"""Quantize the full-size Qwen3.6-35B-A3B text model (random bf16 weights) on one GPU, in each recipe.

    python benchmarks/qwen36_full_size.py [--recipes tq3 tq3a-tqTe] [--new-tokens 8]

No checkpoint is needed: the model is built on the meta device, its Linear layers and fused experts are
replaced exactly as `from_pretrained(..., quantization_config=...)` does, the full-precision rest is
materialised on the GPU, and each replaced tensor is drawn as random bf16 (std 0.02) on the GPU and
quantized there, one tensor at a time. Reports quantization time, bytes per tier, peak GPU memory and a
short greedy `generate`.
"""

from __future__ import annotations

import os

os.environ.setdefault("USE_HUB_KERNELS", "0")  # (transformers 5.25 fetches Hub kernels on CUDA: none offline)

import argparse
import gc
import json
import time

import torch
import transformers

import turboquant_hf  # noqa: F401
from turboquant_hf.format import codec
from turboquant_hf.modeling.modules import TurboQuantWeight
from turboquant_hf.quantization.recipes import get_recipe
from turboquant_hf.reporting.sizing import apply_plan, size_report


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def build(recipe: str, device: str, config=None):
    from transformers.models.qwen3_5_moe import (
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
    )

    config = config or Qwen3_5MoeTextConfig()  # the 35B-A3B defaults: 40 layers, 256 experts, hidden 2048
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM._from_config(config, dtype=torch.bfloat16)
    apply_plan(model, get_recipe(recipe))
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p, dtype=torch.float32).uniform_(1, 16, generator=g)))
            elif name.endswith("dt_bias"):
                p.fill_(1.0)
            elif p.dim() >= 2:
                p.normal_(0, 0.02, generator=g)
            else:
                p.zero_()  # Qwen3.5 RMSNorm weights are zero-centred (scale 1 + w)
    # rotary inverse frequencies were computed at init on the meta device: rebuild those modules for real
    for name, m in list(model.named_modules()):
        if isinstance(getattr(m, "inv_freq", None), torch.Tensor) and hasattr(m, "config"):
            with torch.device("cpu"):
                fresh = type(m)(m.config)
            model.set_submodule(name, fresh.to(device))
    _sync(device)
    t = time.perf_counter()
    weights = 0
    for name, m in model.named_modules():
        if isinstance(m, TurboQuantWeight):
            source = torch.empty(m.source_shape, dtype=torch.bfloat16, device=device).normal_(0, 0.02, generator=g)
            m.load_packed_(*codec.quantize_weight(source, m.bits, m.group_size, name=name))
            weights += source.numel()
            del source
    _sync(device)
    return model.eval(), time.perf_counter() - t, weights


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", nargs="+", default=["tq3", "tq3a-tqTe"])
    p.add_argument("--new-tokens", type=int, default=8)
    args = p.parse_args()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}")
    results = []
    for recipe in args.recipes:
        torch.cuda.reset_peak_memory_stats()
        model, seconds, weights = build(recipe, "cuda")
        report = size_report(model)
        peak_build = torch.cuda.max_memory_allocated()
        ids = torch.randint(0, 248320, (1, 16), device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
        torch.cuda.synchronize()
        gen_s = time.perf_counter() - t
        row = {
            "recipe": recipe,
            "quantize_seconds": round(seconds, 1),
            "quantized_weights": weights,
            "weights_per_second": round(weights / seconds),
            "total_GB": round(report["total_bytes"] / 1e9, 3),
            "tiers": {str(k): {"GB": round(v["bytes"] / 1e9, 3), "bpw": round(v["bits_per_weight"], 3)}
                      for k, v in report["tiers"].items()},
            "peak_GB_while_quantizing": round(peak_build / 1e9, 2),
            "peak_GB_with_generate": round(torch.cuda.max_memory_allocated() / 1e9, 2),
            "generated_tokens": int(out.shape[1] - ids.shape[1]),
            "generate_seconds_eager": round(gen_s, 2),
        }
        print(json.dumps(row))
        results.append(row)
        del model, out
        gc.collect()
        torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    main()
