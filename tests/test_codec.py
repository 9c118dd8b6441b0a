"""The codec against the independent reference package, against Lloyd-Max theory, and its quantizer against a
numpy float32 formulation of the same operations (bit for bit, whatever the chunking or the threads)."""

import math

import pytest
import torch

from turboquant_hf.format import codec
from turboquant_hf.format import constants as fmt

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


# ---------------------------------------------------------------------------------------------------------------
# the quantizer's float32 arithmetic: fixed, so the bytes depend on the weight alone
def _wide_range(rows, cols, seed):
    """Normal values times a power of ten per row (1e-6 to 1e6) and a power of two per element (2**-8 to 2**8)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen)
    w *= 10.0 ** (torch.rand(rows, 1, generator=gen) * 12 - 6)
    w *= 2.0 ** torch.randint(-8, 9, (rows, cols), generator=gen).float()
    return w


def _numpy_quantizer(x, bits, group_size):
    """The quantizer written afresh in numpy float32: the pairwise-tree norm, the butterfly stages h = 1, 2, 4, ...
    on (s1 * x) / n, division by sqrt(G) and the s2 flip, searchsorted rounding, the norm over the same tree.
    Returns (y, norms of the groups, indices, stored norms)."""
    import numpy as np

    f32 = np.float32
    x = np.asarray(x, dtype=f32)
    k, g = x.shape
    s1, s2 = (s.numpy().astype(f32) for s in fmt.signs(group_size))
    codebook = fmt.codebook(fmt.levels_for_bits(bits), group_size).numpy()
    bounds = (codebook[:-1] + codebook[1:]) / f32(2)

    def tree(s):
        while s.shape[1] > 1:
            w = s.shape[1] // 2
            s = s[:, :w] + s[:, w:]
        return s[:, 0]

    n = np.sqrt(tree(x * x))
    u = (x * s1) / np.where(n > 0, n, f32(1))[:, None]
    h = 1
    while h < g:
        blocks = u.reshape(k, g // (2 * h), 2, h)
        a, b = blocks[:, :, 0], blocks[:, :, 1]
        u = np.stack([a + b, a - b], axis=2).reshape(k, g)
        h *= 2
    y = u / np.sqrt(f32(g)) * s2
    idx = np.searchsorted(bounds, y, side="left")
    r = np.sqrt(tree(codebook[idx] * codebook[idx]))
    assert all(a.dtype == f32 for a in (n, u, y, r))
    return y, n, idx, n / np.where(r > 0, r, f32(1))


@pytest.mark.parametrize("group_size", fmt.GROUP_SIZES)
def test_rotation_and_norms_equal_a_numpy_float32_formulation(group_size):
    """Bit for bit, on values over twelve decades; and the rotation is D2 . H . D1 . x / (n sqrt(G))."""
    x = _wide_range(300, group_size, group_size)
    x[7] = 0  # an all-zero group
    q = codec.GroupQuantizer(3, group_size)
    y, n = q.rotate(x)
    y_ref, n_ref, _, _ = _numpy_quantizer(x, 3, group_size)
    assert torch.equal(n.view(torch.int32), torch.from_numpy(n_ref).view(torch.int32))
    assert torch.equal(y.view(torch.int32), torch.from_numpy(y_ref).view(torch.int32))
    s1, s2 = fmt.signs(group_size)
    unit = x.double() / x.double().norm(dim=1, keepdim=True).clamp_min(1e-300)
    assert torch.allclose(y.double(), codec.rotate_groups(unit.float(), s1, s2).double(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("group_size", fmt.GROUP_SIZES)
@pytest.mark.parametrize("bits", [fmt.TERNARY, 2, 3, 4])
def test_quantizer_equals_a_numpy_float32_formulation(bits, group_size):
    """Indices and stored norms of quantize_weight are those of the numpy formulation, bit for bit."""
    x = _wide_range(200, 2 * group_size, 7 * group_size)
    packed, norms = codec.quantize_weight(x, bits, group_size)
    _, _, idx, stored = _numpy_quantizer(x.view(-1, group_size), bits, group_size)
    n_levels = fmt.levels_for_bits(bits)
    assert torch.equal(codec.unpack_indices(packed, n_levels, group_size), torch.from_numpy(idx))
    assert torch.equal(norms.view(-1).view(torch.int32), torch.from_numpy(stored).view(torch.int32))


@pytest.mark.parametrize("group_size", fmt.GROUP_SIZES)
@pytest.mark.parametrize("bits", [fmt.TERNARY, 2, 3, 4])
def test_quantizer_bytes_do_not_depend_on_the_chunking(bits, group_size, monkeypatch):
    """Whole, in row slices of odd sizes through one quantizer (its buffers reused across block widths), and with
    small chunks and blocks (groups of a row split between blocks): the same packed bytes and norms."""
    w = _wide_range(45, 3 * group_size + group_size // 2, group_size + 3).to(torch.bfloat16)  # padded groups
    w[4] = 0
    packed, norms = codec.quantize_weight(w, bits, group_size)
    q = codec.GroupQuantizer(bits, group_size)
    for rows in (1, 3, 7, 13):
        parts = [q(w[r:r + rows], "w", r) for r in range(0, w.shape[0], rows)]
        assert torch.equal(torch.cat([p for p, _ in parts]), packed), rows
        assert torch.equal(torch.cat([n for _, n in parts]), norms), rows
    monkeypatch.setattr(codec, "_CHUNK_ELEMENTS", group_size * 11)
    monkeypatch.setattr(codec, "_CPU_BLOCK_ELEMENTS", group_size * 5)
    small = codec.quantize_weight(w, bits, group_size)
    assert torch.equal(small[0], packed) and torch.equal(small[1], norms)


def test_quantizer_bytes_do_not_depend_on_the_thread_count():
    """One torch thread or two (every step large enough to be split between them); and one quantizer shared by
    several Python threads at once, as the converter's workers share it (each thread has its own buffers)."""
    from concurrent.futures import ThreadPoolExecutor

    w = _wide_range(512, 4096, 3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = codec.quantize_weight(w, 3, 128)
        torch.set_num_threads(2)
        two = codec.quantize_weight(w, 3, 128)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])

    q = codec.GroupQuantizer(3, 128)
    starts = list(range(0, 512, 8))
    with ThreadPoolExecutor(4) as pool:
        parts = list(pool.map(lambda r: q(w[r:r + 8 + r % 3], "w", r), starts))
    for r, (p, n) in zip(starts, parts):
        stop = min(512, r + 8 + r % 3)
        assert torch.equal(p, one[0][r * 32:stop * 32]) and torch.equal(n, one[1][r:stop]), r


def test_powers_of_two_scale_exactly_out_of_the_float32_range_of_squares():
    """A group times 2**e has the same indices and its norm times 2**e exactly, also where its squares would
    overflow (e = 70, 120) or fall below the normal range (e = -70, -110) in float32."""
    gen = torch.Generator().manual_seed(5)
    # magnitudes in [2**-8, 2): every value times 2**e stays a normal float32
    x = (torch.rand(64, 256, generator=gen) + 1) * 2.0 ** torch.randint(-8, 1, (64, 256), generator=gen).float()
    x *= torch.randint(0, 2, (64, 256), generator=gen).float() * 2 - 1
    packed, norms = codec.quantize_weight(x, 4, 128)
    for e in (-110, -70, -40, 40, 70, 120):
        p, n = codec.quantize_weight(x * 2.0**e, 4, 128)
        assert torch.equal(p, packed), e
        assert torch.equal(n, norms * 2.0**e), e
    huge = torch.full((2, 128), 1e36)  # squares overflow float32, the norm does not
    deq = codec.dequantize_weight(*codec.quantize_weight(huge, 4, 128), 128, 128)
    assert ((deq - huge).double().norm() / huge.double().norm()).item() < 0.15


def test_nan_is_located_in_any_block(monkeypatch):
    monkeypatch.setattr(codec, "_CPU_BLOCK_ELEMENTS", 128 * 3)
    bad = torch.randn(40, 300, dtype=torch.bfloat16)
    bad[29, 211] = float("-inf")
    with pytest.raises(ValueError, match=r"w\.weight: weight contains NaN or Inf \(first at row 29, column 211\)"):
        codec.quantize_weight(bad, 3, 128, name="w.weight")
    big = torch.tensor([[1e300] * 128], dtype=torch.float64)  # finite, but not in float32
    with pytest.raises(ValueError, match="row 0, column 0"):
        codec.quantize_weight(big, 3, 128)
