"""Where a model runs: the CPU with a plain reason when no GPU is usable, else the GPU under the preset's plan."""

import pytest
import torch

from engine.runtime import placement as placement_module
from engine.runtime import reserve
from engine.runtime.placement import gpu_status, load_placed, plan_placement


def test_this_cpu_build_runs_on_the_cpu_and_says_why(tiny_checkpoint):
    usable, reason = gpu_status()
    assert not usable and "CPU-only build" in reason  # the CI machine has torch's CPU wheel
    placement = plan_placement(tiny_checkpoint("qwen3_5_moe", "nvfp4"), "4gb")
    assert placement.device == "cpu" and placement.plan is None
    assert placement.note.startswith("CPU mode:") and "CPU-only build" in placement.note


def test_choosing_the_cpu_in_the_settings_is_said_as_such(tiny_checkpoint):
    placement = plan_placement(tiny_checkpoint("qwen3_5_moe", "nvfp4"), "4gb", device="cpu")
    assert placement.device == "cpu" and "chosen in the settings" in placement.note


@pytest.mark.parametrize("capability, dtype", [((8, 6), torch.bfloat16), ((7, 5), torch.float16)])
def test_a_usable_gpu_gets_the_presets_plan(tiny_checkpoint, monkeypatch, capability, dtype):
    monkeypatch.setattr(placement_module, "gpu_status", lambda: (True, "Test GPU"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(reserve, "note_card_baseline", lambda: None)
    measured = reserve.measured_reserve(400 * 2**20, "Test GPU", others_included=False)
    monkeypatch.setattr(reserve, "runtime_reserve", lambda device="cuda": measured)
    placement = plan_placement(tiny_checkpoint("qwen3_5_moe", "nvfp4"), "4gb")
    assert placement.device == "cuda" and placement.dtype == dtype
    assert placement.plan.budget_bytes == 4 * 2**30
    assert placement.plan.breakdown["runtime_reserve"] == measured.reserve_bytes
    assert placement.note.startswith("GPU mode on Test GPU") and placement.to_dict()["plan"]["preset"] == "4gb"
    assert placement.plan.reserve_source == "measured on Test GPU" and "measured on Test GPU" in placement.note


def test_load_placed_on_the_cpu_uses_the_reference_experts(tiny_checkpoint):
    folder = tiny_checkpoint("qwen3_5_moe", "nvfp4")
    model = load_placed(folder, plan_placement(folder, "4gb"))
    assert model.device.type == "cpu" and "expert_cache_slots" not in model.expert_executor.stats()
