"""The VRAM cap's arithmetic, with CUDA's answers stood in for (no GPU here; gpu_tests/ and the bench run it
for real): the allocator gets the budget less what lies outside it, and the measured peak adds that back.
The reserve here is the planner's formula for the H200 (tests/engine/runtime/test_reserve.py covers the measured one)."""

from types import SimpleNamespace

import pytest
import torch

from engine.runtime import reserve, vram
from engine.runtime.planner import MIB, RESERVE_INSIDE_ALLOCATOR_BYTES, cublas_workspaces_bytes, runtime_reserve_bytes

GIB = 2**30
H200 = SimpleNamespace(
    name="NVIDIA H200",
    total_memory=140 * GIB,
    multi_processor_count=132,
    max_threads_per_multi_processor=2048,
    major=9,
)


@pytest.fixture
def fake_cuda(monkeypatch):
    calls = {}
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: H200)
    monkeypatch.setattr(
        reserve, "runtime_reserve", lambda device="cuda": reserve.formula_estimate(torch.device("cuda", 0), "a test")
    )
    monkeypatch.setattr(
        torch.cuda,
        "set_per_process_memory_fraction",
        lambda fraction, device=None: calls.update(fraction=fraction, device=device),
    )
    return calls


def test_the_allocator_gets_the_budget_less_the_outside_estimate(fake_cuda):
    cap = vram.cap_process_memory(4 * GIB)
    outside = runtime_reserve_bytes(132, 2048, 9) - RESERVE_INSIDE_ALLOCATOR_BYTES - cublas_workspaces_bytes(9)
    assert cap.outside_estimate_bytes == outside == (544 + 24 + 264) * MIB  # context, decode graphs, local memory
    assert cap.allocator_limit_bytes == 4 * GIB - outside
    assert fake_cuda["fraction"] == pytest.approx(cap.allocator_limit_bytes / H200.total_memory)
    assert fake_cuda["device"] == torch.device("cuda", 0)


@pytest.mark.parametrize("budget, words", [(200 * GIB, "cannot be held"), (512 * MIB, "outside PyTorch's allocator")])
def test_impossible_limits_are_refused(fake_cuda, budget, words):
    with pytest.raises(ValueError, match=words):
        vram.cap_process_memory(budget)
    assert "fraction" not in fake_cuda


def test_the_measured_peak_adds_what_lies_outside_the_allocator(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (136 * GIB, 140 * GIB))  # 4 GiB in use
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * GIB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: int(3.25 * GIB))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: int(3.1 * GIB))
    peak = vram.measured_peak()
    assert peak["outside_allocator_bytes"] == 1 * GIB
    assert peak["peak_process_bytes"] == int(4.25 * GIB)
    assert peak["peak_allocated_bytes"] == int(3.1 * GIB)
