"""Mixed precision under a bit budget on SmolLM2-135M (or Gemma-3-270M): which sensitivity measure allocates the
bits best.

    python benchmarks/budget_smollm2.py [--model smollm2|gemma3] [--budgets 3.5 3.75] [--rule-average]
                                        [--samples 4] [--kl-samples 2] [--length 256] [--eval-tokens 2048]
                                        [--json out.json]

Sensitivities are measured on Shakespeare plays other than Hamlet and Macbeth (offline_assets.CALIBRATION_PLAYS);
every allocation is evaluated by mean KL(base || quantized) of the next-token distributions on Hamlet + Macbeth
(the project's evaluation text). Round-to-nearest rounding, G = 128, base and quantized models in float32 on CPU
(each quantized weight replaced by its TurboQuant reconstruction, the same numbers the packed model computes).
Budgets are stored bits per quantized weight, group norms included (turboquant_hf.calibration.budget).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import re
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from offline_assets import (
    CALIBRATION_PLAYS,
    gemma3_base,
    shakespeare_text,
    smollm2_base,
)

from turboquant_hf import TurboQuantConfig
from turboquant_hf.calibration import budget
from turboquant_hf.reporting.evaluation import (
    compare_log_probs,
    tokenize_text,
    window_log_probs,
)

RULE = (r"\.v_proj$", r"\.down_proj$")
MODELS = {"smollm2": smollm2_base, "gemma3": gemma3_base}


def spearman(a: list[float], b: list[float]) -> float:
    ra = torch.tensor(a).argsort().argsort().float()
    rb = torch.tensor(b).argsort().argsort().float()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def quantized_copy(base, config, assignment):
    model = copy.deepcopy(base)
    linears, _ = budget.quantized_tensors(model, config)
    for name in linears:
        module = model.get_submodule(name)
        bits = assignment.get(name, config.bits_for(name))
        module.weight.data = budget._rounded(module.weight.data, bits, config.group_size)
    return model


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=list(MODELS), default="smollm2")
    p.add_argument("--budgets", type=float, nargs="+", default=[3.5, 3.75])
    p.add_argument("--rule-average", action="store_true",
                   help="also a budget equal to the bits per weight of every v_proj and down_proj at 4 bits")
    p.add_argument("--samples", type=int, default=4, help="sequences for the Hessian/Fisher measures")
    p.add_argument("--kl-samples", type=int, default=2, help="sequences for the measured-KL sensitivity")
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--eval-tokens", type=int, default=2048)
    p.add_argument("--measures", nargs="+", default=list(budget.MEASURES))
    p.add_argument("--allow-lower", action="store_true", help="2 bits among the candidate widths")
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(1)

    base_dir = MODELS[args.model]()
    tok = AutoTokenizer.from_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cal_ids = tokenize_text(tok, shakespeare_text(CALIBRATION_PLAYS), args.samples * args.length)
    batches = [cal_ids[i * args.length:(i + 1) * args.length].unsqueeze(0) for i in range(args.samples)]
    eval_ids = tokenize_text(tok, shakespeare_text(), args.eval_tokens)
    base_lp = window_log_probs(base, eval_ids)

    config = TurboQuantConfig(bits=3, group_size=128)
    widths = budget.default_widths(config, args.allow_lower)
    losses, seconds = {}, {}
    for measure in args.measures:
        if measure == "auto":  # an allocation-level choice: run per budget below
            continue
        t0 = time.perf_counter()
        use = batches[: args.kl_samples] if measure == "kl" else batches
        losses[measure] = budget.sensitivities(base, config, use, measure, widths)
        seconds[measure] = time.perf_counter() - t0
        print(f"{measure}: {seconds[measure]:.1f} s", flush=True)

    def gain(m):
        return [losses[m][n][3] - losses[m][n][4] for n in sorted(losses[m])]

    # rank agreement of the 3 -> 4 bit loss drops with the measured-KL drops
    ranks = {m: spearman(gain(m), gain("kl")) for m in losses if "kl" in losses and m != "kl"}

    def evaluate(assignment, cfg):
        model = quantized_copy(base, cfg, assignment)
        report = compare_log_probs(base_lp, window_log_probs(model, eval_ids), eval_ids)
        return {"bits_per_weight": budget.bits_per_weight(base, cfg, assignment), "kl": report.mean_kl,
                "ppl": report.quantized_perplexity, "base_ppl": report.base_perplexity,
                "upgraded": sum(1 for b in assignment.values() if b == 4),
                "lowered": sum(1 for b in assignment.values() if b == 2)}

    rows = [{"budget": None, "allocation": "uniform 3-bit", **evaluate({}, config)}]
    budgets = list(args.budgets)
    if args.rule_average:
        linears, _ = budget.quantized_tensors(base, config)
        every = {n: 4 for n in linears if any(re.search(r, n) for r in RULE)}
        budgets.append(round(budget.bits_per_weight(base, config, every), 4))
    for target in budgets:
        cfg = TurboQuantConfig(bits=3, group_size=128, target_bits_per_weight=target)
        for m, measured in losses.items():
            chosen = budget.allocate_from(base, cfg, measured, widths)
            rows.append({"budget": target, "allocation": m, **evaluate(chosen, cfg)})
        if "auto" in args.measures:
            t0 = time.perf_counter()
            report = {}
            chosen = budget.allocate_bits(base, cfg, batches, widths=widths, report=report)
            seconds[f"auto {target}"] = time.perf_counter() - t0
            rows.append({"budget": target, "allocation": f"auto (chose {report['measure']})",
                         "kl_on_calibration": report["kl"], **evaluate(chosen, cfg)})
            print(rows[-1], flush=True)
        rows.append({"budget": target, "allocation": "rule v_proj+down_proj",
                     **evaluate(budget.fixed_rule(base, cfg, RULE), cfg)})
        print(rows[-1], flush=True)
    result = {"model": args.model, "rows": rows, "spearman_vs_kl": ranks, "seconds": seconds,
              "device": f"{platform.processor() or platform.machine()}, 1 thread",
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
              "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
              "widths": list(widths),
              "calibration": f"{args.samples} x {args.length} tokens of {', '.join(CALIBRATION_PLAYS)} "
                             f"({args.kl_samples} sequences for kl)",
              "evaluation": f"{len(eval_ids)} tokens of hamlet_gut.txt + macbeth_gut.txt"}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
