"""The fused Triton router against the reference, in Triton's CPU interpreter (CI; conftest.py sets it) or on
CUDA: the same experts in the same order, weights within float32 rounding, with and without renormalisation."""

import pytest
import torch

pytest.importorskip("triton", reason="Triton ships for Linux; the Windows app runs the reference kernels")

from engine.kernels import reference, triton_router  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("tokens, experts, top_k", [(1, 256, 8), (5, 128, 8), (3, 60, 4), (2, 8, 8)])
@pytest.mark.parametrize("normalise", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_matches_the_reference(tokens, experts, top_k, normalise, dtype):
    gen = torch.Generator().manual_seed(experts + top_k)
    logits = (2 * torch.randn(tokens, experts, generator=gen)).to(DEVICE, dtype)
    ids, weights = triton_router.router_topk(logits, top_k, normalise)
    expected_ids, expected_weights = reference.router_topk(logits, top_k, normalise)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    if dtype == torch.bfloat16:  # equal bf16 logits may leave in either order: compare the probabilities chosen
        assert torch.allclose(weights, expected_weights, rtol=1e-5, atol=1e-7)
        assert torch.equal(ids.sort(-1).values, expected_ids.sort(-1).values) or torch.allclose(
            logits.float().gather(1, ids), logits.float().gather(1, expected_ids)
        )
    else:
        assert torch.equal(ids, expected_ids)
        assert torch.allclose(weights, expected_weights, rtol=1e-5, atol=1e-7)
    if normalise:
        assert torch.allclose(weights.sum(-1), torch.ones(tokens, device=DEVICE), atol=1e-6)


def test_equal_probabilities_pick_the_lower_expert_first():
    logits = torch.zeros(1, 16, device=DEVICE)
    logits[0, [3, 9, 12]] = 1.0
    ids, weights = triton_router.router_topk(logits, 4, False)
    assert ids.tolist() == [[3, 9, 12, 0]]
    assert weights[0, 0] == weights[0, 2] > weights[0, 3]
