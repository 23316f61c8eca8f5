"""The EngineWorker's load, its slot called directly on the test's thread: the expert backend, CPU threads and restore
points from the settings reach the engine, a backend that cannot run is refused in words, the backend that runs is
logged, a loaded model is frozen out of the garbage collector's passes until it is dropped, and the runtime reserve is
measured on a usable GPU and the reference card's estimate otherwise."""

import gc
import weakref

import pytest
import torch

from app.engine_worker import EngineWorker
from app.settings import load_options
from engine.experts.calibration import Calibration
from engine.experts.policy import BackendTrial
from engine.loader import load_model
from engine.runtime import placement, reserve
from engine.runtime.planner import DEFAULT_RESERVE_SOURCE, DEFAULT_RUNTIME_RESERVE_BYTES
from engine.runtime.session import DEFAULT_MAX_SNAPSHOTS
from engine.runtime.state_files import SUFFIX

ONE_LAYER_OF_SLOTS = 8  # the tiny model has 8 experts in each of its 4 MoE layers


@pytest.fixture
def folder(tiny_checkpoint):
    return tiny_checkpoint("qwen3_5_moe", "nvfp4")


@pytest.fixture
def cpu_only(monkeypatch):
    monkeypatch.setattr(placement, "gpu_status", lambda: (False, "no GPU in this test"))
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # the worker sets torch's threads from the setting


@pytest.fixture
def loads(monkeypatch, cpu_only):
    """load_placed's keyword arguments, one dict per call. The model loads on the CPU with an expert cache of one
    layer, so the real CachedExpertExecutor runs, and refuses the gpu backend, without a GPU."""
    calls = []

    def load_cached(folder, where, pin_budget_bytes=None, **backend):
        calls.append({"pin_budget_bytes": pin_budget_bytes, **backend})
        return load_model(
            folder,
            "cpu",
            torch.float32,
            expert_cache_slots=ONE_LAYER_OF_SLOTS,
            pin_budget_bytes=pin_budget_bytes,
            **backend,
        )

    monkeypatch.setattr(placement, "load_placed", load_cached)
    return calls


def recorded(worker: EngineWorker) -> dict:
    seen = {"log": [], "loaded": [], "failed": [], "busy": []}
    worker.log.connect(lambda level, text: seen["log"].append((level, text)))
    worker.loaded.connect(seen["loaded"].append)
    worker.loadFailed.connect(seen["failed"].append)
    worker.busyChanged.connect(seen["busy"].append)
    return seen


def send_and_wait(qtbot, worker: EngineWorker, history: list, text: str, options: dict) -> None:
    """worker.send, which queues the turn for the engine's thread; returns once that turn has ended (its signals
    reach this thread through its event loop, which the wait runs)."""
    with qtbot.waitSignal(worker.busyChanged, check_params_cb=lambda busy: not busy, timeout=60_000):
        worker.send(history, text, options)


def backend_lines(seen: dict) -> list[str]:
    return [text for _, text in seen["log"] if text.startswith("expert backend")]


def test_the_settings_reach_load_placed(settings, folder, loads):
    worker = EngineWorker()
    seen = recorded(worker)
    worker.load(str(folder), load_options(settings))
    assert loads == [{"pin_budget_bytes": None, "expert_backend": "auto", "cpu_threads": None}]  # 0: the cores
    assert len(seen["loaded"]) == 1 and backend_lines(seen) == ["expert backend: offload (chosen by auto)"]

    settings.set("expert_backend", "offload")
    settings.set("cpu_threads", 1)
    settings.set("pin_budget_gib", 0.5)
    worker.load(str(folder), load_options(settings))
    assert loads[-1] == {"pin_budget_bytes": 2**29, "expert_backend": "offload", "cpu_threads": 1}
    assert len(seen["loaded"]) == 2 and backend_lines(seen)[-1] == "expert backend: offload"


def test_the_session_keeps_the_restore_points_the_settings_ask_for(settings, folder, cpu_only):
    worker = EngineWorker()
    worker.load(str(folder), load_options(settings))
    assert worker.session.max_snapshots == DEFAULT_MAX_SNAPSHOTS

    settings.set("turn_snapshots", 3)
    worker.load(str(folder), load_options(settings))
    assert worker.session.max_snapshots == 3
    assert worker.model_info["snapshot_bytes"] == worker.session.snapshot_bytes > 0  # the Settings page's cost


def test_a_gpu_backend_that_does_not_fit_is_refused_in_words(settings, folder, loads):
    settings.set("expert_backend", "gpu")
    worker = EngineWorker()
    seen = recorded(worker)
    worker.load(str(folder), load_options(settings))
    [message] = seen["failed"]
    assert message.startswith(
        "The model cannot run with the expert backend “gpu”: the gpu expert backend keeps "
        "every expert in VRAM: 4 layers of slots, but the cache holds 1"
    )
    assert "Choose another expert backend in Settings" in message and "a bigger VRAM preset" in message
    assert "Traceback" not in message and seen["log"][-1][0] == "error"
    assert worker.session is None and not seen["loaded"] and seen["busy"] == [True, False]

    settings.set("expert_backend", "auto")  # the user's next choice loads: the worker lives on
    worker.load(str(folder), load_options(settings))
    assert len(seen["loaded"]) == 1 and worker.session is not None


@pytest.mark.parametrize("pageable, said", [(None, ""), (4.1e9, " (4.1 GB/s from unpinned RAM)")])
def test_the_measured_bandwidths_are_logged_once(settings, folder, loads, monkeypatch, pageable, said):
    load_cached = placement.load_placed

    def load_calibrated(*args, **kwargs):  # what a GPU machine's calibration leaves in the executor
        model = load_cached(*args, **kwargs)
        model.expert_executor.calibration = Calibration(12.5e9, 31.3e9, 2e-5, 8, pageable)
        model.expert_executor.backend = "hybrid"
        return model

    monkeypatch.setattr(placement, "load_placed", load_calibrated)
    worker = EngineWorker()
    seen = recorded(worker)
    worker.load(str(folder), load_options(settings))
    assert backend_lines(seen) == [
        f"expert backend: hybrid (chosen by auto); measured PCIe 12.5 GB/s{said}, CPU 31.3 GB/s with 8 threads"
    ]


def test_auto_s_trial_is_said_at_load_and_its_choice_once(qtbot, settings, folder, loads, monkeypatch):
    load_cached = placement.load_placed

    def load_on_trial(*args, **kwargs):  # a GPU machine where the calibration favours the CPU: auto times both
        model = load_cached(*args, **kwargs)
        model.expert_executor.calibration = Calibration(12.5e9, 31.3e9, 2e-5, 8)
        model.expert_executor.backend_trial = BackendTrial(("hybrid", "cpu", "offload"))
        return model

    monkeypatch.setattr(placement, "load_placed", load_on_trial)
    worker = EngineWorker()
    seen = recorded(worker)
    worker.load(str(folder), load_options(settings))
    assert backend_lines(seen) == [
        "expert backend: auto: whichever of cpu, hybrid, offload decodes fastest over "
        "the first tokens; measured PCIe 12.5 GB/s, CPU 31.3 GB/s with 8 threads"
    ]
    options = {"sampling": {"max_new_tokens": 2, "seed": 1}}
    send_and_wait(qtbot, worker, [], "Hi", options)
    assert len(backend_lines(seen)) == 1  # still timing: nothing chosen to say
    trial = worker.session.model.expert_executor.backend_trial
    trial.seconds, trial.chosen = {"hybrid": [0.0084], "cpu": [0.0071], "offload": [0.0076]}, "cpu"
    for text in ("Hi again", "And again"):
        send_and_wait(qtbot, worker, worker.session.messages, text, options)
    assert backend_lines(seen)[1:] == [
        "expert backend: auto chose cpu by the median decode step (cpu 7.1 ms, hybrid 8.4 ms, offload 7.6 ms)"
    ]


def test_a_cpu_only_run_logs_no_backend(settings, folder, cpu_only):
    worker = EngineWorker()
    seen = recorded(worker)
    worker.load(str(folder), load_options(settings))
    assert len(seen["loaded"]) == 1 and backend_lines(seen) == []
    assert "expert_backend" not in worker._runtime_measures(worker.session)


def collectable(obj) -> bool:
    return any(tracked is obj for generation in range(3) for tracked in gc.get_objects(generation))


def held_by_a_cycle(obj) -> weakref.ref:
    """Tie `obj` into a reference cycle (only the collector frees those, refcounts never do); a weak reference to it."""
    cycle = [obj]
    cycle.append(cycle)
    return weakref.ref(obj)


def test_a_loaded_model_is_frozen_until_it_is_dropped(settings, folder, cpu_only):
    worker = EngineWorker()
    worker.load(str(folder), load_options(settings))
    assert gc.get_freeze_count() > 0 and not collectable(worker.session.model)  # no pass mid-reply walks the model
    first = held_by_a_cycle(worker.session.model)

    worker.load(str(folder), load_options(settings))  # the next model: the first is collected, cycle and all
    assert first() is None and not collectable(worker.session.model)

    second = held_by_a_cycle(worker.session.model)
    worker.unload()
    assert second() is None and gc.get_freeze_count() == 0


def measured_by(worker: EngineWorker) -> list[dict]:
    found = []
    worker.reserveMeasured.connect(found.append)
    worker.measure_reserve()
    return found


def test_without_a_usable_gpu_the_reserve_is_the_reference_estimate(cpu_only):
    worker = EngineWorker()
    seen = recorded(worker)
    [found] = measured_by(worker)
    assert found["gpu_usable"] is False and found["gpu_status"] == "no GPU in this test"
    assert found["measured"] is False and found["reserve_bytes"] == DEFAULT_RUNTIME_RESERVE_BYTES
    assert found["source"] == DEFAULT_RESERVE_SOURCE
    assert seen["log"] == [("info", f"runtime reserve 688 MiB: {DEFAULT_RESERVE_SOURCE}")]


def test_on_a_usable_gpu_the_worker_emits_the_measured_reserve(monkeypatch):
    measured = reserve.measured_reserve(700 * 2**20, "NVIDIA Test", others_included=False)
    monkeypatch.setattr(placement, "gpu_status", lambda: (True, "NVIDIA Test"))
    monkeypatch.setattr(reserve, "runtime_reserve", lambda device="cuda": measured)
    worker = EngineWorker()
    seen = recorded(worker)
    [found] = measured_by(worker)
    assert found == dict(measured.to_dict(), gpu_usable=True, gpu_status="NVIDIA Test")
    size = f"{measured.reserve_bytes // 2**20:,} MiB"
    assert seen["log"] == [("info", f"runtime reserve {size}: measured on NVIDIA Test")]


def test_a_gpu_that_cannot_be_read_leaves_the_estimate_and_the_reason(monkeypatch):
    def broken():
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(placement, "gpu_status", broken)
    worker = EngineWorker()
    seen = recorded(worker)
    [found] = measured_by(worker)
    assert found["gpu_usable"] is False and "CUDA driver initialization failed" in found["gpu_status"]
    assert found["source"] == DEFAULT_RESERVE_SOURCE
    assert seen["log"][0][0] == "error" and "Traceback" in seen["log"][0][1]


def test_the_loaded_models_footprint_is_read_on_the_worker_for_the_engine_page(settings, folder, cpu_only):
    from engine.runtime.footprint import footprint_from_checkpoint

    worker = EngineWorker()
    worker.load(str(folder), load_options(settings))
    assert worker.model_info["footprint"] == footprint_from_checkpoint(folder)


def test_a_chat_returned_to_resumes_without_prefilling_its_history(qtbot, settings, folder, cpu_only):
    """The window's chat A, then chat B, then A again: A's next turn starts from A's saved state (the prefix cache
    the API shares), so it prefills far less than its whole prompt; unloading writes the states to disk."""
    worker = EngineWorker()
    finished = []
    worker.replyFinished.connect(finished.append)
    worker.load(str(folder), load_options(settings))
    options = {"sampling": {"max_new_tokens": 3, "temperature": 0.0}}
    send_and_wait(qtbot, worker, [], "Tell me about chat A, " * 20, options)
    chat_a = list(worker.session.messages)
    send_and_wait(qtbot, worker, [], "Chat B here", options)
    send_and_wait(qtbot, worker, chat_a, "More about A", options)
    resumed = finished[-1]["stats"]
    assert resumed["error"] is None
    assert resumed["cached_tokens"] > 100 and resumed["prefill_tokens"] < resumed["prompt_tokens"] - 100
    spill = worker.states.spill
    worker.unload()
    assert len(spill) >= 1 and len(list(spill.folder.glob("*" + SUFFIX))) == len(spill)
