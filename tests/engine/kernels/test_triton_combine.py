"""The fused end of a decode step's MoE layer against the reference, in Triton's CPU interpreter (CI; conftest.py
sets it) or on CUDA; and the reference against the plain arithmetic it stands for."""

import math

import pytest
import torch

pytest.importorskip("triton", reason="Triton ships for Linux; the Windows app runs the reference kernels")

from engine.kernels import reference, triton_combine  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(k, hidden, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    h, shared = (torch.randn(1, hidden, generator=gen).to(DEVICE, dtype) for _ in range(2))
    routed = torch.randn(k, hidden, generator=gen).to(DEVICE, dtype)
    weights = torch.rand(1, k, generator=gen).to(DEVICE)
    cpu_routed = torch.randn(1, hidden, generator=gen).to(DEVICE)
    return h, routed, weights, shared, cpu_routed


@pytest.mark.parametrize("k, hidden", [(8, 2048), (3, 1500), (1, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_cpu", [True, False])
def test_combine_matches_the_reference(k, hidden, dtype, with_cpu):
    h, routed, weights, shared, cpu_routed = _inputs(k, hidden, dtype, seed=k + hidden)
    gpu_rows = torch.tensor([float(j % 3 != 1) for j in range(k)], device=DEVICE) if with_cpu else None
    if with_cpu and k > 1:
        routed[1] = float("nan")  # a CPU row reads a slot that may hold anything
    cpu = cpu_routed if with_cpu else None
    got = triton_combine.combine_experts(h, routed, weights, gpu_rows, shared, cpu)
    expected = reference.combine_experts(h, routed, weights, gpu_rows, shared, cpu)
    assert got.dtype == dtype and got.shape == (1, hidden)
    assert not got.isnan().any()
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7  # bf16: one ulp (the one rounding of the output)
    assert torch.allclose(got.float(), expected.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_shared_expert_gated_by_its_logit(dtype):
    """The shared expert's gate applied in the combine: sigmoid(logit) times the expert, each rounded to the
    input dtype as the prompt path stores them, then the sums in float32."""
    h, routed, weights, shared, cpu_routed = _inputs(8, 2048, dtype, seed=11)
    gate = torch.tensor([[-0.7]], device=DEVICE).to(dtype)
    got = triton_combine.combine_experts(h, routed, weights, None, shared, cpu_routed, gate)
    expected = reference.combine_experts(h, routed, weights, None, shared, cpu_routed, gate)
    plain = reference.combine_experts(h, routed, weights, None, torch.sigmoid(gate) * shared, cpu_routed)
    assert torch.equal(expected, plain)
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    assert torch.allclose(got.float(), expected.float(), rtol=tolerance, atol=tolerance)
    ungated = reference.combine_experts(h, routed, weights, None, shared, cpu_routed)
    assert not torch.allclose(got.float(), ungated.float(), rtol=tolerance, atol=tolerance)


def test_without_shared_expert_or_cpu_share():
    h, routed, weights, _, _ = _inputs(4, 96, torch.float32, seed=5)
    got = triton_combine.combine_experts(h, routed, weights)
    assert torch.allclose(got, reference.combine_experts(h, routed, weights), atol=1e-5)


def test_reference_is_the_weighted_sum_and_the_adds():
    k, hidden = 4, 10
    h, routed, weights, shared, cpu_routed = _inputs(k, hidden, torch.float32, seed=3)
    gpu_rows = torch.tensor([1.0, 0.0, 1.0, 1.0], device=DEVICE)
    routed[1] = math.inf  # the CPU's row: never weighed
    expected = h + shared + cpu_routed + sum(weights[0, j] * routed[j] for j in (0, 2, 3))
    got = reference.combine_experts(h, routed, weights, gpu_rows, shared, cpu_routed)
    assert torch.allclose(got, expected, atol=1e-6)
