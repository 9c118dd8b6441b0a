"""CPU decode speed of TurboQuant against bf16, in one run: SmolLM2-135M generating, and one 4096x14336 layer.

    python benchmarks/cpu_decode.py [--bits 3] [--new-tokens 64] [--repeats 5] [--layer-repeats 30]
                                    [--skip-model] [--skip-layer] [--skip-moe]

Model: greedy generation with a fixed prompt, batch 1, both models in the same dtype (bf16 by default), the two
models' runs interleaved, median of the repeats. Layer: a 14336x4096 Gaussian weight (Llama-3-8B's gate/up
shape) quantized with G=128, `TurboQuantLinear` against bf16 `F.linear` on bf16 activations of M = 1 and 16 rows,
interleaved, median of the repeats. MoE: the routed-experts op at one token (8 of 32 experts of Qwen3-30B-A3B's
shapes), the compiled kernel against the torch reference. Prints tokens per second or milliseconds, and the ratio
(> 1: faster), with the path the CPU product ran on (`turboquant_hf.modeling.cpu_kernel.status()`).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from offline_assets import smollm2_base

import turboquant_hf  # noqa: F401
from turboquant_hf import TurboQuantConfig
from turboquant_hf.format import codec
from turboquant_hf.format import constants as fmt
from turboquant_hf.modeling import cpu_kernel
from turboquant_hf.modeling.modules import TurboQuantLinear, quantize_linear_


def decode_rate(model, prompt, new_tokens: int) -> float:
    t = time.perf_counter()
    out = model.generate(**prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return (out.shape[1] - prompt["input_ids"].shape[1]) / (time.perf_counter() - t)


def model_table(args, dtype) -> None:
    base_dir = smollm2_base()
    tok = AutoTokenizer.from_pretrained(base_dir)
    prompt = tok("The sea was calm that morning, and", return_tensors="pt")
    models = {"base": AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype),
              "quant": AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype,
                                                            quantization_config=TurboQuantConfig(bits=args.bits))}
    rates = {k: [] for k in models}
    with torch.no_grad():
        for m in models.values():
            m.generate(**prompt, max_new_tokens=4, do_sample=False)  # warm-up
        for _ in range(args.repeats):
            for k, m in models.items():
                rates[k].append(decode_rate(m, prompt, args.new_tokens))
    r_base, r_quant = (statistics.median(rates[k]) for k in ("base", "quant"))
    print(f"SmolLM2-135M-Instruct, batch 1, {args.new_tokens} new tokens, {args.dtype}, median of {args.repeats}\n")
    print("| model | tokens/s | ratio vs base |")
    print("|---|---|---|")
    print(f"| base ({args.dtype}) | {r_base:.1f} | 1.00 |")
    print(f"| TurboQuant {args.bits}-bit | {r_quant:.1f} | {r_quant / r_base:.2f} |\n")


def layer_table(args) -> None:
    torch.manual_seed(0)
    out_features, in_features = 14336, 4096
    w = torch.randn(out_features, in_features) * in_features**-0.5
    layer = TurboQuantLinear(in_features, out_features, bias=False, bits=args.bits, group_size=128)
    quantize_linear_(layer, w)
    w16 = w.to(torch.bfloat16)
    print(f"one {in_features} -> {out_features} layer, {args.bits}-bit G=128 against bf16 F.linear, bf16 activations, "
          f"median of {args.layer_repeats}\n")
    print("| M | bf16 ms | TurboQuant ms | ratio (bf16 / TurboQuant) |")
    print("|---|---|---|---|")
    with torch.no_grad():
        for m in (1, 16):
            x = torch.randn(m, in_features).to(torch.bfloat16)
            runs = {"bf16": lambda x=x: F.linear(x, w16), "tq": lambda x=x: layer(x)}
            times = {k: [] for k in runs}
            for fn in runs.values():
                fn()
            for _ in range(args.layer_repeats):
                for k, fn in runs.items():
                    t = time.perf_counter()
                    fn()
                    times[k].append(time.perf_counter() - t)
            t_bf16, t_tq = (statistics.median(times[k]) * 1e3 for k in ("bf16", "tq"))
            print(f"| {m} | {t_bf16:.2f} | {t_tq:.2f} | {t_bf16 / t_tq:.2f} |")
    print()


def moe_table(args) -> None:
    """The routed-experts op at decode (one token, 8 of 32 experts, Qwen3-30B-A3B's expert shapes): the compiled
    kernel against the torch reference (TURBOQUANT_CPU_KERNEL=0), interleaved."""
    torch.manual_seed(0)
    experts, hidden, inter, top_k, g = 32, 2048, 768, 8, 128
    gate_up = codec.quantize_weight(torch.randn(experts * 2 * inter, hidden) * hidden**-0.5, args.bits, g)
    down = codec.quantize_weight(torch.randn(experts * hidden, inter) * inter**-0.5, args.bits, g)
    cb = fmt.codebook(fmt.levels_for_bits(args.bits), g)
    s1, s2 = fmt.signs(g)
    x = torch.randn(1, hidden).to(torch.bfloat16)
    index = torch.randperm(experts)[:top_k].view(1, top_k)
    weights = torch.softmax(torch.randn(1, top_k), -1).to(torch.bfloat16)
    times = {"1": [], "0": []}
    saved = os.environ.get("TURBOQUANT_CPU_KERNEL")
    try:
        for _ in range(args.layer_repeats + 1):
            for setting, ts in times.items():
                os.environ["TURBOQUANT_CPU_KERNEL"] = setting
                t = time.perf_counter()
                torch.ops.turboquant.moe_experts_nograd(x, index, weights, *gate_up, cb, *down, cb, s1, s2, g,
                                                        experts, "silu")
                ts.append(time.perf_counter() - t)
    finally:
        if saved is None:
            os.environ.pop("TURBOQUANT_CPU_KERNEL", None)
        else:
            os.environ["TURBOQUANT_CPU_KERNEL"] = saved
    kernel, reference = (statistics.median(times[k][1:]) * 1e3 for k in ("1", "0"))
    print(f"routed experts op, 1 token, top-{top_k} of {experts} experts ({hidden} -> 2x{inter} -> {hidden}), "
          f"{args.bits}-bit G={g}, median of {args.layer_repeats}\n")
    print("| reference ms | kernel ms | ratio (reference / kernel) |")
    print("|---|---|---|")
    print(f"| {reference:.2f} | {kernel:.2f} | {reference / kernel:.2f} |\n")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bits", type=float, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layer-repeats", type=int, default=30)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--skip-model", action="store_true")
    p.add_argument("--skip-layer", action="store_true")
    p.add_argument("--skip-moe", action="store_true")
    args = p.parse_args()
    args.bits = int(args.bits) if float(args.bits).is_integer() else args.bits
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads, {platform.machine()}, "
          f"{cpu_name()}), transformers {transformers.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\nCPU product: {cpu_kernel.status()}\n")
    if not args.skip_model:
        model_table(args, dtype)
    if not args.skip_layer:
        layer_table(args)
    if not args.skip_moe:
        moe_table(args)


if __name__ == "__main__":
    main()
