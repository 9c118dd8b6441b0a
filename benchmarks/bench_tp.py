"""Decode speed and memory per GPU under tensor parallelism, bf16 against TurboQuant, from saved checkpoints.

    python benchmarks/bench_tp.py prepare DIR [--models llama8b qwen36] [--recipes tq3]
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py run DIR [--batch 1 8] [--md tp2.md] [--json tp2.json]
    python benchmarks/bench_tp.py run DIR ...          # one process: the tp 1 rows of the same checkpoints

`prepare` builds each model from its config with random bf16 weights (bench_e2e's `build`), saves it, and saves
its TurboQuant checkpoint made the way users make one: `from_pretrained(bf16 checkpoint,
quantization_config=recipe)` then `save_pretrained`. `run` loads every checkpoint in DIR on each rank with
`tp_plan="auto"` (one process: on the one device) and times decoding at each batch size: eager steps over a
DynamicCache, and on CUDA the same steps captured in a CUDA graph over a StaticCache (NCCL's all-reduces are
captured with them) and replayed; tokens/s over the batch, the slowest rank's. Memory per rank: the bytes of its
part of the state dict, and (CUDA) the peak allocated during load and decode. Each rank's greedy tokens are
checked to be the same on every rank before its numbers count. `--tiny` (prepare) builds a two-layer Llama
instead, for running the whole path on CPU (gloo) where the timings mean nothing.
"""

from __future__ import annotations

import os

os.environ.setdefault("USE_HUB_KERNELS", "0")  # (transformers 5.25 fetches Hub kernels on CUDA: none offline)

import argparse
import json
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_e2e  # noqa: E402

from turboquant_hf.integration.tensor_parallel import local_state_bytes  # noqa: E402
from turboquant_hf.quantization.recipes import get_recipe  # noqa: E402

MANIFEST = "bench_tp.json"


def tiny_config():
    return transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                    max_position_embeddings=256, tie_word_embeddings=False)


def prepare(out: str, models: list[str], recipes: list[str], tiny: bool) -> list[dict]:
    """Save each model in bf16 and under each recipe below `out`; the list of checkpoints goes to its manifest."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    specs = ({"tiny": ("tiny Llama", tiny_config, "LlamaForCausalLM")} if tiny
             else {key: bench_e2e.MODELS[key] for key in models})
    group = 64 if tiny else 128
    entries = []
    for key, (label, make_config, cls_name) in specs.items():
        source = os.path.join(out, f"{key}-bf16")
        model = bench_e2e.build(make_config(), cls_name, None, device=device)
        model.save_pretrained(source)
        del model
        entries.append(dict(model=label, weights="bf16", path=os.path.basename(source)))
        for recipe in recipes:
            path = os.path.join(out, f"{key}-{recipe}")
            model = transformers.AutoModelForCausalLM.from_pretrained(
                source, quantization_config=get_recipe(recipe, group_size=group), dtype=torch.bfloat16,
                device_map=device)
            model.save_pretrained(path)
            del model
            entries.append(dict(model=label, weights=recipe, path=os.path.basename(path)))
        if device == "cuda":
            torch.cuda.empty_cache()
    with open(os.path.join(out, MANIFEST), "w") as f:
        json.dump(entries, f, indent=1)
    return entries


def _greedy(model, ids, steps: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)


def _gather(value):
    if not torch.distributed.is_initialized():
        return [value]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, value)
    return out


def measure(directory: str, entry: dict, batches: list[int], steps: int, prompt: int) -> list[dict]:
    """The rows of one checkpoint: for each batch size, eager and (CUDA) CUDA-graph decode tokens/s."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    kw = {"tp_plan": "auto"} if world > 1 else {"device_map": "cuda" if cuda else "cpu"}
    if cuda:
        if world > 1:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.cuda.reset_peak_memory_stats()
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(directory, entry["path"]),
                                                              dtype=torch.bfloat16, **kw)
    model.eval()
    device = next(p for p in model.parameters()).device
    local = local_state_bytes(model)
    vocab = model.config.get_text_config().vocab_size
    rows = []
    for batch in batches:
        ids = torch.randint(0, vocab, (batch, prompt), generator=torch.Generator().manual_seed(batch)).to(device)
        tokens = _gather(_greedy(model, ids, 4).cpu())
        if any(not torch.equal(t, tokens[0]) for t in tokens):
            raise RuntimeError(f"{entry['path']}: the ranks decoded different tokens at batch {batch}")
        modes = [("eager", lambda: bench_e2e._eager_tps(model, ids, steps))]
        if cuda:
            modes.insert(0, ("CUDA graph", lambda: bench_e2e._graph_tps(model, model.forward, ids, steps, prompt)))
        for mode, timed in modes:
            row = dict(entry, tp=world, batch=batch, mode=mode)
            try:
                with torch.no_grad():
                    tps = timed()
            except Exception as exc:  # noqa: BLE001 - record why; the other rows still run
                tps, row["error"] = float("nan"), repr(exc)[:300]
            every = _gather(tps)  # every rank gathers, failed or not, so that none waits alone
            row["tokens_per_s"] = min(every) if all(t == t for t in every) else float("nan")
            rows.append(row)
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    per_rank = _gather((local, peak))
    for row in rows:
        row["GB_per_rank"] = max(b for b, _ in per_rank) / 1e9
        row["peak_GB_per_rank"] = max(p for _, p in per_rank) / 1e9
    del model
    if cuda:
        torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict], command: str) -> str:
    env = dict(torch=torch.__version__, transformers=transformers.__version__,
               device=torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    base = {(r["model"], r["tp"], r["batch"], r["mode"]): r["tokens_per_s"] for r in rows if r["weights"] == "bf16"}
    out = [f"- device: {env['device']} x {rows[0]['tp'] if rows else 1}; torch {env['torch']}, "
           f"transformers {env['transformers']}; date: {env['date']}", f"- command: `{command}`", "",
           "| model | weights | tp | GB per rank | peak GB per rank | batch | mode | tokens/s | ratio vs bf16 |",
           "|---|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        ref = base.get((r["model"], r["tp"], r["batch"], r["mode"]), float("nan"))
        out.append(f"| {r['model']} | {r['weights']} | {r['tp']} | {r['GB_per_rank']:.2f} | "
                   f"{r['peak_GB_per_rank']:.2f} | {r['batch']} | {r['mode']} | {r['tokens_per_s']:.1f} | "
                   f"{r['tokens_per_s'] / ref:.2f} |")
    out += [f"\n- {r['path']} ({r['mode']}, batch {r['batch']}): failed ({r['error']})" for r in rows if "error" in r]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("action", choices=["prepare", "run"])
    ap.add_argument("dir")
    ap.add_argument("--models", nargs="+", default=["llama8b"], choices=list(bench_e2e.MODELS))
    ap.add_argument("--recipes", nargs="+", default=["tq3"])
    ap.add_argument("--tiny", action="store_true", help="prepare: a two-layer Llama (the path on CPU)")
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--md")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.action == "prepare":
        os.makedirs(args.dir, exist_ok=True)
        for e in prepare(args.dir, args.models, args.recipes, args.tiny):
            print(json.dumps(e), flush=True)
        return 0
    with open(os.path.join(args.dir, MANIFEST)) as f:
        entries = json.load(f)
    rows = []
    for entry in entries:
        rows += measure(args.dir, entry, args.batch, args.steps, args.prompt)
    if int(os.environ.get("RANK", "0")) == 0:
        for r in rows:
            print(json.dumps(r), flush=True)
        command = "bench_tp.py " + " ".join(sys.argv[1:] if argv is None else argv)
        if args.md:
            with open(args.md, "w") as f:
                f.write(markdown(rows, command))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank has its rows and files written
        torch.distributed.destroy_process_group()
        # the interpreter's own teardown of the backend's threads can abort a rank that has finished (SIGABRT,
        # "terminate called without an active exception"): a finished rank leaves without it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
