"""CPU decode speed of TurboQuant SmolLM2-135M against the unquantized model, in one run.

    python benchmarks/cpu_decode.py [--bits 3] [--new-tokens 64] [--repeats 3]

Greedy generation with a fixed prompt, batch 1, both models in the same dtype (bf16 by default), median
of the repeats; prints tokens per second and the ratio (quantized / base; > 1 means faster).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from offline_assets import smollm2_base  # noqa: E402

import turboquant_hf  # noqa: E402,F401
from turboquant_hf import TurboQuantConfig  # noqa: E402


def decode_rate(model, prompt, new_tokens: int, repeats: int) -> float:
    model.generate(**prompt, max_new_tokens=4, do_sample=False)  # warm-up
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = model.generate(**prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        rates.append((out.shape[1] - prompt["input_ids"].shape[1]) / (time.perf_counter() - t))
    return statistics.median(rates)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bits", type=float, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = p.parse_args()
    bits = int(args.bits) if float(args.bits).is_integer() else args.bits
    dtype = getattr(torch, args.dtype)

    base_dir = smollm2_base()
    tok = AutoTokenizer.from_pretrained(base_dir)
    prompt = tok("The sea was calm that morning, and", return_tensors="pt")
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    quant = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype, quantization_config=TurboQuantConfig(bits=bits))
    r_base = decode_rate(base, prompt, args.new_tokens, args.repeats)
    r_quant = decode_rate(quant, prompt, args.new_tokens, args.repeats)
    print(f"SmolLM2-135M-Instruct, batch 1, {args.new_tokens} new tokens, {args.dtype}, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads, {platform.machine()}), transformers {transformers.__version__}, "
          f"{time.strftime('%Y-%m-%d')}\n")
    print("| model | tokens/s | ratio vs base |")
    print("|---|---|---|")
    print(f"| base ({args.dtype}) | {r_base:.1f} | 1.00 |")
    print(f"| TurboQuant {bits}-bit | {r_quant:.1f} | {r_quant / r_base:.2f} |")


if __name__ == "__main__":
    main()
