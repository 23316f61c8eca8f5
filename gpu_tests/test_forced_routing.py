"""Forced routings on the GPU: captured decode graphs replay each step's new ids, and at every preset the
worst-case routings of a chunk stay within the plan's budget on the full-size model."""

import json
import subprocess
import sys

import pytest
import torch

import engine
from engine.experts.routing import force_routing

FP32_TOLERANCE = 1e-3  # as test_gpu_runtime.py: summation order only
WORST_CASES = "same,distinct,uniform"


@pytest.mark.parametrize("mode", ["uniform", "locality", "fixed"])
def test_graphed_steps_follow_the_forced_routing_like_the_plain_forward(tiny_checkpoint, mode):
    folder = tiny_checkpoint("qwen3_5_moe", "nvfp4")
    graphed = engine.load_model(folder, device="cuda", expert_cache_slots=8)
    plain = engine.load_model(folder, device="cuda", expert_cache_slots=8)
    plain.decode_runner = None
    assert graphed.decode_runner is not None
    routings = force_routing(graphed, mode, seed=3), force_routing(plain, mode, seed=3)
    states = graphed.new_state(80), plain.new_state(80)
    prompt = torch.randint(2, 320, (40,), generator=torch.Generator().manual_seed(8))
    graphed.forward(prompt, states[0])
    plain.forward(prompt, states[1])
    token = 5
    for _ in range(12):
        for routing in routings:
            routing.advance()
        assert torch.equal(routings[0].step_ids.cpu(), routings[1].step_ids.cpu())
        got, expected = graphed.forward([token], states[0]), plain.forward([token], states[1])
        error = float((got.float().cpu() - expected.cpu()).abs().max() / expected.abs().max())
        assert error <= FP32_TOLERANCE
        token = int(expected.argmax())
    assert graphed.decode_runner.graphs


@pytest.mark.parametrize("preset", ["4gb", "8gb", "12gb"])
def test_worst_case_routing_stays_within_the_preset(preset):
    """Prefill and decode of the full-size real-layout model under every chunk worst case: no out-of-memory,
    and the measured peak within the budget."""
    command = [
        sys.executable,
        "-m",
        "engine",
        "bench",
        "--synthetic",
        "qwen3.6-35b-a3b-nvfp4",
        "--preset",
        preset,
        "--routing",
        WORST_CASES,
        "--prompt-tokens",
        "4096",
        "--decode-tokens",
        "8",
        "--json",
    ]
    # the bench reads what lies outside its allocator from the card's free memory, so what this process
    # (CUDA started by earlier tests) holds on the card is counted in its peak: take it back out
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    others = total - free
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert [row["routing"] for row in result["runs"]] == WORST_CASES.split(",")
    for row in result["runs"]:
        assert "error" not in row, row
        assert row["peak_process_bytes"] - others <= result["plan"]["budget_bytes"], (row, others)
