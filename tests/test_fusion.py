"""Sibling projections fused into one packed weight (`turboquant_hf.integration.fusion`): same outputs, fewer ops, the
same state dict and checkpoints, and a group that dissolves when a member's tensors are replaced."""

import pytest
import torch
from torch.profiler import profile
from transformers import AutoModelForCausalLM

from turboquant_hf import TurboQuantConfig, TurboQuantLinear, quantize_weight
from turboquant_hf.integration import fusion
from turboquant_hf.integration.fusion import fuse_projections, unfuse_projections


def _ops(model, ids) -> int:
    """How many `turboquant::linear` ops one forward runs (the op with autograd or without)."""
    with profile() as prof:
        model(ids)
    return sum(e.count for e in prof.key_averages() if e.key in ("turboquant::linear", "turboquant::linear_nograd"))


@pytest.fixture()
def model(tiny_llama_dir):
    m = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=TurboQuantConfig(group_size=64),
                                             dtype=torch.float32)
    return m.eval()


IDS = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(0))


def test_fused_model_gives_the_same_logits_with_fewer_ops(model):
    with torch.no_grad():
        ref = model(IDS).logits
        assert _ops(model, IDS) == 14  # 2 layers x (q, k, v, o, gate, up, down)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        assert fuse_projections(model) == 4  # q/k/v and gate/up in each layer
        assert fuse_projections(model) == 0  # already fused
        out = model(IDS).logits
        assert _ops(model, IDS) == 8
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        # the members hold views of one storage per group: no extra memory
        attn = model.model.layers[0].self_attn
        ptr = attn.q_proj.weight.tq_packed.untyped_storage().data_ptr()
        assert all(m.weight.tq_packed.untyped_storage().data_ptr() == ptr for m in (attn.k_proj, attn.v_proj))
        # the state dict is unchanged, and none of its tensors shares memory with another
        after = model.state_dict()
        assert after.keys() == before.keys()
        assert all(torch.equal(after[k], before[k]) for k in before)
        for k, v in after.items():
            assert v.untyped_storage().nbytes() == v.numel() * v.element_size(), k
        # nothing is held between forwards
        assert attn.q_proj._tq_group._x is None and attn.q_proj._tq_group._outs is None
        # inputs of more than FUSED_MAX_ROWS rows (prefill) run each member on its own rows: the same logits, the
        # group kept
        long_ids = torch.randint(3, 256, (1, fusion.FUSED_MAX_ROWS + 1), generator=torch.Generator().manual_seed(1))
        assert _ops(model, long_ids) == 14
        unfuse_projections(model)
        ref_long = model(long_ids).logits
        fuse_projections(model)
        torch.testing.assert_close(model(long_ids).logits, ref_long, rtol=1e-5, atol=1e-5)
        assert _ops(model, long_ids[:, :fusion.FUSED_MAX_ROWS]) == 8 and attn.q_proj._tq_group.intact()


def test_fused_model_saves_and_reloads_the_same_checkpoint(model, tmp_path):
    with torch.no_grad():
        ref = model(IDS).logits
        model.save_pretrained(tmp_path / "plain")
        fuse_projections(model)
        model.save_pretrained(tmp_path / "fused")
        from safetensors.torch import load_file

        a = load_file(str(tmp_path / "plain" / "model.safetensors"))
        b = load_file(str(tmp_path / "fused" / "model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "fused", dtype=torch.float32).eval()
        torch.testing.assert_close(again(IDS).logits, ref, rtol=1e-5, atol=1e-5)


def test_siblings_called_with_other_inputs_or_out_of_order(model):
    """A member called on its own (another input, another order) computes its own rows: results never depend on
    what the siblings were called with."""
    attn = model.model.layers[0].self_attn
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
    y = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = {n: getattr(attn, n)(t) for n, t in (("q_proj", x), ("k_proj", y), ("v_proj", x))}
        want_k_x = attn.k_proj(x)
        fuse_projections(model)
        # the same input twice, then the others: the group serves them
        got2 = {"q_proj": attn.q_proj(x), "q_proj2": attn.q_proj(x)}
        torch.testing.assert_close(attn.k_proj(x), want_k_x, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(attn.v_proj(x), want["v_proj"], rtol=1e-5, atol=1e-5)
        assert getattr(attn.q_proj, "_tq_group", None) is not None
        # siblings that read different inputs (k from y while q and k of x are pending): the group dissolves
        got = {"v_proj": attn.v_proj(x), "k_proj": attn.k_proj(y), "q_proj": attn.q_proj(x)}
        assert all(getattr(getattr(attn, n), "_tq_group", None) is None for n in want)
        assert getattr(model.model.layers[1].self_attn.q_proj, "_tq_group", None) is not None  # others stay
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got2["q_proj"], want["q_proj"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got2["q_proj2"], want["q_proj"], rtol=1e-5, atol=1e-5)


def test_replaced_tensors_dissolve_the_group_and_loads_in_place_keep_it(model):
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        ref = model(IDS).logits
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        fuse_projections(model)
        model.load_state_dict(sd)  # in-place copies into the views: the group stays and reads them
        assert getattr(attn.q_proj, "_tq_group", None) is not None
        torch.testing.assert_close(model(IDS).logits, ref, rtol=1e-5, atol=1e-5)
        # another weight for k_proj, installed by replacing its tensors: the group must not use stale rows
        w = attn.k_proj.weight
        packed, norms = w.tq_packed.clone(), w.tq_norms.clone() * 2
        w.load_packed_(packed, norms)
        out = model(IDS).logits
        assert getattr(attn.q_proj, "_tq_group", None) is None and getattr(attn.k_proj, "_tq_group", None) is None
        assert not torch.allclose(out, ref)
        unfuse_projections(model)
        w.load_packed_(packed, norms / 2)
        torch.testing.assert_close(model(IDS).logits, ref, rtol=1e-5, atol=1e-5)


def test_unfuse_gives_members_their_own_tensors(model):
    with torch.no_grad():
        ref = model(IDS).logits
        fuse_projections(model)
        assert unfuse_projections(model) == 4
        attn = model.model.layers[0].self_attn
        assert attn.q_proj.weight.tq_packed.untyped_storage().data_ptr() != \
            attn.k_proj.weight.tq_packed.untyped_storage().data_ptr()
        assert _ops(model, IDS) == 14
        assert torch.equal(model(IDS).logits, ref)


def test_from_pretrained_fuses_on_gpus_only(model):
    """Loading onto the CPU leaves the members as they are (the hook fuses weights on CUDA devices only)."""
    attn = model.model.layers[0].self_attn
    assert getattr(attn.q_proj, "_tq_group", None) is None
    assert fuse_projections(model, device_type="cuda") == 0
    assert fuse_projections(model, device_type="cpu") == 4


def test_only_alike_quantized_siblings_fuse(tiny_llama_dir):
    m = AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, quantization_config=TurboQuantConfig(group_size=64, modules_to_not_convert=["k_proj"]),
        dtype=torch.float32)
    attn = m.model.layers[0].self_attn
    assert not isinstance(attn.k_proj, TurboQuantLinear) and isinstance(attn.q_proj, TurboQuantLinear)
    ids = IDS
    with torch.no_grad():
        ref = m(ids).logits
        assert fuse_projections(m) == 4  # q with v (k stays a plain Linear), and gate/up
        assert attn.q_proj._tq_group is attn.v_proj._tq_group and attn.q_proj._tq_group.splits == [128, 64]
        torch.testing.assert_close(m(ids).logits, ref, rtol=1e-5, atol=1e-5)


def test_siblings_of_other_bit_widths_fuse_apart(tiny_llama_dir):
    """Four-bit v_proj among 3-bit q and k (a recipe): q and k fuse, v runs alone."""
    from turboquant_hf.integration.fusion import FusedProjections

    m = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=TurboQuantConfig(group_size=64),
                                             dtype=torch.float32).eval()
    attn = m.model.layers[0].self_attn
    v = TurboQuantLinear(128, 64, bias=False, bits=4, group_size=64)
    with torch.no_grad():
        v.weight.load_packed_(*quantize_weight(torch.randn(64, 128, generator=torch.Generator().manual_seed(3)) * 0.05,
                                               4, 64))
    attn.v_proj = v
    with torch.no_grad():
        ref = m(IDS).logits
        assert fuse_projections(m) == 4
        assert isinstance(attn.q_proj._tq_group, FusedProjections) and attn.q_proj._tq_group.splits == [128, 64]
        assert getattr(attn.v_proj, "_tq_group", None) is None
        torch.testing.assert_close(m(IDS).logits, ref, rtol=1e-5, atol=1e-5)


def test_fused_model_compiles_fullgraph(model):
    with torch.no_grad():
        ref = model(IDS).logits
        fuse_projections(model)
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        out = compiled(IDS).logits
        assert _ops(compiled, IDS) == 8
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_hybrid_moe_model_fuses_its_gated_delta_net_projections(tmp_path):
    """Qwen3.5/3.6-style hybrid MoE: the gated-delta-net input projections (qkv, z, b, a), the attention layer's
    q/k/v and the shared expert's gate/up each become one op; same logits."""
    from conftest import tiny_qwen3_5_moe_config
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM

    torch.manual_seed(0)
    Qwen3_5MoeForCausalLM(tiny_qwen3_5_moe_config()).save_pretrained(tmp_path)
    m = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=TurboQuantConfig(group_size=64),
                                             dtype=torch.float32).eval()
    with torch.no_grad():
        ref = m(IDS).logits
        n_before = _ops(m, IDS)
        # 3 linear-attention layers (qkv/z/b/a), 1 attention layer (q/k/v), 4 shared experts (gate/up)
        assert fuse_projections(m) == 8
        la = m.model.layers[0].linear_attn
        assert la.in_proj_qkv._tq_group is la.in_proj_a._tq_group
        assert la.in_proj_qkv._tq_group.splits == [2 * 2 * 32 + 4 * 48, 4 * 48, 4, 4]
        torch.testing.assert_close(m(IDS).logits, ref, rtol=1e-5, atol=1e-5)
        assert _ops(m, IDS) == n_before - 3 * 3 - 2 - 4
