"""turboquant-mlx checkpoints made by the real converter, for the tests.

`TURBOQUANT_MLX_PYTHON` names the python of an environment holding `mlx[cpu]==0.32.4`, `mlx-lm==0.32.2` and
`turboquant-mlx-full==0.30.0` (`.ci/run` makes one). Tiny models are built from config here, saved with
save_pretrained, and converted with `python -m turboquant_mlx.convert`; results are cached by a hash of the
source files, the converter's arguments and the MLX packages' versions (`TURBOQUANT_MLX_CACHE`, default
`~/.cache/turboquant-hf/mlx-fixtures`), so the second pass of CI converts nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
MLX_PYTHON = os.environ.get("TURBOQUANT_MLX_PYTHON")
CACHE = os.environ.get("TURBOQUANT_MLX_CACHE") or os.path.join(
    os.path.expanduser("~"), ".cache", "turboquant-hf", "mlx-fixtures")

# recipe name -> converter arguments
RECIPES = {
    "tq3": ["--bits", "3", "--group-size", "64"],
    "tq4-attn2": ["--bits", "4", "--attn-bits", "2", "--group-size", "64"],
    "tq3a-tqTe": ["--bits", "3", "--group-size", "64", "--ternary-experts"],
    "tqTe-down4": ["--bits", "3", "--group-size", "64", "--ternary-experts", "--expert-down-bits", "4"],
    # MLP and experts in groups of 32, attention in groups of 64
    "tqTe-g32": ["--bits", "3", "--group-size", "64", "--ternary-experts", "--mlp-group-size", "32"],
}
# (model, recipe) pairs converted for the tests
CASES = [("llama", "tq3"), ("llama", "tq4-attn2"),
         ("qwen3_moe", "tq3"), ("qwen3_moe", "tq3a-tqTe"), ("qwen3_moe", "tqTe-down4"), ("qwen3_moe", "tqTe-g32"),
         ("qwen3_5_moe", "tq3"), ("qwen3_5_moe", "tq3a-tqTe"), ("qwen3_5_moe", "tqTe-down4")]


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    # input widths 256 (2^8), 384 (12 * 32: o_proj) and 320 (20 * 16: down_proj)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=96, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2))


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=256, hidden_size=128, intermediate_size=192, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=256, tie_word_embeddings=False))


def _qwen3_5_moe():
    from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    # shared_expert down_proj reads 576 inputs: not m * 2^k, rotated in 3 blocks of 192 (12 * 16)
    text = dict(vocab_size=256, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=64, moe_intermediate_size=64, shared_expert_intermediate_size=576, num_experts=8,
                num_experts_per_tok=2, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
                linear_value_head_dim=48, linear_conv_kernel_dim=4, full_attention_interval=4,
                max_position_embeddings=256, tie_word_embeddings=False)
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    return Qwen3_5MoeForConditionalGeneration(
        Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False))


BUILDERS = {"llama": _llama, "qwen3_moe": _qwen3_moe, "qwen3_5_moe": _qwen3_5_moe}


def build_source(kind: str, directory: str) -> str:
    """The tiny bf16 source model `kind` saved in the layout mlx-lm reads, with a tokenizer."""
    from conftest import make_tokenizer

    torch.manual_seed(0)
    model = BUILDERS[kind]()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "conv1d" not in name:
                p.normal_(0, 0.05)
    model = model.to(torch.bfloat16)
    # mlx-lm reads Qwen3-MoE experts per expert and Qwen3.5-MoE experts fused
    model.save_pretrained(directory, save_original_format=kind != "qwen3_5_moe")
    make_tokenizer(directory)
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    if kind == "qwen3_moe":  # mlx-lm's Qwen3-MoE arguments, which transformers 5 writes under other names
        config["num_experts"] = config.get("num_experts", config.get("num_local_experts"))
        config["rope_theta"] = config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta"))
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    return directory


def _mlx_versions() -> str:
    out = subprocess.run([MLX_PYTHON, "-c", "import importlib.metadata as m; print([m.version(p) for p in "
                          "('mlx', 'mlx-lm', 'turboquant-mlx-full')])"], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _content_hash(directory: str, extra: str) -> str:
    h = hashlib.sha256(extra.encode())
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name == "config.json":
            with open(path) as f:
                config = json.load(f)
            config.pop("transformers_version", None)
            data = json.dumps(config, sort_keys=True).encode()
        elif name.endswith((".safetensors", ".json")):
            with open(path, "rb") as f:
                data = f.read()
        else:
            continue
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()[:20]


def run_mlx(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    result = subprocess.run([MLX_PYTHON, *args], capture_output=True, text=True, timeout=timeout)
    if result.returncode:
        raise RuntimeError(f"{' '.join(args[:3])} failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                           f"{result.stderr[-3000:]}")
    return result


class Fixtures:
    """Sources and their MLX conversions under one temporary folder (conversions come from the cache)."""

    def __init__(self, root: str):
        self.root = root
        self.versions = _mlx_versions()
        self._sources: dict[str, str] = {}
        self._converted: dict[tuple, str] = {}

    def source(self, kind: str) -> str:
        if kind not in self._sources:
            self._sources[kind] = build_source(kind, os.path.join(self.root, f"src_{kind}"))
        return self._sources[kind]

    def converted(self, kind: str, recipe: str, converter: list[str] | None = None) -> str:
        """`python -m turboquant_mlx.convert` of source `kind` with `recipe` (or explicit converter arguments)."""
        key = (kind, recipe)
        if key not in self._converted:
            src = self.source(kind)
            args = converter or ["-m", "turboquant_mlx.convert", *RECIPES[recipe]]
            digest = _content_hash(src, json.dumps([args, self.versions]))
            out = os.path.join(CACHE, f"{kind}-{recipe}-{digest}")
            if not os.path.isfile(os.path.join(out, "config.json")):
                os.makedirs(CACHE, exist_ok=True)
                tmp = tempfile.mkdtemp(prefix=".tmp-", dir=CACHE)
                try:
                    run_mlx([*args, "--hf-path", src, "--mlx-path", os.path.join(tmp, "out")])
                    try:
                        os.replace(os.path.join(tmp, "out"), out)
                    except OSError:  # another run finished the same conversion first (it is deterministic)
                        if not os.path.isfile(os.path.join(out, "config.json")):
                            raise
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
            self._converted[key] = out
        return self._converted[key]

    def mlx_logits(self, checkpoint: str, ids: list[list[int]]):
        """MLX's own forward of `checkpoint` (see mlx_reference_forward.py), as a float32 numpy array."""
        import numpy as np

        with tempfile.TemporaryDirectory() as tmp:
            ids_path, out_path = os.path.join(tmp, "ids.json"), os.path.join(tmp, "logits.npy")
            with open(ids_path, "w") as f:
                json.dump(ids, f)
            run_mlx([os.path.join(HERE, "mlx_reference_forward.py"), checkpoint, ids_path, out_path])
            return np.load(out_path)
