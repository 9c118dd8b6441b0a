"""Speed of the streaming converter (`conversion.streaming.StreamingQuantizer`) on a synthetic Llama checkpoint.

Writes a bf16 checkpoint with real layer shapes (hidden 2048, intermediate 5632, 32 heads, 4 KV heads, vocabulary
32000: about 44M weights a layer) and random values, then measures on the chosen device:

1. read: every source byte read with plain positioned reads (what the converter does; the page cache as it is,
   or cold after --drop-caches when the machine allows it);
2. quantization throughput from tensors already on the device (a layer's weights, several times over);
3. the whole conversion (plan, read, quantize, write and sync the shards, side files, card), in params per
   second, after a first plan that imports transformers' modeling code once a process (timed apart);
4. on CPU, when `turboquant-plus-vllm` is installed, the peer writer `save_tq3_checkpoint` on the same
   checkpoint in the same run, and the ratio;
5. with --verify, that the device writes the CPU's bytes: a one-layer checkpoint converted on the CPU and on the
   device (in one slice a tensor, and in many small slices under a memory budget; the chosen bits and ternary),
   every output file compared byte for byte. A difference fails the run (exit code 1).

    python benchmarks/convert_speed.py --layers 8                                        # CPU, with the peer writer
    python benchmarks/convert_speed.py --layers 40 --device cuda --drop-caches --verify  # H200: 3.8 GB of bf16

Prints a Markdown row per measurement and, with --json FILE, writes them as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time

import torch

SHAPES = dict(hidden=2048, intermediate=5632, heads=32, kv_heads=4, vocab=32000)


def llama_tensors(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int):
    """[(name, shape)] of a Llama checkpoint, in the order a Hub checkpoint lists them."""
    head_dim = hidden // heads
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,)),
                (p + "self_attn.q_proj.weight", (heads * head_dim, hidden)),
                (p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
                (p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
                (p + "self_attn.o_proj.weight", (hidden, heads * head_dim)),
                (p + "mlp.gate_proj.weight", (intermediate, hidden)),
                (p + "mlp.up_proj.weight", (intermediate, hidden)),
                (p + "mlp.down_proj.weight", (hidden, intermediate))]
    out += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return out


def write_tokenizer(directory: str, vocab: int) -> None:
    """A word-level tokenizer.json of `vocab` entries (enough for AutoTokenizer and the peer writer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, vocab):
        words[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
                   "eos_token": "</s>"}, f)


def write_synthetic_llama(directory: str, layers: int, shard_bytes: int = 2 * 10**9, seed: int = 0,
                          variants: int = 2, **shape) -> dict:
    """A bf16 Llama checkpoint of `layers` layers: config.json, sharded safetensors with an index, tokenizer.

    Values are random (std 0.02; norms 1); each shape draws `variants` random tensors that the layers take in
    turn, so that writing a large checkpoint costs little more than the disk. Returns {"bytes", "params",
    "largest_tensor_bytes"}."""
    from turboquant_hf.format.shards import ShardWriter

    dims = dict(SHAPES, **shape)
    os.makedirs(directory, exist_ok=True)
    tensors = llama_tensors(layers, **dims)
    gen = torch.Generator().manual_seed(seed)
    pool: dict = {}

    def value(name, shape, i):
        key = (shape, "norm" in name, i % variants)
        if key not in pool:
            if "norm" in name:
                pool[key] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                pool[key] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        return pool[key]

    shards, current, size = [], [], 0
    for name, shape in tensors:
        nbytes = math.prod(shape) * 2
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += nbytes
    shards.append(current)
    weight_map, total = {}, 0
    for k, entries in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        w = ShardWriter(os.path.join(directory, fname), [(n, "BF16", s) for n, s in entries])
        for i, (n, s) in enumerate(entries):
            layer = int(n.split(".")[2]) if n.startswith("model.layers.") else 0
            w.write(n, 0, value(n, s, layer))
            weight_map[n] = fname
            total += math.prod(s) * 2
        w.finish()
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": dims["hidden"],
              "intermediate_size": dims["intermediate"], "num_hidden_layers": layers,
              "num_attention_heads": dims["heads"], "num_key_value_heads": dims["kv_heads"],
              "vocab_size": dims["vocab"], "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "dtype": "bfloat16"}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    write_tokenizer(directory, dims["vocab"])
    return {"bytes": total, "params": total // 2,
            "largest_tensor_bytes": max(math.prod(s) * 2 for _, s in tensors)}


# ---------------------------------------------------------------------------------------------------------------
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def measure_read(src: str) -> float:
    """Seconds to read every tensor byte of the checkpoint with the converter's reader."""
    from turboquant_hf.format.shards import SourceReader, source_index

    reader = SourceReader()
    start = time.perf_counter()
    for t in source_index(src).values():
        for off in range(0, t.nbytes, 1 << 26):
            reader.read(t, off, min(1 << 26, t.nbytes - off))
    reader.close()
    return time.perf_counter() - start


def measure_quantize_on_device(device: torch.device, bits: int, group_size: int, repeats: int) -> tuple[float, int]:
    """(seconds, params) to quantize one layer's weight matrices `repeats` times, from tensors already on
    `device`, in the converter's slices."""
    from turboquant_hf.conversion.streaming import CPU_SLICE, CUDA_SLICE
    from turboquant_hf.format.codec import GroupQuantizer

    gen = torch.Generator().manual_seed(1)
    shapes = [s for n, s in llama_tensors(1, **SHAPES) if ".layers." in n and len(s) == 2]
    weights = [(torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16).to(device) for s in shapes]
    q = GroupQuantizer(bits, group_size, device)
    slice_elems = CUDA_SLICE if device.type == "cuda" else CPU_SLICE

    slices = [(w, r, max(1, slice_elems // w.shape[1])) for w in weights
              for r in range(0, w.shape[0], max(1, slice_elems // w.shape[1]))]

    def one(job):
        w, r, rows = job
        return q(w[r:r + rows], "w", r)

    if device.type == "cpu":  # as the converter does: single-threaded workers, one per torch thread
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(torch.get_num_threads(), initializer=torch.set_num_threads, initargs=(1,))

        def run():
            list(pool.map(one, slices))
    else:
        def run():
            for job in slices:
                one(job)

    run()  # warm-up: kernels, caches
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    _sync(device)
    return time.perf_counter() - start, repeats * sum(w.numel() for w in weights)


def _tensor_differences(a: str, b: str) -> str:
    """What differs between two safetensors files: "(tensor: share of elements that differ, by how much; ...)"."""
    from safetensors.torch import load_file

    if not (a.endswith(".safetensors") and os.path.isfile(a) and os.path.isfile(b)):
        return ""
    x, y = load_file(a), load_file(b)
    if x.keys() != y.keys():
        return f" (tensors {sorted(set(x) ^ set(y))} in one only)"
    out = []
    for k in sorted(x):
        if x[k].shape != y[k].shape or x[k].dtype != y[k].dtype:
            out.append(f"{k}: {x[k].dtype} {list(x[k].shape)} vs {y[k].dtype} {list(y[k].shape)}")
        elif not torch.equal(x[k], y[k]):
            diff = x[k] != y[k]
            largest = (x[k].double() - y[k].double()).abs().max().item() if x[k].is_floating_point() else None
            out.append(f"{k}: {diff.double().mean().item():.2e} of elements differ"
                       + (f", by at most {largest:.3g}" if largest is not None else ""))
    more = f"; and {len(out) - 3} more tensors" if len(out) > 3 else ""
    return " (" + "; ".join(out[:3]) + more + ")"


def verify_against_cpu(work: str, device: torch.device, bits, group_size: int) -> list[str]:
    """Convert a one-layer checkpoint (vocabulary 4000) on the CPU and on `device`, in one slice a tensor and in
    many small slices (a --max-memory of the largest tensor), with `bits` and ternary: the files that differ
    from the CPU's, as "config: file" (empty: the same bytes)."""
    from turboquant_hf import TurboQuantConfig
    from turboquant_hf.conversion.streaming import StreamingQuantizer

    src = os.path.join(work, "verify-src")
    meta = write_synthetic_llama(src, 1, vocab=4000)
    converter = StreamingQuantizer.from_pretrained(src)
    differ = []
    for b in dict.fromkeys([bits, 1.58]):
        cfg = TurboQuantConfig(bits=b, group_size=group_size)
        ref = os.path.join(work, f"verify-cpu-{b}")
        converter.quantize(ref, quantization_config=cfg, device="cpu", progress=False)
        for how, budget in (("whole", None), ("budget", meta["largest_tensor_bytes"])):
            out = os.path.join(work, f"verify-{device.type}-{b}-{how}")
            converter.quantize(out, quantization_config=cfg, device=str(device), max_memory=budget, progress=False)
            names = sorted(f for f in set(os.listdir(ref)) | set(os.listdir(out))
                           if f not in ("README.md", "turboquant_build.json"))
            for f in names:
                a, c = os.path.join(ref, f), os.path.join(out, f)
                if not (os.path.isfile(a) and os.path.isfile(c) and open(a, "rb").read() == open(c, "rb").read()):
                    differ.append(f"{b} bits, {how}: {f}{_tensor_differences(a, c)}")
            shutil.rmtree(out)
        shutil.rmtree(ref)
    shutil.rmtree(src)
    return differ


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "safetensors", "turboquant-transformers", "turboquant-plus-vllm", "triton"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the synthetic model (44M weights each)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=0, help="layers quantized on the device (default: 3 CPU, 50 CUDA)")
    ap.add_argument("--work-dir", help="where the checkpoints go (default: a temporary folder, removed at the end)")
    ap.add_argument("--no-peer", action="store_true", help="skip the peer writer even when it is installed")
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before the read and conversion "
                                                               "(needs root; noted when it fails)")
    ap.add_argument("--verify", action="store_true", help="check that the device writes the CPU's bytes on a "
                                                          "one-layer checkpoint (fails the run if not)")
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args(argv)

    from turboquant_hf import TurboQuantConfig
    from turboquant_hf.conversion.streaming import StreamingQuantizer
    from turboquant_hf.reporting.card import human_bytes, human_count

    device = torch.device(args.device)
    work = args.work_dir or tempfile.mkdtemp(prefix="tq-convert-speed-")
    os.makedirs(work, exist_ok=True)
    src = os.path.join(work, "src")
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else
            f"CPU: {os.cpu_count()} cores of {_cpu_name()}, torch threads "
            f"{torch.get_num_threads()}", "versions": _versions(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python " + " ".join([os.path.relpath(sys.argv[0])] + (argv or sys.argv[1:])),
            "layers": args.layers, "bits": args.bits, "group_size": args.group_size,
            "load_average_before": os.getloadavg()[0]}
    rows = []
    try:
        t0 = time.perf_counter()
        meta = write_synthetic_llama(src, args.layers)
        info.update(source_bytes=meta["bytes"], params=meta["params"], write_seconds=time.perf_counter() - t0)
        print(f"synthetic checkpoint: {human_bytes(meta['bytes'])}, {human_count(meta['params'])} params, "
              f"{args.layers} layers", file=sys.stderr)

        cold = drop_caches() if args.drop_caches else False
        read_s = measure_read(src)
        rows.append(("read every source byte" + (" (cold cache)" if cold else ""), read_s, meta["bytes"] / read_s,
                     "bytes/s"))

        repeats = args.repeats or (50 if device.type == "cuda" else 3)
        q_s, q_params = measure_quantize_on_device(device, args.bits, args.group_size, repeats)
        rows.append((f"quantize on {device.type}, tensors already there", q_s, q_params / q_s, "params/s"))

        cfg = TurboQuantConfig(bits=args.bits, group_size=args.group_size)
        # once a process, whatever the checkpoint: importing transformers' modeling code for the architecture
        # (torch._dynamo and the rest) to plan on the meta device; shown apart, not in the conversion's time
        start = time.perf_counter()
        StreamingQuantizer.from_pretrained(src)._targets(cfg)
        import_s = time.perf_counter() - start
        rows.append(("first plan in the process (imports the model's code)", import_s, meta["params"] / import_s,
                     "params/s"))
        out = os.path.join(work, "tq")
        shutil.rmtree(out, ignore_errors=True)
        if args.drop_caches:
            drop_caches()
        start = time.perf_counter()
        summary = StreamingQuantizer.from_pretrained(src).quantize(out, quantization_config=cfg, device=str(device),
                                                               progress=False)
        conv_s = time.perf_counter() - start
        rows.append(("whole conversion (turboquant-hf)", conv_s, meta["params"] / conv_s, "params/s"))
        info["summary"] = summary.as_dict()
        info["conversion_over_read"] = conv_s / read_s

        peer = None
        if device.type == "cpu" and not args.no_peer:
            try:
                from turboquant_vllm.checkpoint import save_tq3_checkpoint
            except ImportError:
                print("turboquant-plus-vllm is not installed: no peer measurement", file=sys.stderr)
            else:
                peer_out = os.path.join(work, "peer")
                shutil.rmtree(peer_out, ignore_errors=True)
                start = time.perf_counter()
                save_tq3_checkpoint(src, peer_out, bits=args.bits, group_size=args.group_size)
                peer = time.perf_counter() - start
                rows.append(("whole conversion (peer save_tq3_checkpoint)", peer, meta["params"] / peer, "params/s"))
                info["speedup_over_peer"] = peer / conv_s

        if args.verify:
            start = time.perf_counter()
            info["verify_differs"] = verify_against_cpu(work, device, args.bits, args.group_size)
            print(f"verify: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)

    info["results"] = [{"what": w, "seconds": s, "rate": r, "unit": u} for w, s, r, u in rows]
    info["load_average_after"] = os.getloadavg()[0]
    print(f"\n{info['device']}; {info['date']}; " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    print(f"load average (1 min) before / after: {info['load_average_before']:.2f} / {info['load_average_after']:.2f}")
    print(f"`{info['command']}`: {human_count(meta['params'])} params, {human_bytes(meta['bytes'])} of bf16, "
          f"{args.bits}-bit G={args.group_size}\n")
    print("| measurement | seconds | rate |\n|---|---:|---:|")
    for what, s, rate, unit in rows:
        shown = f"{human_bytes(rate)}/s" if unit == "bytes/s" else f"{human_count(rate)} params/s"
        print(f"| {what} | {s:.2f} | {shown} |")
    if "speedup_over_peer" in info:
        print(f"\nturboquant-hf is {info['speedup_over_peer']:.1f}x the peer writer's speed on this checkpoint")
    print(f"whole conversion / read time: {info['conversion_over_read']:.2f}")
    if "verify_differs" in info:
        differ = info["verify_differs"]
        print(f"verify: {device.type} output differs from the CPU's in {', '.join(differ)}" if differ else
              f"verify: the {device.type} output is byte for byte the CPU's (one layer; {args.bits} bits and "
              "ternary; one slice a tensor and many small slices)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=2)
    return 1 if info.get("verify_differs") else 0


if __name__ == "__main__":
    sys.exit(main())
