"""The `turboquant::linear` custom op: reference semantics, registration, and tracing."""

import importlib.util
import os

import pytest
import torch

from turboquant_hf import codec
from turboquant_hf import format as fmt
from turboquant_hf.modules import TurboQuantLinear, format_constants, quantize_linear_


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_op_keeps_dtype_and_leading_dims(dtype):
    x, packed, norms, cb, s1, s2 = _inputs(8, 128, dtype=dtype)
    x3 = x.view(1, 5, 200)
    y = torch.ops.turboquant.linear(x3, packed, norms, cb, s1, s2, 128, 200)
    assert y.dtype == dtype and y.shape == (1, 5, 40)
    ref = x.float() @ codec.dequantize_weight(packed, norms, 200, 128).T
    assert torch.allclose(y.float().view(5, 40), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_opcheck():
    x, packed, norms, cb, s1, s2 = _inputs(8, 64)
    torch.library.opcheck(
        torch.ops.turboquant.linear.default,
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
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert spec is None or not str(spec.origin or spec.submodule_search_locations).startswith(here)
