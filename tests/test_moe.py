"""MoE experts: TurboQuantExperts on tiny Qwen3.5-MoE, Qwen3-MoE and Mixtral, fused and per-expert sources, and on
gpt-oss and Llama 4 (text), whose experts transformers stores transposed (gpt-oss: interleaved gate/up, biases, a
clamped SwiGLU; Llama 4: expert-block inputs)."""

import copy
import json
import logging
import os

import pytest
import torch
from conftest import assert_same_tensors, qwen3_5_moe, spread_weights_
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from turboquant_hf import TurboQuantConfig, TurboQuantLinear
from turboquant_hf.format import codec
from turboquant_hf.format import constants as fmt
from turboquant_hf.format.checkpoint import CheckpointError
from turboquant_hf.modeling.modules import TurboQuantExperts
from turboquant_hf.quantization.recipes import get_recipe

E, TOP_K, H, I = 8, 2, 128, 64


def qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=256, hidden_size=H, intermediate_size=192, moe_intermediate_size=I, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=E, num_experts_per_tok=TOP_K,
        max_position_embeddings=256))


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(
        vocab_size=256, hidden_size=H, intermediate_size=I, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=E, num_experts_per_tok=TOP_K, max_position_embeddings=256))


BUILDERS = {"qwen3_5_moe": qwen3_5_moe, "qwen3_moe": qwen3_moe, "mixtral": mixtral}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{(kind, layout): dir}: each tiny model saved per-expert (transformers' default) and pre-fused."""
    out = {}
    for kind, build in BUILDERS.items():
        torch.manual_seed(0)
        model = spread_weights_(build()).to(torch.bfloat16)
        for layout, original in (("per_expert", True), ("fused", False)):
            d = str(tmp_path_factory.mktemp(f"{kind}_{layout}"))
            model.save_pretrained(d, save_original_format=original)
            out[kind, layout] = d
    return out


def saved_name(kind: str, module_name: str, source_keys) -> str:
    """Module name -> saved checkpoint name: transformers reverses the renames the source needed."""
    if kind == "qwen3_5_moe":
        return module_name.replace("model.", "model.language_model.", 1)
    if kind == "mixtral" and any("block_sparse_moe" in k for k in source_keys):
        return module_name.replace(".mlp.experts", ".block_sparse_moe.experts")
    return module_name

CASES = [(k, layout) for k in BUILDERS for layout in ("per_expert", "fused")]


def _ids():
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


def _fused_source(model, name):
    """The full-precision fused [E, 2I, H] / [E, H, I] tensors of an experts module of a plain model."""
    m = model.get_submodule(name)
    return m.gate_up_proj.detach(), m.down_proj.detach()


@pytest.mark.parametrize("kind, layout", CASES)
def test_experts_quantized_on_the_fly(checkpoints, kind, layout, tmp_path):
    src = checkpoints[kind, layout]
    base = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    q = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32,
                                             quantization_config=TurboQuantConfig(bits=3, group_size=64))
    experts = {n: m for n, m in q.named_modules() if n.endswith(".experts")}
    assert experts and all(isinstance(m, TurboQuantExperts) for m in experts.values())
    for name, m in experts.items():
        gu, dn = _fused_source(base, name)
        for packed_w, source in ((m.gate_up_proj, gu), (m.down_proj, dn)):
            packed, norms = codec.quantize_weight(source, 3, 64)
            assert torch.equal(packed_w.tq_packed, packed) and torch.equal(packed_w.tq_norms, norms), name
    # routers and shared-expert gates stay untouched
    for name, p in base.named_parameters():
        if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "block_sparse_moe.gate.weight")):
            assert torch.equal(q.get_parameter(name), p), name

    # Output close to the unquantized model, judged like weight noise of the 3-bit Lloyd-Max size (see
    # test_quantizer.test_logits_close_to_unquantized for why a fixed bound says little on random models).
    ids = _ids()
    with torch.no_grad():
        ref = base(ids).logits
        rel_q = ((q(ids).logits - ref).norm() / ref.norm()).item()
        noisy = copy.deepcopy(base)
        g = torch.Generator().manual_seed(7)
        for name, m in q.named_modules():
            if isinstance(m, (TurboQuantLinear, TurboQuantExperts)):
                params = [noisy.get_submodule(name).weight] if isinstance(m, TurboQuantLinear) else \
                    [noisy.get_submodule(name).gate_up_proj, noisy.get_submodule(name).down_proj]
                for w in params:
                    w += 0.1859 * w.norm() / w.numel() ** 0.5 * torch.randn(w.shape, generator=g)
        rel_noise = ((noisy(ids).logits - ref).norm() / ref.norm()).item()
    assert 0.4 * rel_noise < rel_q < 1.3 * rel_noise, (rel_q, rel_noise)

    # saved with the published pre-fused names, whatever the source layout
    q.save_pretrained(tmp_path)
    saved = load_file(os.path.join(tmp_path, "model.safetensors"))
    source_keys = load_file(os.path.join(src, "model.safetensors")).keys()
    for name, m in experts.items():
        key = saved_name(kind, name, source_keys)
        assert saved[key + ".gate_up_proj.tq_packed"].shape == (E * 2 * I * (H // 64), 24)
        assert saved[key + ".gate_up_proj.tq_norms"].shape == (E * 2 * I, H // 64)
        assert saved[key + ".down_proj.tq_packed"].shape == (E * H * (I // 64), 24)
        assert saved[key + ".down_proj.tq_norms"].shape == (E * H, I // 64)
    assert not [k for k in saved if ".experts." in k and not k.endswith((".tq_packed", ".tq_norms"))]
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, q(ids).logits)


def test_qwen3_5_both_classes_share_one_checkpoint(checkpoints, tmp_path):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration

    # the text-only class is what AutoModelForCausalLM picks for the multimodal checkpoint

    src = checkpoints["qwen3_5_moe", "fused"]
    cfg = get_recipe("tq3a-tqTe", group_size=64)
    full = Qwen3_5MoeForConditionalGeneration.from_pretrained(src, dtype=torch.float32, quantization_config=cfg)
    text = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, quantization_config=cfg)
    assert type(text) is Qwen3_5MoeForCausalLM
    assert not any(isinstance(m, TurboQuantLinear) for n, m in full.named_modules() if "visual" in n)
    full.save_pretrained(tmp_path / "full")
    text.save_pretrained(tmp_path / "text")
    a, b = load_file(tmp_path / "full" / "model.safetensors"), load_file(tmp_path / "text" / "model.safetensors")
    for k, v in b.items():  # the text model's tensors are the multimodal checkpoint's language_model tensors
        assert k.startswith(("model.language_model.", "lm_head.")) and torch.equal(a[k], v), k
    gu = a["model.language_model.layers.0.mlp.experts.gate_up_proj.tq_packed"]
    assert gu.shape[1] == fmt.bytes_per_group(3, 64) == 13  # ternary routed experts
    assert a["model.language_model.layers.0.mlp.shared_expert.up_proj.weight.tq_packed"].shape[1] == 24
    # GatedDeltaNet widths that are not multiples of G are padded and recorded, never left in bf16:
    # out_proj reads 4 value heads x 40 = 160 inputs, padded to 192 at G = 64
    out_proj = "model.language_model.layers.0.linear_attn.out_proj.weight"
    assert out_proj not in a and a[out_proj + ".tq_norms"].shape == (H, 3)
    tq = json.load(open(tmp_path / "full" / "tq_config.json"))
    assert tq["orig_in_dims"][out_proj] == 160
    assert tq["expert_bits"] == 1.58 and json.load(open(tmp_path / "full" / "config.json"))[
        "quantization_config"]["expert_bits"] == 1.58
    ids = _ids()
    # both classes load the multimodal checkpoint; the text class also loads its own save
    for cls, d in ((Qwen3_5MoeForConditionalGeneration, "full"), (AutoModelForCausalLM, "full"),
                   (AutoModelForCausalLM, "text")):
        again = cls.from_pretrained(tmp_path / d)
        with torch.no_grad():
            assert torch.equal(again(input_ids=ids).logits, text(input_ids=ids).logits), (cls.__name__, d)


def test_inactive_experts_are_never_read(checkpoints):
    """Poison every expert the router did not pick (NaN norms, random bytes): the output must not change."""
    q = AutoModelForCausalLM.from_pretrained(checkpoints["qwen3_5_moe", "fused"], dtype=torch.float32,
                                             quantization_config=TurboQuantConfig(bits=3, group_size=64))
    ids = torch.tensor([[5, 17, 42]])
    chosen = {}

    def record(name):
        def hook(module, args, output):
            chosen[name] = set(output[2].flatten().tolist())
        return hook

    handles = [m.gate.register_forward_hook(record(n)) for n, m in q.named_modules() if n.endswith(".mlp")]
    with torch.no_grad():
        before = q(ids).logits
    for h in handles:
        h.remove()
    poisoned = 0
    for name, m in q.named_modules():
        if isinstance(m, TurboQuantExperts):
            idle = [e for e in range(E) if e not in chosen[name.rpartition(".")[0]]]
            assert idle
            for w in (m.gate_up_proj, m.down_proj):
                rows = w.rows // E
                for e in idle:
                    w.tq_norms[e * rows : (e + 1) * rows] = float("nan")
                    seg = w.tq_packed[e * rows * w.n_groups : (e + 1) * rows * w.n_groups]
                    seg.copy_(torch.randint(0, 256, seg.shape, dtype=torch.uint8))
                    poisoned += 1
    with torch.no_grad():
        after = q(ids).logits
    assert poisoned > 0 and torch.equal(before, after)


def test_expert_op_matches_dense_reference():
    """The grouped-by-expert op equals a per-token loop over dense dequantized experts."""
    torch.manual_seed(0)
    gu_src, dn_src = torch.randn(E, 2 * I, H) * 0.05, torch.randn(E, H, I) * 0.05
    m = TurboQuantExperts(E, H, I, 3, 4, 64)
    m.gate_up_proj.load_packed_(*codec.quantize_weight(gu_src, 3, 64))
    m.down_proj.load_packed_(*codec.quantize_weight(dn_src, 4, 64))
    gu = m.gate_up_proj.dequantize().view(E, 2 * I, H)
    dn = m.down_proj.dequantize().view(E, H, I)
    x = torch.randn(7, H)
    idx = torch.stack([torch.randperm(E)[:TOP_K] for _ in range(7)])
    wts = torch.softmax(torch.randn(7, TOP_K), -1)
    ref = torch.zeros(7, H)
    for t in range(7):
        for k in range(TOP_K):
            e = idx[t, k]
            g, u = (gu[e] @ x[t]).chunk(2)
            ref[t] += wts[t, k] * (dn[e] @ (torch.nn.functional.silu(g) * u))
    assert torch.allclose(m(x, idx, wts), ref, rtol=1e-4, atol=1e-5)


def test_ternary_error_and_packing():
    torch.manual_seed(3)
    for g in fmt.GROUP_SIZES:
        trits = torch.randint(0, 3, (50, g))
        assert torch.equal(codec.unpack_indices(codec.pack_indices(trits, 3), 3, g), trits)
    w = torch.randn(256, 1024)
    packed, norms = codec.quantize_weight(w, fmt.TERNARY, 128)
    deq = codec.dequantize_weight(packed, norms, 1024, 128)
    rel = ((deq - w).view(-1, 128).norm(dim=1) / w.view(-1, 128).norm(dim=1)).pow(2).mean().sqrt().item()
    assert abs(rel - 0.4361) / 0.4361 <= 0.03


def test_expert_count_mismatch_named(checkpoints, tmp_path):
    import shutil

    d = tmp_path / "bad"
    shutil.copytree(checkpoints["qwen3_moe", "fused"], d)
    config = json.load(open(d / "config.json"))
    config["moe_intermediate_size"] = I * 2  # only the experts disagree with the checkpoint
    json.dump(config, open(d / "config.json", "w"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.(gate_up|down)_proj.*shape"):
        AutoModelForCausalLM.from_pretrained(d, quantization_config=TurboQuantConfig(group_size=64))
    # and a pre-quantized checkpoint whose packed experts disagree with the config
    q = AutoModelForCausalLM.from_pretrained(checkpoints["qwen3_moe", "fused"],
                                             quantization_config=TurboQuantConfig(group_size=64))
    q.save_pretrained(tmp_path / "q")
    config = json.load(open(tmp_path / "q" / "config.json"))
    config["num_local_experts"] = E * 2
    json.dump(config, open(tmp_path / "q" / "config.json", "w"))
    with pytest.raises(CheckpointError, match=r"experts\.(gate_up|down)_proj\.tq_(norms|packed)"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "q")


# -- transposed experts: gpt-oss and Llama 4 ----------------------------------------------------------------------
IT = 96  # their intermediate width: 2I != H (a transposition mix-up changes shapes) and I not a multiple of G = 64


def gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    return GptOssForCausalLM(GptOssConfig(vocab_size=256, hidden_size=H, intermediate_size=IT, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                          num_local_experts=E, num_experts_per_tok=TOP_K))


def llama4():
    from transformers import Llama4ForCausalLM
    from transformers.models.llama4 import Llama4TextConfig

    return Llama4ForCausalLM(Llama4TextConfig(vocab_size=256, hidden_size=H, intermediate_size=IT,
                                              intermediate_size_mlp=192, num_hidden_layers=2, num_attention_heads=4,
                                              num_key_value_heads=2, head_dim=32, num_local_experts=E,
                                              num_experts_per_tok=1, interleave_moe_layer_step=1))


# {kind: (builder, its experts' ExpertsLayout fields, activation)} (the layout module is imported where it is used, so
# that tests/output_digest.py can import this file's builders against trees that predate it)
TRANSPOSED = {"gpt_oss": (gpt_oss, dict(transposed=True, interleaved=True, bias=True, alpha=1.702, limit=7.0),
                          "clamped_swiglu"),
              "llama4": (llama4, dict(transposed=True, inputs="expert_blocks", top_k=1), "silu")}


def _layout(kind: str):
    from turboquant_hf.modeling.experts_layout import ExpertsLayout

    return ExpertsLayout(**TRANSPOSED[kind][1])


@pytest.fixture(scope="module")
def transposed_checkpoints(tmp_path_factory):
    """{kind: dir} of tiny gpt-oss and Llama 4 models saved in bf16. gpt-oss's expert biases are drawn too, and its
    gate/up weights wide enough that the clamp of its SwiGLU (limit 7) acts on many gate and up values."""
    out = {}
    for kind, (build, _, _) in TRANSPOSED.items():
        torch.manual_seed(0)
        model = spread_weights_(build())
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
                    p.normal_(0, 0.5)
                elif name.endswith("experts.gate_up_proj") and kind == "gpt_oss":
                    p.normal_(0, 0.5)
        d = str(tmp_path_factory.mktemp(kind))
        model.to(torch.bfloat16).save_pretrained(d)
        out[kind] = d
    return out


def _record_clamped_gates(model) -> list:
    """Wrap each gpt-oss experts module's `_apply_gate` to record the share of gate values above the limit and of
    up values outside [-limit, limit]."""
    seen = []
    for m in model.modules():
        if type(m).__name__ == "GptOssExperts":
            def apply_gate(gate_up, m=m, original=m._apply_gate):
                gate, up = gate_up[..., ::2], gate_up[..., 1::2]
                seen.append(((gate > m.limit).float().mean().item(), (up.abs() > m.limit).float().mean().item()))
                return original(gate_up)
            m._apply_gate = apply_gate
    return seen


@pytest.mark.parametrize("kind", list(TRANSPOSED))
def test_transposed_experts_quantize_save_reload_dequantize(transposed_checkpoints, kind, tmp_path):
    """gpt-oss and Llama 4 experts ([E, in, out]) quantized on the fly in the published row layout (the stored
    matrices transposed: one packed row per output channel), saved under the published names, reloaded bit for bit,
    generating; `dequantize()` gives back transformers' own module class and parameter layout (transposition,
    interleave, biases), whose float forward matches the quantized model's logits within float32 rounding."""
    src = transposed_checkpoints[kind]
    layout, activation = _layout(kind), TRANSPOSED[kind][2]
    base = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    q = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32,
                                             quantization_config=TurboQuantConfig(bits=3, group_size=64))
    experts = {n: m for n, m in q.named_modules() if n.endswith(".experts")}
    assert len(experts) == 2 and all(isinstance(m, TurboQuantExperts) for m in experts.values())
    plain_class = type(base.get_submodule(next(iter(experts))))
    for name, m in experts.items():
        assert (m.layout, m.activation) == (layout, activation), name
        plain = base.get_submodule(name)
        assert tuple(plain.gate_up_proj.shape) == (E, H, 2 * IT) and tuple(plain.down_proj.shape) == (E, IT, H)
        for packed_w, source in ((m.gate_up_proj, plain.gate_up_proj), (m.down_proj, plain.down_proj)):
            packed, norms = codec.quantize_weight(source.detach().transpose(1, 2), 3, 64)
            assert torch.equal(packed_w.tq_packed, packed) and torch.equal(packed_w.tq_norms, norms), name
        for attr in ("gate_up_proj_bias", "down_proj_bias") if layout.bias else ():
            assert torch.equal(getattr(m, attr), getattr(plain, attr)), (name, attr)

    q.save_pretrained(tmp_path / "q")
    saved = load_file(tmp_path / "q" / "model.safetensors")
    ng_h, ng_i = H // 64, -(-IT // 64)
    for name in experts:
        assert saved[name + ".gate_up_proj.tq_packed"].shape == (E * 2 * IT * ng_h, 24)
        assert saved[name + ".gate_up_proj.tq_norms"].shape == (E * 2 * IT, ng_h)
        assert saved[name + ".down_proj.tq_packed"].shape == (E * H * ng_i, 24)
        assert saved[name + ".down_proj.tq_norms"].shape == (E * H, ng_i)
        for attr in ("gate_up_proj_bias", "down_proj_bias") if layout.bias else ():
            assert torch.equal(saved[f"{name}.{attr}"], base.get_submodule(name).get_parameter(attr)), attr
    extra = {"gate_up_proj_bias", "down_proj_bias"} if layout.bias else set()
    assert not [k for k in saved if ".experts." in k and not k.endswith((".tq_packed", ".tq_norms"))
                and k.rpartition(".")[2] not in extra]

    again = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    again.save_pretrained(tmp_path / "again")
    assert_same_tensors(tmp_path / "q", tmp_path / "again")  # the round trip is bit-exact
    ids = _ids()
    with torch.no_grad():
        logits = q(ids).logits
        assert torch.equal(again(ids).logits, logits)
    tokens = q.generate(ids, max_new_tokens=6, do_sample=False)
    assert tokens.shape == (2, 18) and torch.equal(again.generate(ids, max_new_tokens=6, do_sample=False), tokens)

    q.dequantize()
    assert {k: tuple(v.shape) for k, v in q.state_dict().items()} == {
        k: tuple(v.shape) for k, v in base.state_dict().items()}
    for name, m in experts.items():
        plain = q.get_submodule(name)
        assert type(plain) is plain_class
        for attr, w in (("gate_up_proj", m.gate_up_proj), ("down_proj", m.down_proj)):
            want = codec.dequantize_weight(w.tq_packed, w.tq_norms, w.in_features, 64).view(w.source_shape)
            assert torch.equal(plain.get_parameter(attr), want.transpose(1, 2)), (name, attr)
    seen = _record_clamped_gates(q)
    with torch.no_grad():
        dequantized = q(ids).logits
    rel = ((dequantized - logits).norm() / logits.norm()).item()
    assert rel < 1e-5, rel
    if kind == "gpt_oss":  # the clamp acted on the gate and on the up values of every layer
        assert len(seen) == 2 and all(g > 0.05 and u > 0.05 for g, u in seen), seen
    assert torch.equal(q.generate(ids, max_new_tokens=6, do_sample=False), tokens)


def test_missing_expert_bias_is_named(transposed_checkpoints, tmp_path):
    """A quantized gpt-oss checkpoint without one of its expert biases is refused naming the tensor (never loaded
    with an uninitialised bias)."""
    from safetensors.torch import save_file

    q = AutoModelForCausalLM.from_pretrained(transposed_checkpoints["gpt_oss"],
                                             quantization_config=TurboQuantConfig(group_size=64))
    q.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_bias"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\) of quantized layers \(model\.layers\.1\.mlp\."
                                              r"experts\.down_proj_bias\)"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("kind", list(TRANSPOSED))
def test_transposed_experts_sizes_from_headers_and_budget(transposed_checkpoints, kind):
    """The plan from safetensors headers alone (`turboquant-hf plan`, the memory plan) and the bit budget's accounting
    count a transposed expert tensor as the rows it is packed in: E x 2I (or E x H) rows over H (or I) inputs."""
    from safetensors import safe_open

    from turboquant_hf.calibration import budget
    from turboquant_hf.quantization import planning

    src = transposed_checkpoints[kind]
    with safe_open(os.path.join(src, "model.safetensors"), "pt") as f:
        tensors = {k: (None, tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    cfg = TurboQuantConfig(bits=3, group_size=64, module_bits={"down_proj": 4})
    planned = planning.from_headers(json.load(open(os.path.join(src, "config.json"))), tensors, cfg)
    model = AutoModelForCausalLM.from_pretrained(src)
    _, fixed = budget.quantized_tensors(model, cfg)
    for name in (n for n, m in model.named_modules() if n.endswith(".experts")):
        assert planned[name + ".gate_up_proj"] == (name, 3, E * 2 * IT, H)
        assert planned[name + ".down_proj"] == (name, 4, E * H, IT)
        assert fixed[name + ".gate_up_proj"] == (3, E * 2 * IT, H) and fixed[name + ".down_proj"] == (4, E * H, IT)


def _dense_experts(x, index, weights, gate_up, down, gate_up_bias, down_bias, interleaved, clamped):
    """The routed experts written out per token and slot in float64 (independent of the package's code)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for slot in range(index.shape[1]):
            ex = int(index[t, slot])
            if not 0 <= ex < gate_up.shape[0]:
                continue
            a = gate_up[ex] @ x[t] + (gate_up_bias[ex] if gate_up_bias is not None else 0)
            gate, up = (a[0::2], a[1::2]) if interleaved else a.chunk(2)
            if clamped:
                gate, up = gate.clamp(max=0.8), up.clamp(-0.8, 0.8)
                mid = (up + 1) * gate * torch.sigmoid(1.5 * gate)
            else:
                mid = torch.nn.functional.silu(gate) * up
            y = down[ex] @ mid + (down_bias[ex] if down_bias is not None else 0)
            out[t] += weights[t, slot] * y
    return out


@pytest.mark.parametrize("interleaved, bias, clamped", [(False, True, False), (True, False, False),
                                                        (False, True, True), (True, True, True)])
def test_expert_op_layouts_match_dense_reference(interleaved, bias, clamped):
    """The routed experts op with biases, interleaved gate/up outputs and the clamped SwiGLU (alpha 1.5, limit 0.8,
    which most values pass) equals a dense float64 loop over the dequantized experts; pairs routed to no expert
    (index -1 or E) add nothing, not even a bias."""
    torch.manual_seed(0)
    t = 7
    from turboquant_hf.modeling.experts_layout import ExpertsLayout

    layout = ExpertsLayout(interleaved=interleaved, bias=bias, alpha=1.5, limit=0.8)
    m = TurboQuantExperts(E, H, I, 3, 4, 64, "clamped_swiglu" if clamped else "silu", layout=layout)
    m.gate_up_proj.load_packed_(*codec.quantize_weight(torch.randn(E, 2 * I, H) * 0.2, 3, 64))
    m.down_proj.load_packed_(*codec.quantize_weight(torch.randn(E, H, I) * 0.2, 4, 64))
    if bias:
        m.gate_up_proj_bias.data.normal_()
        m.down_proj_bias.data.normal_()
    gu = m.gate_up_proj.dequantize(torch.float64).view(E, 2 * I, H)
    dn = m.down_proj.dequantize(torch.float64).view(E, H, I)
    x = torch.randn(t, H)
    idx = torch.stack([torch.randperm(E)[:TOP_K] for _ in range(t)])
    idx[2, 1], idx[4, 0] = -1, E
    wts = torch.softmax(torch.randn(t, TOP_K), -1)
    biases = (m.gate_up_proj_bias.double(), m.down_proj_bias.double()) if bias else (None, None)
    ref = _dense_experts(x.double(), idx, wts.double(), gu, dn, *biases, interleaved, clamped)
    got = m(x, idx, wts)
    assert ((got.double() - ref).norm() / ref.norm()).item() < 2e-6


def test_llama4_expert_blocks_match_transformers_and_skip_unrouted_experts():
    """Llama 4's convention (every expert's block of tokens at once): the quantized experts equal transformers'
    `Llama4TextExperts` holding the dequantized weights, on blocks where each token reaches its top-k experts (rows
    scaled by the routing score, zero elsewhere); experts no token reaches are never read (their packed bytes and
    norms poisoned), and their output rows are zero."""
    from transformers.models.llama4 import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    from turboquant_hf.modeling.experts_layout import EXPERT_BLOCKS, ExpertsLayout

    torch.manual_seed(0)
    t, k = 5, 2
    plain = Llama4TextExperts(Llama4TextConfig(hidden_size=H, intermediate_size=IT, num_local_experts=E))
    m = TurboQuantExperts(E, H, IT, 3, 3, 64, "silu", layout=ExpertsLayout(transposed=True, inputs=EXPERT_BLOCKS,
                                                                          top_k=k))
    with torch.no_grad():
        for attr, shape in (("gate_up_proj", (E, H, 2 * IT)), ("down_proj", (E, IT, H))):
            source = torch.randn(shape) * 0.1
            w = getattr(m, attr)
            w.load_packed_(*codec.quantize_weight(source.transpose(1, 2), 3, 64))
            setattr(plain, attr, torch.nn.Parameter(w.dequantize().view(w.source_shape).transpose(1, 2)))
    chosen = torch.stack([torch.randperm(E - 2)[:k] for _ in range(t)])  # experts E-2 and E-1: no token
    chosen[3, 1] = chosen[3, 0]  # a token that reaches one expert only
    scores = torch.zeros(E, t)
    scores.scatter_(0, chosen.t(), torch.rand(k, t) + 0.1)
    blocks = (torch.randn(t, H)[None] * scores[:, :, None]).reshape(E * t, H)
    for w in (m.gate_up_proj, m.down_proj):
        rows = w.rows // E
        w.tq_norms[(E - 2) * rows:] = float("nan")
        idle = w.tq_packed[(E - 2) * rows * w.n_groups:]
        idle.copy_(torch.randint(0, 256, idle.shape, dtype=torch.uint8))
    with torch.no_grad():
        want = plain(blocks)
    got = m(blocks)
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    assert torch.equal(got.view(E, t, H)[E - 2:], torch.zeros(2, t, H))
    with pytest.raises(ValueError, match="multiple of 8 rows"):
        m(blocks[:-1])


def _gpt_oss_experts():
    return gpt_oss().model.layers[0].mlp.experts


def test_unsupported_expert_forms_are_named():
    """`read_experts` reads gpt-oss's and Llama 4's forms, and names the reason for each form it does not compute."""
    from turboquant_hf.modeling.experts_layout import UnsupportedExperts, read_experts

    assert read_experts(_gpt_oss_experts(), "silu").layout == _layout("gpt_oss")
    assert read_experts(llama4().model.layers[0].feed_forward.experts, "silu", 1).layout == _layout("llama4")

    def refused(change, match):
        m = _gpt_oss_experts()
        change(m)
        with pytest.raises(UnsupportedExperts, match=match):
            read_experts(m, "silu")

    refused(lambda m: setattr(m, "has_gate", False), "no gate projection")
    refused(lambda m: setattr(m, "has_post_expert_norm", True), "normalizes each expert")
    refused(lambda m: setattr(m, "has_bias", False), r"do not match has_bias=False")
    refused(lambda m: delattr(m, "down_proj_bias"), r"biases \(gate_up_proj_bias\) do not match")
    refused(lambda m: setattr(m, "is_transposed", False), r"are not \[E, 2I, H\] and \[E, H, I\]")
    refused(lambda m: setattr(m, "is_concatenated", True), "_apply_gate computes none of")  # gate/up order wrong
    refused(lambda m: setattr(m, "_apply_gate", lambda gu: gu[..., ::2] * gu[..., 1::2]), "computes none of")
    refused(lambda m: setattr(m, "limit", float("nan")), "computes none of")

    class TwoArguments(torch.nn.Module):  # undecorated, neither routed tokens nor expert blocks
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.empty(E, 2 * I, H))
            self.down_proj = torch.nn.Parameter(torch.empty(E, H, I))

        def forward(self, hidden_states, gammas):
            return hidden_states

    with pytest.raises(UnsupportedExperts, match=r"forward takes \(hidden_states, gammas\): neither routed"):
        read_experts(TwoArguments(), "silu")
    no_forward = TwoArguments()
    type(no_forward).forward = torch.nn.Module.forward  # (nn.Module's own: *input, nothing to tell)
    with pytest.raises(UnsupportedExperts, match=r"forward takes \(\*input\)"):
        read_experts(no_forward, "silu")


def test_unsupported_experts_stay_in_full_precision_with_the_reason(transposed_checkpoints, caplog, monkeypatch,
                                                                      tmp_path):
    """An experts module whose gate activation is none TurboQuant computes stays in full precision with a warning
    naming the module and the reason; a checkpoint holding such experts packed is refused with the reason."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    src = transposed_checkpoints["gpt_oss"]
    q = AutoModelForCausalLM.from_pretrained(src, quantization_config=TurboQuantConfig(group_size=64))
    q.save_pretrained(tmp_path)
    monkeypatch.setattr(GptOssExperts, "_apply_gate", lambda self, gu: gu[..., ::2] * torch.sigmoid(gu[..., 1::2]))
    with caplog.at_level(logging.WARNING):
        plain = AutoModelForCausalLM.from_pretrained(src, quantization_config=TurboQuantConfig(group_size=64))
    assert "model.layers.0.mlp.experts (GptOssExperts) stays in full precision: its _apply_gate computes none" \
        in caplog.text
    assert type(plain.model.layers[0].mlp.experts) is GptOssExperts
    assert isinstance(plain.model.layers[0].self_attn.q_proj, TurboQuantLinear)
    with pytest.raises(CheckpointError, match=r"model\.layers\.\d\.mlp\.experts: the checkpoint holds its experts "
                                              "packed, but its _apply_gate computes none"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("bad", [{"expert_bits": 5}, {"expert_bits": "two"}])
def test_invalid_tier_setting(bad):
    with pytest.raises(ValueError, match="bits must be one of"):
        TurboQuantConfig(**bad)
