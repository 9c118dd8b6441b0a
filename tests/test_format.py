"""Format constants against the published values and the independent reference."""

import pytest
import torch

from turboquant_hf.format import constants as fmt


def _sign_bytes(s: torch.Tensor) -> str:
    bits = (s > 0).to(torch.int64).view(-1, 8)
    return bytes(int((b << torch.arange(8)).sum()) for b in bits).hex()


def test_signs_match_published_check_values():
    s1, s2 = fmt.signs(128)
    assert _sign_bytes(s1) == "2242d73f177cab01f6ba4affe75f6b65"
    assert _sign_bytes(s2) == "07d021a85ce6402438d201c5cbbf2514"


def _mt19937(seed: int, count: int) -> list[int]:
    """Plain MT19937 (init_genrand) outputs, written from the published algorithm."""
    mt = [0] * 624
    mt[0] = seed
    for i in range(1, 624):
        mt[i] = (1812433253 * (mt[i - 1] ^ (mt[i - 1] >> 30)) + i) & 0xFFFFFFFF
    out, index = [], 624
    while len(out) < count:
        if index >= 624:
            for i in range(624):
                y = (mt[i] & 0x80000000) | (mt[(i + 1) % 624] & 0x7FFFFFFF)
                mt[i] = mt[(i + 397) % 624] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
            index = 0
        y = mt[index]
        index += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        y ^= y >> 18
        out.append(y)
    return out


@pytest.mark.parametrize("group_size", fmt.GROUP_SIZES)
def test_signs_from_mt19937_stream(group_size):
    words = _mt19937(42, 2 * group_size)
    expect = torch.tensor([1.0 if w % 2 else -1.0 for w in words])
    s1, s2 = fmt.signs(group_size)
    assert torch.equal(torch.cat([s1, s2]), expect)


@pytest.mark.parametrize("group_size", fmt.GROUP_SIZES)
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codebooks_equal_reference(bits, group_size):
    ref = pytest.importorskip("turboquant_vllm.torch_ops")
    q = ref.PolarQuantTorch(group_size, bits, seed=42, device="cpu")
    assert torch.equal(q.centroids, fmt.codebook(2**bits, group_size))
    assert torch.equal(q.boundaries, fmt.boundaries(2**bits, group_size))
    assert fmt.boundaries(2**bits, group_size)[2 ** (bits - 1) - 1].item() == 0.0


def test_codebook_scaled_values():
    c3 = fmt.codebook(8, 128) * 128**0.5
    assert torch.allclose(c3[4:], torch.tensor([0.2451, 0.7560, 1.3439, 2.1519]), atol=2e-4)
    t = fmt.codebook(3, 64)
    assert torch.allclose(t, torch.tensor([-1.224006, 0.0, 1.224006]) / 8)


@pytest.mark.parametrize("group_size", fmt.GROUP_SIZES)
def test_geometry_identifies_bit_width(group_size):
    widths = {n: fmt.bytes_per_group(n, group_size) for n in (3, 4, 8, 16)}
    assert len(set(widths.values())) == 4
    for n, w in widths.items():
        assert fmt.levels_from_geometry(w, group_size) == n
    assert widths[3] == -(-group_size // 5)
    with pytest.raises(ValueError, match="bytes per group"):
        fmt.levels_from_geometry(7, group_size)


@pytest.mark.parametrize("bad", [1, 5, 8, 2.5, "four", None, True])
def test_bad_bits_named(bad):
    with pytest.raises(ValueError, match=r"bits must be one of 2, 3, 4 or 1.58"):
        fmt.check_bits(bad)


@pytest.mark.parametrize("bad", [32, 100, 512, 0, None])
def test_bad_group_size_named(bad):
    with pytest.raises(ValueError, match=r"group_size must be one of 64, 128, 256"):
        fmt.check_group_size(bad)
