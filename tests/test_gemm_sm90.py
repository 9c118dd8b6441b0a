"""The packed-weight GEMM compiled for sm_90 (H100/H200) by Triton's own compiler, without a GPU: the properties its
speed rests on, read off the machine code.

- The products run on wgmma (`HGMMA` in SASS), not `mma.sync`.
- With the lane order (LANES), the decoded weight goes straight into wgmma's register operand: no `ldmatrix`
  (`LDSM`) of the weight tile, which the natural order needs (it goes through shared memory), on the axis order of
  the Triton in use (`linear._lanes_first`).
- The activations reach shared memory through asynchronous copies (`LDGSTS`: software-pipelined loads).

The interpreter tests (test_kernels.py) check the values; these check the code the GPU would run.
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

_TYPES = dict(x_ptr="*bf16", pk_ptr="*i32", nrm_ptr="*fp32", cb_ptr="*fp32", out_ptr="*bf16", ws_ptr="*fp32",
              cnt_ptr="*i32", M="i32", N="i32", stride_xm="i32", stride_om="i32", SPLIT="i32")


def _compiled(n_levels: int, bm: int, bn: int, lanes: bool, warps: int, split: int = 1, ng: int = 32,
              prefetch: bool = False, stages: int = 3):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from turboquant_hf.kernels import gemm, linear

    fn = gemm._gemm_kernel
    values = dict(NG=ng, KSTEPS=ng // split, NLEV=n_levels, G=128, BK=128, BM=bm, BN=bn, SWAP=True, GROUP=1,
                  RUNTIME_LAYOUT=True, F16=False, USE_ASM=True, LANES=lanes, WARPS=warps,
                  LANES_FIRST=linear._lanes_first(), PREFETCH=prefetch)
    signature, constants, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constants[(i,)] = values[p.name]
        else:
            signature[p.name] = _TYPES[p.name]
            if _TYPES[p.name].startswith("*") or p.name in ("N", "stride_xm", "stride_om"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=warps, num_stages=stages))
    return kernel


def _sass(*args, **kwargs) -> str:
    from triton.tools.disasm import get_sass

    return get_sass(_compiled(*args, **kwargs).asm["cubin"])


@pytest.mark.parametrize("n_levels,bm,bn,warps,prefetch", [(8, 64, 128, 4, False), (4, 16, 64, 4, False),
                                                           (16, 128, 128, 8, False), (8, 128, 128, 8, True)])
def test_lane_order_feeds_wgmma_from_registers(n_levels, bm, bn, warps, prefetch):
    sass = _sass(n_levels, bm, bn, True, warps, prefetch=prefetch)
    assert "HGMMA" in sass and "HMMA" not in sass.replace("HGMMA", "")
    assert "LDSM" not in sass, "the decoded weight passes through shared memory"
    assert "LDGSTS" in sass


def test_natural_order_goes_through_shared_memory():
    """The same tile in the natural order needs the shared-memory round trip the lane order avoids (so the test
    above can tell them apart), and split-K compiles with its counter epilogue."""
    sass = _sass(8, 64, 128, False, 4, split=4)
    assert "HGMMA" in sass and "LDSM" in sass
    assert "ATOM" in sass or "RED" in sass
