"""The Triton RMSNorm against the reference, in Triton's CPU interpreter (CI; conftest.py sets it) or on CUDA."""

import pytest
import torch

pytest.importorskip("triton", reason="Triton ships for Linux; the Windows app runs the reference kernels")

from engine.kernels import reference, triton_norm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("shape", [(1, 2048), (3, 80), (2, 5, 256), (0, 64)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_reference(shape, offset, dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (3 * torch.randn(shape, generator=gen)).to(DEVICE, dtype)
    weight = torch.randn(shape[-1], generator=gen).to(DEVICE, dtype)
    got = triton_norm.rms_norm(x, weight, 1e-6, offset)
    expected = reference.rms_norm(x, weight, 1e-6, offset)
    assert got.shape == x.shape and got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the output either way
    assert torch.allclose(got.float(), expected.float(), rtol=tolerance, atol=tolerance)


def test_strided_rows_are_read_in_place():
    """q of an attention layer with an output gate: each head's query is half of a [T, H, 2D] projection."""
    gen = torch.Generator().manual_seed(1)
    projection = torch.randn(3, 4, 2 * 32, generator=gen).to(DEVICE)
    query = projection.split(32, dim=-1)[0]
    weight = torch.randn(32, generator=gen).to(DEVICE)
    got = triton_norm.rms_norm(query, weight, 1e-6, 1.0)
    assert not query.is_contiguous() and got.is_contiguous()
    assert torch.allclose(got, reference.rms_norm(query, weight, 1e-6, 1.0), rtol=1e-5, atol=1e-5)


def test_rows_it_cannot_take_go_to_the_reference():
    x = torch.randn(2, 8).to(DEVICE)[:, ::2]  # features not contiguous
    weight = torch.ones(4).to(DEVICE)
    assert torch.equal(triton_norm.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6, 0.0))


@pytest.mark.parametrize("shape", [(1, 2048), (3, 80), (0, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_residual_add_and_its_norm_match_the_reference(shape, dtype):
    """A decoder layer's residual sum and the post-attention norm of it in one kernel: the sum rounded to its
    dtype as a stored sum is, then normed."""
    gen = torch.Generator().manual_seed(sum(shape) + 1)
    x, y = ((3 * torch.randn(shape, generator=gen)).to(DEVICE, dtype) for _ in range(2))
    weight = torch.randn(shape[-1], generator=gen).to(DEVICE, dtype)
    total, normed = triton_norm.add_rms_norm(x, y, weight, 1e-6, 1.0)
    expected_total, expected = reference.add_rms_norm(x, y, weight, 1e-6, 1.0)
    assert torch.equal(expected_total, x + y) and torch.equal(expected, reference.rms_norm(x + y, weight, 1e-6, 1.0))
    assert total.shape == normed.shape == x.shape and total.dtype == normed.dtype == dtype
    # bf16: two roundings (the sum's, the norm's), which Triton's CPU interpreter truncates (CUDA rounds)
    tolerance = 1e-5 if dtype == torch.float32 else 2**-6
    assert torch.allclose(total.float(), expected_total.float(), rtol=tolerance, atol=tolerance)
    scale = float(expected.abs().max()) if expected.numel() else 1.0
    assert torch.allclose(normed.float(), expected.float(), rtol=tolerance, atol=tolerance * scale)
