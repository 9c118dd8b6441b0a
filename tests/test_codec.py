"""The codec against the independent reference package and against Lloyd-Max theory."""

import math

import pytest
import torch

from turboquant_hf import codec
from turboquant_hf import format as fmt

ref_ops = pytest.importorskip("turboquant_vllm.torch_ops")
ref_wq = pytest.importorskip("turboquant_vllm.weight_quant")

# in_features: multiples of G and not (96, 200, 1000 exercise padding); 3-D expert-shaped tensors too.
SHAPES = [(64, 256), (48, 200), (33, 1000), (4, 24, 96), (3, 40, 384)]


def _reference_quantize(w: torch.Tensor, bits: int, group_size: int):
    """What the reference writer does to one tensor: pad rows, group, quantize with norm correction, pack."""
    in_features = w.shape[-1]
    w2d = w.reshape(-1, in_features).float()
    padded = fmt.padded_width(in_features, group_size)
    w2d = torch.nn.functional.pad(w2d, (0, padded - in_features))
    q = ref_ops.PolarQuantTorch(group_size, bits, seed=42, device="cpu")
    idx, norms = q.quantize(w2d.reshape(-1, group_size), norm_correction=True)
    return q, idx, ref_wq.pack_indices(idx, bits), norms.reshape(w2d.shape[0], -1)


@pytest.mark.parametrize("group_size", fmt.GROUP_SIZES)
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bytes_and_norms_match_reference(shape, bits, group_size):
    torch.manual_seed(hash((shape, bits, group_size)) % 2**31)
    w = torch.randn(shape) * 0.02
    packed, norms = codec.quantize_weight(w, bits, group_size)
    q, ref_idx, ref_packed, ref_norms = _reference_quantize(w, bits, group_size)

    assert packed.dtype == torch.uint8 and norms.dtype == torch.float32
    assert packed.shape == ref_packed.shape and norms.shape == ref_norms.shape
    idx = codec.unpack_indices(packed, 2**bits, group_size)
    differ = idx != ref_idx
    # Only boundary ties (float rounding of the rotation) may differ.
    assert differ.float().mean().item() <= 1e-5
    same_groups = ~differ.any(dim=1)
    if not differ.any():
        assert torch.equal(packed, ref_packed)
    rel = ((norms.flatten() - ref_norms.flatten()).abs() / ref_norms.flatten().clamp_min(1e-30))[same_groups]
    assert rel.max().item() <= 1e-6

    # The reference's dequantization of OUR bytes equals ours.
    ref_deq = q.dequantize(ref_wq.unpack_indices(packed, bits, group_size), norms.flatten())
    in_features = shape[-1]
    ref_deq = ref_deq.reshape(-1, fmt.padded_width(in_features, group_size))[:, :in_features]
    ours = codec.dequantize_weight(packed, norms, in_features, group_size)
    assert torch.allclose(ours, ref_deq, rtol=0, atol=1e-6 * w.abs().max().item())


@pytest.mark.parametrize("n_levels", [3, 4, 8, 16])
@pytest.mark.parametrize("group_size", [64, 128])
def test_pack_unpack_roundtrip(n_levels, group_size):
    torch.manual_seed(n_levels)
    idx = torch.randint(0, n_levels, (37, group_size))
    packed = codec.pack_indices(idx, n_levels)
    assert packed.shape == (37, fmt.bytes_per_group(n_levels, group_size))
    assert torch.equal(codec.unpack_indices(packed, n_levels, group_size), idx)
    cb = fmt.codebook(n_levels, group_size)
    assert torch.equal(codec.decode_values(packed, cb, group_size), cb[idx])


def test_packing_byte_layout():
    # 3-bit: 8 indices -> 3 bytes, LSB first.
    idx = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0] * 16])
    w = sum(v << (3 * k) for k, v in enumerate([1, 2, 3, 4, 5, 6, 7, 0]))
    assert codec.pack_indices(idx, 8)[0, :3].tolist() == [w & 255, (w >> 8) & 255, (w >> 16) & 255]
    # 4-bit nibbles, 2-bit quarters.
    assert codec.pack_indices(torch.tensor([[3, 12] * 64]), 16)[0, 0].item() == 3 | 12 << 4
    assert codec.pack_indices(torch.tensor([[1, 2, 3, 0] * 32]), 4)[0, 0].item() == 1 | 2 << 2 | 3 << 4
    # ternary: 5 trits a byte, least significant first; 26 bytes for G=128.
    t = torch.tensor([[2, 1, 0, 2, 1] * 25 + [1, 1, 2]])
    p = codec.pack_indices(t, 3)
    assert p.shape == (1, 26)
    assert p[0, 0].item() == 2 + 3 * 1 + 9 * 0 + 27 * 2 + 81 * 1
    assert p[0, 25].item() == 1 + 3 * 1 + 9 * 2


# Relative RMS error of the optimal scalar quantizer for N(0, 1) (format.md section 3).
LLOYD_MAX = {4: 0.0975, 3: 0.1859, 2: 0.3428, fmt.TERNARY: 0.4361}


def _finite_group_theory(group_size: int, n_levels: int) -> float:
    """Relative RMS error of the codebook on one coordinate of a uniformly random unit vector in R^G.

    After the random rotation each coordinate of a normalised group has density proportional to
    (1 - y^2)^((G-3)/2): slightly lighter-tailed than N(0, 1/G), more so at small G.
    """
    import numpy as np
    from scipy import integrate, special

    c = fmt.codebook(n_levels, group_size).double().numpy()
    edges = np.concatenate([[-1.0], (c[:-1] + c[1:]) / 2, [1.0]])
    log_k = special.gammaln(group_size / 2) - special.gammaln((group_size - 1) / 2) - 0.5 * np.log(np.pi)

    def density(y):
        return np.exp(log_k) * (1 - y * y) ** ((group_size - 3) / 2)

    mse = sum(
        integrate.quad(lambda y, ci=ci: (y - ci) ** 2 * density(y), lo, hi, limit=200)[0]
        for ci, lo, hi in zip(c, edges[:-1], edges[1:])
    )
    return math.sqrt(mse * group_size)


@pytest.mark.parametrize("group_size", fmt.GROUP_SIZES)
@pytest.mark.parametrize("bits", [4, 3, 2, fmt.TERNARY])
def test_error_matches_lloyd_max(bits, group_size):
    torch.manual_seed(1)
    w = torch.randn(512, 1024)
    packed, norms = codec.quantize_weight(w, bits, group_size)
    deq = codec.dequantize_weight(packed, norms, 1024, group_size)
    rel = ((deq - w).view(-1, group_size).norm(dim=1) / w.view(-1, group_size).norm(dim=1)).pow(2).mean().sqrt()
    rel = rel.item()
    finite = _finite_group_theory(group_size, fmt.levels_for_bits(bits))
    assert abs(rel - finite) / finite <= 0.03, (rel, finite)
    if group_size >= 128:  # close enough to the Gaussian limit for the textbook values to apply
        assert abs(rel - LLOYD_MAX[bits]) / LLOYD_MAX[bits] <= 0.03, (rel, LLOYD_MAX[bits])


def test_zero_group_and_nan():
    w = torch.randn(4, 256)
    w[1, 128:] = 0
    packed, norms = codec.quantize_weight(w, 3, 128)
    assert norms[1, 1].item() == 0.0
    assert codec.unpack_indices(packed, 8, 128)[3].tolist() == [3] * 128
    bad = torch.randn(8, 128)
    bad[5, 7] = float("nan")
    with pytest.raises(ValueError, match=r"layers\.3\.mlp\.up_proj\.weight.*NaN or Inf.*row 5, column 7"):
        codec.quantize_weight(bad, 3, 128, name="layers.3.mlp.up_proj.weight")
    bad[5, 7] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        codec.quantize_weight(bad, 3, 128)


def test_quantize_is_dtype_and_chunk_invariant(monkeypatch):
    torch.manual_seed(2)
    w = torch.randn(300, 640, dtype=torch.bfloat16)
    a = codec.quantize_weight(w, 3, 128)
    monkeypatch.setattr(codec, "_CHUNK_ELEMENTS", 128 * 7)
    b = codec.quantize_weight(w.float(), 3, 128)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_rotation_is_orthogonal():
    s1, s2 = fmt.signs(128)
    x = torch.randn(10, 128)
    y = codec.rotate_groups(x, s1, s2)
    assert torch.allclose(y.norm(dim=1), x.norm(dim=1), rtol=1e-5)
    assert torch.allclose(codec.unrotate_groups(y, s1, s2), x, atol=1e-5)
    h = codec.hadamard_matrix(128)
    i, j = 37, 101
    assert h[i, j].item() == (-1) ** bin(i & j).count("1")
    assert math.isclose((h @ h.T)[5, 5].item(), 128)
