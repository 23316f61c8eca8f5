"""Switching a loaded model to another plan's expert cache (issue 24): the slots are rebuilt from the host
records, no checkpoint file is read, and the model then computes and counts as one loaded with that plan."""

import dataclasses

import pytest
import torch

import engine
from engine.checkpoint.safetensors_file import SafetensorsFile
from engine.runtime.placement import Placement, switch_plan
from engine.runtime.planner import GIB, plan_memory
from engine.runtime.footprint import footprint_from_checkpoint

PROMPT = torch.tensor([3, 17, 5, 9, 22, 41, 8, 13, 2, 30])


def _prompt_logits(model):
    state = model.new_state(32)
    logits = model.forward(PROMPT, state)
    return logits, model.expert_executor.stats()


def _decode_logits(model):
    """The logits of two decoded tokens after the prompt, through the model's decode steps."""
    state = model.new_state(32)
    model.forward(PROMPT, state)
    model.forward(torch.tensor([7]), state)
    return model.forward(torch.tensor([11]), state)


@pytest.fixture
def folder(tiny_checkpoint):
    return tiny_checkpoint("qwen3_5_moe", "nvfp4")


def test_a_resized_cache_is_a_cache_loaded_that_size(folder, monkeypatch):
    model = engine.load_model(folder, expert_cache_slots=8)
    before, _ = _prompt_logits(model)

    def no_reading(*args, **kwargs):
        raise AssertionError("the checkpoint was read")

    monkeypatch.setattr(SafetensorsFile, "__init__", no_reading)
    model.expert_executor.resize(16)
    assert model.expert_executor.cache.slots == 16
    resized, resized_stats = _prompt_logits(model)
    monkeypatch.undo()
    fresh, fresh_stats = _prompt_logits(engine.load_model(folder, expert_cache_slots=16))
    assert torch.allclose(resized, before, rtol=0, atol=1e-5) and torch.allclose(resized, fresh, rtol=0, atol=1e-6)
    counted = ("expert_cache_hits", "expert_cache_misses", "expert_bytes_copied")
    assert [resized_stats[k] for k in counted] == [fresh_stats[k] for k in counted]
    assert resized_stats["expert_cache_misses"] > 0


def test_switch_plan_resizes_in_place_or_says_a_reload_is_needed(folder):
    footprint = footprint_from_checkpoint(folder)
    small = plan_memory(
        footprint,
        GIB,
        "custom",
        dict(expert_cache_layers=1, prefill_overlap=False, prefill_chunk_tokens=128, kv_tokens=4096),
    )
    big = dataclasses.replace(small, expert_cache_layers=2, expert_slots=2 * small.expert_slots)
    loaded = Placement("cuda", torch.float32, small, "")
    model = engine.load_model(folder, expert_cache_slots=small.expert_slots)
    _decode_logits(model)  # a decode step planned for the old slots
    assert switch_plan(model, loaded, dataclasses.replace(loaded, plan=big))
    assert model.expert_executor.cache.slots == big.expert_slots
    fresh = engine.load_model(folder, expert_cache_slots=big.expert_slots)
    assert torch.allclose(_decode_logits(model), _decode_logits(fresh), rtol=0, atol=1e-6)
    for other in (
        dataclasses.replace(loaded, kv_cache="fp8", plan=small),
        dataclasses.replace(loaded, dtype=torch.bfloat16),
        Placement("cpu", torch.float32, None, ""),
    ):
        assert not switch_plan(model, loaded, other)
    assert model.expert_executor.cache.slots == big.expert_slots  # a refused switch leaves the cache alone


def test_a_resize_the_gpu_backend_cannot_run_is_refused_before_the_cache_goes(folder):
    model = engine.load_model(folder, expert_cache_slots=64, expert_backend="gpu")
    executor = model.expert_executor
    cache = executor.cache
    with pytest.raises(ValueError, match="the gpu expert backend keeps every expert in VRAM"):
        executor.resize(8)
    assert executor.cache is cache and _prompt_logits(model)[0].isfinite().all()
