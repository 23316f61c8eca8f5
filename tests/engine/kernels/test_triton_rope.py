"""Each head's norm and rotary embedding in one kernel against the reference, in Triton's CPU interpreter (CI;
conftest.py sets it) or on CUDA; and the reference against the rotation it stands for."""

import math

import pytest
import torch

pytest.importorskip("triton", reason="Triton ships for Linux; the Windows app runs the reference kernels")

from engine.kernels import reference, triton_rope  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(tokens, heads, features, rotary, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    # a [T, H, 2D] projection split into query and gate, as an output-gated layer's q is: strided rows
    x = (3 * torch.randn(tokens, heads, 2 * features, generator=gen)).to(DEVICE, dtype)[..., :features]
    weight = torch.randn(features, generator=gen).to(DEVICE)
    positions = torch.randint(0, 40000, (tokens,), generator=gen).to(DEVICE)
    inv_freq = (1.0 / 1e7 ** (torch.arange(0, rotary, 2, dtype=torch.float32) / rotary)).to(DEVICE)
    return x, weight, positions, inv_freq


@pytest.mark.parametrize("tokens, heads, features, rotary", [(1, 16, 256, 64), (3, 2, 256, 64), (2, 4, 96, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_norm_rope_matches_the_reference(tokens, heads, features, rotary, dtype, offset):
    x, weight, positions, inv_freq = _inputs(tokens, heads, features, rotary, dtype, seed=tokens + features)
    got = triton_rope.norm_rope(x, weight, 1e-6, offset, positions, inv_freq)
    expected = reference.norm_rope(x, weight, 1e-6, offset, positions, inv_freq)
    assert got.shape == (tokens, heads, features) and got.dtype == dtype and got.is_contiguous()
    # bf16: cos and sin rounded from float32 values that may differ in their last bit, then three roundings, which
    # Triton's CPU interpreter truncates (CUDA rounds to nearest)
    tolerance = 1e-5 if dtype == torch.float32 else 2**-6
    scale = float(expected.abs().max())
    assert torch.allclose(got.float(), expected.float(), rtol=tolerance, atol=tolerance * scale)


def test_the_reference_norms_then_rotates_each_pair():
    """Feature i < r/2 and i + r/2 turn by the angle position * inv_freq[i]; the features past r only norm."""
    x, weight, positions, inv_freq = _inputs(2, 3, 12, 8, torch.float32, seed=4)
    got = reference.norm_rope(x, weight, 1e-6, 1.0, positions, inv_freq)
    normed = reference.rms_norm(x, weight, 1e-6, 1.0)
    for t in range(2):
        for i in range(4):
            angle = float(positions[t]) * float(inv_freq[i])
            c, s = math.cos(angle), math.sin(angle)
            a, b = normed[t, :, i], normed[t, :, i + 4]
            assert torch.allclose(got[t, :, i], a * c - b * s, atol=1e-4)
            assert torch.allclose(got[t, :, i + 4], b * c + a * s, atol=1e-4)
    assert torch.equal(got[..., 8:], normed[..., 8:])
