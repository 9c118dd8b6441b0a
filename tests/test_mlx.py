"""turboquant-mlx checkpoints: lossless loading, MLX's own forward, save/reload, conversion to tq3_native, bad input.

The checkpoints come from the real converter (`tests/mlx_fixtures.py`; needs TURBOQUANT_MLX_PYTHON, which
`.ci/run` sets). The tests of the repacking and of the ops need no MLX.
"""

import json
import math
import os
import shutil
import tempfile

import mlx_fixtures
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from turboquant_hf import TurboQuantConfig, TurboQuantExperts, TurboQuantLinear
from turboquant_hf.cli import commands as cli
from turboquant_hf.format import codec
from turboquant_hf.format import constants as fmt
from turboquant_hf.format import hadamard as rotation
from turboquant_hf.format.checkpoint import CheckpointError
from turboquant_hf.integration import mlx
from turboquant_hf.modeling.modules import TurboQuantWeight

IDS = [[5, 9, 33, 100, 7, 250, 3, 17, 64, 128, 1, 2, 77, 31, 200, 8]]
# relative error of an effective weight against its source, per tier (Lloyd-Max theory: 0.1859 at 3 bits,
# 0.4361 ternary, 0.0975 at 4 bits, 0.3428 at 2 bits; MLX clips at 1.5x the largest level and scales by RMS)
ERROR_BOUNDS = {3: (0.17, 0.20), fmt.TERNARY: (0.41, 0.45), 4: (0.085, 0.105), 2: (0.32, 0.36)}


# ---------------------------------------------------------------------------------------------------------------
# MLX's packing, written out in torch for the tests that need no MLX
def mlx_pack(indices: torch.Tensor, n_levels: int) -> torch.Tensor:
    """Rows of indices `(rows, n)` packed as turboquant-mlx does: uint32 words, LSB first, `32 // b` per word
    (20 base-3 digits per word for ternary), the last word zero-padded."""
    rows, n = indices.shape
    per = mlx.indices_per_word(n_levels)
    padded = torch.zeros(rows, -(-n // per) * per, dtype=torch.int64)
    padded[:, :n] = indices
    digits = padded.view(rows, -1, per)
    if n_levels == 3:
        words = (digits * torch.tensor([3**i for i in range(per)])).sum(-1)
    else:
        b = int(math.log2(n_levels))
        words = (digits << (torch.arange(per) * b)).sum(-1)
    return words.to(torch.int64).to(torch.int32).view(torch.uint32) if hasattr(torch, "uint32") else words


@pytest.mark.parametrize("n_levels, group_size", [(3, 64), (3, 32), (3, 16), (4, 64), (4, 16), (8, 64), (8, 16), (16, 64),
                                                  (16, 128)])
def test_repack_is_lossless(n_levels, group_size):
    g = torch.Generator().manual_seed(n_levels)
    rows, width = 6, 5 * group_size
    idx = torch.randint(0, n_levels, (rows, width), generator=g)
    words = mlx_pack(idx, n_levels)
    packed = mlx.repack(words, n_levels, width, group_size)
    assert packed.shape == (rows * 5, fmt.bytes_per_group(n_levels, group_size))
    assert torch.equal(codec.unpack_indices(packed, n_levels, group_size).view(rows, width), idx)
    assert torch.equal(mlx.unpack_words(words, n_levels, width).long(), idx)
    assert torch.equal(packed, codec.pack_indices(idx.view(-1, group_size), n_levels))
    assert torch.equal(mlx.pack_groups(idx.view(-1, group_size).to(torch.uint8), n_levels), packed)


def test_three_bit_words_are_not_a_bit_stream():
    """10 indices and 2 spare bits per word: the bytes differ from the per-group bit stream, so 3-bit is repacked."""
    idx = torch.randint(0, 8, (2, 64), generator=torch.Generator().manual_seed(0))
    raw = mlx_pack(idx, 8).contiguous().view(torch.uint8)[:, :24].reshape(-1)
    assert not torch.equal(raw, codec.pack_indices(idx, 8).reshape(-1))


def _random_hadamard_weight(rows_shape, in_features, bits, group_size, seed):
    g = torch.Generator().manual_seed(seed)
    w = TurboQuantWeight(tuple(rows_shape) + (in_features,), bits, group_size, rotation="hadamard")
    n_levels = w.n_levels
    idx = torch.randint(0, n_levels, (w.rows * w.n_groups, group_size), generator=g)
    codebook = torch.sort(torch.randn(n_levels, generator=g)).values.half()
    signs = (torch.randint(0, 2, (in_features,), generator=g) * 2 - 1).half()
    norms = (torch.rand(w.rows, w.n_groups, generator=g) * 0.05 + 0.01).half()
    w.load_packed_(codec.pack_indices(idx, n_levels), norms, codebook, signs)
    return w


@pytest.mark.parametrize("in_features, bits, group_size", [(256, 3, 64), (320, 4, 64), (576, fmt.TERNARY, 64),
                                                           (384, 2, 32), (192, 3, 16)])
def test_hadamard_linear_equals_its_dense_weight(in_features, bits, group_size):
    lin = TurboQuantLinear(in_features, 40, bias=True, bits=bits, group_size=group_size, rotation="hadamard")
    lin.weight = _random_hadamard_weight((40,), in_features, bits, group_size, seed=in_features)
    lin.bias = torch.nn.Parameter(torch.randn(40))
    x = torch.randn(3, 5, in_features, generator=torch.Generator().manual_seed(1))
    dense = x @ lin.weight.dequantize().T + lin.bias
    y = lin(x)
    assert ((y - dense).norm() / dense.norm()).item() < 1e-5
    # the effective weight is (codebook[idx] * scale) @ T.T / sqrt(b) * signs per block of b inputs (T_20, T_28
    # are not symmetric)
    b = rotation.block_size(in_features)
    rot = codec.rotated_weight(lin.weight.tq_packed, lin.weight.tq_norms.float(), lin.weight.tq_codebook.float(),
                               group_size)
    t = torch.block_diag(*[rotation.transform_matrix(b)] * (in_features // b)) / math.sqrt(b)
    assert torch.allclose(lin.weight.dequantize(), rot @ t.T * lin.weight.tq_signs.float(), atol=1e-6)


def test_hadamard_experts_equal_dense_experts():
    e, h, i, k = 4, 128, 64, 2
    experts = TurboQuantExperts(e, h, i, (fmt.TERNARY, fmt.TERNARY), 4, 64, "silu", rotation="hadamard")
    experts.gate_proj = _random_hadamard_weight((e, i), h, fmt.TERNARY, 64, 1)
    experts.up_proj = _random_hadamard_weight((e, i), h, fmt.TERNARY, 64, 2)
    experts.down_proj = _random_hadamard_weight((e, h), i, 4, 64, 3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, h, generator=g)
    top = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(7)])
    weights = torch.rand(7, k, generator=g)
    gate = experts.gate_proj.dequantize().view(e, i, h)
    up = experts.up_proj.dequantize().view(e, i, h)
    down = experts.down_proj.dequantize().view(e, h, i)
    ref = torch.zeros(7, h)
    for t in range(7):
        for s in range(k):
            ex = top[t, s]
            ref[t] += weights[t, s] * (down[ex] @ (torch.nn.functional.silu(gate[ex] @ x[t]) * (up[ex] @ x[t])))
    out = experts(x, top, weights)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5


# ---------------------------------------------------------------------------------------------------------------
# checkpoints from the real converter
@pytest.fixture(scope="session")
def fixtures(tmp_path_factory):
    if not mlx_fixtures.MLX_PYTHON:
        pytest.skip("TURBOQUANT_MLX_PYTHON is not set (an environment with turboquant-mlx; .ci/run makes one)")
    return mlx_fixtures.Fixtures(str(tmp_path_factory.mktemp("mlx")))


_LOADED: dict = {}


def loaded(fixtures, kind, recipe):
    """(MLX checkpoint dir, model loaded from it with no arguments, float32), once per session."""
    if (kind, recipe) not in _LOADED:
        d = fixtures.converted(kind, recipe)
        _LOADED[kind, recipe] = d, AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    return _LOADED[kind, recipe]


def _quantized_modules(model):
    """{model module name: (TurboQuantWeight, projection or None)} of every whole-row-Hadamard weight."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, TurboQuantLinear):
            out[name] = (m.weight, None)
        elif isinstance(m, TurboQuantExperts):
            for leaf in ("gate_proj", "up_proj", "down_proj"):
                out[f"{name}.{leaf}"] = (getattr(m, leaf), leaf)
    return out


def _mlx_name(kind, name):
    if kind == "qwen3_5_moe":
        name = "language_model." + name if name == "lm_head" else name.replace("model.", "language_model.model.", 1)
    return name.replace(".experts.", ".switch_mlp.")


CASE_IDS = [f"{k}-{r}" for k, r in mlx_fixtures.CASES]


def test_hadamard_matrices_match_mlx(fixtures, tmp_path):
    """Our T_m (m = 12, 20, 28), the kron structure and the blockwise rule against mx.hadamard_transform."""
    widths = [12, 20, 28, 24, 40, 56, 64, 320, 384, 576, 448]
    script = tmp_path / "h.py"
    script.write_text(
        "import sys, json, numpy as np, mlx.core as mx\n"
        "from turboquant_mlx.core.rotation import rotate_input\n"
        "out = {}\n"
        f"for n in {widths}:\n"
        "    x = mx.array(np.random.default_rng(n).standard_normal((3, n)).astype(np.float32))\n"
        "    s = mx.array(np.where(np.random.default_rng(n + 1).random(n) < 0.5, -1, 1).astype(np.float16))\n"
        "    out[n] = [np.array(x).tolist(), np.array(s).tolist(), np.array(rotate_input(x, s)).tolist()]\n"
        "json.dump(out, open(sys.argv[1], 'w'))\n")
    result = tmp_path / "h.json"
    mlx_fixtures.run_mlx([str(script), str(result)])
    for n, (x, s, y) in json.loads(result.read_text()).items():
        ours = rotation.rotate_rows(torch.tensor(x), torch.tensor(s))
        assert torch.allclose(ours, torch.tensor(y), atol=1e-5), n


@pytest.mark.parametrize("kind, recipe", mlx_fixtures.CASES, ids=CASE_IDS)
def test_loaded_modules_hold_the_files_exactly(fixtures, kind, recipe):
    d, model = loaded(fixtures, kind, recipe)
    files = {}
    index = {}
    for name in os.listdir(d):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(d, name), "pt") as f:
                index.update({k: os.path.join(d, name) for k in f.keys()})
    quantized = _quantized_modules(model)
    assert len(quantized) == len([k for k in index if k.endswith(".codebook")]) > 0

    def get(key):
        path = index[key]
        files.setdefault(path, load_file(path))
        return files[path][key]

    tiers = set()
    for name, (w, _) in quantized.items():
        src = _mlx_name(kind, name)
        codebook, scales, signs, words = (get(f"{src}.{p}") for p in ("codebook", "scales", "signs", "weight"))
        tiers.add(w.bits)
        assert w.rotation == "hadamard" and w.n_levels == codebook.numel()
        assert torch.equal(w.tq_codebook, codebook) and torch.equal(w.tq_signs, signs), name
        assert w.tq_norms.dtype == scales.dtype and torch.equal(w.tq_norms, scales.reshape(w.tq_norms.shape)), name
        ours = codec.unpack_indices(w.tq_packed, w.n_levels, w.group_size).view(-1, w.in_features)
        theirs = mlx.unpack_words(words.reshape(-1, words.shape[-1]), w.n_levels, w.in_features).long()
        assert torch.equal(ours, theirs), name
    expected = {"tq3": {3}, "tq4-attn2": {2, 4}, "tq3a-tqTe": {3, fmt.TERNARY}, "tqTe-down4": {3, 4, fmt.TERNARY},
                "tqTe-g32": {3, fmt.TERNARY}}
    assert tiers == expected[recipe]
    if recipe == "tqTe-g32":
        sizes = {name: w.group_size for name, (w, _) in quantized.items()}
        assert {g for n, g in sizes.items() if ".experts." in n} == {32}
        assert {g for n, g in sizes.items() if "self_attn" in n} == {64}


@pytest.mark.parametrize("kind, recipe", mlx_fixtures.CASES, ids=CASE_IDS)
def test_effective_weights_have_the_tier_error(fixtures, kind, recipe):
    _, model = loaded(fixtures, kind, recipe)
    base = AutoModelForCausalLM.from_pretrained(fixtures.source(kind), dtype=torch.float32)
    measured = {}
    for name, (w, leaf) in _quantized_modules(model).items():
        if leaf is None:
            source = base.get_submodule(name).weight
        else:
            experts = base.get_submodule(name.rpartition(".")[0])
            i = experts.down_proj.shape[-1]
            source = {"gate_proj": experts.gate_up_proj[:, :i], "up_proj": experts.gate_up_proj[:, i:],
                      "down_proj": experts.down_proj}[leaf]
        rel = ((w.dequantize().view(source.shape) - source).norm() / source.norm()).item()
        lo, hi = ERROR_BOUNDS[w.bits]
        assert lo < rel < hi, (name, w.bits, rel)
        measured.setdefault(w.bits, []).append(rel)
    print({bits: round(sum(v) / len(v), 4) for bits, v in measured.items()})


@pytest.mark.parametrize("kind, recipe", mlx_fixtures.CASES, ids=CASE_IDS)
def test_logits_equal_mlx_forward(fixtures, kind, recipe):
    d, model = loaded(fixtures, kind, recipe)
    reference = fixtures.mlx_logits(d, IDS)
    with torch.no_grad():
        ours = model(torch.tensor(IDS)).logits.numpy()
    rel = np.linalg.norm(ours - reference) / np.linalg.norm(reference)
    print(f"{kind} {recipe}: relative difference to MLX {rel:.2e}")
    assert rel < 1e-4


@pytest.mark.parametrize("kind, recipe", mlx_fixtures.CASES, ids=CASE_IDS)
def test_save_reload_is_bit_exact(fixtures, kind, recipe, tmp_path):
    _, model = loaded(fixtures, kind, recipe)
    model.save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    assert config["quantization_config"]["format"] == fmt.HADAMARD_FORMAT and "quantization" not in config
    with open(tmp_path / "tq_config.json") as f:
        assert json.load(f)["format"] == fmt.HADAMARD_FORMAT
    card = (tmp_path / "README.md").read_text()
    assert "- tq_hadamard" in card and "loaded from a turboquant-mlx" in card and "seed 42" not in card
    saved = load_file(tmp_path / "model.safetensors")
    assert not [k for k in saved if saved[k].dtype == torch.uint32]
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    assert not [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    ids = torch.tensor(IDS)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)


def _copy_checkpoint(src, dst, edit_tensors=None, edit_config=None):
    shutil.copytree(src, dst)
    if edit_tensors:
        path = os.path.join(dst, "model.safetensors")
        tensors = load_file(path)
        edit_tensors(tensors)
        save_file(tensors, path, metadata={"format": "mlx"})
    if edit_config:
        path = os.path.join(dst, "config.json")
        with open(path) as f:
            config = json.load(f)
        edit_config(config)
        with open(path, "w") as f:
            json.dump(config, f)
    return str(dst)


def test_config_without_mlx_block_loads_the_same(fixtures, tmp_path):
    d, model = loaded(fixtures, "qwen3_moe", "tqTe-down4")

    def strip(config):
        config.pop("quantization"), config.pop("quantization_config")

    bare = _copy_checkpoint(d, tmp_path / "bare", edit_config=strip)
    again = AutoModelForCausalLM.from_pretrained(bare, quantization_config=TurboQuantConfig(), dtype=torch.float32)
    assert again.config.quantization_config.format == fmt.HADAMARD_FORMAT
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # and passing a config to a checkpoint that declares its own works as for tq3_native checkpoints
    with pytest.warns(UserWarning, match="quantization_config` from the model will be used"):
        passed = AutoModelForCausalLM.from_pretrained(d, quantization_config=TurboQuantConfig(), dtype=torch.float32)
    assert all(torch.equal(a[k], v) for k, v in passed.state_dict().items())


def test_fullgraph_compile_traces_mlx_model(fixtures):
    _, model = loaded(fixtures, "qwen3_moe", "tqTe-down4")
    ids = torch.tensor(IDS)
    with torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(ids).logits
    assert torch.equal(eager, compiled)


@pytest.mark.parametrize("kind, recipe", [("qwen3_5_moe", "tqTe-down4"), ("llama", "tq4-attn2")])
def test_convert_to_tq3_native(fixtures, kind, recipe, tmp_path, capsys):
    d, model = loaded(fixtures, kind, recipe)
    out = tmp_path / "native"
    assert cli.main(["convert", d, "--to", "tq3_native", "--out", str(out), "--json"]) == cli.EXIT_OK
    result = json.loads(capsys.readouterr().out)
    with open(out / "config.json") as f:
        assert json.load(f)["quantization_config"]["format"] == fmt.FORMAT_NAME
    with open(out / "tq_config.json") as f:
        assert json.load(f)["format"] == fmt.FORMAT_NAME
    native = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert not [k for k in native.state_dict() if k.endswith((".tq_signs", ".tq_codebook"))]
    # the reported error is the error of the saved weights against the MLX ones, and has the size requantizing implies
    per_layer = {x["name"]: x for x in result["per_layer"]}
    mlx_weights = _quantized_modules(model)
    total_err = total_ref = 0.0
    for name, m in native.named_modules():
        parts = {}
        if isinstance(m, TurboQuantLinear):
            parts[name + ".weight"] = (m.weight, mlx_weights[name][0].dequantize())
        elif isinstance(m, TurboQuantExperts):
            e, h, i = m.num_experts, m.hidden_size, m.intermediate_size
            gate_up = torch.cat([mlx_weights[f"{name}.{p}"][0].dequantize().view(e, i, h)
                                 for p in ("gate_proj", "up_proj")], 1)
            parts[name + ".gate_up_proj"] = (m.gate_up_proj, gate_up)
            parts[name + ".down_proj"] = (m.down_proj, mlx_weights[name + ".down_proj"][0].dequantize())
        for key, (w, source) in parts.items():
            assert w.rotation == "groups"
            diff = (w.dequantize().view(source.shape) - source).norm()
            rel = (diff / source.norm()).item()
            assert abs(rel - per_layer[key]["relative_error"]) < 1e-4, key
            lo, hi = ERROR_BOUNDS[w.bits]
            assert lo - 0.02 < rel < hi + 0.02, (key, w.bits, rel)
            total_err += diff.item() ** 2
            total_ref += source.norm().item() ** 2
    assert len(per_layer) == len(result["per_layer"]) and abs(result["relative_error"] - (total_err / total_ref) ** .5) < 1e-4
    with open(out / "turboquant_convert.json") as f:
        assert json.load(f)["relative_error"] == result["relative_error"]


# ---------------------------------------------------------------------------------------------------------------
# bad input
def _first_key(tensors, suffix):
    return sorted(k for k in tensors if k.endswith(suffix))[0]


def test_unsupported_codebook_length_is_named(fixtures, tmp_path):
    d = fixtures.converted("llama", "tq3")
    bad = {}

    def edit(t):
        key = _first_key(t, ".codebook")
        t[key] = torch.linspace(-2, 2, 5).half()
        bad["key"] = key

    path = _copy_checkpoint(d, tmp_path / "c", edit_tensors=edit)
    with pytest.raises(CheckpointError, match=rf"{bad['key']}: F16 \[5\]; supported codebooks have 3"):
        AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("part", ["signs", "scales"])
def test_missing_signs_or_scales_are_named(fixtures, tmp_path, part):
    d = fixtures.converted("qwen3_moe", "tqTe-down4")
    gone = {}

    def edit(t):
        key = _first_key(t, "switch_mlp.up_proj." + part)
        del t[key]
        gone["key"] = key

    path = _copy_checkpoint(d, tmp_path / "m", edit_tensors=edit)
    with pytest.raises(CheckpointError, match=rf"checkpoint is missing {gone['key']}"):
        AutoModelForCausalLM.from_pretrained(path)


def _assert_left_to_transformers(directory):
    """An MLX checkpoint that is not TurboQuant: its config reads as written (no block rewritten into this
    package's), and transformers refuses to load it as it does without this package, before any weight is read."""
    from transformers import AutoConfig

    with open(os.path.join(directory, "config.json")) as f:
        written = json.load(f)["quantization_config"]
    assert AutoConfig.from_pretrained(directory).quantization_config == written
    for kwargs in ({}, {"quantization_config": TurboQuantConfig()}):
        with pytest.raises(ValueError, match="no `quant_method`"):
            AutoModelForCausalLM.from_pretrained(directory, **kwargs)


def test_affine_mlx_checkpoint_is_left_to_transformers(fixtures):
    """A checkpoint quantized by MLX's own affine quantizer (mlx_lm convert -q)."""
    d = fixtures.converted("llama", "mlx-affine",
                           converter=["-m", "mlx_lm.convert", "-q", "--q-bits", "4", "--q-group-size", "64"])
    _assert_left_to_transformers(d)


def test_older_affine_block_without_mode_is_left_to_transformers(fixtures, tmp_path):
    d = fixtures.converted("llama", "mlx-affine",
                           converter=["-m", "mlx_lm.convert", "-q", "--q-bits", "4", "--q-group-size", "64"])

    def drop_mode(config):
        for block in ("quantization", "quantization_config"):
            config[block].pop("mode", None)

    _assert_left_to_transformers(_copy_checkpoint(d, tmp_path / "old", edit_config=drop_mode))


def test_turboquant_mlx_variant_this_version_cannot_load_is_named(fixtures, tmp_path):
    """A turboquant-mlx checkpoint with QJL residual correction: its config is refused, saying why."""
    d = fixtures.converted("llama", "tq3")

    def qjl(config):
        for block in ("quantization", "quantization_config"):
            config[block]["use_qjl"] = True

    path = _copy_checkpoint(d, tmp_path / "qjl", edit_config=qjl)
    with pytest.raises(ValueError, match="uses QJL residual correction"):
        AutoModelForCausalLM.from_pretrained(path)


def test_affine_module_in_a_turboquant_checkpoint_is_named(fixtures, tmp_path):
    d = fixtures.converted("llama", "tq3")
    name = "model.layers.1.self_attn.v_proj"

    def edit(t):
        for part in ("codebook", "signs"):
            del t[f"{name}.{part}"]
        t[f"{name}.biases"] = torch.zeros_like(t[f"{name}.scales"])

    path = _copy_checkpoint(d, tmp_path / "a", edit_tensors=edit)
    with pytest.raises(CheckpointError, match=rf"{name}.biases: .* MLX affine-quantized"):
        AutoModelForCausalLM.from_pretrained(path)


_KERNEL_CHECK = r"""
import torch
import turboquant_hf.kernels.registry as k
from turboquant_hf import codec, ops
assert k._cuda_hadamard_linear is not None
worst = 0.0
for n_levels in (3, 8, 16):
    for g in (16, 32, 64):
        n, width = 24, 5 * g
        gen = torch.Generator().manual_seed(n_levels * g)
        idx = torch.randint(0, n_levels, (n * 5, g), generator=gen)
        packed = codec.pack_indices(idx, n_levels)
        cb = torch.sort(torch.randn(n_levels, generator=gen)).values.half()
        norms = (torch.rand(n, 5, generator=gen) + 0.1).half()
        signs = (torch.randint(0, 2, (width,), generator=gen) * 2 - 1).half()
        for m in (1, 5, 40):
            x = torch.randn(2, m, width, generator=gen)
            ref = ops.turboquant_hadamard_linear(x, packed, norms, cb, signs, g, width)
            y = k._cuda_hadamard_linear(x, packed, norms, cb, signs, g, width)
            assert y.shape == ref.shape
            rel = ((y - ref).norm() / ref.norm()).item()
            assert rel < 1e-5, (n_levels, g, m, rel)
            worst = max(worst, rel)
print("worst", worst)
"""


def test_cuda_implementation_under_the_triton_interpreter():
    """The CUDA implementation of turboquant::hadamard_linear (torch rotation + kernels.linear.product), run on CPU
    tensors by Triton's interpreter in a fresh process, equals the reference for ternary, 3 and 4 bits, G = 16..64."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    # run outside the checkout: `python -c` puts the working folder first on sys.path, where `kernels/` would
    # shadow Hugging Face's `kernels` package that transformers imports
    result = subprocess.run([sys.executable, "-c", _KERNEL_CHECK], capture_output=True, text=True, env=env,
                            timeout=900, cwd=tempfile.gettempdir())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "worst" in result.stdout


def test_qwen3_5_multimodal_class_loads_the_text_model(fixtures):
    """Qwen3_5MoeForConditionalGeneration reads the same MLX files (whose vision tower the converter dropped:
    transformers reports it missing) and computes the same text logits."""
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForConditionalGeneration

    d, text_model = loaded(fixtures, "qwen3_5_moe", "tqTe-down4")
    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(d, dtype=torch.float32)
    assert isinstance(model.model.language_model.layers[0].mlp.experts, TurboQuantExperts)
    ids = torch.tensor(IDS)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, text_model(ids).logits)
