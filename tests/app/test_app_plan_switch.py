"""The EngineWorker's plan switch: the loaded model takes another plan's expert cache and KV cache in place, as a job
of the engine queue, without reading its checkpoint again; a plan that needs a reload is refused in words and the
model runs on as it was, as it does after a switch that fails half-way.

Plans are made as on a GPU ("cuda" placements of custom plans) and their models loaded on the CPU with the plan's
expert slots: switch_plan and the sessions do not tell the difference."""

import dataclasses
import weakref

import pytest
import torch
from test_app_worker import recorded, send_and_wait

from app.engine_worker import EngineWorker
from app.settings import load_options
from engine.checkpoint.safetensors_file import SafetensorsFile
from engine.loader import load_model
from engine.runtime import placement
from engine.runtime.footprint import footprint_from_checkpoint
from engine.runtime.placement import Placement
from engine.runtime.planner import GIB, PlanError, plan_memory

SLOTS_PER_LAYER = 8  # the tiny model's experts in each MoE layer
REPLY = {"sampling": {"max_new_tokens": 3, "temperature": 0.0}}


def custom(layers: int, kv_tokens: int) -> dict:
    return dict(expert_cache_layers=layers, prefill_overlap=False, prefill_chunk_tokens=128, kv_tokens=kv_tokens)


@pytest.fixture
def folder(tiny_checkpoint):
    return tiny_checkpoint("qwen3_5_moe", "nvfp4")


@pytest.fixture
def gpu_plans(monkeypatch, folder):
    """plan_placement gives the custom plan the options ask for as a GPU placement; load_placed loads the model on
    the CPU with that plan's expert slots. Returns the plan_placement calls' custom plans."""
    footprint = footprint_from_checkpoint(folder)
    asked = []

    def plan(folder, preset, budget_bytes=None, custom=None, **kwargs):
        asked.append(custom)
        made = plan_memory(footprint, GIB, "custom", custom)
        return Placement("cuda", torch.float32, made, f"GPU mode in a test: {made.summary()}", made.kv_cache)

    def load_cpu(folder, where, pin_budget_bytes=None, **backend):
        return load_model(
            folder,
            "cpu",
            torch.float32,
            expert_cache_slots=where.plan.expert_slots,
            kv_cache_dtype=where.kv_cache,
            pin_budget_bytes=pin_budget_bytes,
            **backend,
        )

    monkeypatch.setattr(placement, "plan_placement", plan)
    monkeypatch.setattr(placement, "load_placed", load_cpu)
    monkeypatch.setattr(EngineWorker, "_check_peak", lambda self: None)  # the GPU's peak: there is no GPU here
    return asked


def options_for(settings, layers: int, kv_tokens: int) -> dict:
    settings.set("preset", "custom")
    settings.set("vram_gib", 1.0)  # a budget of its own: the free VRAM is never read
    settings.set("custom_plan", custom(layers, kv_tokens))
    return load_options(settings)


def switched(qtbot, worker: EngineWorker, options: dict) -> tuple[list, list]:
    """Run worker.switch_plan and wait until it has answered: (planSwitched infos, planSwitchFailed messages)."""
    infos, failures = [], []
    worker.planSwitched.connect(infos.append)
    worker.planSwitchFailed.connect(failures.append)
    try:
        worker.switch_plan(options)
        qtbot.waitUntil(lambda: bool(infos or failures), timeout=60_000)
    finally:
        worker.planSwitched.disconnect(infos.append)
        worker.planSwitchFailed.disconnect(failures.append)
    return infos, failures


def test_a_switch_resizes_the_loaded_model_and_its_context_in_place(qtbot, settings, folder, gpu_plans, monkeypatch):
    worker = EngineWorker()
    seen = recorded(worker)
    worker.load(str(folder), options_for(settings, 1, 4096))
    model, old_session = worker.session.model, weakref.ref(worker.session)
    assert model.expert_executor.cache.slots == SLOTS_PER_LAYER and worker.session.context_tokens == 4096
    finished = []
    worker.replyFinished.connect(finished.append)
    chat = "Tell me about the plan, " * 20
    send_and_wait(qtbot, worker, [], chat, REPLY)
    history = list(worker.session.messages)

    def no_reading(*args, **kwargs):
        raise AssertionError("the checkpoint was read")

    monkeypatch.setattr(SafetensorsFile, "__init__", no_reading)
    times = iter([100.0, 101.5])
    worker.clock = lambda: next(times)
    infos, failures = switched(qtbot, worker, options_for(settings, 2, 2048))
    assert failures == [] and len(infos) == 1
    [info] = infos
    assert worker.session.model is model and model.expert_executor.cache.slots == 2 * SLOTS_PER_LAYER
    assert worker.session.context_tokens == 2048 == info["context_tokens"] == worker.model_info["context_tokens"]
    assert worker.session.prefill_chunk_tokens == 128 and info["context_plan_tokens"] == 2048
    assert info["placement"]["plan"]["expert_slots"] == 2 * SLOTS_PER_LAYER == worker.placement.plan.expert_slots
    assert worker.queue.session is worker.session and worker.server_context.context_tokens == 2048
    assert worker.server_context.worker is worker.queue
    assert old_session() is None  # its KV cache went with it: the worker holds one
    assert (
        "info",
        "switched the plan in place in 1.5 s: expert cache 8 -> 16 slots, context 4,096 -> 2,048 tokens, "
        "prefill chunk 128 -> 128",
    ) in seen["log"]

    send_and_wait(qtbot, worker, history, "And now?", REPLY)  # the chat goes on, its state from the prefix cache
    stats = finished[-1]["stats"]
    assert stats["error"] is None and stats["new_tokens"] > 0
    assert stats["cached_tokens"] > 100 and stats["prefill_tokens"] < stats["prompt_tokens"] - 100


@pytest.mark.parametrize(
    "other, said",
    [
        (lambda p: dataclasses.replace(p, kv_cache="fp8"), "its KV cache is fp8, the loaded model's bf16"),
        (lambda p: Placement("cpu", torch.float32, None, "CPU mode"), "it would run on the CPU"),
    ],
)
def test_a_plan_that_needs_a_reload_is_refused_and_the_model_runs_on(
    qtbot, settings, folder, gpu_plans, monkeypatch, other, said
):
    worker = EngineWorker()
    worker.load(str(folder), options_for(settings, 1, 4096))
    session, slots = worker.session, worker.session.model.expert_executor.cache.slots
    planned = placement.plan_placement
    monkeypatch.setattr(placement, "plan_placement", lambda *args, **kwargs: other(planned(*args, **kwargs)))
    infos, [message] = switched(qtbot, worker, options_for(settings, 2, 2048))
    assert infos == [] and message.startswith("This plan needs the model loaded again: " + said)
    assert "Load the model on the Models page" in message
    assert worker.session is session and worker.queue.session is session
    assert session.model.expert_executor.cache.slots == slots and worker.model_info["context_tokens"] == 4096
    finished = []
    worker.replyFinished.connect(finished.append)
    send_and_wait(qtbot, worker, [], "Still there?", REPLY)
    assert finished[-1]["stats"]["error"] is None and finished[-1]["stats"]["new_tokens"] > 0


def test_a_plan_that_does_not_fit_is_said_and_the_model_runs_on(qtbot, settings, folder, gpu_plans, monkeypatch):
    worker = EngineWorker()
    worker.load(str(folder), options_for(settings, 1, 4096))
    session = worker.session

    def none_fits(*args, **kwargs):
        raise PlanError("the resident weights alone take more than the budget")

    monkeypatch.setattr(placement, "plan_placement", none_fits)
    infos, [message] = switched(qtbot, worker, options_for(settings, 2, 2048))
    assert infos == [] and message.startswith("No VRAM plan fits this model (the resident weights alone")
    assert worker.session is session


def test_a_switch_that_fails_half_way_goes_back_to_the_plan_loaded(qtbot, settings, folder, gpu_plans, monkeypatch):
    worker = EngineWorker()
    seen = recorded(worker)
    worker.load(str(folder), options_for(settings, 1, 4096))
    executor = worker.session.model.expert_executor
    resize, sizes = executor.resize, []

    def out_of_memory_once(slots):
        sizes.append(slots)
        if len(sizes) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (in a test)")
        resize(slots)

    monkeypatch.setattr(executor, "resize", out_of_memory_once)
    infos, [message] = switched(qtbot, worker, options_for(settings, 2, 2048))
    assert infos == [] and sizes == [2 * SLOTS_PER_LAYER, SLOTS_PER_LAYER]  # the loaded plan's cache rebuilt
    assert message.startswith("Switching the plan failed: OutOfMemoryError(") and "the plan it ran before" in message
    assert any(level == "error" and "Traceback" in text for level, text in seen["log"])
    assert worker.session.context_tokens == 4096 and worker.queue.session is worker.session
    assert worker.model_info["placement"]["plan"]["expert_slots"] == SLOTS_PER_LAYER
    finished = []
    worker.replyFinished.connect(finished.append)
    send_and_wait(qtbot, worker, [], "Still there?", REPLY)
    assert finished[-1]["stats"]["error"] is None


def test_without_a_model_a_switch_says_so(qtbot, settings):
    worker = EngineWorker()
    failures = []
    worker.planSwitchFailed.connect(failures.append)
    worker.switch_plan(load_options(settings))
    assert failures == ["No model is loaded: the plan shown applies to the next one loaded."]
