"""Time of calibrated rounding on a 7-8B-shaped model (or a tiny one, to try the script on a CPU).

    python benchmarks/calibration_speed.py [--shape llama8b|tiny] [--layers N] [--samples 16] [--length 512]
                                           [--bits 3] [--device cuda] [--json out.json] [--md out.md]

The model is a Llama-3.1-8B-shaped `LlamaForCausalLM` (hidden 4096, MLP 14336, 32 layers, vocabulary 128256) in
bfloat16 on CUDA (float32 on a CPU) with random normal(0, 0.02) weights, all 32 decoder layers or the first
`--layers` (the time per layer is what scales): the time of calibration depends on the shapes, the number of tokens and
the device, not on the values. Calibration data: `--samples` sequences of `--length` random token ids. Timed:
`calibration.calibrate_model` (the loader's path: block inputs captured once, then per decoder layer the input
Hessians, error-feedback rounding of every Linear in the rotated basis, the stored norms fitted, and the layer run
again on its quantized weights), and round-to-nearest of the same model for comparison. Peak device memory is
reported on CUDA.
"""

from __future__ import annotations

import os

os.environ.setdefault("USE_HUB_KERNELS", "0")  # (transformers 5.25 fetches Hub kernels on CUDA: none offline)

import argparse
import datetime
import gc
import json
import platform
import sys
import time

import torch
import transformers

from turboquant_hf import TurboQuantConfig
from turboquant_hf.calibration.sequential import calibrate_model, rtn_quantize
from turboquant_hf.quantization import planning
from turboquant_hf.quantization.config import CalibrationConfig

SHAPES = {
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024),
}


def build(shape: str, device: str, dtype: torch.dtype, layers: int | None = None):
    dims = dict(SHAPES[shape], **({"num_hidden_layers": layers} if layers else {}))
    config = transformers.LlamaConfig(**dims, max_position_embeddings=8192, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM._from_config(config, dtype=dtype)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02, generator=gen)
            else:
                p.fill_(1.0)  # the RMSNorm weights
        for name, m in list(model.named_modules()):
            if isinstance(getattr(m, "inv_freq", None), torch.Tensor) and hasattr(m, "config"):
                with torch.device("cpu"):
                    fresh = type(m)(m.config)
                model.set_submodule(name, fresh.to(device))
    return model.eval()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), default="llama8b")
    p.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--bits", type=float, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json")
    p.add_argument("--md")
    args = p.parse_args()
    bits = int(args.bits) if args.bits == int(args.bits) else args.bits
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32

    gen = torch.Generator().manual_seed(1)
    vocab = SHAPES[args.shape]["vocab_size"]
    batches = [torch.randint(0, vocab, (1, args.length), generator=gen) for _ in range(args.samples)]
    cal = CalibrationConfig(data=batches, samples=args.samples, sequence_length=args.length)
    config = TurboQuantConfig(bits=bits, group_size=128, calibration=cal)

    result = {"shape": args.shape, "bits": bits, "group_size": 128, "samples": args.samples, "length": args.length,
              "tokens": args.samples * args.length, "dtype": str(dtype).removeprefix("torch.")}
    blocks = args.layers or SHAPES[args.shape]["num_hidden_layers"]
    result["layers"] = blocks
    for method in ("round-to-nearest", "calibrated"):
        model = build(args.shape, args.device, dtype, args.layers)
        if args.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        base_memory = torch.cuda.memory_allocated() if args.device.startswith("cuda") else 0
        done = []
        _sync(args.device)
        t0 = time.perf_counter()
        if method == "calibrated":
            calibrate_model(model, config, batches,
                            progress=lambda i, n: (done.append(time.perf_counter() - t0),
                                                   print(f"block {i}/{n}: {done[-1]:.1f} s", flush=True)))
        else:
            rtn_quantize(model, planning.from_config(model, config))
        _sync(args.device)
        seconds = time.perf_counter() - t0
        result[method] = {"seconds": round(seconds, 2)}
        if method == "calibrated" and len(done) == blocks:
            per_block = [b - a for a, b in zip([0.0, *done[:-1]], done)]
            result[method]["seconds_per_block_median"] = round(sorted(per_block)[len(per_block) // 2], 2)
        if args.device.startswith("cuda"):
            peak = torch.cuda.max_memory_allocated() - base_memory
            result[method]["peak_extra_gib"] = round(peak / 2**30, 2)
        print(method, result[method], flush=True)
        del model
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()

    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else \
        f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
    result.update(device=device, date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  versions={"torch": torch.__version__, "transformers": transformers.__version__},
                  command="python benchmarks/calibration_speed.py " + " ".join(sys.argv[1:]))
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.md:
        cal_row = result["calibrated"]
        with open(args.md, "w") as f:
            f.write("| shape | layers | bits | calibration tokens | calibrated (s) | per layer (s, median) | "
                    "round-to-nearest (s) | peak extra memory (GiB) |\n|---|---|---|---|---|---|---|---|\n")
            f.write(f"| {args.shape} | {blocks} | {bits} | {result['tokens']} | {cal_row['seconds']} | "
                    f"{cal_row.get('seconds_per_block_median', 'n/a')} | {result['round-to-nearest']['seconds']} | "
                    f"{cal_row.get('peak_extra_gib', 'n/a')} |\n")


if __name__ == "__main__":
    main()
