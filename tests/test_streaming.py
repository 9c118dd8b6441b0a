"""The streaming converter writes what from_pretrained + save_pretrained would, without holding the model."""

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import assert_same_tensors, safetensors_tensors
from hub_fixtures import hub_env, hub_in_process, local_hub  # noqa: F401  (fixtures)
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from turboquant_hf import TurboQuantConfig
from turboquant_hf.cli import commands as cli
from turboquant_hf.conversion import streaming
from turboquant_hf.conversion.streaming import (
    STATE_NAME,
    ConversionError,
    StreamingQuantizer,
)
from turboquant_hf.format import codec
from turboquant_hf.format import constants as fmt
from turboquant_hf.format.checkpoint import CheckpointError, read_checkpoint_index
from turboquant_hf.format.codec import GroupQuantizer
from turboquant_hf.format.shards import ShardWriter, source_index

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    """benchmarks/convert_speed.py: its synthetic checkpoint writer (real Llama layer shapes, random values)."""
    spec = importlib.util.spec_from_file_location("convert_speed", os.path.join(ROOT, "benchmarks", "convert_speed.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _same_files(a_dir, b_dir, skip=("README.md", "turboquant_build.json")):
    """Every file of two folders, byte for byte (the card and the build record carry times and paths)."""
    names = sorted(f for f in os.listdir(a_dir) if f not in skip)
    assert names == sorted(f for f in os.listdir(b_dir) if f not in skip)
    for f in names:
        with open(os.path.join(a_dir, f), "rb") as fa, open(os.path.join(b_dir, f), "rb") as fb:
            assert fa.read() == fb.read(), f


def _copy_source(src, dst, skip=()):
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f not in skip:
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    return str(dst)


def _convert(src, out, **kw):
    kw.setdefault("progress", False)
    return StreamingQuantizer.from_pretrained(src).quantize(out, **kw)


# The child reports its own peak resident memory (VmHWM, which starts afresh at exec) when it exits: the kernel's
# ru_maxrss of a child also counts the pages of the forked parent (pytest) before the exec.
_CHILD = """import atexit, runpy, sys
def report():
    with open("/proc/self/status") as f:
        sys.stderr.write("PEAK_RSS_KB " + next(l for l in f if l.startswith("VmHWM")).split()[1] + "\\n")
atexit.register(report)
sys.argv = ["turboquant-hf"] + sys.argv[1:]
runpy.run_module("turboquant_hf", run_name="__main__", alter_sys=True)
"""


def _run_cli(args, cwd):
    """`turboquant-hf ARGS` in a subprocess: (exit code, stdout, stderr, peak resident bytes of the child)."""
    p = subprocess.run([sys.executable, "-c", _CHILD, *map(str, args)], cwd=cwd, capture_output=True, text=True,
                       stdin=subprocess.DEVNULL)
    peaks = [int(line.split()[1]) * 1024 for line in p.stderr.splitlines() if line.startswith("PEAK_RSS_KB ")]
    return p.returncode, p.stdout, p.stderr, peaks[-1] if peaks else None


# ---------------------------------------------------------------------------------------------------------------
# same bytes as from_pretrained + save_pretrained
def test_optimum_interface():
    from optimum.quantization_base import OptimumQuantizer

    assert issubclass(StreamingQuantizer, OptimumQuantizer)


def test_dense_llama_matches_from_pretrained(tiny_llama_dir, tmp_path):
    cfg = TurboQuantConfig(bits=3, group_size=64, module_bits={"down_proj": 4})
    summary = _convert(tiny_llama_dir, tmp_path / "out", quantization_config=cfg, max_shard_size=200_000)
    AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=cfg).save_pretrained(tmp_path / "ref")
    assert_same_tensors(tmp_path / "out", tmp_path / "ref")
    assert len(summary.shards) > 1 and os.path.isfile(tmp_path / "out" / "model.safetensors.index.json")
    index = json.load(open(tmp_path / "out" / "model.safetensors.index.json"))
    assert set(index["weight_map"]) == set(safetensors_tensors(tmp_path / "out"))
    for name, f in index["weight_map"].items():
        assert name in read_checkpoint_index([str(tmp_path / "out" / f)])
    assert summary.params_quantized > 0 and summary.bytes_out < summary.bytes_in
    assert os.path.isfile(tmp_path / "out" / "tokenizer.json")
    tq = json.load(open(tmp_path / "out" / "tq_config.json"))
    ref_tq = json.load(open(tmp_path / "ref" / "tq_config.json"))
    assert tq == ref_tq and tq["module_bits"] == {"down_proj": 4}  # original_model: the same source folder
    ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(tmp_path / "out")(ids).logits
        b = AutoModelForCausalLM.from_pretrained(tmp_path / "ref")(ids).logits
    assert torch.equal(a, b)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temporary folder left behind


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_qwen3_5_moe_matches_from_pretrained(layout, tmp_path):
    from test_moe import qwen3_5_moe
    from transformers import Qwen3_5MoeForConditionalGeneration

    from turboquant_hf.quantization.recipes import get_recipe

    torch.manual_seed(0)
    qwen3_5_moe().to(torch.bfloat16).save_pretrained(tmp_path / "src", save_original_format=layout == "per_expert")
    assert any(".experts.0." in k for k in safetensors_tensors(tmp_path / "src")) == (layout == "per_expert")
    cfg = get_recipe("tq3a-tqTe", group_size=64)
    _convert(tmp_path / "src", tmp_path / "out", quantization_config=cfg)
    Qwen3_5MoeForConditionalGeneration.from_pretrained(tmp_path / "src", quantization_config=cfg).save_pretrained(
        tmp_path / "ref")
    assert_same_tensors(tmp_path / "out", tmp_path / "ref")
    out = safetensors_tensors(tmp_path / "out")
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj.tq_packed" in out
    assert not any(".experts.0." in k for k in out)
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = Qwen3_5MoeForConditionalGeneration.from_pretrained(tmp_path / "out")(ids).logits
        b = Qwen3_5MoeForConditionalGeneration.from_pretrained(tmp_path / "ref")(ids).logits
    assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_per_expert_sources_are_fused(kind, tmp_path):
    """Per-expert source tensors are regrouped into the published pre-fused layout, exactly as loading does."""
    import test_moe

    torch.manual_seed(0)
    getattr(test_moe, kind)().to(torch.bfloat16).save_pretrained(tmp_path / "src")  # per-expert (default save)
    assert any(".experts.0." in k for k in safetensors_tensors(tmp_path / "src"))
    cfg = TurboQuantConfig(bits=3, group_size=64, module_bits={r"experts\.down_proj": 4})
    _convert(tmp_path / "src", tmp_path / "out", quantization_config=cfg)
    AutoModelForCausalLM.from_pretrained(tmp_path / "src", quantization_config=cfg).save_pretrained(tmp_path / "ref")
    assert_same_tensors(tmp_path / "out", tmp_path / "ref")
    out = safetensors_tensors(tmp_path / "out")
    assert not any(".experts.0." in k for k in out)
    assert sum(k.endswith("experts.gate_up_proj.tq_packed") for k in out) == 2


def test_incomplete_experts_named(tmp_path):
    from test_moe import qwen3_moe

    qwen3_moe().save_pretrained(tmp_path / "src")
    t = load_file(tmp_path / "src" / "model.safetensors")
    del t["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(t, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts: the per-expert tensors"):
        _convert(tmp_path / "src", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bits", [2, 3, 4, 1.58])
@pytest.mark.parametrize("group_size", [64, 128, 256])
def test_slices_quantize_like_the_codec(bits, group_size):
    """The converter's slice quantizer gives codec.quantize_weight's bytes and norms, however the rows are sliced
    (with padding, an all-zero row, values on every scale)."""
    gen = torch.Generator().manual_seed(group_size)
    for shape in [(37, 3 * group_size), (40, 200), (6, 1000)]:
        w = torch.randn(shape, generator=gen) * torch.logspace(-4, 1, shape[0]).unsqueeze(1)
        w[3] = 0
        w = w.to(torch.bfloat16)
        packed, norms = codec.quantize_weight(w, bits, group_size)
        q = GroupQuantizer(bits, group_size, torch.device("cpu"))
        for rows in (1, 7, shape[0]):
            parts = [q(w[r:r + rows].clone(), "w", r) for r in range(0, shape[0], rows)]
            assert torch.equal(torch.cat([p for p, _ in parts]), packed), (shape, rows)
            assert torch.equal(torch.cat([n for _, n in parts]), norms), (shape, rows)


def test_shards_are_what_safetensors_writes(tmp_path):
    tensors = {"b.weight": torch.randn(3, 5).to(torch.bfloat16), "a.tq_packed": torch.randint(0, 255, (7, 3)).byte(),
               "a.tq_norms": torch.randn(7, 1), "c": torch.randn(3).half(), "d": torch.arange(5), "e": torch.zeros(0)}
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    names = {torch.bfloat16: "BF16", torch.uint8: "U8", torch.float32: "F32", torch.float16: "F16",
             torch.int64: "I64"}
    w = ShardWriter(str(tmp_path / "ours.safetensors"), [(k, names[v.dtype], tuple(v.shape))
                                                          for k, v in tensors.items()])
    for k, v in reversed(tensors.items()):
        w.write(k, 0, v)
    w.finish()
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


# ---------------------------------------------------------------------------------------------------------------
# memory
def test_memory_budget_slices_without_changing_bytes(tiny_llama_dir, tmp_path):
    """A budget just above the largest tensor quantizes in many small slices: the same bytes."""
    converter = StreamingQuantizer.from_pretrained(tiny_llama_dir)
    budget = converter.largest_tensor_bytes
    a = converter.quantize(tmp_path / "a", max_memory=budget, progress=False)
    converter.quantize(tmp_path / "b", progress=False)
    _same_files(tmp_path / "a", tmp_path / "b")
    assert a.bytes_in == converter.total_bytes


def _device_path(monkeypatch):
    """Run the path a GPU takes on the CPU device: reader threads fill reusable host buffers, the main thread
    quantizes into them, the writer thread writes (page-locked buffers, streams and events are CUDA's alone).
    Returns the host buffer pools the conversions make."""
    from turboquant_hf.format import shards

    monkeypatch.setattr(streaming, "_POOLED_DEVICES", ())
    pools = []

    class Recorded(shards.HostBuffers):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            pools.append(self)

    monkeypatch.setattr(streaming, "HostBuffers", Recorded)
    return pools


@pytest.fixture(scope="module")
def float32_moe_dir(tmp_path_factory):
    """A Qwen3 MoE saved in float32 with per-expert tensors: several sources per quantized unit, and float32
    slices (the quantizer's float32 load path)."""
    from test_moe import qwen3_moe

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("moe_f32")
    qwen3_moe().to(torch.float32).save_pretrained(d)
    return str(d)


@pytest.mark.parametrize("case", ["budget", "whole", "ternary", "moe"])
def test_device_path_writes_the_same_bytes(case, tiny_llama_dir, float32_moe_dir, tmp_path, monkeypatch):
    """The device pipeline gives the bytes of the CPU worker pool, with many slices in flight (a small budget)
    or one slice a tensor, float16 norms after packed groups of an odd width (ternary, G = 64), several sources
    a unit in float32; and never holds more host buffers than slices in flight."""
    src = float32_moe_dir if case == "moe" else tiny_llama_dir
    kw = {"budget": dict(max_memory=100_000, max_shard_size=150_000), "whole": {},
          "ternary": dict(quantization_config=TurboQuantConfig(bits=1.58, group_size=64), max_shard_size=150_000),
          "moe": dict(max_memory=200_000)}[case]
    _convert(src, tmp_path / "pool", **kw)
    pools = _device_path(monkeypatch)
    _convert(src, tmp_path / "device", **kw)
    _same_files(tmp_path / "pool", tmp_path / "device")
    assert len(pools) == 1 and 1 <= pools[0].allocated <= streaming._DEVICE_IN_FLIGHT
    assert not pools[0].pin  # page-locked on CUDA only
    if case == "budget":
        assert pools[0].allocated > 1  # slices overlap


@pytest.mark.parametrize("path", ["pool", "device"])
def test_write_error_in_the_writer_thread(path, tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """A full disk while writing (in the writer thread): the caller gets an OSError naming the file, and neither
    the output nor the temporary folder is left; likewise an error while finishing a shard, and from the CLI."""
    import errno
    import threading

    if path == "device":
        _device_path(monkeypatch)
    write, finish = ShardWriter.write, ShardWriter.finish
    calls = []

    def full_disk(self, *a):
        calls.append(a[0])
        if len(calls) > 5:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(self, *a)

    kw = dict(max_memory=100_000, max_shard_size=150_000)
    with monkeypatch.context() as m:
        m.setattr(ShardWriter, "write", full_disk)
        with pytest.raises(OSError, match="No space left on device") as e:
            _convert(tiny_llama_dir, tmp_path / "out", **kw)
    assert e.value.errno == errno.ENOSPC and ".out.partial" in e.value.filename and e.value.filename.endswith(".tmp")
    assert len(calls) == 6  # nothing written after the error
    assert os.listdir(tmp_path) == []
    assert not [t for t in threading.enumerate() if t.name.startswith("turboquant-convert")]

    def broken_finish(self):
        finish(self)
        raise RuntimeError("finish failed")

    with monkeypatch.context() as m:
        m.setattr(ShardWriter, "finish", broken_finish)
        with pytest.raises(RuntimeError, match="finish failed"):
            _convert(tiny_llama_dir, tmp_path / "out", **kw)
    assert os.listdir(tmp_path) == []

    calls.clear()
    monkeypatch.setattr(ShardWriter, "write", full_disk)
    assert cli.main(["quantize", tiny_llama_dir, "--out", str(tmp_path / "out"), "--streaming"]) == 1
    err = capsys.readouterr().err
    assert "failed: OSError: [Errno 28] No space left on device" in err and ".out.partial" in err
    assert os.listdir(tmp_path) == []


def test_budget_smaller_than_the_largest_tensor_is_refused(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    converter = StreamingQuantizer.from_pretrained(tiny_llama_dir)
    monkeypatch.setattr(StreamingQuantizer, "_plan", lambda *a: pytest.fail("work started despite the refusal"))
    with pytest.raises(ValueError, match=r"smaller than the largest tensor \(model\.layers\.0\.mlp\.down_proj\.weight,"
                                         r" 90,112 bytes\)"):
        converter.quantize(tmp_path / "out", max_memory=90_111, progress=False)
    assert cli.main(["quantize", tiny_llama_dir, "--out", str(tmp_path / "out"), "--max-memory", "90KB"]) == 2
    err = capsys.readouterr().err
    assert "--max-memory 90,000 bytes is smaller than the largest tensor" in err and "nothing was written" in err
    assert not os.listdir(tmp_path)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """bf16 Llama checkpoints with real layer shapes (hidden 2048, intermediate 5632, vocabulary 32000):
    8 layers (0.97 GB) and 42 layers (3.96 GB); the largest tensor is the 131 MB embedding."""
    bench = _bench()
    root = tmp_path_factory.mktemp("synthetic")
    meta = {name: bench.write_synthetic_llama(str(root / name), layers)
            for name, layers in (("1gb", 8), ("4gb", 42))}
    yield root, meta
    shutil.rmtree(root, ignore_errors=True)


def test_peak_memory_does_not_grow_with_the_model(synthetic, tmp_path):
    """Converting 1 GB and 4 GB checkpoints (one 1 GB output shard for the larger) in a subprocess: the peak
    resident memory differs by less than the largest tensor, and the conversion's own use stays within a
    --max-memory budget equal to the largest tensor."""
    root, meta = synthetic
    largest = meta["4gb"]["largest_tensor_bytes"]
    assert meta["1gb"]["bytes"] > 0.9e9 and meta["4gb"]["bytes"] > 3.9e9
    peaks = {}
    for name in ("1gb", "4gb"):
        code, out, err, peak = _run_cli(["quantize", root / name, "--out", tmp_path / name, "--max-memory", largest,
                                         "--json"], tmp_path)
        assert code == 0, err
        result = json.loads(out)
        summary = result["summary"]
        assert result["converter"] == "streaming" and summary["params_processed"] == meta[name]["params"]
        assert summary["peak_rss"] - summary["peak_rss_before"] <= largest, summary
        assert summary["peak_rss"] <= peak + 2**20  # the kernel's per-thread counters drift by a few pages
        peaks[name] = peak
        print(f"{name}: peak RSS {peak / 1e6:.0f} MB, tensor work {(summary['peak_rss'] - summary['peak_rss_before']) / 1e6:.0f}"
              f" MB, {summary['seconds']:.1f} s")
        assert len(summary["shards"]) == 1
        shutil.rmtree(tmp_path / name)
    assert abs(peaks["4gb"] - peaks["1gb"]) < largest, peaks


# ---------------------------------------------------------------------------------------------------------------
# interruption and resume
class _Interrupt:
    """Raise KeyboardInterrupt once `after` shards are finished."""

    def __init__(self, monkeypatch, after):
        self.done = 0
        finish = ShardWriter.finish

        def patched(writer):
            finish(writer)
            self.done += 1
            if self.done == after:
                raise KeyboardInterrupt

        monkeypatch.setattr(ShardWriter, "finish", patched)


@pytest.mark.parametrize("path", ["pool", "device"])
def test_resume_after_an_interruption(path, tiny_llama_dir, tmp_path, monkeypatch):
    """Interrupted in the writer thread once two shards are finished: they are kept, and resume writes the rest
    (on the worker pool's path and on the device pipeline's)."""
    if path == "device":
        _device_path(monkeypatch)
    kw = dict(quantization_config=TurboQuantConfig(bits=4, group_size=64), max_shard_size=100_000)
    full = _convert(tiny_llama_dir, tmp_path / "ref", **kw)
    assert len(full.shards) >= 5
    with monkeypatch.context() as m:
        _Interrupt(m, after=2)
        with pytest.raises(KeyboardInterrupt):
            _convert(tiny_llama_dir, tmp_path / "out", **kw)
    assert not (tmp_path / "out").exists()
    partial = tmp_path / ".out.partial"
    kept = sorted(f for f in os.listdir(partial) if f.endswith(".safetensors"))
    assert len(kept) == 2 and (partial / STATE_NAME).is_file()
    stamps = {f: (os.stat(partial / f).st_ino, os.stat(partial / f).st_mtime_ns) for f in kept}
    # another configuration cannot resume from these shards, and leaves them alone
    with pytest.raises(ConversionError, match="cannot resume"):
        _convert(tiny_llama_dir, tmp_path / "out", resume=True, quantization_config=TurboQuantConfig(bits=3),
                 max_shard_size=100_000)
    assert sorted(f for f in os.listdir(partial) if f.endswith(".safetensors")) == kept
    summary = _convert(tiny_llama_dir, tmp_path / "out", resume=True, **kw)
    assert summary.shards_resumed == 2 and summary.params_processed < full.params_processed
    _same_files(tmp_path / "out", tmp_path / "ref")
    assert {f: (os.stat(tmp_path / "out" / f).st_ino, os.stat(tmp_path / "out" / f).st_mtime_ns) for f in kept} == stamps
    assert not partial.exists()


def test_killed_conversion_leaves_the_target_untouched_and_resumes(tmp_path):
    """SIGKILL half way through (subprocess, real shards): --out keeps what it had; --resume finishes with the
    bytes of an uninterrupted run and keeps the finished shards."""
    src = tmp_path / "src"
    _bench().write_synthetic_llama(str(src), 2, vocab=16000)  # 307 MB
    args = ["quantize", src, "--streaming", "--force", "--max-shard-size", "8MB", "--json"]
    code, _, err, _ = _run_cli(args + ["--out", tmp_path / "ref"], tmp_path)
    assert code == 0, err
    out = tmp_path / "out"
    out.mkdir()
    (out / "previous.txt").write_text("the previous output")
    partial = tmp_path / ".out.partial"
    with open(tmp_path / "kill.log", "w") as log:
        p = subprocess.Popen([sys.executable, "-m", "turboquant_hf", *map(str, args + ["--out", out])], cwd=tmp_path,
                             stdout=log, stderr=log)
        done, total = [], None
        deadline = time.monotonic() + 300
        while p.poll() is None and time.monotonic() < deadline:
            if total is None and (partial / STATE_NAME).is_file():
                try:
                    total = len(json.load(open(partial / STATE_NAME))["layout"])
                except ValueError:  # being written
                    pass
            if total and partial.is_dir():
                done = sorted(f for f in os.listdir(partial) if f.endswith(".safetensors"))
                if len(done) >= total // 2:
                    p.send_signal(signal.SIGKILL)
                    break
            time.sleep(0.005)
        p.wait()
    assert p.returncode == -signal.SIGKILL, f"the conversion ended before it could be killed ({total} shards)"
    assert 0 < len(done) < total
    assert os.listdir(out) == ["previous.txt"] and (out / "previous.txt").read_text() == "the previous output"
    stamps = {f: os.stat(partial / f).st_ino for f in done}
    code, stdout, err, _ = _run_cli(args + ["--out", out, "--resume"], tmp_path)
    assert code == 0, err
    assert json.loads(stdout)["summary"]["shards_resumed"] >= len(done)
    _same_files(out, tmp_path / "ref")
    assert {f: os.stat(out / f).st_ino for f in done} == stamps  # kept, not written again
    assert not partial.exists()


# ---------------------------------------------------------------------------------------------------------------
# progress, summary, model card, command line
def test_progress_summary_and_card(tiny_llama_dir, tmp_path, capsys):
    from turboquant_hf.reporting import card as tq_card

    summary = StreamingQuantizer.from_pretrained(tiny_llama_dir).quantize(tmp_path / "out", progress=True)
    err = capsys.readouterr().err
    assert "quantizing" in err and "model.norm.weight" in err  # the bar shows bytes and the tensor's name
    assert "B/s" in err or "MB" in err or "kB" in err
    out = safetensors_tensors(tmp_path / "out")
    source = safetensors_tensors(tiny_llama_dir)
    quantized = {k[: -len(fmt.PACKED_SUFFIX)] for k in out if k.endswith(fmt.PACKED_SUFFIX)}
    assert summary.params_quantized == sum(source[k].numel() for k in quantized)
    assert summary.params_kept == sum(v.numel() for k, v in source.items() if k not in quantized)
    assert summary.bytes_in == sum(v.numel() * v.element_size() for v in source.values())
    assert summary.bytes_out == sum(v.numel() * v.element_size() for v in out.values())
    total = summary.params_quantized + summary.params_kept
    assert summary.bits_per_weight == pytest.approx(8 * summary.bytes_out / total)
    packed_bytes = sum(v.numel() * v.element_size() for k, v in out.items() if k.endswith(fmt.PACKED_SUFFIX)
                       or k.endswith(fmt.NORMS_SUFFIX))
    assert summary.bits_per_quantized_weight == pytest.approx(8 * packed_bytes / summary.params_quantized)
    assert 3.25 <= summary.bits_per_quantized_weight < 3.4  # 3 bits + a float32 norm per 128 (+ padding)
    assert summary.seconds > 0 and summary.params_per_second == pytest.approx(total / summary.seconds)
    assert summary.text() in err
    for part in (f"quantized {tq_card.human_count(summary.params_quantized)} params",
                 f"kept {tq_card.human_count(summary.params_kept)} in full precision",
                 f"{tq_card.human_bytes(summary.bytes_in)} in, {tq_card.human_bytes(summary.bytes_out)} out",
                 f"{summary.bits_per_weight:.3f} bits per weight", "params/s on cpu"):
        assert part in summary.text()
    # the model card, from the same generator save_pretrained uses
    card = (tmp_path / "out" / "README.md").read_text()
    assert card == tq_card.render_card(str(tmp_path / "out"), name="out")
    assert "turboquant" in card and "library_name: transformers" in card
    assert json.load(open(tmp_path / "out" / tq_card.BUILD_NAME))["source"] == os.path.basename(tiny_llama_dir)


def test_cli_chooses_the_converter_by_memory_budget(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    from turboquant_hf.format import shards

    largest = StreamingQuantizer.from_pretrained(tiny_llama_dir).largest_tensor_bytes
    assert cli.main(["quantize", tiny_llama_dir, "--out", str(tmp_path / "ref"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["converter"] == "from_pretrained"
    # a budget below the model's size (above its largest tensor)
    assert cli.main(["quantize", tiny_llama_dir, "--out", str(tmp_path / "budget"), "--max-memory", str(largest),
                     "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["converter"] == "streaming" and result["summary"]["params_quantized"] > 0
    assert_same_tensors(tmp_path / "budget", tmp_path / "ref")
    assert os.path.isfile(tmp_path / "budget" / "README.md")
    # less memory available than the model: chosen without being asked
    monkeypatch.setattr(shards, "available_memory", lambda: largest)
    assert cli.main(["quantize", tiny_llama_dir, "--out", str(tmp_path / "auto")]) == 0
    captured = capsys.readouterr()
    assert "streaming conversion (the weights" in captured.err and "wrote" in captured.out
    assert_same_tensors(tmp_path / "auto", tmp_path / "ref")
    # asked for
    monkeypatch.setattr(shards, "available_memory", lambda: 10**12)
    assert cli.main(["quantize", tiny_llama_dir, "--out", str(tmp_path / "asked"), "--streaming", "--bits", "4",
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["quantization_config"]["bits"] == 4


def test_cli_streaming_keeps_layers_in_the_same_dtype(tiny_llama_dir, tmp_path, capsys):
    """A float32 source: --dtype bfloat16 (the default) casts the full-precision tensors on both paths alike."""
    src = tmp_path / "src"
    AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).save_pretrained(src)
    assert safetensors_tensors(src)["model.embed_tokens.weight"].dtype == torch.float32
    assert cli.main(["quantize", str(src), "--out", str(tmp_path / "ref"), "--bits", "2"]) == 0
    assert cli.main(["quantize", str(src), "--out", str(tmp_path / "out"), "--bits", "2", "--streaming",
                     "--max-shard-size", "100KB"]) == 0
    capsys.readouterr()
    assert_same_tensors(tmp_path / "out", tmp_path / "ref")
    assert safetensors_tensors(tmp_path / "out")["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert json.load(open(tmp_path / "out" / "config.json"))["dtype"] == "bfloat16"


def test_cli_streaming_with_eval(tiny_llama_dir, tmp_path, capsys):
    """--eval after a streaming conversion: measured against the source and written into the card."""
    text = tmp_path / "words.txt"
    text.write_text(" ".join(["the a of to and in is it you that he was for on are with as his they be"] * 10))
    assert cli.main(["quantize", tiny_llama_dir, "--out", str(tmp_path / "out"), "--streaming", "--bits", "4",
                     "--eval", str(text), "--max-tokens", "100", "--window", "64", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["converter"] == "streaming" and result["eval"]["tokens"] == 99
    readme = (tmp_path / "out" / "README.md").read_text()
    assert f"| perplexity | {result['eval']['base_perplexity']:.3f} | {result['eval']['quantized_perplexity']:.3f} |" \
        in readme


def test_cli_streams_a_hub_repo(tiny_llama_dir, tmp_path, hub_in_process, capsys):
    """A Hub repo id: the weights come down as safetensors (snapshot), then stream; a --max-memory below the
    size the Hub reports picks the converter by itself."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub_in_process.url, token=hub_in_process.token)
    repo = api.create_repo("tiny-llama-bf16").repo_id
    api.upload_folder(folder_path=tiny_llama_dir, repo_id=repo)
    largest = StreamingQuantizer.from_pretrained(tiny_llama_dir).largest_tensor_bytes
    assert cli.main(["quantize", repo, "--out", str(tmp_path / "asked"), "--streaming", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["converter"] == "streaming"
    assert cli.main(["quantize", repo, "--out", str(tmp_path / "budget"), "--max-memory", str(largest),
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["converter"] == "streaming"
    _convert(tiny_llama_dir, tmp_path / "local")
    assert_same_tensors(tmp_path / "asked", tmp_path / "local")
    assert_same_tensors(tmp_path / "budget", tmp_path / "local")
    assert "base_model: " + repo in (tmp_path / "asked" / "README.md").read_text()


# ---------------------------------------------------------------------------------------------------------------
# bad input: clear errors naming the file or tensor, nothing left behind
def _assert_refused(src, tmp_path, capsys, pattern):
    with pytest.raises(ConversionError, match=pattern):
        _convert(src, tmp_path / "out")
    assert cli.main(["quantize", str(src), "--out", str(tmp_path / "out"), "--streaming"]) == 2
    assert re.search(pattern, capsys.readouterr().err)
    assert not [f for f in os.listdir(tmp_path) if "out" in f]  # neither the output nor a temporary folder


@pytest.mark.parametrize("damage", ["header length", "header json", "header offsets"])
def test_corrupted_header(damage, tiny_llama_dir, tmp_path, capsys):
    src = _copy_source(tiny_llama_dir, tmp_path / "src")
    path = os.path.join(src, "model.safetensors")
    data = bytearray(open(path, "rb").read())
    n = int.from_bytes(data[:8], "little")
    if damage == "header length":
        data[:8] = (len(data) + 1).to_bytes(8, "little")
    elif damage == "header json":
        data[8 + n // 2] = ord("}")
    else:
        data[8:8 + n] = data[8:8 + n].replace(b'"data_offsets":[0,', b'"data_offsets":[8,', 1)
    open(path, "wb").write(bytes(data))
    _assert_refused(src, tmp_path, capsys, r"src/model\.safetensors: corrupted safetensors header")


def test_shard_missing_from_the_index(tiny_llama_dir, tmp_path, capsys):
    src = tmp_path / "src"
    AutoModelForCausalLM.from_pretrained(tiny_llama_dir).save_pretrained(src, max_shard_size="200KB")
    index = json.load(open(src / "model.safetensors.index.json"))["weight_map"]
    missing = sorted(set(index.values()))[1]
    os.remove(src / missing)
    _assert_refused(src, tmp_path, capsys, rf"shard {missing} is listed in model\.safetensors\.index\.json "
                                           r"\(for model\.")


def test_fp8_sources_are_refused(tiny_llama_dir, tmp_path, capsys):
    """An FP8 checkpoint (e4m3 weights with scale tensors) is never quantized as if it held the weights."""
    tensors = load_file(os.path.join(tiny_llama_dir, "model.safetensors"))
    for k in [k for k in tensors if k.endswith("proj.weight")]:
        tensors[k] = tensors[k].float().to(torch.float8_e4m3fn)
        tensors[k + "_scale_inv"] = torch.ones(1, 1)
    src = _copy_source(tiny_llama_dir, tmp_path / "src", skip=("model.safetensors",))
    save_file(tensors, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    _assert_refused(src, tmp_path, capsys, r"model\.safetensors: tensor model\.layers\.0\.mlp\.down_proj\.weight "
                                           r"\(F8_E4M3\) belongs to a quantized checkpoint")
    config = json.load(open(os.path.join(src, "config.json")))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    json.dump(config, open(os.path.join(src, "config.json"), "w"))
    _assert_refused(src, tmp_path, capsys, r"config\.json: the checkpoint is already quantized \(quant_method 'fp8'\)")


def test_integer_weights_are_refused(tiny_llama_dir, tmp_path, capsys):
    tensors = load_file(os.path.join(tiny_llama_dir, "model.safetensors"))
    tensors["model.layers.1.self_attn.v_proj.weight"] = torch.ones(64, 128, dtype=torch.int8)
    src = _copy_source(tiny_llama_dir, tmp_path / "src", skip=("model.safetensors",))
    save_file(tensors, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    _assert_refused(src, tmp_path, capsys, r"tensor model\.layers\.1\.self_attn\.v_proj\.weight is stored as I8")


def test_transposed_experts_are_refused_by_name(tmp_path, capsys):
    """gpt-oss's experts, stored [E, in, out], are not streamed: refused naming the tensor and the way to quantize
    them, before anything is written."""
    from test_moe import gpt_oss

    torch.manual_seed(0)
    gpt_oss().to(torch.bfloat16).save_pretrained(tmp_path / "src")
    _assert_refused(tmp_path / "src", tmp_path, capsys,
                    r"model\.layers\.\d\.mlp\.experts\.(gate_up|down)_proj: experts stored \[E, in, out\] \(gpt-oss, "
                    r"Llama 4\) are not streamed")


def _mxfp4_gpt_oss(tmp_path):
    """A tiny gpt-oss checkpoint in the form gpt-oss ships in: experts in MXFP4 (random E2M1 codes, block scales
    2^-8 to 2^-4), everything else bf16, a `quantization_config` of method mxfp4; beside it the same model in bf16
    with the experts holding what transformers' own MXFP4 dequantization makes of them. (MXFP4 folder, bf16
    folder, {expert tensor: its bf16 value [E, in, out]})."""
    from test_moe import gpt_oss
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)
    model = gpt_oss().to(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    tensors = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    decoded = {}
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, n_in, n_out = tensors.pop(key).shape  # (stored [E, in, out]; MXFP4 blocks are [E, out, in / 32, 16])
        blocks = torch.randint(0, 256, (e, n_out, n_in // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(119, 124, (e, n_out, n_in // 32), generator=gen, dtype=torch.uint8)
        tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
        decoded[key] = convert_moe_packed_tensors(blocks, scales)
    src = tmp_path / "mxfp4"
    os.makedirs(src)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(src / "config.json", "w") as f:
        json.dump(config, f)
    with torch.no_grad():
        for key, value in decoded.items():
            model.get_parameter(key).copy_(value)
    model.save_pretrained(tmp_path / "bf16")
    return src, tmp_path / "bf16", decoded


def test_gpt_oss_from_mxfp4(tmp_path, capsys):
    """gpt-oss as it ships (MXFP4 experts): each expert row read from its blocks and scales equals transformers'
    own dequantization; the converted folder holds exactly the tensors that `from_pretrained` of the dequantized
    bf16 model + `save_pretrained` write (experts quantized in their published row layout), its config is
    TurboQuant's alone, and it loads to the same logits."""
    from turboquant_hf.format.shards import Mxfp4Tensor, SourceReader

    src, bf16, decoded = _mxfp4_gpt_oss(tmp_path)
    tensors = StreamingQuantizer(src).tensors
    assert not any(k.endswith(("_blocks", "_scales")) for k in tensors)
    reader = SourceReader()
    for key, value in decoded.items():
        t = tensors[key]
        assert isinstance(t, Mxfp4Tensor) and t.rows == value.shape[0] * value.shape[2]
        rows = torch.cat([reader.rows(t, a, min(t.rows, a + 5)) for a in range(0, t.rows, 5)])  # (uneven slices)
        assert torch.equal(rows.view(value.shape[0], value.shape[2], value.shape[1]).transpose(1, 2), value), key
    reader.close()
    cfg = TurboQuantConfig(bits=4, group_size=64, module_bits={r"experts\.down_proj": 3})
    _convert(src, tmp_path / "out", quantization_config=cfg)
    AutoModelForCausalLM.from_pretrained(bf16, quantization_config=cfg).save_pretrained(tmp_path / "ref")
    assert_same_tensors(tmp_path / "out", tmp_path / "ref")
    assert "model.layers.0.mlp.experts.gate_up_proj.tq_packed" in safetensors_tensors(tmp_path / "out")
    with open(tmp_path / "out" / "config.json") as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "turboquant"
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(tmp_path / "out")(ids).logits
        b = AutoModelForCausalLM.from_pretrained(tmp_path / "ref")(ids).logits
    assert torch.equal(a, b)
    # the command line takes the streaming converter for an MXFP4 source by itself (loading it whole would keep
    # its own quantization and ignore the requested one)
    assert cli.main(["quantize", str(src), "--out", str(tmp_path / "cli"), "--bits", "4", "--group-size", "64",
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["converter"] == "streaming"
    _convert(src, tmp_path / "api", quantization_config=TurboQuantConfig(bits=4, group_size=64))
    assert_same_tensors(tmp_path / "cli", tmp_path / "api")
    # `plan` counts the MXFP4 experts as the weights they decode to: the plan of the bf16 folder
    plans = []
    for folder in (src, bf16):
        assert cli.main(["plan", str(folder), "--bits", "4", "--group-size", "64", "--json"]) == 0
        plans.append({k: v for k, v in json.loads(capsys.readouterr().out).items() if k != "source"})
    assert plans[0] == plans[1] and plans[0]["tiers"]


def test_mxfp4_half_pairs_are_refused(tmp_path, capsys):
    """An MXFP4 tensor whose scales are missing is refused by name before anything is written."""
    src, _, _ = _mxfp4_gpt_oss(tmp_path)
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    _assert_refused(src, tmp_path, capsys, r"MXFP4 tensor model\.layers\.1\.mlp\.experts\.down_proj_blocks has no "
                                           r"_scales partner")


@pytest.mark.parametrize("path", ["pool", "device"])
def test_nan_half_way_leaves_nothing(path, tiny_llama_dir, tmp_path, monkeypatch):
    if path == "device":
        _device_path(monkeypatch)
    src = _copy_source(tiny_llama_dir, tmp_path / "src", skip=("model.safetensors",))
    t = load_file(os.path.join(tiny_llama_dir, "model.safetensors"))
    t["model.layers.1.mlp.up_proj.weight"][5, 7] = float("nan")
    save_file(t, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*NaN.*row 5, column 7"):
        _convert(src, tmp_path / "out", max_shard_size=100_000)
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_existing_output_is_refused_before_any_work(tiny_llama_dir, tmp_path, monkeypatch):
    (tmp_path / "out").mkdir()
    monkeypatch.setattr(StreamingQuantizer, "_plan", lambda *a: pytest.fail("work started"))
    with pytest.raises(FileExistsError, match="nothing was written"):
        _convert(tiny_llama_dir, tmp_path / "out")
    with pytest.raises(ValueError, match="outside the source folder"):
        _convert(tiny_llama_dir, os.path.join(tiny_llama_dir, "out"))


def test_source_index_reads_only_listed_files(tiny_llama_dir, tmp_path):
    """With an index, stray .safetensors files (consolidated copies, ...) are not read."""
    src = tmp_path / "src"
    AutoModelForCausalLM.from_pretrained(tiny_llama_dir).save_pretrained(src, max_shard_size="200KB")
    (src / "consolidated.safetensors").write_bytes(b"not a safetensors file")
    assert set(source_index(str(src))) == set(safetensors_tensors(tiny_llama_dir))


# ---------------------------------------------------------------------------------------------------------------
# speed against the peer writer
def test_faster_than_the_peer_writer(tmp_path):
    """On the same synthetic checkpoint in the same process: at least twice the peer's save_tq3_checkpoint."""
    peer = pytest.importorskip("turboquant_vllm.checkpoint")
    src = str(tmp_path / "src")
    meta = _bench().write_synthetic_llama(src, 2, hidden=1024, heads=16, intermediate=2816, vocab=4000)  # 22M + 8M
    StreamingQuantizer.from_pretrained(src)._targets(TurboQuantConfig())  # imports the model class: not timed
    ours = float("inf")
    for attempt in range(2):  # the better of two runs: a transient stall of the machine is not the writer's speed
        start = time.perf_counter()
        _convert(src, tmp_path / f"ours{attempt}")
        ours = min(ours, time.perf_counter() - start)
    start = time.perf_counter()
    peer.save_tq3_checkpoint(src, str(tmp_path / "peer"), bits=3, group_size=128)
    theirs = time.perf_counter() - start
    assert theirs >= 2 * ours, (ours, theirs, meta)
    # the same packed bytes but for boundary ties
    a, b = safetensors_tensors(tmp_path / "ours0"), safetensors_tensors(tmp_path / "peer")
    k = "model.layers.0.mlp.down_proj.weight.tq_packed"
    assert (a[k] != b[k]).float().mean() < 1e-4
