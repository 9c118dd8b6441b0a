"""Tensor parallelism (`tp_plan="auto"`, world size 2, gloo on CPU) of TurboQuant models against one process.

Two ranks run `tensor_parallel_worker.py` under torchrun once for every case. Quantized on the fly and
pre-quantized: tiny Llama, Qwen3-MoE and the text-only Qwen3.5-MoE (its gated delta nets' projections gather their
output; attention, shared expert and routed experts split), and gpt-oss (its plan splits only the embeddings: its
quantized attention and transposed, biased experts stay whole on every rank). The logits equal the single-process quantized model's
within float32 rounding of a different summation order (the row-wise partial products are summed across ranks):
|difference| <= 1e-5 * (1 + max |logit|). Each rank holds about half of the packed bytes, and a row-wise split that
would cut a group is refused with the layer and the sizes named.
"""

import os
import socket
import subprocess
import sys

import pytest
import tensor_parallel_worker as worker
import torch

import turboquant_hf
from turboquant_hf.integration import tensor_parallel as tp

HERE = os.path.dirname(os.path.abspath(__file__))
BITS = 3
TOL = 1e-5


def _spread(model, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (p.dim() >= 2 and "conv1d" not in name) or name.endswith(".bias"):
                p.normal_(0, 0.05)
    return model


def _llama(intermediate_size):
    """Tiny Llama with biases everywhere (column-wise biases split, row-wise ones added once after the sum)."""
    from conftest import tiny_llama_config
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(tiny_llama_config(intermediate_size=intermediate_size, attention_bias=True,
                                              mlp_bias=True))


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=256))


def _qwen3_5_moe():
    from conftest import tiny_qwen3_5_moe_config
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM

    return Qwen3_5MoeForCausalLM(tiny_qwen3_5_moe_config(moe_intermediate_size=128))


def _gpt_oss():
    from test_moe import gpt_oss

    return gpt_oss()


MODELS = {"llama": lambda: _llama(384), "qwen3_moe": _qwen3_moe, "qwen3_5_moe": _qwen3_5_moe, "gpt_oss": _gpt_oss}
EXPERT_MODELS = ("qwen3_moe", "qwen3_5_moe")
# models whose plan splits none of the quantized layers (gpt-oss's names only the embeddings: attention and its
# transposed, biased experts stay whole on every rank, as transformers keeps them in bf16)
WHOLE_MODELS = ("gpt_oss",)
SPLIT_MODELS = [k for k in MODELS if k not in WHOLE_MODELS]
IDS = torch.arange(3, 35).reshape(2, 16) % 200 + 3  # the worker's tokens


def _plan(directory) -> dict:
    """`turboquant-hf plan DIR --gpus 2` of a saved checkpoint (its `tensor_parallel` part)."""
    import json

    from turboquant_hf.format import checkpoint
    from turboquant_hf.reporting import sizing

    index = checkpoint.read_checkpoint_index([os.path.join(directory, "model.safetensors")])
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    tensors = {k: (v["dtype"], v["shape"]) for k, v in index.items()}
    return sizing.plan_stored_memory(config, tensors, gpus=2)["tensor_parallel"]


def _with_language_model_prefix(src: str, dst: str) -> str:
    """A copy of a text-only Qwen3.5-MoE checkpoint with its tensors under `model.language_model.`, as the published
    multimodal checkpoints name them (the text class loads them through a prefix change)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    renamed = {"model.language_model." + k.removeprefix("model.") if k.startswith("model.") else k: v
               for k, v in tensors.items()}
    save_file(renamed, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case built, quantized in one process, then loaded by two tensor parallel ranks."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("tp")
    cases, reference = [], {}
    for kind, build in MODELS.items():
        src, pre = str(root / kind), str(root / f"{kind}_tq")
        _spread(build()).save_pretrained(src)
        model = AutoModelForCausalLM.from_pretrained(
            src, dtype=torch.float32, quantization_config=turboquant_hf.TurboQuantConfig(bits=BITS, group_size=64))
        with torch.no_grad():
            reference[kind] = (model(IDS).logits, tp.resident_packed_bytes(model))
        model.save_pretrained(pre)
        reference[kind] += (_plan(pre), worker.expert_bytes(model))
        cases += [f"{kind}_fly={src}:{BITS}", f"{kind}_pre={pre}"]
        if kind in EXPERT_MODELS:
            cases += [f"ep_{kind}_fly={src}:{BITS}", f"ep_{kind}_pre={pre}"]
    prefixed = _with_language_model_prefix(str(root / "qwen3_5_moe_tq"), str(root / "qwen3_5_moe_prefixed"))
    cases.append(f"qwen3_5_moe_prefixed={prefixed}")
    cut = str(root / "llama_cut")  # intermediate 352: 176 inputs of down_proj per rank, not a multiple of 64
    _spread(_llama(352)).save_pretrained(cut)
    cases += [f"cut={cut}:{BITS}", f"calibrated={root / 'llama'}:c{BITS}"]
    out = root / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), os.path.join(HERE, "tensor_parallel_worker.py"), str(out), *cases]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, check=False, cwd=str(root), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    results = {}
    for case in cases:
        name = case.partition("=")[0]
        results[name] = [torch.load(out / f"{name}.{r}.pt") for r in range(2)]
    return reference, results


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("source", ["fly", "pre"])
def test_logits_equal_one_process(runs, kind, source):
    reference, results = runs
    logits = reference[kind][0]
    bound = TOL * (1 + logits.abs().max().item())
    for rank, record in enumerate(results[f"{kind}_{source}"]):
        assert "error" not in record, record.get("error")
        diff = (record["logits"] - logits).abs().max().item()
        assert diff <= bound, f"rank {rank}: max |logit difference| {diff:.3g} > {bound:.3g}"
    first, second = (r["generated"] for r in results[f"{kind}_{source}"])
    assert torch.equal(first, second) and first.shape == (1, 12)
    for record in results[f"{kind}_{source}"]:
        if "generated_static" in record:  # a static cache, sized for this rank by transformers
            assert torch.equal(record["generated_static"], first)


@pytest.mark.parametrize("kind", list(MODELS))
def test_each_rank_holds_half_the_packed_bytes(runs, kind):
    """Each rank holds about half of the packed bytes; where the plan splits no quantized layer (gpt-oss), all."""
    reference, results = runs
    whole = reference[kind][1]
    for source in ("fly", "pre"):
        held = [r["packed_bytes"] for r in results[f"{kind}_{source}"]]
        for rank, b in enumerate(held):
            if kind in WHOLE_MODELS:
                assert b == whole, f"{kind} {source} rank {rank}: {b} of {whole} packed bytes"
            else:
                assert 0.45 * whole <= b <= 0.56 * whole, f"{kind} {source} rank {rank}: {b} of {whole} packed bytes"
        assert sum(held) >= whole  # nothing dropped (only small layers outside the plan are replicated)


def test_group_cutting_split_is_refused(runs):
    _, results = runs
    for record in results["cut"]:
        msg = record.get("error", "")
        assert "TensorParallelError" in msg and "model.layers.0.mlp.down_proj" in msg, msg
        assert "352" in msg and "176" in msg and "group size 64" in msg, msg


def test_chunk_ranges_tile_and_refuse_cut_groups():
    assert [tp.chunk_range(10, r, 3) for r in range(3)] == [(0, 4), (4, 8), (8, 10)]
    assert [tp.group_aligned_range("x", "input width", 255, 64, r, 2) for r in range(2)] == [(0, 128), (128, 255)]
    with pytest.raises(tp.TensorParallelError, match=r"x: its input width of 96 split into pieces of 48"):
        tp.group_aligned_range("x", "input width", 96, 64, 0, 2)


def test_local_source_slices_match_quantized_slices():
    """A rank quantizing its slice of the source gets the same bytes as that slice of the whole quantized weight."""
    from turboquant_hf.format import codec
    from turboquant_hf.modeling.modules import TurboQuantWeight

    torch.manual_seed(0)
    w = torch.randn(6, 192)
    packed, norms = codec.quantize_weight(w, 3, 64)
    t = TurboQuantWeight((6, 192), 3, 64, device="meta")
    t.tp_shard = tp.ShardSpec((6, 192), ((0, 6),), 64, 192)  # the second rank of a row-wise split
    p2, n2 = codec.quantize_weight(tp.local_source(t, w), 3, 64)
    assert torch.equal(p2, packed.view(6, 3, -1)[:, 1:].reshape(-1, packed.shape[1]))
    assert torch.equal(n2, norms[:, 1:])


@pytest.mark.parametrize("kind", list(MODELS))
def test_plan_gpus_2_predicts_each_ranks_bytes(runs, kind):
    """`plan --gpus 2` from the headers equals the bytes of the first rank's state dict (its shards included)."""
    reference, results = runs
    plan = reference[kind][2]
    assert not plan["refused"]
    for source in ("fly", "pre"):
        assert results[f"{kind}_{source}"][0]["state_bytes"] == plan["weights_bytes_per_gpu"], source


def test_plan_cli_gpus_names_group_cutting_splits_and_budgets_each_gpu(tmp_path, capsys):
    import json

    from turboquant_hf.cli import commands as cli

    _spread(_llama(352)).save_pretrained(tmp_path)
    assert cli.main(["plan", str(tmp_path), "--bits", "3", "--group-size", "64", "--gpus", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    tp_plan = plan["tensor_parallel"]
    assert tp_plan["gpus"] == 2 and len(tp_plan["refused"]) == 2  # down_proj of both layers: 176 inputs per GPU
    assert all("mlp.down_proj" in r and "352" in r and "176" in r for r in tp_plan["refused"])
    assert tp_plan["weights_bytes_per_gpu"] == tp_plan["replicated_bytes"] + tp_plan["split_bytes"] // 2
    per_gpu = tp_plan["total_gpu_bytes_per_gpu"]
    assert per_gpu < plan["total_gpu_bytes"]
    # a budget between the per-GPU total and the one-GPU total fits only with --gpus 2
    budget = f"{(per_gpu + plan['total_gpu_bytes']) / 2e9:.9f}"
    assert cli.main(["plan", str(tmp_path), "--bits", "3", "--group-size", "64", "--gpu-gb", budget]) == \
        cli.EXIT_DOES_NOT_FIT
    capsys.readouterr()
    assert cli.main(["plan", str(tmp_path), "--bits", "3", "--group-size", "64", "--gpus", "2", "--gpu-gb",
                     budget]) == 0
    assert "tensor parallel over 2 GPUs" in capsys.readouterr().out


def test_calibration_under_tensor_parallelism_is_refused(runs):
    _, results = runs
    for record in results["calibrated"]:
        msg = record.get("error", "")
        assert "tensor parallelism (tp_plan) does not support" in msg and "save_pretrained" in msg, msg


@pytest.mark.parametrize("kind", SPLIT_MODELS)
def test_on_the_fly_each_rank_reads_only_its_slice(runs, kind):
    """Quantizing on the fly, the loader hands each rank only its slice of every split full-precision tensor."""
    _, results = runs
    for record in results[f"{kind}_fly"]:
        sliced, total = record["read_as_slices"]
        assert total > 0 and sliced == total, f"{sliced} of {total} tensors arrived as this rank's slice"


@pytest.mark.parametrize("kind", EXPERT_MODELS)
@pytest.mark.parametrize("source", ["fly", "pre"])
def test_expert_parallel_keeps_whole_experts_per_rank(runs, kind, source):
    """With the model's expert-parallel plan (`ep_size=2`, or `enable_expert_parallel` before transformers 5.21)
    each rank holds half of the experts, whole (half of their packed bytes), and the logits equal one process's.
    (Before 5.21 that plan splits only the experts: attention stays whole on each rank.)"""
    reference, results = runs
    logits = reference[kind][0]
    bound = TOL * (1 + logits.abs().max().item())
    for rank, record in enumerate(results[f"ep_{kind}_{source}"]):
        assert "error" not in record, record.get("error")
        assert (record["logits"] - logits).abs().max().item() <= bound, rank
        (start, stop), = set(record["experts"])  # the same experts of every layer
        assert record["experts"] and (start, stop) == (rank * (stop - start), (rank + 1) * (stop - start))
    whole = reference[kind][3]
    for record in results[f"ep_{kind}_{source}"]:
        assert 2 * record["expert_bytes"] == whole


def test_saving_a_ranks_slices_is_refused(runs):
    _, results = runs
    for name in ("llama_fly", "qwen3_5_moe_pre", "ep_qwen3_moe_fly"):
        for record in results[name]:
            assert "saved from it would be partial" in record.get("save_error", ""), name


def test_whole_row_rotation_is_refused_by_name():
    """turboquant-mlx weights rotate whole input rows, which no split preserves."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from turboquant_hf.modeling.modules import TurboQuantLinear

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        layer = TurboQuantLinear(128, 64, bias=False, bits=3, group_size=64, device="meta", rotation="hadamard")
        layer.__dict__["_tq_name"] = "model.layers.0.mlp.up_proj"
        with pytest.raises(tp.TensorParallelError, match=r"model\.layers\.0\.mlp\.up_proj\.weight uses a whole-row"):
            tp.shard_linear_(layer, "colwise", mesh)
    finally:
        dist.destroy_process_group()


def test_experts_in_other_layouts_are_refused_by_name():
    """Tensor and expert parallelism split experts stored gate rows then up rows without biases; gpt-oss's layout
    (transposed, interleaved, biased) is refused naming the module and the layout, before any split."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from turboquant_hf.modeling.experts_layout import ExpertsLayout
    from turboquant_hf.modeling.modules import TurboQuantExperts

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        layout = ExpertsLayout(transposed=True, interleaved=True, bias=True, alpha=1.702, limit=7.0)
        for shard in (tp.shard_experts_, tp.shard_experts_by_expert_):
            experts = TurboQuantExperts(4, 128, 64, 3, 3, 64, "clamped_swiglu", device="meta", layout=layout)
            experts.__dict__["_tq_name"] = "model.layers.0.mlp.experts"
            with pytest.raises(tp.TensorParallelError, match=r"model\.layers\.0\.mlp\.experts holds its experts in "
                                                             r"a layout \(\[E, in, out\], interleaved gate/up, biased\)"):
                shard(experts, mesh)
            assert experts.gate_up_proj.tp_shard is None
    finally:
        dist.destroy_process_group()


def test_slices_are_found_under_a_renamed_prefix(runs):
    """Each rank finds its slices when the checkpoint names the tensors `model.language_model.*`."""
    reference, results = runs
    logits = reference["qwen3_5_moe"][0]
    for record in results["qwen3_5_moe_prefixed"]:
        assert "error" not in record, record.get("error")
        assert (record["logits"] - logits).abs().max().item() <= TOL * (1 + logits.abs().max().item())
        assert 2 * record["packed_bytes"] == reference["qwen3_5_moe"][1]


def test_slices_read_from_the_file_equal_slices_of_the_whole(tmp_path):
    """`load_shards`' reader: experts 1-2 of 4, two row ranges, groups 1-2 of 3 (the last one partial) of a stored
    packed tensor and its norms equal the same slices of the whole tensors."""
    from safetensors.torch import save_file

    from turboquant_hf.format import checkpoint

    blocks, rows, in_features, g, bpg = 4, 8, 160, 64, 24  # 3 groups, the last one of 32 weights
    packed = torch.randint(0, 256, (blocks * rows * 3, bpg), dtype=torch.uint8)
    norms = torch.randn(blocks * rows, 3)
    save_file({"w.tq_packed": packed, "w.tq_norms": norms}, str(tmp_path / "x.safetensors"))
    index = checkpoint.read_checkpoint_index([str(tmp_path / "x.safetensors")])
    spec = tp.ShardSpec((blocks, rows, in_features), ((1, 3), (5, 7)), 64, 160, 1, 3)
    got_packed = tp._read_slices(index["w.tq_packed"], spec, g, bpg)
    got_norms = tp._read_slices(index["w.tq_norms"], spec, g, 1)
    want_packed = torch.cat([packed.view(blocks, rows, 3, bpg)[1:3, a:b, 1:3] for a, b in ((1, 3), (5, 7))], 1)
    want_norms = torch.cat([norms.view(blocks, rows, 3)[1:3, a:b, 1:3] for a, b in ((1, 3), (5, 7))], 1)
    assert torch.equal(got_packed, want_packed.reshape(-1, bpg))
    assert torch.equal(got_norms, want_norms.reshape(-1, 2))


def test_tensor_parallel_benchmark_driver_runs_end_to_end(tmp_path):
    """benchmarks/bench_tp.py, the driver of the multi-GPU table, on CPU: `prepare` saves a bf16 checkpoint and its
    TurboQuant checkpoint (through from_pretrained and save_pretrained), `run` under torchrun loads both on two
    ranks with tp_plan="auto", checks that the ranks decode the same tokens and reports each row; the TurboQuant
    rank holds fewer bytes than the bf16 rank, and each rank about half of what the one process holds (exactly half
    where transformers also splits the embeddings, 5.18 and later)."""
    import json

    script = os.path.join(HERE, "..", "benchmarks", "bench_tp.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, script, "prepare", str(tmp_path), "--tiny"], check=True, env=env,
                   capture_output=True, timeout=300)
    rows = {}
    for world in (1, 2):
        out = tmp_path / f"tp{world}.json"
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-addr",
                  "127.0.0.1", "--master-port", str(_free_port())] if world > 1 else [sys.executable]
        done = subprocess.run([*launch, script, "run", str(tmp_path), "--steps", "3", "--batch", "1", "2",
                               "--json", str(out), "--md", str(tmp_path / f"tp{world}.md")], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        rows[world] = {(r["weights"], r["batch"]): r for r in json.loads(out.read_text())}
        assert set(rows[world]) == {(w, b) for w in ("bf16", "tq3") for b in (1, 2)}
        assert all(r["tp"] == world and r["mode"] == "eager" and r["tokens_per_s"] > 0 for r in rows[world].values())
        assert "| tiny Llama | tq3 | " + str(world) in (tmp_path / f"tp{world}.md").read_text()
    for world in (1, 2):
        assert rows[world]["tq3", 1]["GB_per_rank"] < 0.5 * rows[world]["bf16", 1]["GB_per_rank"]
    for weights in ("bf16", "tq3"):
        assert rows[1][weights, 1]["GB_per_rank"] / 2 <= rows[2][weights, 1]["GB_per_rank"]
        assert rows[2][weights, 1]["GB_per_rank"] < 0.7 * rows[1][weights, 1]["GB_per_rank"]
