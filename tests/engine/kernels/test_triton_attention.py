"""The Triton decode attention against the reference, in Triton's CPU interpreter (CI; conftest.py sets it) or on
CUDA: grouped query heads, lengths that do not fill the key blocks or the ranges, and a cache longer than the
keys in use (rows past the position hold garbage the kernel must not read)."""

import pytest
import torch

pytest.importorskip("triton", reason="Triton ships for Linux; the Windows app runs the reference kernels")

from engine.kernels import reference, triton_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("heads, kv_heads, dim, value_dim", [(16, 2, 64, 64), (4, 4, 32, 16), (8, 1, 16, 32)])
@pytest.mark.parametrize("position", [0, 15, 16, 77])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_the_reference(heads, kv_heads, dim, value_dim, position, dtype):
    check_against_the_reference(heads, kv_heads, dim, value_dim, position, dtype)


@pytest.mark.parametrize("position", [0, 77])
@pytest.mark.parametrize("tiles", sorted(set(triton_attention.TILES.values())))
def test_more_ranges_than_the_merge_reads_at_once(monkeypatch, position, tiles):
    """Many key ranges, most of them empty, merged MERGE at a time; each precision's tile of keys."""
    monkeypatch.setattr(triton_attention, "_splits", lambda device: 4 * triton_attention.MERGE)
    monkeypatch.setitem(triton_attention.TILES, "ieee", tiles)
    check_against_the_reference(16, 2, 64, 64, position, torch.float32)


def check_against_the_reference(heads, kv_heads, dim, value_dim, position, dtype):
    gen = torch.Generator().manual_seed(position + heads)
    capacity = 96
    keys = torch.randn(capacity, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    values = torch.randn(capacity, kv_heads, value_dim, generator=gen).to(DEVICE, dtype)
    keys[position + 1 :] = float("nan")  # beyond the token: never read
    values[position + 1 :] = float("nan")
    q = torch.randn(1, heads, dim, generator=gen).to(DEVICE, dtype)
    at = torch.tensor([position], device=DEVICE)
    got = triton_attention.decode_attention(q, keys, values, at, dim**-0.5)
    expected = reference.decode_attention(q.float(), keys.float(), values.float(), at, dim**-0.5)
    assert got.shape == (1, heads, value_dim) and got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding
    assert torch.allclose(got.float(), expected, rtol=tolerance, atol=tolerance)


def test_shapes_it_cannot_take_go_to_the_reference():
    keys, values = torch.randn(8, 2, 24).to(DEVICE), torch.randn(8, 2, 24).to(DEVICE)  # 24: no power of two
    q, at = torch.randn(1, 4, 24).to(DEVICE), torch.tensor([5], device=DEVICE)
    assert not triton_attention.decode_attention_capturable(q, keys, values)
    assert torch.equal(
        triton_attention.decode_attention(q, keys, values, at, 0.2),
        reference.decode_attention(q, keys, values, at, 0.2),
    )
