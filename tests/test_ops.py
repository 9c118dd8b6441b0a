"""The `turboquant::linear` custom op: reference semantics, registration, and tracing."""

import importlib.util
import os

import pytest
import torch

from turboquant_hf.format import codec
from turboquant_hf.format import constants as fmt
from turboquant_hf.modeling.modules import (
    TurboQuantLinear,
    format_constants,
    quantize_linear_,
)


def _inputs(n_levels, group_size, rows=40, in_features=200, m=5, dtype=torch.float32):
    torch.manual_seed(0)
    w = torch.randn(rows, in_features)
    packed, norms = codec.quantize_weight(w, fmt.bits_for_levels(n_levels), group_size)
    cb, s1, s2 = format_constants(n_levels, group_size, "cpu")
    x = torch.randn(m, in_features, dtype=dtype)
    return x, packed, norms, cb, s1, s2


@pytest.mark.parametrize("n_levels", [3, 4, 8, 16])
@pytest.mark.parametrize("group_size", [64, 128])
def test_op_equals_dequantized_matmul(n_levels, group_size):
    x, packed, norms, cb, s1, s2 = _inputs(n_levels, group_size)
    y = torch.ops.turboquant.linear(x, packed, norms, cb, s1, s2, group_size, 200)
    w = codec.dequantize_weight(packed, norms, 200, group_size)
    ref = x @ w.T
    assert torch.allclose(y, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("n_levels", [3, 4, 8, 16])
def test_reference_product_in_a_reused_buffer(n_levels, monkeypatch):
    """On CPU the reference product builds each weight block in a per-thread buffer (`codec.decode_scratch`): the
    weight built there equals the freshly allocated one bit for bit (ternary through its padded groups; a dtype
    the buffer cannot hold gets a new tensor), and products of other weights and block splits through the same
    buffer stay exact, so nothing of one call leaks into the next."""
    from turboquant_hf.modeling import ops

    monkeypatch.setenv("TURBOQUANT_CPU_KERNEL", "0")  # the reference itself (a few rows take the compiled kernel)

    x, packed, norms, cb, s1, s2 = _inputs(n_levels, 64, rows=37, in_features=300, m=3)
    fresh = codec.rotated_weight(packed, norms, cb, 64)
    buf = torch.full((fresh.numel() + 11,), float("nan"))
    built = codec.rotated_weight(packed, norms, cb, 64, out=buf)
    assert torch.equal(built, fresh) and built.data_ptr() == buf.data_ptr()
    wide = codec.rotated_weight(packed, norms.double(), cb, 64, out=buf)  # float64 result: not in the buffer
    assert wide.dtype == torch.float64 and wide.data_ptr() != buf.data_ptr()
    assert torch.equal(wide, codec.rotated_weight(packed, norms.double(), cb, 64))
    assert codec.rotated_weight(packed, norms, cb, 64, out=buf[:10]).data_ptr() != buf.data_ptr()  # too small
    x_rot = ops.rotate_activations(x, s1, s2, 64)
    want = x_rot @ fresh.T
    other_x, other_packed, other_norms, *_ = _inputs(n_levels, 64, rows=90, in_features=300, m=3)
    other_want = x_rot @ codec.rotated_weight(other_packed, other_norms, cb, 64).T
    assert torch.equal(ops.codebook_matmul(x_rot, packed, norms, cb, 64), want)
    assert torch.equal(ops.codebook_matmul(x_rot, other_packed, other_norms, cb, 64), other_want)
    # a product autograd differentiates keeps its own weight block (the next call must not overwrite it)
    x_grad = x_rot.clone().requires_grad_()
    ops.codebook_matmul(x_grad, packed, norms, cb, 64).sum().backward()
    ops.codebook_matmul(x_rot, other_packed, other_norms, cb, 64)
    x_again = x_rot.clone().requires_grad_()
    y = ops.codebook_matmul(x_again, packed, norms, cb, 64)
    ops.codebook_matmul(x_rot, other_packed, other_norms, cb, 64)
    y.sum().backward()
    assert torch.allclose(x_again.grad, torch.ones(3, 37) @ fresh, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(ops, "_REFERENCE_BLOCK_ELEMENTS", 10 * 320)  # blocks of 10 rows through one buffer

    def by_blocks(pk, nr):  # (each block's own product: a matmul's rounding follows its shape)
        return torch.cat([x_rot @ codec.rotated_weight(pk[r * 5:(r + 10) * 5], nr[r:r + 10], cb, 64).T
                          for r in range(0, nr.shape[0], 10)], 1)

    assert torch.equal(ops.codebook_matmul(x_rot, other_packed, other_norms, cb, 64), by_blocks(other_packed, other_norms))
    assert torch.equal(ops.codebook_matmul(x_rot, packed, norms, cb, 64), by_blocks(packed, norms))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_op_keeps_dtype_and_leading_dims(dtype):
    x, packed, norms, cb, s1, s2 = _inputs(8, 128, dtype=dtype)
    x3 = x.view(1, 5, 200)
    y = torch.ops.turboquant.linear(x3, packed, norms, cb, s1, s2, 128, 200)
    assert y.dtype == dtype and y.shape == (1, 5, 40)
    ref = x.float() @ codec.dequantize_weight(packed, norms, 200, 128).T
    assert torch.allclose(y.float().view(5, 40), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.parametrize("name", ["linear", "linear_nograd"])
def test_opcheck(name):
    x, packed, norms, cb, s1, s2 = _inputs(8, 64)
    torch.library.opcheck(
        getattr(torch.ops.turboquant, name).default,
        (x, packed, norms, cb, s1, s2, 64, 200),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )


def test_module_compiles_fullgraph():
    layer = TurboQuantLinear(200, 40, bias=True, bits=3, group_size=64)
    torch.manual_seed(3)
    quantize_linear_(layer, torch.randn(40, 200))
    layer.bias.data.normal_()
    x = torch.randn(3, 200)
    eager = layer(x)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), eager)


def test_kernels_subpackage_is_not_a_top_level_module():
    import turboquant_hf.kernels as k

    assert k.__name__ == "turboquant_hf.kernels"
    spec = importlib.util.find_spec("kernels")
    # (another distribution's top-level `kernels`, e.g. in a virtual environment inside the checkout, is fine)
    ours = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels") + os.sep
    assert spec is None or not str(spec.origin or spec.submodule_search_locations).startswith(ours)


@pytest.mark.parametrize("bits, g, in_features", [(3, 64, 200), (4, 128, 256), (fmt.TERNARY, 64, 128), (2, 256, 300)])
def test_linear_backward_is_the_dequantized_product(bits, g, in_features):
    """d(x @ W.T)/dx = grad @ W with W the weight the packed tensors encode (the weight itself is frozen); no
    deprecated autograd fallback."""
    import warnings

    lin = TurboQuantLinear(in_features, 48, bias=True, bits=bits, group_size=g)
    quantize_linear_(lin, torch.randn(48, in_features, generator=torch.Generator().manual_seed(g)))
    torch.nn.init.normal_(lin.bias)
    w = lin.weight.dequantize(torch.float64)
    x = torch.randn(2, 5, in_features, dtype=torch.float64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = lin(x.float()).double()
        gy = torch.randn_like(y)
        (y * gy).sum().backward()
    ref = gy @ w
    assert ((x.grad - ref).norm() / ref.norm()).item() < 2e-6


@pytest.mark.parametrize("layout", ["default", "gpt_oss"])
def test_moe_experts_backward_matches_dense_experts(layout):
    """Gradients of the routed experts op for the hidden states and the routing weights equal those of a dense
    float64 computation with the dequantized experts; also with gpt-oss's layout (biases, interleaved gate/up
    outputs, the clamped SwiGLU at a limit that most values pass)."""
    from turboquant_hf.modeling.experts_layout import ExpertsLayout
    from turboquant_hf.modeling.modules import TurboQuantExperts

    e, h, i, g, k, t = 4, 128, 64, 64, 2, 6
    gen = torch.Generator().manual_seed(0)
    clamped = layout == "gpt_oss"
    lay = ExpertsLayout(interleaved=True, bias=True, alpha=1.702, limit=0.5) if clamped else ExpertsLayout()
    m = TurboQuantExperts(e, h, i, 3, 4, g, "clamped_swiglu" if clamped else "silu", layout=lay)
    m.gate_up_proj.load_packed_(*codec.quantize_weight(torch.randn(e, 2 * i, h, generator=gen), 3, g))
    m.down_proj.load_packed_(*codec.quantize_weight(torch.randn(e, h, i, generator=gen), 4, g))
    b_gu, b_d = torch.zeros(e, 2 * i, dtype=torch.float64), torch.zeros(e, h, dtype=torch.float64)
    if clamped:
        m.gate_up_proj_bias.data.normal_(generator=gen)
        m.down_proj_bias.data.normal_(generator=gen)
        b_gu, b_d = m.gate_up_proj_bias.double(), m.down_proj_bias.double()
    w_gu = m.gate_up_proj.dequantize(torch.float64).view(e, 2 * i, h)
    w_dn = m.down_proj.dequantize(torch.float64).view(e, h, i)
    x = torch.randn(t, h, generator=gen, dtype=torch.float64, requires_grad=True)
    index = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen, dtype=torch.float64, requires_grad=True)
    y = m(x.float(), index, weights.float()).double()
    gy = torch.randn_like(y)
    (y * gy).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), weights.detach().clone().requires_grad_()
    rows = []
    for tok in range(t):
        row = 0
        for slot in range(k):
            ex = index[tok, slot]
            a = w_gu[ex] @ x2[tok] + b_gu[ex]
            if clamped:
                gate, up = a[0::2].clamp(max=0.5), a[1::2].clamp(-0.5, 0.5)
                mid = (up + 1) * gate * torch.sigmoid(1.702 * gate)
            else:
                mid = torch.nn.functional.silu(a[:i]) * a[i:]
            row = row + w2[tok, slot] * (w_dn[ex] @ mid + b_d[ex])
        rows.append(row)
    (torch.stack(rows) * gy).sum().backward()
    # (the clamp's kinks: a value within float32 rounding of the limit may take the other side than in float64)
    bound = 2e-5 if clamped else 2e-6
    for got, want in ((x.grad, x2.grad), (weights.grad, w2.grad)):
        assert ((got - want).norm() / want.norm()).item() < bound


def test_linear_op_without_autograd_where_no_gradient_is_needed():
    """`ops.linear_op` gives the op without an autograd formula where no gradient can flow to the activations
    (grad mode off, or activations that do not require one) and the one with it otherwise; both compute the same
    product, and a layer's backward still reaches its input."""
    from turboquant_hf import TurboQuantLinear
    from turboquant_hf.modeling import ops
    from turboquant_hf.modeling.modules import quantize_linear_

    layer = TurboQuantLinear(256, 48, bias=True, bits=3)
    quantize_linear_(layer, torch.randn(48, 256) * 0.05)
    x = torch.randn(3, 256)
    nograd, with_grad = torch.ops.turboquant.linear_nograd.default, torch.ops.turboquant.linear.default
    assert ops.linear_op(x) is nograd
    assert ops.linear_op(x.requires_grad_()) is with_grad
    with torch.no_grad():
        assert ops.linear_op(x) is nograd
        y0 = layer(x)
    y1 = layer(x)
    assert torch.equal(y0, y1.detach()) and y1.requires_grad
    y1.sum().backward()
    w = layer.weight.dequantize()
    assert torch.allclose(x.grad, w.sum(0).expand_as(x), atol=1e-4)


def test_moe_op_without_autograd_where_no_gradient_is_needed():
    """`ops.moe_op`: the MoE op without autograd unless the hidden states or the routing weights need a gradient;
    the two ops give the same output."""
    from turboquant_hf.modeling import ops

    h, w = torch.randn(3, 8), torch.rand(3, 2)
    nograd, with_grad = torch.ops.turboquant.moe_experts_nograd.default, torch.ops.turboquant.moe_experts.default
    assert ops.moe_op(h, w) is nograd
    assert ops.moe_op(h, w.clone().requires_grad_()) is with_grad
    assert ops.moe_op(h.clone().requires_grad_(), w) is with_grad
    with torch.no_grad():
        assert ops.moe_op(h.clone().requires_grad_(), w.clone().requires_grad_()) is nograd
    assert str(nograd._schema).replace("_nograd", "") == str(with_grad._schema)


def test_packed_indices_that_do_not_hold_the_weight_are_refused():
    """Packed indices missing a group (or with one too many) for the norms' rows x groups: a clear error naming the
    shapes, never a product of whatever memory follows them."""
    from turboquant_hf.format import runtime_layout as layout

    packed, norms = codec.quantize_weight(torch.randn(64, 256) * 0.02, 3, 128)
    x = torch.randn(2, 256)
    cb = fmt.codebook(8, 128, "cpu")
    s1, s2 = fmt.signs(128, "cpu")
    for bad in (packed[:-1], torch.cat([packed, packed[:1]]), packed[:, :-1]):
        with pytest.raises(ValueError, match=r"do not hold 64 rows x 2 groups of 128"):
            torch.ops.turboquant.linear(x, bad, norms, cb, s1, s2, 128, 256)
    runtime = layout.to_runtime(packed, 8, 128, 2)
    want = torch.ops.turboquant.linear(x, packed, norms, cb, s1, s2, 128, 256)
    got = torch.ops.turboquant.linear(x, runtime, norms, layout.runtime_codebook(cb), s1, s2, 128, 256)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"expected \(128, 12\)"):
        torch.ops.turboquant.linear(x, runtime[:-1], norms, layout.runtime_codebook(cb), s1, s2, 128, 256)
