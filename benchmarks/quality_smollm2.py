"""Perplexity and KL divergence of TurboQuant SmolLM2-135M against its base, next to the reference package.

    python benchmarks/quality_smollm2.py [--tokens 4096] [--bits 4 3 2]

Both models run in float32 on CPU; the text is Hamlet and Macbeth from the `shakespeare` archive. The
reference column is the independent `turboquant-plus-vllm` package's quantize -> dequantize of the same
layers (rows zero-padded to G), so the two columns must agree.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from offline_assets import shakespeare_text, smollm2_base  # noqa: E402

import turboquant_hf  # noqa: E402,F401
from turboquant_hf import TurboQuantConfig  # noqa: E402
from turboquant_hf.reporting.evaluation import (  # noqa: E402
    compare_log_probs,
    tokenize_text,
    window_log_probs,
)


def reference_model(base, bits: int, group_size: int):
    from turboquant_vllm.torch_ops import PolarQuantTorch

    model = copy.deepcopy(base)
    q = PolarQuantTorch(group_size, bits, seed=42, device="cpu")
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name != "lm_head":
            w = m.weight.data
            rows, cols = w.shape
            padded = -(-cols // group_size) * group_size
            idx, norms = q.quantize(torch.nn.functional.pad(w, (0, padded - cols)).reshape(-1, group_size),
                                    norm_correction=True)
            m.weight.data = q.dequantize(idx, norms).reshape(rows, padded)[:, :cols].contiguous()
    return model


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--bits", type=int, nargs="+", default=[4, 3, 2])
    p.add_argument("--group-size", type=int, default=128)
    args = p.parse_args()

    base_dir = smollm2_base()
    tok = AutoTokenizer.from_pretrained(base_dir)
    ids = tokenize_text(tok, shakespeare_text(), args.tokens)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    base_lp = window_log_probs(base, ids)
    rows = []
    for bits in args.bits:
        ours = AutoModelForCausalLM.from_pretrained(
            base_dir, dtype=torch.float32, quantization_config=TurboQuantConfig(bits=bits, group_size=args.group_size)
        )
        mine = compare_log_probs(base_lp, window_log_probs(ours, ids), ids)
        ref = compare_log_probs(base_lp, window_log_probs(reference_model(base, bits, args.group_size), ids), ids)
        rows.append((bits, mine, ref))
    print(f"SmolLM2-135M-Instruct, {len(ids) - 1} predicted tokens of Shakespeare, G={args.group_size}, "
          f"float32 on CPU ({platform.processor() or platform.machine()}), torch {torch.__version__}, "
          f"transformers {transformers.__version__}, {time.strftime('%Y-%m-%d')}\n")
    print("| bits | base PPL | TurboQuant PPL | reference PPL | TurboQuant KL (nats) | reference KL |")
    print("|---|---|---|---|---|---|")
    for bits, mine, ref in rows:
        print(f"| {bits} | {mine.base_perplexity:.2f} | {mine.quantized_perplexity:.2f} | "
              f"{ref.quantized_perplexity:.2f} | {mine.mean_kl:.4f} | {ref.mean_kl:.4f} |")


if __name__ == "__main__":
    main()
