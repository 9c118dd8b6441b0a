"""The `turboquant-hf` command line: quantize, card, plan (headers only), bad input and exit codes."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys

import pytest

from turboquant_hf.cli import commands as cli

# ---------------------------------------------------------------------------------------------------------------
# A Qwen3.6-35B-A3B-shaped folder: its config.json and safetensors files whose headers are real and whose data
# is a hole (the files are extended with truncate(), sparse on disk): `plan` reads headers only.
QWEN36_TEXT = dict(
    model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, vocab_size=248320, num_experts=256, num_experts_per_tok=8,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    full_attention_interval=4, max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False,
)
QWEN36_CONFIG = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
    "text_config": dict(QWEN36_TEXT, layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                                  for i in range(40)]),
    "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "out_hidden_size": 2048},
    "tie_word_embeddings": False, "dtype": "bfloat16",
}


def qwen36_tensors() -> tuple[dict, set]:
    """{name: shape} of the checkpoint, and the names TurboQuant quantizes (Linear weights and fused experts)."""
    t, linear = {}, set()
    p = "model.language_model."

    def lin(name, shape):
        t[name] = shape
        linear.add(name)

    t[p + "embed_tokens.weight"] = (248320, 2048)
    t[p + "norm.weight"] = (2048,)
    t["lm_head.weight"] = (248320, 2048)  # kept in full precision by default
    for i in range(40):
        L = f"{p}layers.{i}."
        t[L + "input_layernorm.weight"] = (2048,)
        t[L + "post_attention_layernorm.weight"] = (2048,)
        if (i + 1) % 4 == 0:
            lin(L + "self_attn.q_proj.weight", (16 * 256 * 2, 2048))  # query and output gate
            lin(L + "self_attn.k_proj.weight", (2 * 256, 2048))
            lin(L + "self_attn.v_proj.weight", (2 * 256, 2048))
            lin(L + "self_attn.o_proj.weight", (2048, 16 * 256))
            t[L + "self_attn.q_norm.weight"] = (256,)
            t[L + "self_attn.k_norm.weight"] = (256,)
        else:
            lin(L + "linear_attn.in_proj_qkv.weight", (2 * 16 * 128 + 32 * 128, 2048))
            lin(L + "linear_attn.in_proj_z.weight", (32 * 128, 2048))
            lin(L + "linear_attn.in_proj_b.weight", (32, 2048))
            lin(L + "linear_attn.in_proj_a.weight", (32, 2048))
            lin(L + "linear_attn.out_proj.weight", (2048, 32 * 128))
            t[L + "linear_attn.conv1d.weight"] = (2 * 16 * 128 + 32 * 128, 1, 4)
            t[L + "linear_attn.A_log"] = (32,)
            t[L + "linear_attn.dt_bias"] = (32,)
            t[L + "linear_attn.norm.weight"] = (128,)
        t[L + "mlp.gate.weight"] = (256, 2048)  # the router: full precision by default
        lin(L + "mlp.experts.gate_up_proj", (256, 2 * 512, 2048))
        lin(L + "mlp.experts.down_proj", (256, 2048, 512))
        lin(L + "mlp.shared_expert.gate_proj.weight", (512, 2048))
        lin(L + "mlp.shared_expert.up_proj.weight", (512, 2048))
        lin(L + "mlp.shared_expert.down_proj.weight", (2048, 512))
        t[L + "mlp.shared_expert_gate.weight"] = (1, 2048)
    v = "model.visual."
    t[v + "patch_embed.proj.weight"] = (1152, 3, 2, 16, 16)
    for i in range(27):
        B = f"{v}blocks.{i}."
        t[B + "attn.qkv.weight"] = (3 * 1152, 1152)
        t[B + "attn.proj.weight"] = (1152, 1152)
        t[B + "mlp.linear_fc1.weight"] = (4304, 1152)
        t[B + "mlp.linear_fc2.weight"] = (1152, 4304)
        t[B + "norm1.weight"] = (1152,)
        t[B + "norm2.weight"] = (1152,)
    t[v + "merger.linear_fc1.weight"] = (4608, 4608)
    t[v + "merger.linear_fc2.weight"] = (2048, 4608)
    return t, linear


def write_header_only_safetensors(path: str, tensors: dict, dtype: str = "BF16", nbytes: int = 2) -> None:
    header, offset = {}, 0
    for name, shape in tensors.items():
        size = math.prod(shape) * nbytes
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)  # a hole, not data


@pytest.fixture(scope="module")
def qwen36_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen36_35b_a3b")
    tensors, _ = qwen36_tensors()
    names = list(tensors)
    shards = [names[i::4] for i in range(4)]
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-00004.safetensors"
        write_header_only_safetensors(str(d / fname), {n: tensors[n] for n in shard})
        weight_map.update({n: fname for n in shard})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps(QWEN36_CONFIG))
    return str(d)


def _expected_weights(bytes_per_group_for) -> int:
    """Weights in bytes with TurboQuant, counted independently of the package: rows x ceil(in/128) x
    (bytes per group, norm included) for quantized tensors, bf16 for the rest."""
    tensors, linear = qwen36_tensors()
    total = 0
    for name, shape in tensors.items():
        if name in linear:
            rows, in_features = math.prod(shape[:-1]), shape[-1]
            total += rows * math.ceil(in_features / 128) * bytes_per_group_for(name)
        else:
            total += 2 * math.prod(shape)
    return total


def test_qwen36_folder_is_35b_a3b_sized(qwen36_dir):
    tensors, _ = qwen36_tensors()
    params = sum(math.prod(s) for s in tensors.values())
    assert 34.5e9 < params < 36.5e9
    apparent = sum(os.path.getsize(os.path.join(qwen36_dir, f)) for f in os.listdir(qwen36_dir))
    assert apparent > 2 * 34.5e9  # bf16 sizes on paper; sparse on disk


def test_plan_qwen36_uniform_3bit(qwen36_dir, capsys):
    assert cli.main(["plan", qwen36_dir, "--bits", "3", "--context", "32768", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_cache_bytes_per_token"] == 20480  # 10 full-attention layers x 2 KV heads x 256 x 2 x 2 bytes
    assert plan["kv_cache"]["layers"] == 10
    assert plan["kv_cache_bytes"] == 20480 * 32768
    assert [t["bits"] for t in plan["tiers"]] == [3]
    assert plan["weights_bytes"] == _expected_weights(lambda name: 48 + 4)  # 3 bits x 128 / 8, float32 norm
    _, linear = qwen36_tensors()
    assert plan["tiers"][0]["tensors"] == len(linear)
    # 30 GatedDeltaNet layers: a constant recurrent state (32 x 128 x 128) and conv state (8192 x 3), in bf16
    assert plan["recurrent_state"]["layers"] == 30
    assert plan["recurrent_state_bytes"] == 30 * (32 * 128 * 128 + 8192 * 3) * 2


def test_plan_qwen36_tq3a_tqte(qwen36_dir, capsys):
    assert cli.main(["plan", qwen36_dir, "--recipe", "tq3a-tqTe"]) == 0
    text = capsys.readouterr().out
    assert "KV cache per token (bf16): 20,480 bytes" in text
    assert "ternary (1.58-bit)" in text and "3-bit" in text
    assert cli.main(["plan", qwen36_dir, "--recipe", "tq3a-tqTe", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # routed experts ternary (5 trits a byte: ceil(128 / 5) = 26 bytes a group, float16 norm), everything else 3-bit
    expected = _expected_weights(lambda name: 26 + 2 if ".mlp.experts." in name else 48 + 4)
    assert plan["weights_bytes"] == expected
    tiers = {t["bits"]: t for t in plan["tiers"]}
    assert tiers[1.58]["tensors"] == 80 and tiers[3]["tensors"] == len(qwen36_tensors()[1]) - 80
    assert plan["weights_bytes"] < json.loads(_plan_json(qwen36_dir, "--bits", "3"))["weights_bytes"]
    # on a GPU the ternary experts are 2-bit codes (32 bytes a group), unless the compact bytes are asked for
    assert plan["weights_gpu_bytes"] == _expected_weights(lambda name: 32 + 2 if ".mlp.experts." in name else 48 + 4)
    assert plan["total_gpu_bytes"] - plan["total_bytes"] == plan["weights_gpu_bytes"] - plan["weights_bytes"] > 0


def test_plan_gpu_budget_counts_the_runtime_layout(qwen36_dir, capsys, monkeypatch):
    """A GPU budget is checked against what the GPU holds; a RAM budget against the published bytes."""
    plan = json.loads(_plan_json(qwen36_dir, "--recipe", "tq3a-tqTe", "--context", "4096"))
    between = (plan["total_bytes"] + plan["total_gpu_bytes"]) / 2e9  # fits the bytes, not the 2-bit codes
    args = ["plan", qwen36_dir, "--recipe", "tq3a-tqTe", "--context", "4096", "--json"]
    assert cli.main([*args, "--gpu-gb", f"{between}", "--ram-gb", f"{between}"]) == cli.EXIT_DOES_NOT_FIT
    out = json.loads(capsys.readouterr().out)
    assert out["fits_gpu"] is False and out["fits_ram"] is True
    monkeypatch.setenv("TURBOQUANT_COMPACT_TERNARY", "1")
    assert cli.main([*args, "--gpu-gb", f"{between}"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits_gpu"] is True and out["total_gpu_bytes"] == out["total_bytes"]
    assert cli.main(["plan", qwen36_dir, "--recipe", "tq3a-tqTe"]) == 0
    assert "weights on a GPU" not in capsys.readouterr().out
    monkeypatch.delenv("TURBOQUANT_COMPACT_TERNARY")
    assert cli.main(["plan", qwen36_dir, "--recipe", "tq3a-tqTe"]) == 0
    assert "weights on a GPU" in capsys.readouterr().out


def _plan_json(d, *extra):
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(["plan", d, "--json", *extra]) == 0
    return buf.getvalue()


def test_plan_budget_exit_codes(qwen36_dir, capsys):
    assert cli.main(["plan", qwen36_dir, "--recipe", "tq3a-tqTe", "--context", "131072", "--gpu-gb", "80"]) == 0
    assert "GPU 80 GB: fits" in capsys.readouterr().out
    assert cli.main(["plan", qwen36_dir, "--bits", "3", "--gpu-gb", "8", "--json"]) == cli.EXIT_DOES_NOT_FIT
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits_gpu"] is False and plan["max_context_gpu"] == 0


def test_plan_per_expert_tensors(tmp_path, capsys):
    """Checkpoints that store each expert separately (`experts.N.gate_proj.weight`) plan the same way."""
    config = {"model_type": "qwen3_moe", "hidden_size": 256, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 1024}
    tensors = {"model.embed_tokens.weight": (1000, 256), "model.layers.0.mlp.gate.weight": (4, 256)}
    for e in range(4):
        for proj, shape in (("gate_proj", (128, 256)), ("up_proj", (128, 256)), ("down_proj", (256, 128))):
            tensors[f"model.layers.0.mlp.experts.{e}.{proj}.weight"] = shape
    write_header_only_safetensors(str(tmp_path / "model.safetensors"), tensors)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert cli.main(["plan", str(tmp_path), "--recipe", "tq3-sensitive4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    tiers = {t["bits"]: t["tensors"] for t in plan["tiers"]}
    assert tiers == {4: 4, 3: 8}  # down_proj is "sensitive" at 4 bits
    assert plan["kv_cache_bytes_per_token"] == 1 * 2 * 64 * 2 * 2
    assert plan["full_precision_tensors"] == 2


@pytest.fixture(scope="module")
def tiny_tq_dirs(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama quantized by from_pretrained and saved: {name: (folder, TurboQuantConfig)}, uniform 3-bit and
    3-bit with down_proj at 4 bits (group size 64)."""
    from transformers import AutoModelForCausalLM

    from turboquant_hf import TurboQuantConfig

    configs = {"tq3": TurboQuantConfig(bits=3, group_size=64),
               "tq3-down4": TurboQuantConfig(bits=3, group_size=64, sensitive_patterns=["down_proj"], sensitive_bits=4)}
    out = {}
    for name, cfg in configs.items():
        d = str(tmp_path_factory.mktemp(name))
        AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=cfg).save_pretrained(d)
        out[name] = (d, cfg)
    return out


def _stored_tensor_bytes(directory: str) -> dict:
    """{tensor name: bytes} from the safetensors headers of `directory`, read here byte by byte (data_offsets)."""
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with open(os.path.join(directory, name), "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            out.update({k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()})
    return out


@pytest.mark.parametrize("name", ["tq3", "tq3-down4"])
def test_plan_on_an_already_quantized_folder(name, tiny_tq_dirs, capsys):
    """`plan` on a TurboQuant checkpoint says so and plans what it holds: the stored bytes of every tensor (packed
    uint8 and norms, the rest at its dtype) and the tier each packed tensor was written at; --bits does not apply."""
    d, cfg = tiny_tq_dirs[name]
    stored = _stored_tensor_bytes(d)
    packed = [k[: -len(".tq_packed")] for k in stored if k.endswith(".tq_packed")]
    assert packed
    tiers: dict = {}  # bits -> [tensors, bytes], from the config the folder was written with
    for key in packed:
        t = tiers.setdefault(cfg.bits_for(key[: -len(".weight")]), [0, 0])
        t[0] += 1
        t[1] += stored[key + ".tq_packed"] + stored[key + ".tq_norms"]
    if name == "tq3-down4":
        assert set(tiers) == {3, 4}
    assert cli.main(["plan", d, "--bits", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["weights_bytes"] == sum(stored.values())  # exactly the tensor bytes on disk
    assert {t["bits"]: [t["tensors"], t["bytes"]] for t in plan["tiers"]} == tiers
    assert plan["already_quantized"] is True
    assert plan["full_precision_tensors"] == len(stored) - 2 * len(packed)
    assert plan["full_precision_bytes"] == sum(stored.values()) - sum(b for _, b in tiers.values())
    assert plan["group_size"] == 64 and plan["quantization_config"]["quant_method"] == "turboquant"
    assert plan["total_bytes"] == plan["weights_bytes"] + plan["kv_cache_bytes"]
    assert cli.main(["plan", d, "--bits", "2"]) == 0
    text = capsys.readouterr().out
    assert "already quantized with TurboQuant" in text and "--bits not applied" in text
    assert f"{sum(stored.values()):,} bytes as stored" in text
    rows = {line.split()[0]: int(line.split()[1]) for line in text.splitlines() if line.split()[:1]
            and line.split()[0].endswith("-bit")}
    assert rows == {f"{bits}-bit": n for bits, (n, _) in tiers.items()}


# ---------------------------------------------------------------------------------------------------------------
def test_quantize_writes_a_complete_folder(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "tiny-tq3"
    assert cli.main(["quantize", tiny_llama_dir, "--out", str(out), "--recipe", "tq3-sensitive4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["out"] == str(out)
    for f in ("config.json", "model.safetensors", "tq_config.json", "README.md", "tokenizer.json",
              "turboquant_build.json"):
        assert (out / f).is_file(), f
    assert sorted(os.listdir(tmp_path)) == ["tiny-tq3"]  # no temporary folder left
    readme = (out / "README.md").read_text()
    assert "--recipe tq3-sensitive4" in readme and 'from_pretrained("<your-namespace>/tiny-tq3"' in readme
    assert json.loads((out / "config.json").read_text())["quantization_config"]["sensitive_bits"] == 4
    # the output exists now: refuse to overwrite it unless asked
    assert cli.main(["quantize", tiny_llama_dir, "--out", str(out)]) == cli.EXIT_USAGE
    assert "already exists" in capsys.readouterr().err
    assert cli.main(["quantize", tiny_llama_dir, "--out", str(out), "--bits", "4", "--force"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["bits"] == 4
    assert sorted(os.listdir(tmp_path)) == ["tiny-tq3"]
    # `card` regenerates the README from the folder
    os.remove(out / "README.md")
    assert cli.main(["card", str(out)]) == 0
    assert "4-bit" in (out / "README.md").read_text()


@pytest.mark.parametrize("exc, code", [(KeyboardInterrupt, cli.EXIT_INTERRUPTED), (RuntimeError, cli.EXIT_FAILURE)])
def test_interrupted_quantize_leaves_no_output(exc, code, tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """The weights are already saved (in the temporary folder) when the run dies: nothing named --out appears,
    and the temporary folder is removed."""
    import transformers

    def boom(*a, **k):
        raise exc("stopped here")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", boom)
    out = tmp_path / "never"
    assert cli.main(["quantize", tiny_llama_dir, "--out", str(out)]) == code
    assert os.listdir(tmp_path) == []
    err = capsys.readouterr().err
    assert ("interrupted" if exc is KeyboardInterrupt else "stopped here") in err


def test_bad_input_exit_codes(tiny_llama_dir, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps({"model_type": "llama"}))
    cases = [
        (["plan", str(empty)], "no .safetensors"),
        (["plan", str(tmp_path / "missing")], "neither a local directory nor a Hub repo id"),
        (["plan", tiny_llama_dir, "--recipe", "tq9"], "unknown recipe 'tq9'; known recipes: tq2"),
        (["quantize", tiny_llama_dir, "--out", str(tmp_path / "x"), "--recipe", "nope"], "unknown recipe 'nope'"),
        (["push", tiny_llama_dir, "tester/not-tq"], "not a TurboQuant checkpoint"),
        (["push", str(tmp_path / "missing"), "tester/x"], "no such directory"),
        (["card", tiny_llama_dir], "not a TurboQuant checkpoint"),
        (["eval", tiny_llama_dir, "--base", tiny_llama_dir, "--text", "t.txt"], "not a TurboQuant checkpoint"),
        (["quantize", tiny_llama_dir, "--out", str(tmp_path / "y"), "--eval", str(tmp_path / "no.txt")], "no such file"),
        (["plan", tiny_llama_dir, "--bits", "5"], "bits must be one of"),
        (["plan", tiny_llama_dir, "--config", str(tmp_path / "none.json")], "no such file"),
        ([], "usage: turboquant-hf"),
    ]
    for argv, message in cases:
        assert cli.main(argv) == cli.EXIT_USAGE, argv
        assert message in capsys.readouterr().err, argv
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_quantize_refuses_an_already_quantized_source(tiny_llama_dir, tmp_path, capsys):
    """A TurboQuant (or turboquant-mlx) checkpoint given to `quantize` is refused before any work: loading it
    would keep its own bits and silently ignore the requested ones."""
    q = tmp_path / "q"
    assert cli.main(["quantize", tiny_llama_dir, "--out", str(q), "--bits", "4"]) == 0
    capsys.readouterr()
    assert cli.main(["quantize", str(q), "--out", str(tmp_path / "qq"), "--bits", "2"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "already quantized (quant_method 'turboquant')" in err and "config.json" in err
    mlx = tmp_path / "mlx"
    shutil.copytree(tiny_llama_dir, mlx)
    config = json.loads((mlx / "config.json").read_text())
    config["quantization"] = {"mode": "turboquant", "bits": 3, "group_size": 64}
    (mlx / "config.json").write_text(json.dumps(config))
    assert cli.main(["quantize", str(mlx), "--out", str(tmp_path / "m"), "--streaming"]) == cli.EXIT_USAGE
    assert "turboquant-hf convert SRC --to tq3_native" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["mlx", "q"]  # nothing written for the refused runs


def test_help_reads_well(capsys):
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    for word in ("quantize", "push", "card", "plan", "eval", "exit codes", "HF_TOKEN"):
        assert word in text
    assert cli.main(["plan", "--help"]) == 0
    text = capsys.readouterr().out
    assert "tq3a-tqTe" in text and "--gpu-gb" in text and "headers" in text


def test_console_script(tmp_path):
    """The installed `turboquant-hf` script runs and its exit code is usable from a shell."""
    script = shutil.which("turboquant-hf", path=os.path.dirname(sys.executable))
    assert script, "the turboquant-hf console script is not installed (pip install -e .)"
    (tmp_path / "config.json").write_text("{}")
    proc = subprocess.run([script, "plan", str(tmp_path)], capture_output=True, text=True, cwd=str(tmp_path),
                          timeout=120)
    assert proc.returncode == 2
    assert "plan: error:" in proc.stderr and "no .safetensors" in proc.stderr


# The CLI in a fresh process, with huggingface_hub's retry backoff (1 + 2 + 4 + 8 + 8 s for a refused connection)
# skipped: the retries still happen, without the waiting.
_CLI_WITHOUT_BACKOFF = """
import sys
from huggingface_hub.utils import _http
_http.time.sleep = lambda seconds: None
from turboquant_hf.cli.commands import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def dead_hub(tmp_path_factory):
    """(endpoint, environment) of a Hub that refuses connections: the local Hub server, started and stopped."""
    from hub_server import LocalHub

    hub = LocalHub().start()
    url = hub.url
    hub.stop()
    env = dict(os.environ, HF_ENDPOINT=url, HF_TOKEN="hf_unused", HF_HUB_CACHE=str(tmp_path_factory.mktemp("cache")),
               HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
               HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="5", TOKENIZERS_PARALLELISM="false")
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(key, None)
    return url, env


@pytest.mark.parametrize("command", ["push", "plan", "quantize", "quantize --push-to-hub", "eval"])
def test_refused_connection_exits_3(command, dead_hub, tiny_tq_dirs, tiny_llama_dir, tmp_path):
    """Every command that talks to the Hub exits 3 (the Hub failed) when the endpoint refuses connections, and
    says which endpoint. `plan REPO` used to exit 2: hf_hub_download reports the refused connection as
    LocalEntryNotFoundError, an EntryNotFoundError, which read as a missing file."""
    url, env = dead_hub
    tq_dir = tiny_tq_dirs["tq3"][0]
    text = tmp_path / "words.txt"
    text.write_text("the a of to and in is it you that he was for on are with as his they be " * 4)
    argv = {
        "push": ["push", tq_dir, "tester/tiny-tq3"],
        "plan": ["plan", "tester/tiny-llama"],
        "quantize": ["quantize", "tester/tiny-llama", "--out", str(tmp_path / "out")],
        "quantize --push-to-hub": ["quantize", tiny_llama_dir, "--out", str(tmp_path / "out"), "--push-to-hub",
                                   "tester/tiny-tq3"],
        "eval": ["eval", tq_dir, "--base", "tester/tiny-llama", "--text", str(text)],
    }[command]
    proc = subprocess.run([sys.executable, "-c", _CLI_WITHOUT_BACKOFF, *argv], env=env, capture_output=True,
                          text=True, cwd=str(tmp_path), timeout=120)
    assert proc.returncode == cli.EXIT_HUB, proc.stderr[-3000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith(f"turboquant-hf {argv[0]}: error:")]
    assert len(error) == 1, proc.stderr[-3000:]
    assert f"the connection to {url} failed" in error[0] and "Connection refused" in error[0], error[0]
    assert "Traceback" not in proc.stderr
    if command == "quantize":
        assert not (tmp_path / "out").exists()
    if command == "quantize --push-to-hub":  # quantized and saved; the push is what failed
        assert "creating the repository tester/tiny-tq3 failed" in error[0]
        assert (tmp_path / "out" / "model.safetensors").is_file()


def test_eval_writes_its_numbers_into_the_card(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "tiny-tq4"
    assert cli.main(["quantize", tiny_llama_dir, "--out", str(out), "--bits", "4"]) == 0
    text = tmp_path / "words.txt"
    text.write_text(" ".join(["the a of to and in is it you that he was for on are with as his they be"] * 20))
    capsys.readouterr()
    assert cli.main(["eval", str(out), "--base", tiny_llama_dir, "--text", str(text), "--max-tokens", "300",
                     "--window", "128", "--write-card", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] == 299 and result["window"] == 128 and result["mean_kl"] > 0
    assert 0 < result["top1_agreement"] <= 1
    stored = json.loads((out / "turboquant_eval.json").read_text())
    assert stored["quantized_perplexity"] == result["quantized_perplexity"]
    readme = (out / "README.md").read_text()
    assert f"| perplexity | {result['base_perplexity']:.3f} | {result['quantized_perplexity']:.3f} |" in readme
    assert "299 predicted tokens of `words.txt`" in readme
    assert f"| 100% | {100 * result['top1_agreement']:.1f}% |" in readme


def test_eval_warns_when_the_text_is_the_calibration_text(tiny_llama_dir, tmp_path, capsys):
    import hashlib

    out = tmp_path / "tiny-tq4"
    assert cli.main(["quantize", tiny_llama_dir, "--out", str(out), "--bits", "4"]) == 0
    text = tmp_path / "words.txt"
    text.write_text(" ".join(["the a of to and in is it you that he was for on are with as his they be"] * 10))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["calibrated_with"] = {
        "kind": "text-file", "source": "words.txt", "samples": 2, "sequence_length": 64, "tokens": 128, "seed": 0,
        "source_sha256": hashlib.sha256(text.read_text().encode()).hexdigest()}
    (out / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert cli.main(["eval", str(out), "--base", tiny_llama_dir, "--text", str(text), "--max-tokens", "100",
                     "--write-card"]) == 0
    printed = capsys.readouterr().out
    assert "warning: the evaluation text is the text the model was calibrated on (words.txt)" in printed
    readme = (out / "README.md").read_text()
    assert "**Warning:** the evaluation text is the text the model was calibrated on (words.txt)" in readme
    assert "Calibrated on `words.txt`" in readme
    other = tmp_path / "other.txt"
    other.write_text(text.read_text() + " the")
    assert cli.main(["eval", str(out), "--base", tiny_llama_dir, "--text", str(other), "--max-tokens", "100"]) == 0
    assert "warning" not in capsys.readouterr().out


@pytest.mark.parametrize("recipe", ["tq3", "tq3a-tqTe"])
def test_plan_agrees_with_the_module_replacement(qwen36_dir, recipe, capsys):
    """`plan` decides from tensor names and shapes in the headers; from_pretrained decides from module types.
    For the full Qwen3.6-35B-A3B both must quantize the same weights into the same bytes."""
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    from turboquant_hf.quantization.recipes import get_recipe
    from turboquant_hf.reporting.sizing import size_from_config

    plan = json.loads(_plan_json(qwen36_dir, "--recipe", recipe))
    report = size_from_config(Qwen3_5MoeTextConfig(), get_recipe(recipe))
    planned = {float(t["bits"]): t for t in plan["tiers"]}
    assert set(planned) == {float(b) for b in report["tiers"]}
    for bits, tier in report["tiers"].items():
        assert planned[float(bits)]["bytes"] == tier["bytes"], bits
