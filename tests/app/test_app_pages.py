"""The Models, Engine, Settings and Logs pages and the gauges, driven offscreen with pytest-qt.

A FakeWorker stands in for the EngineWorker: it has the same signals, and its `load` slot only
records the call, so no model is loaded and every test runs in milliseconds.
"""

import json
import re

import pytest
from app_fakes import FakeWorker
from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication

from app import system_info
from app.model_library import scan_library
from app.pages.engine_page import NOT_MEASURED, EnginePage
from app.pages.logs import LogsPage
from app.pages.models import COLUMNS, ModelsPage
from app.pages.settings_page import EXPERT_BACKENDS, SettingsPage
from app.settings import load_options
from app.widgets.gauges import Sparkline, SystemFooter
from app.widgets.plan_bar import PlanBar
from engine.experts.backend import BACKENDS
from engine.runtime import reserve
from engine.runtime.decode_estimate import estimate_decode
from engine.runtime.footprint import footprint_from_checkpoint, footprint_from_synthetic
from engine.runtime.planner import GIB, plan_memory
from engine.runtime.session import DEFAULT_MAX_SNAPSHOTS
from engine.testing.tiny_checkpoints import write_tiny_checkpoint

SYNTHETIC = "qwen3.6-35b-a3b-nvfp4"


@pytest.fixture
def worker():
    return FakeWorker()


@pytest.fixture(autouse=True)
def empty_hf_cache(tmp_path, monkeypatch):
    """The library never scans the real Hugging Face cache of the machine running the tests."""
    hub = tmp_path / "hub"
    hub.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    return hub


@pytest.fixture(autouse=True)
def no_demo_model(tmp_path, monkeypatch):
    """Library rows are only what each test puts there; test_library_lists_the_demo_model checks the demo."""
    monkeypatch.setattr("app.model_library.DEMO_MODEL", tmp_path / "no-demo-model")


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(system_info, "gpu_memory", lambda: None)


@pytest.fixture
def engine_page(qtbot, worker, settings, no_gpu):
    page = EnginePage(worker, settings)
    qtbot.addWidget(page)
    return page


@pytest.fixture
def tiny_model(tmp_path):
    return write_tiny_checkpoint(tmp_path / "m", "qwen3_5_moe", "nvfp4")


# ---- plan bar and gauges ---------------------------------------------------------------------------


def test_plan_bar_shows_each_part_of_a_plan(qtbot):
    plan = plan_memory(footprint_from_synthetic(SYNTHETIC), 4 * GIB, "4gb").to_dict()
    bar = PlanBar()
    qtbot.addWidget(bar)
    bar.resize(600, 120)
    bar.set_plan(plan, 4 * GIB)
    keys = [key for key, _, _ in bar.parts()]
    assert keys == [
        "resident_weights",
        "expert_cache",
        "kv_cache",
        "gdn_state",
        "prefill_workspace",
        "runtime_reserve",
        "free",
    ]
    sizes = dict((key, n) for key, _, n in bar.parts())
    assert sizes["free"] == plan["headroom_bytes"]
    assert "KV cache  990.0 MiB" in bar.legend_texts()
    assert "expert cache  435.0 MiB" in bar.legend_texts()
    assert bar.bar.part_at(1) == "resident_weights"  # the largest part starts the bar
    assert "4.00 GiB planned of a 4.00 GiB budget" in bar.total_label.text()

    bar.set_plan(None, 4 * GIB)
    assert bar.parts() == [] and bar.legend_texts() == []
    assert not bar.total_label.isVisibleTo(bar)


def test_sparkline_keeps_the_last_values(qtbot):
    line = Sparkline(capacity=60)
    qtbot.addWidget(line)
    for value in range(100):
        line.add_value(value)
    assert line.values() == [float(v) for v in range(40, 100)]
    line.grab()  # paints without error


@pytest.mark.skipif(system_info.gpu_memory() is not None, reason="this machine has an NVIDIA GPU")
def test_footer_says_cpu_mode_and_shows_ram(qtbot):
    footer = SystemFooter()
    qtbot.addWidget(footer)
    assert footer.gpu_label.text() == "no NVIDIA GPU: CPU mode"
    assert footer.vram_bar.value_label.text() == "none"
    assert re.fullmatch(r"\d+\.\d / \d+\.\d GiB", footer.ram_bar.value_label.text())
    assert footer.timer.isActive() and footer.timer.interval() == 2000


def test_footer_shows_the_gpu_it_reads(qtbot):
    gpu = {"name": "NVIDIA GeForce RTX 2050", "total_bytes": 4 * GIB, "used_bytes": GIB, "free_bytes": 3 * GIB}
    footer = SystemFooter(read_gpu=lambda: gpu, read_ram=lambda: {"total_bytes": 16 * GIB, "used_bytes": 6 * GIB})
    qtbot.addWidget(footer)
    assert footer.gpu_label.text() == "NVIDIA GeForce RTX 2050"
    assert footer.vram_bar.value_label.text() == "1.0 / 4.0 GiB"
    assert footer.ram_bar.value_label.text() == "6.0 / 16.0 GiB"
    assert footer.vram_bar.bar.value() == 250


# ---- engine page -----------------------------------------------------------------------------------


def test_switching_preset_changes_the_plan(qtbot, engine_page, settings):
    assert "synthetic" in engine_page.model_label.text()
    layers = []
    for preset in ("4gb", "8gb", "12gb"):
        with qtbot.waitSignal(engine_page.planChanged) as emitted:
            engine_page.set_preset(preset)
        layers.append(emitted.args[0]["expert_cache_layers"])
        assert engine_page.plan()["budget_bytes"] == int(preset.removesuffix("gb")) * GIB
        assert settings.get("preset") == preset
    assert layers[0] == 1 and 2 < layers[1] < layers[2]  # chat, the default use, spends memory on the cache
    assert engine_page.detail_labels["expert_cache"].text().startswith(f"{layers[2]} layers × 256 experts")
    assert engine_page.detail_labels["max_prompt"].text().startswith("32,768 tokens")
    assert engine_page.detail_labels["rules"].text().endswith("memory for chat")
    assert not engine_page.error_label.isVisibleTo(engine_page)
    assert not engine_page.custom_editor.isVisibleTo(engine_page)


def test_the_memory_use_trades_cache_layers_for_prompt_length(qtbot, engine_page, settings):
    """Both uses say what they give before one is chosen; the choice replans and is saved for the next load."""
    engine_page.set_preset("8gb")
    labels = [engine_page.use_combo.itemText(i) for i in range(engine_page.use_combo.count())]
    assert labels[0].startswith("Chat: 32,768-token prompts, ") and "cache layers" in labels[0]
    assert labels[1].startswith("Long context: ") and ", 2 cache layers, ~" in labels[1]
    chat_layers = engine_page.plan()["expert_cache_layers"]
    with qtbot.waitSignal(engine_page.planChanged) as emitted:
        engine_page.set_use("long-context")
    plan = emitted.args[0]
    assert plan["use"] == "long-context" and plan["expert_cache_layers"] == 2 < chat_layers
    assert plan["max_prompt_tokens"] > 32768 and f"{plan['max_prompt_tokens']:,}-token prompts" in labels[1]
    assert settings.get("plan_use") == "long-context" and load_options(settings)["plan_use"] == "long-context"
    engine_page.set_preset("custom")
    assert not engine_page.use_combo.isEnabled()


def test_each_use_says_its_expected_decode_speed_and_what_that_assumes(engine_page):
    """The figure beside each use is the engine's estimate for its plan, chat's cache faster than long context's,
    and its tooltip says it is an estimate and what for."""
    engine_page.set_preset("8gb")
    footprint = footprint_from_synthetic(SYNTHETIC)
    speeds = {}
    for index in range(engine_page.use_combo.count()):
        use = engine_page.use_combo.itemData(index)
        plan = plan_memory(footprint, 8 * GIB, "8gb", use=use)
        expected = estimate_decode(plan, footprint)
        label = engine_page.use_combo.itemText(index)
        assert label.endswith(f"{plan.expert_cache_layers} cache layers, ~{expected.tokens_per_s:.0f} tok/s expected")
        speeds[use] = int(re.search(r"~(\d+) tok/s", label).group(1))
        tip = engine_page.use_combo.itemData(index, Qt.ItemDataRole.ToolTipRole)
        assert "an estimate of decode speed, not a measurement" in tip and "offload backend" in tip
        assert expected.card in tip and f"hits {expected.hit_rate:.0%}" in tip
    assert speeds["chat"] > speeds["long-context"]
    assert "an estimate of decode speed" in engine_page.use_combo.toolTip()  # the use shown, on the closed combo


def test_a_plan_other_than_the_loaded_models_says_it_applies_at_the_next_load(engine_page, worker):
    engine_page.set_preset("8gb")
    running = engine_page.plan()
    worker.loaded.emit({"placement": {"device": "cuda", "plan": running}})
    assert not engine_page.next_load_note.isVisibleTo(engine_page)
    engine_page.set_use("long-context")
    assert engine_page.next_load_note.isVisibleTo(engine_page)
    layers = running["expert_cache_layers"]
    assert f"loaded with ({layers} cache layers, 32,768-token prompts); load it again" in (
        engine_page.next_load_note.text()
    )
    engine_page.set_use("chat")
    assert not engine_page.next_load_note.isVisibleTo(engine_page)
    engine_page.set_use("long-context")
    worker.unloaded.emit()
    assert not engine_page.next_load_note.isVisibleTo(engine_page)
    engine_page.set_use("chat")


def on_a_gpu(engine_page, worker) -> None:
    """The worker has found a usable GPU: the page plans for it, out of CPU mode."""
    measured = reserve.measured_reserve(900 * 2**20, "NVIDIA H200", others_included=False)
    worker.reserveMeasured.emit(dict(measured.to_dict(), gpu_usable=True, gpu_status="NVIDIA H200"))


def test_a_plan_the_loaded_model_can_take_in_place_is_applied_now(qtbot, engine_page, worker):
    on_a_gpu(engine_page, worker)
    engine_page.set_preset("8gb")
    running = engine_page.plan()
    worker.loaded.emit({"placement": {"device": "cuda", "plan": running}, "context_tokens": 32768})
    assert not engine_page.apply_button.isVisibleTo(engine_page)
    engine_page.set_use("long-context")
    note, button = engine_page.next_load_note, engine_page.apply_button
    assert note.isVisibleTo(engine_page) and button.isVisibleTo(engine_page) and button.isEnabled()
    assert "applies now, without reloading the weights" in note.text() and "load it again" not in note.text()
    with qtbot.waitSignal(engine_page.switchRequested):
        button.click()
    assert not button.isEnabled() and note.text().startswith("Switching the loaded model to this plan")
    worker.planSwitched.emit({"placement": {"device": "cuda", "plan": engine_page.plan()}, "context_tokens": 65536})
    assert not note.isVisibleTo(engine_page) and not button.isVisibleTo(engine_page)
    assert engine_page.live.context_label.text() == "0 / 65,536"  # the gauges follow the new context
    engine_page.set_use("chat")  # the plan it was loaded with is now the other one
    assert button.isVisibleTo(engine_page) and button.isEnabled()


def test_a_switch_the_worker_refuses_is_said_until_another_plan_is_shown(qtbot, engine_page, worker):
    on_a_gpu(engine_page, worker)
    engine_page.set_preset("8gb")
    worker.loaded.emit({"placement": {"device": "cuda", "plan": engine_page.plan()}, "context_tokens": 32768})
    engine_page.set_use("long-context")
    engine_page.apply_button.click()
    worker.planSwitchFailed.emit("This plan needs the model loaded again: its KV cache is fp8.")
    note, button = engine_page.next_load_note, engine_page.apply_button
    assert note.text() == "This plan needs the model loaded again: its KV cache is fp8."
    assert note.isVisibleTo(engine_page) and not button.isVisibleTo(engine_page)
    engine_page.set_preset("12gb")
    assert button.isVisibleTo(engine_page) and button.isEnabled() and "applies now" in note.text()


def test_apply_now_is_offered_only_where_a_switch_in_place_can_run(engine_page, worker, monkeypatch):
    engine_page.set_preset("8gb")
    running = engine_page.plan()
    worker.loaded.emit({"placement": {"device": "cuda", "plan": running}})
    engine_page.set_use("long-context")
    note, button = engine_page.next_load_note, engine_page.apply_button
    assert note.isVisibleTo(engine_page) and not button.isVisibleTo(engine_page)  # CPU mode: no GPU plan runs
    on_a_gpu(engine_page, worker)
    assert button.isVisibleTo(engine_page)
    worker.loaded.emit({"placement": {"device": "cuda", "plan": dict(running, kv_cache="fp8")}})
    assert not button.isVisibleTo(engine_page) and "load it again to run this one" in note.text()
    worker.loaded.emit({"placement": {"device": "cuda", "plan": dict(running, model="another model")}})
    assert not button.isVisibleTo(engine_page)
    worker.loaded.emit({"placement": {"device": "cuda", "plan": running}})
    engine_page.budget_spin.setValue(6.0)
    assert button.isVisibleTo(engine_page)
    engine_page.budget_spin.setValue(0.0)
    gpu = {"name": "NVIDIA H200", "total_bytes": 8 * GIB, "used_bytes": 2 * GIB, "free_bytes": 6 * GIB}
    monkeypatch.setattr(system_info, "gpu_memory", lambda: gpu)
    engine_page.set_preset("auto")  # its budget is the free VRAM, which lacks what the loaded model holds
    assert engine_page.plan() and note.isVisibleTo(engine_page) and not button.isVisibleTo(engine_page)


def test_budget_override_changes_kv_tokens(engine_page, settings):
    engine_page.set_preset("8gb")
    layers_at_8 = engine_page.plan()["expert_cache_layers"]
    engine_page.set_use("long-context")
    kv_at_8 = engine_page.plan()["kv_tokens"]
    engine_page.budget_spin.setValue(6.0)
    assert engine_page.plan()["budget_bytes"] == 6 * GIB
    assert engine_page.plan()["kv_tokens"] < kv_at_8
    engine_page.set_use("chat")  # a chat keeps its 32K-token prompt and gives up cache layers
    assert engine_page.plan()["expert_cache_layers"] < layers_at_8 and engine_page.plan()["kv_tokens"] == 33792
    engine_page.set_use("long-context")
    assert engine_page.detail_labels["kv_cache"].text().startswith(f"{engine_page.plan()['kv_tokens']:,} tokens")
    assert settings.get("vram_gib") == 6.0


def test_custom_plan_that_does_not_fit_shows_the_reason(qtbot, engine_page, settings):
    engine_page.budget_spin.setValue(4.0)
    engine_page.set_preset("custom")
    assert engine_page.custom_editor.isVisibleTo(engine_page)
    assert engine_page.plan()["policy"] == "custom"  # the default custom plan fits 4 GiB
    with qtbot.waitSignal(engine_page.planChanged) as emitted:
        engine_page.custom_editor.layers_spin.setValue(10)
    assert emitted.args == [{}] and engine_page.plan() == {}
    assert engine_page.error_label.isVisibleTo(engine_page)
    assert "lower expert_cache_layers to at most 3" in engine_page.error_label.text()  # NVFP4 head: room for 3
    assert engine_page.plan_bar.parts() == []
    assert engine_page.custom_editor.layers_cost.text() == "4.25 GiB (2,560 slots)"
    assert settings.get("custom_plan")["expert_cache_layers"] == 10

    engine_page.custom_editor.layers_spin.setValue(1)
    engine_page.custom_editor.overlap_check.setChecked(True)
    assert "needs at least 2 expert-cache layers" in engine_page.error_label.text()


def test_auto_needs_a_budget_without_a_gpu_and_uses_free_vram_with_one(engine_page, monkeypatch):
    monkeypatch.setattr(system_info, "gpu_memory", lambda: None)
    engine_page.set_preset("8gb")
    engine_page.set_preset("auto")
    assert engine_page.plan() == {}
    uses = [engine_page.use_combo.itemText(i) for i in range(engine_page.use_combo.count())]
    assert uses == ["Chat", "Long context"]  # no plan, so no 8gb figures beside them
    assert not engine_page.error_label.isVisibleTo(engine_page)  # no GPU is CPU mode, a normal state: no red error
    assert engine_page.mode_label.text().startswith("CPU mode: the plan is not used.")
    assert "set a VRAM budget" in engine_page.budget_note.text()
    engine_page.budget_spin.setValue(16.0)
    assert engine_page.plan()["policy"] == "12gb" and engine_page.plan()["expert_cache_layers"] > 2
    assert "chose the 12 GB rules" in engine_page.detail_labels["rules"].text()

    assert "what a card of this budget would get" in engine_page.mode_label.text()

    gpu = {"name": "RTX 3060", "total_bytes": 12 * GIB, "used_bytes": GIB, "free_bytes": 11 * GIB}
    monkeypatch.setattr(system_info, "gpu_memory", lambda: gpu)
    engine_page.budget_spin.setValue(0.0)
    assert engine_page.plan()["budget_bytes"] == 11 * GIB
    assert "free memory of RTX 3060" in engine_page.budget_note.text()
    assert not engine_page.mode_label.isVisibleTo(engine_page)  # GPU mode: the plan is the one used


def test_auto_counts_what_the_loaded_model_holds_as_free(engine_page, worker, monkeypatch):
    """The card's free memory lacks what the loaded model's allocator holds, which a plan replacing the model's
    gets: Auto's budget adds it, as the worker reports it at load and after each reply, until the model goes."""
    gpu = {"name": "RTX 3060", "total_bytes": 16 * GIB, "used_bytes": 10 * GIB, "free_bytes": 6 * GIB}
    monkeypatch.setattr(system_info, "gpu_memory", lambda: gpu)
    engine_page.set_preset("8gb")
    engine_page.set_preset("auto")
    assert engine_page.plan()["budget_bytes"] == 6 * GIB, engine_page.error_label.text()
    running = dict(engine_page.plan())
    worker.loaded.emit({"placement": {"device": "cuda", "plan": running}, "vram_reserved_bytes": 5 * GIB})
    assert engine_page.plan()["budget_bytes"] == 11 * GIB
    assert "RTX 3060 and the 5.00 GiB the loaded model holds" in engine_page.budget_note.text()
    worker.replyFinished.emit({"answer": "", "stats": {"new_tokens": 3, "vram_reserved_bytes": 5 * GIB + GIB // 2}})
    assert engine_page.plan()["budget_bytes"] == 11 * GIB + GIB // 2
    engine_page.set_preset("8gb")  # a card's size: nothing to add
    assert engine_page.plan()["budget_bytes"] == 8 * GIB
    engine_page.set_preset("auto")
    worker.unloaded.emit()
    assert engine_page.plan()["budget_bytes"] == 6 * GIB
    assert engine_page.budget_note.text().endswith("the free memory of RTX 3060.")


def test_the_engine_page_plans_with_the_reserve_measured_on_the_gpu_and_says_so(engine_page, worker):
    engine_page.set_preset("4gb")
    footprint = footprint_from_synthetic(SYNTHETIC)
    estimate = engine_page.plan()
    assert not estimate["reserve_measured"] and estimate == plan_memory(footprint, 4 * GIB, "4gb").to_dict()
    assert engine_page.detail_labels["max_prompt"].text().endswith("· estimate")
    assert "until this machine's GPU is checked" in engine_page.reserve_note.text()

    measured = reserve.measured_reserve(900 * 2**20, "NVIDIA H200", others_included=False)
    worker.reserveMeasured.emit(dict(measured.to_dict(), gpu_usable=True, gpu_status="NVIDIA H200"))
    plan = engine_page.plan()
    expected = plan_memory(footprint, 4 * GIB, "4gb", reserve_bytes=measured.reserve_bytes)
    assert plan["reserve_measured"] and plan["breakdown"]["runtime_reserve"] == measured.reserve_bytes
    assert plan["max_prompt_tokens"] == expected.max_prompt_tokens < estimate["max_prompt_tokens"]
    guarantee = engine_page.detail_labels["max_prompt"].text()
    assert guarantee.startswith(f"{expected.max_prompt_tokens:,} tokens")
    assert guarantee.endswith("· measured on this GPU")
    note = engine_page.reserve_note.text()
    assert "measured on this GPU" in note and "measured on NVIDIA H200" in note and "estimate" not in note


def test_in_cpu_mode_the_engine_page_says_the_plan_is_an_estimate_it_does_not_use(engine_page, worker):
    engine_page.set_preset("4gb")
    worker.reserveMeasured.emit(
        dict(
            reserve.reference_estimate().to_dict(),
            gpu_usable=False,
            gpu_status="this PyTorch build has no CUDA support",
        )
    )
    assert not engine_page.plan()["reserve_measured"]
    assert engine_page.detail_labels["max_prompt"].text().endswith("· estimate")
    note = engine_page.reserve_note.text()
    assert note.startswith("The guarantee is an estimate") and "reference card, an RTX 2050" in note
    mode = engine_page.mode_label.text()
    assert engine_page.mode_label.isVisibleTo(engine_page) and mode.startswith("CPU mode: the plan is not used.")
    assert "no CUDA support" in mode and not engine_page.error_label.isVisibleTo(engine_page)


def test_a_gpu_whose_reserve_could_not_be_measured_shows_the_formula_as_an_estimate(engine_page, worker):
    engine_page.set_preset("4gb")
    formula = reserve.RuntimeReserve(
        900 * 2**20,
        820 * 2**20,
        "estimate for NVIDIA T4 from its 40 SMs, not measured: another program is using NVIDIA T4",
        measured=False,
        gpu="NVIDIA T4",
    )
    worker.reserveMeasured.emit(dict(formula.to_dict(), gpu_usable=True, gpu_status="NVIDIA T4"))
    assert engine_page.plan()["breakdown"]["runtime_reserve"] == 900 * 2**20
    assert engine_page.detail_labels["max_prompt"].text().endswith("· estimate")
    assert "another program is using NVIDIA T4" in engine_page.reserve_note.text()
    assert "not used" not in engine_page.reserve_note.text()


def test_engine_page_plans_for_the_loaded_model(engine_page, tiny_model):
    engine_page.set_preset("4gb")
    engine_page.set_model_footprint(footprint_from_checkpoint(tiny_model))
    assert engine_page.plan()["model"] == "m"
    assert "the loaded model" in engine_page.model_label.text()
    assert engine_page.custom_editor.layers_spin.maximum() == 4  # the tiny model's MoE layers


def test_live_gauges_follow_progress_and_replies(engine_page, worker):
    engine_page.set_preset("4gb")
    live = engine_page.live
    assert live.hit_rate_label.text() == NOT_MEASURED and live.vram_label.text() == NOT_MEASURED
    assert live.last_reply_label.text() == "No reply yet."
    for rate, used in ((10.0, 120), (12.5, 140)):
        worker.progress.emit(
            {"new_tokens": 5, "decode_tokens_per_s": rate, "context_used": used, "context_tokens": 8192}
        )
    assert live.decode_label.text() == "12.5 tok/s"
    assert live.last_reply_label.text() == "The first reply is on its way…"  # not "No reply yet." while it streams
    assert live.decode_history.values() == [10.0, 12.5]
    assert live.context_label.text() == "140 / 8,192" and live.context_bar.value() == 140
    worker.replyFinished.emit(
        {
            "answer": "5",
            "reasoning": "",
            "stats": {
                "prompt_tokens": 140,
                "prefill_tokens": 120,
                "new_tokens": 20,
                "time_to_first_token_s": 0.25,
                "prefill_tokens_per_s": 480.0,
                "decode_tokens_per_s": 12.0,
                "stop_reason": "eos",
                "seed": 1,
            },
        }
    )
    assert live.prefill_label.text() == "480.0 tok/s" and live.prefill_history.values() == [480.0]
    assert "20 tokens" in live.last_reply_label.text() and "0.25 s" in live.last_reply_label.text()
    assert live.hit_rate_label.text() == NOT_MEASURED  # the CPU engine reports none: nothing is made up
    worker.progress.emit(
        {
            "decode_tokens_per_s": 30.0,
            "context_used": 10,
            "context_tokens": 8192,
            "expert_cache_hit_rate": 0.875,
            "vram_used_bytes": 3 * GIB,
        }
    )
    assert live.hit_rate_label.text() == "87.5%"
    planned = system_info.format_bytes(engine_page.plan()["breakdown"]["total"])
    assert live.vram_label.text() == f"3.00 GiB of {planned} planned"
    assert not live.backend_label.isVisibleTo(live)  # no backend stats yet: no row


def test_live_gauges_show_the_expert_backend_and_the_cpu_share(engine_page, worker):
    live = engine_page.live
    assert not live.backend_title.isVisibleTo(live) and not live.backend_label.isVisibleTo(live)
    worker.progress.emit(
        {
            "decode_tokens_per_s": 20.0,
            "expert_cache_hit_rate": 0.9,
            "expert_backend": "hybrid",
            "cpu_expert_calls": 38,
            "cpu_expert_share": 0.38,
            "calibration": {"pcie_bytes_per_s": 6e9, "cpu_bytes_per_s": 4e9, "cpu_threads": 8},
        }
    )
    assert live.backend_label.isVisibleTo(live) and live.backend_title.isVisibleTo(live)
    assert live.backend_label.text() == "hybrid · CPU 38% of experts"
    assert live.hit_rate_label.text() == "90.0%"
    worker.replyFinished.emit(
        {
            "answer": "x",
            "reasoning": "",
            "stats": {"new_tokens": 3, "stop_reason": "eos", "expert_backend": "cpu", "cpu_expert_share": 1.0},
        }
    )
    assert live.backend_label.text() == "cpu · CPU 100% of experts"
    worker.progress.emit({"expert_backend": "offload", "cpu_expert_calls": 0, "cpu_expert_share": 0.0})
    assert live.backend_label.text() == "offload"  # the CPU never computes experts here: no share to show
    trial = {"chosen": None, "step_seconds": {"hybrid": 0.0084, "cpu": 0.0091, "offload": None}}
    worker.progress.emit({"expert_backend": "offload", "cpu_expert_share": 0.2, "expert_backend_trial": trial})
    assert live.backend_label.text() == "offload · auto is timing cpu, hybrid, offload"
    trial["chosen"], trial["step_seconds"]["offload"] = "offload", 0.0076
    worker.progress.emit({"expert_backend": "offload", "cpu_expert_share": 0.1, "expert_backend_trial": trial})
    assert live.backend_label.text() == "offload · auto chose it: 7.6 ms a token, cpu 9.1, hybrid 8.4"
    worker.progress.emit(
        {
            "expert_backend": "cpu",
            "cpu_expert_share": 1.0,
            "expert_backend_trial": {"chosen": "cpu", "step_seconds": {"cpu": 0.0325, "offload": 0.1124}},
        }
    )  # a pageable machine's trial of two
    assert live.backend_label.text() == "cpu · CPU 100% of experts · auto chose it: 32.5 ms a token, offload 112.4"
    worker.loaded.emit({"name": "m", "context_tokens": 4096})
    assert not live.backend_label.isVisibleTo(live)  # a new model: the old one's backend says nothing
    worker.progress.emit({"decode_tokens_per_s": 5.0, "expert_calls": 40})  # a CPU-only run's stats
    assert not live.backend_label.isVisibleTo(live)


# ---- model library and models page -----------------------------------------------------------------


def test_library_lists_the_demo_model(monkeypatch):
    from engine.resources import DEMO_MODEL

    monkeypatch.setattr("app.model_library.DEMO_MODEL", DEMO_MODEL)
    (demo,) = scan_library([])
    assert (demo["name"], demo["architecture"], demo["format"], demo["error"]) == (
        "Demo model (built in)",
        "qwen3_5_moe",
        "bf16",
        "",
    )


def test_library_scan_finds_a_checkpoint_and_lists_a_bad_folder(tmp_path, empty_hf_cache, tiny_model):
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    snapshot = empty_hf_cache / "models--Org--Tiny-MoE" / "snapshots" / "0123abc"
    write_tiny_checkpoint(snapshot, "qwen3_moe", "bf16")
    entries = {e["name"]: e for e in scan_library([tiny_model, bad])}
    assert set(entries) == {"m", "not-a-model", "Org/Tiny-MoE"}
    model = entries["m"]
    assert (model["architecture"], model["format"], model["error"]) == ("qwen3_5_moe", "nvfp4", "")
    assert model["fits"] == {"4gb": True, "8gb": True, "12gb": True}
    assert model["size_bytes"] == sum(p.stat().st_size for p in tiny_model.iterdir())
    assert "has no config.json" in entries["not-a-model"]["error"]
    assert entries["not-a-model"]["fits"] == {}
    hub_model = entries["Org/Tiny-MoE"]
    assert (hub_model["architecture"], hub_model["format"], hub_model["source"]) == (
        "qwen3_moe",
        "bf16",
        "Hugging Face cache",
    )


def test_library_reports_why_a_preset_does_not_fit(tmp_path):
    """A tiny model plus a 3.5 GiB projection from a header alone: the shard is sparse, nothing is written."""
    folder = write_tiny_checkpoint(tmp_path / "big", "qwen3_moe", "bf16")
    big = int(3.5 * GIB)
    header = json.dumps(
        {
            "model.layers.0.self_attn.big_proj.weight": {
                "dtype": "BF16",
                "shape": [big // 128, 64],
                "data_offsets": [0, big],
            }
        }
    ).encode()
    with open(folder / "model-big.safetensors", "wb") as handle:
        handle.write(len(header).to_bytes(8, "little") + header)
        handle.truncate(8 + len(header) + big)
    (entry,) = scan_library([folder])
    assert entry["error"] == ""
    assert entry["fits"] == {"4gb": False, "8gb": True, "12gb": True}
    assert "does not fit 4.00 GiB" in entry["fit_errors"]["4gb"]


def test_library_survives_a_checkpoint_without_routed_experts(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "odd", "qwen3_moe", "bf16")
    (folder / "model.safetensors").unlink()
    header = json.dumps({"lm_head.weight": {"dtype": "BF16", "shape": [320, 64], "data_offsets": [0, 40960]}})
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header.encode() + bytes(40960))
    (entry,) = scan_library([folder])
    assert entry["error"] and entry["fits"] == {}


def _models_page(qtbot, worker, settings):
    page = ModelsPage(worker, settings)
    qtbot.addWidget(page)
    page.resize(900, 500)
    qtbot.waitSignal(page.libraryScanned).wait()  # the first scan, started by the page itself
    return page


def _cell(page, row, column):
    return page.library.index(row, COLUMNS.index(column)).data()


def test_models_page_judges_each_model_against_this_machine(qtbot, worker, settings, tiny_model, monkeypatch):
    weights = footprint_from_checkpoint(tiny_model)
    weight_bytes = weights.resident_bytes + weights.embedding_bytes + weights.routed_expert_bytes
    # a machine whose RAM is smaller than the tiny model's weights: it is too big here, whatever the presets say
    monkeypatch.setattr(
        system_info,
        "ram",
        lambda: {"total_bytes": weight_bytes // 2, "used_bytes": 0, "available_bytes": weight_bytes // 2},
    )
    monkeypatch.setattr(system_info, "gpu_memory", lambda: None)
    page = _models_page(qtbot, worker, settings)
    with qtbot.waitSignal(page.libraryScanned):
        page.add_folder(tiny_model)
    row = page.library.row_of(str(tiny_model))
    assert _cell(page, row, "This PC") == "✗ too big"
    assert _cell(page, row, "Presets") == "4 GB ✓  8 GB ✓  12 GB ✓"
    tip = page.library.index(row, COLUMNS.index("This PC")).data(Qt.ItemDataRole.ToolTipRole)
    assert tip.startswith("Does not fit this machine") and "no GPU" in tip and "CPU mode" in tip


def test_models_page_load_emits_load_requested(qtbot, worker, settings, tiny_model):
    page = _models_page(qtbot, worker, settings)
    assert page.library.rowCount() == 0
    with qtbot.waitSignal(page.libraryScanned):
        page.add_folder(tiny_model)
    assert settings.get("model_folders") == [str(tiny_model)]
    row = page.library.row_of(str(tiny_model))
    assert [_cell(page, row, c) for c in ("Name", "Architecture", "Format", "This PC", "Presets", "Status")] == [
        "m",
        "qwen3_5_moe",
        "nvfp4",
        "✓ fits",
        "4 GB ✓  8 GB ✓  12 GB ✓",
        "ready",
    ]
    assert page.load_button.isEnabled()
    with qtbot.waitSignal(page.loadRequested) as requested:
        qtbot.mouseClick(page.load_button, Qt.MouseButton.LeftButton)
    options = requested.args[1]
    assert requested.args[0] == str(tiny_model) and worker.load_calls == [(str(tiny_model), options)]
    assert {k: options[k] for k in ("context_tokens", "cpu_threads", "preset", "vram_gib")} == {
        "context_tokens": 8192,
        "cpu_threads": 0,
        "preset": "auto",
        "vram_gib": 0.0,
    }
    assert settings.get("last_model") == str(tiny_model)

    worker.loadStarted.emit(str(tiny_model))
    worker.busyChanged.emit(True)
    assert page.busy_bar.isVisibleTo(page) and not page.load_button.isEnabled()
    assert _cell(page, row, "Status") == "loading…"
    worker.loaded.emit(
        {
            "name": "m",
            "path": str(tiny_model),
            "model_type": "qwen3_5_moe_text",
            "layers": 4,
            "experts": 8,
            "experts_per_token": 2,
            "context_tokens": 4096,
        }
    )
    worker.busyChanged.emit(False)
    assert not page.busy_bar.isVisibleTo(page) and page.load_button.isEnabled()
    assert _cell(page, row, "Status") == "loaded"
    assert "Loaded m" in page.status_label.text() and "4,096 tokens" in page.status_label.text()
    assert page.unload_button.isEnabled()
    qtbot.mouseClick(page.unload_button, Qt.MouseButton.LeftButton)
    assert page.status_label.text() == "No model loaded." and not page.unload_button.isEnabled()
    assert _cell(page, row, "Status") == "ready"


def test_models_page_shows_why_a_folder_cannot_be_opened(qtbot, worker, settings, tmp_path):
    page = _models_page(qtbot, worker, settings)
    bad = tmp_path / "downloads"
    bad.mkdir()
    with qtbot.waitSignal(page.libraryScanned):
        page.add_folder(bad)
    assert page.error_banner.isVisibleTo(page)
    assert "cannot be opened as a model" in page.error_banner.text()
    assert "has no config.json" in page.error_banner.text()
    assert _cell(page, 0, "Status").startswith("cannot open: has no config.json")
    assert not page.load_button.isEnabled()  # the bad row is selected and cannot be loaded

    logged = []
    page.log.connect(lambda level, text: logged.append((level, text)))
    with qtbot.waitSignal(page.libraryScanned):
        page.add_folder(bad)  # opened again: the Logs page hears of it too
    assert logged and logged[-1][0] == "error" and "has no config.json" in logged[-1][1]
    assert page.remove_button.isVisibleTo(page) and str(bad) in page.remove_button.toolTip()

    message = f"This folder cannot be opened as a model.\n{bad}: holds no .safetensors weights"
    page.error_banner.hide()
    worker.loadStarted.emit(str(bad))
    worker.loadFailed.emit(message)
    assert page.error_banner.isVisibleTo(page) and page.error_banner.text() == message
    assert not page.busy_bar.isVisibleTo(page)
    assert page.status_label.text() == "No model loaded."

    with qtbot.waitSignal(page.libraryScanned):
        qtbot.mouseClick(page.remove_button, Qt.MouseButton.LeftButton)  # a folder that failed can be removed
    assert settings.get("model_folders") == [] and page.library.rowCount() == 0
    assert bad.is_dir()  # taken off the list, not deleted


# ---- settings and logs -----------------------------------------------------------------------------


def test_settings_page_saves_sampling_and_rejects_bad_values(qtbot, settings):
    page = SettingsPage(settings)
    qtbot.addWidget(page)
    page.sampling_fields["temperature"].setText("0.6")
    page.sampling_fields["top_k"].setText("40")
    page.sampling_fields["seed"].setText("7")
    qtbot.mouseClick(page.save_sampling_button, Qt.MouseButton.LeftButton)
    assert settings.get("sampling") == {"temperature": 0.6, "top_k": 40, "seed": 7}
    assert page.sampling_message.text().startswith("Saved")

    page.sampling_fields["top_p"].setText("1.5")
    assert not page.save_sampling()
    assert page.sampling_message.text() == "Top-p must be in (0, 1], got 1.5"
    page.sampling_fields["top_p"].setText("")
    page.sampling_fields["top_k"].setText("forty")
    assert not page.save_sampling()
    assert page.sampling_message.text() == "Top-k must be a whole number, not 'forty'"
    assert settings.get("sampling") == {"temperature": 0.6, "top_k": 40, "seed": 7}  # nothing bad was stored

    page.reset_sampling()
    assert settings.get("sampling") == {}
    page.context_spin.setValue(16384)
    page.thinking_check.setChecked(False)
    page.threads_spin.setValue(1)
    assert (settings.get("context_tokens"), settings.get("enable_thinking"), settings.get("cpu_threads")) == (
        16384,
        False,
        1,
    )
    with qtbot.waitSignal(page.themeChanged) as theme:
        page.theme_combo.setCurrentIndex(page.theme_combo.findData("dark"))
    assert theme.args == ["dark"] and settings.get("theme") == "dark"


def test_settings_page_expert_backend_and_cpu_threads_reach_the_load_options(qtbot, settings):
    page = SettingsPage(settings)
    qtbot.addWidget(page)
    combo = page.backend_combo
    assert [combo.itemData(i) for i in range(combo.count())] == list(BACKENDS)
    assert [combo.itemText(i) for i in range(combo.count())] == [label for label, _, _ in EXPERT_BACKENDS]
    assert all(combo.itemData(i, Qt.ItemDataRole.ToolTipRole) for i in range(combo.count()))
    assert "applies when a model is loaded" in combo.toolTip() and "Applies when" in page.threads_spin.toolTip()
    assert combo.currentData() == "auto" and page.threads_spin.text() == "physical cores"
    assert {k: load_options(settings)[k] for k in ("expert_backend", "cpu_threads")} == {
        "expert_backend": "auto",
        "cpu_threads": 0,
    }

    combo.setCurrentIndex(combo.findData("hybrid"))
    threads = page.threads_spin.maximum()  # the machine's logical CPUs
    page.threads_spin.setValue(threads)
    assert (settings.get("expert_backend"), settings.get("cpu_threads")) == ("hybrid", threads)
    assert {k: load_options(settings)[k] for k in ("expert_backend", "cpu_threads")} == {
        "expert_backend": "hybrid",
        "cpu_threads": threads,
    }
    reopened = SettingsPage(settings)
    qtbot.addWidget(reopened)
    assert reopened.backend_combo.currentText() == "Hybrid (PCIe + CPU)" and reopened.threads_spin.value() == threads

    settings.set("expert_backend", "warp-drive")  # a hand-edited store: the page and the load agree on Auto
    assert load_options(settings)["expert_backend"] == "auto"
    edited = SettingsPage(settings)
    qtbot.addWidget(edited)
    assert edited.backend_combo.currentData() == "auto"


def test_settings_page_restore_points_reach_the_load_options_and_say_their_cost(qtbot, settings):
    page = SettingsPage(settings)
    qtbot.addWidget(page)
    assert page.snapshots_spin.value() == DEFAULT_MAX_SNAPSHOTS == load_options(settings)["turn_snapshots"]
    assert "61 MiB for Qwen3.6-35B-A3B" in page.snapshots_cost.text()  # no model loaded: the cost in general

    page.snapshots_spin.setValue(64)
    assert settings.get("turn_snapshots") == 64 == load_options(settings)["turn_snapshots"]
    page.snapshots_spin.setValue(page.snapshots_spin.minimum() - 1)  # the control holds no invalid value
    assert settings.get("turn_snapshots") == 1
    page.set_model({"name": "<b>Qwen3.6-35B-A3B</b>", "snapshot_bytes": 61 * 2**20})
    assert page.snapshots_cost.text().startswith("1 × 61.0 MiB = 61.0 MiB of host RAM for <b>Qwen3.6-35B-A3B</b>.")
    page.snapshots_spin.setValue(4)
    assert page.snapshots_cost.text().startswith("4 × 61.0 MiB = 244.0 MiB of host RAM")
    assert page.snapshots_cost.textFormat() == Qt.TextFormat.PlainText  # a folder's name is never markup
    page.set_model({"name": "Qwen3-30B-A3B", "snapshot_bytes": 0})
    assert page.snapshots_cost.text().startswith("Qwen3-30B-A3B has no recurrent layers")
    page.set_model(None)
    assert "61 MiB for Qwen3.6-35B-A3B" in page.snapshots_cost.text()

    reopened = SettingsPage(settings)
    qtbot.addWidget(reopened)
    assert reopened.snapshots_spin.value() == 4
    settings._store.setValue("turn_snapshots", "1000")  # a hand-edited store: the page and the load agree
    edited = SettingsPage(settings)
    qtbot.addWidget(edited)
    assert edited.snapshots_spin.value() == DEFAULT_MAX_SNAPSHOTS == load_options(settings)["turn_snapshots"]


def test_logs_page_filters_and_copies_diagnostics(qtbot, worker):
    page = LogsPage(worker)
    qtbot.addWidget(page)
    worker.log.emit("info", "loaded /models/m in 0.1 s")
    worker.log.emit("warning", "expert banks fell back to pageable memory")
    worker.log.emit("error", "/models/x: has no config.json")
    assert page.filtered.rowCount() == 3
    page.level_combo.setCurrentIndex(page.level_combo.findData("warning"))
    assert page.filtered.rowCount() == 2
    page.level_combo.setCurrentIndex(page.level_combo.findData("error"))
    assert page.filtered.rowCount() == 1
    page.level_combo.setCurrentIndex(page.level_combo.findData("info"))
    page.search_field.setText("PAGEABLE")
    assert page.filtered.rowCount() == 1
    assert "WARNING" in page.filtered.index(0, 0).data()

    page.set_plan(plan_memory(footprint_from_synthetic(SYNTHETIC), 4 * GIB, "4gb").to_dict())
    qtbot.mouseClick(page.copy_button, Qt.MouseButton.LeftButton)
    copied = QGuiApplication.clipboard().text()
    assert "Python " in copied and "PySide6 " in copied and "GPU " in copied and "RAM " in copied
    assert "Last error:\n/models/x: has no config.json" in copied
    assert f"{SYNTHETIC}, preset 4gb for chat, budget 4.00 GiB" in copied
    assert "copied" in page.copied_label.text()


def test_the_library_scan_never_blocks_the_gui_thread(qtbot, worker, settings, monkeypatch):
    """A scan that blocks (a hung network folder, a FIFO) leaves the page usable; its result arrives later."""
    import threading

    import app.library_scanner as scanner

    release, gui = threading.Event(), threading.get_ident()
    threads = []

    def blocked(folders, downloads=None):
        threads.append(threading.get_ident())
        assert release.wait(10), "the test never released the scan"
        return []

    monkeypatch.setattr(scanner, "scan_library", blocked)
    page = ModelsPage(worker, settings)  # returns while its first scan is blocked
    qtbot.addWidget(page)
    assert "Scanning…" in page.sources_label.text() and page.library.rowCount() == 0
    with qtbot.waitSignal(page.libraryScanned, timeout=5000):
        release.set()
    assert threads and gui not in threads and "Scanning…" not in page.sources_label.text()


# a hand-edited or foreign settings file: every bad value reads as its default, with one warning


@pytest.mark.parametrize(
    "key, stored",
    [
        ("context_tokens", '"abc"'),
        ("context_tokens", "1000000000000"),
        ("context_tokens", "8192.5"),
        ("cpu_threads", "10000"),
        ("cpu_threads", '"many"'),
        ("cpu_threads", "-1"),
        ("cpu_threads", "true"),
        ("vram_gib", "NaN"),
        ("vram_gib", "-4"),
        ("pin_budget_gib", '"lots"'),
        ("preset", '"16gb"'),
        ("preset", "4"),
        ("theme", '"neon"'),
        ("expert_backend", '"warp"'),
        ("custom_plan", "[1, 2]"),
        (
            "custom_plan",
            '{"expert_cache_layers": "x", "prefill_overlap": false, "prefill_chunk_tokens": 256, "kv_tokens": 8192}',
        ),
        ("sampling", '{"temperature": "hot"}'),
        ("sampling", '{"seed": -1}'),
        ("sampling", '{"top_p": 7}'),
        ("sampling", '{"bogus": 1}'),
        ("sampling", "[]"),
        ("enable_thinking", '"yes"'),
        ("model_folders", '"/one/folder"'),
        ("model_folders", "[1]"),
        ("last_model", "{}"),
        ("hub_offline", "1"),
        ("download_folder", "{not json"),
        ("chat_engine", "[]"),
        ("turn_snapshots", "0"),
        ("turn_snapshots", "65"),
        ("turn_snapshots", "4.0"),
        ("turn_snapshots", '"8"'),
        ("turn_snapshots", "true"),
    ],
)
def test_a_bad_stored_setting_reads_as_its_default_with_one_warning(settings, key, stored):
    from app.settings import DEFAULTS

    settings._store.setValue(key, stored)
    assert settings.get(key) == DEFAULTS[key] and settings.get(key) == DEFAULTS[key]
    (warning,) = settings.warnings  # read twice, said once
    assert (
        warning.startswith(f"setting {key} in {settings._store.fileName()} is {stored!r:.80}")
        and f"using the default {json.dumps(DEFAULTS[key])}" in warning
    )


@pytest.mark.parametrize(
    "key, stored, value",
    [
        ("context_tokens", "32768", 32768),
        ("cpu_threads", "1", 1),
        ("vram_gib", "6", 6),
        ("turn_snapshots", "1", 1),
        ("turn_snapshots", "64", 64),
        ("sampling", '{"temperature": 0.5, "seed": 7}', {"temperature": 0.5, "seed": 7}),
        (
            "custom_plan",
            '{"expert_cache_layers": 2, "prefill_overlap": true, "prefill_chunk_tokens": 128, "kv_tokens": 4096}',
            {"expert_cache_layers": 2, "prefill_overlap": True, "prefill_chunk_tokens": 128, "kv_tokens": 4096},
        ),
    ],
)
def test_a_good_stored_setting_reads_as_stored(settings, key, stored, value):
    settings._store.setValue(key, stored)
    assert settings.get(key) == value and settings.warnings == []


def test_the_settings_page_and_load_options_survive_bad_stored_values(qtbot, settings):
    reported = []
    settings.report_warnings(lambda level, message: reported.append((level, message)))
    for key, stored in (("context_tokens", '"abc"'), ("cpu_threads", "10000"), ("sampling", '{"top_k": "x"}')):
        settings._store.setValue(key, stored)
    page = SettingsPage(settings)
    qtbot.addWidget(page)
    assert (page.context_spin.value(), page.threads_spin.value()) == (8192, 0)
    assert page.sampling_fields["top_k"].text() == ""
    assert {k: load_options(settings)[k] for k in ("context_tokens", "cpu_threads")} == {
        "context_tokens": 8192,
        "cpu_threads": 0,
    }
    assert [(level, message.split(" in ")[0]) for level, message in reported] == [
        ("warning", "setting sampling"),
        ("warning", "setting context_tokens"),
        ("warning", "setting cpu_threads"),
    ]


def test_the_engine_page_judges_the_model_against_this_machine(engine_page, monkeypatch):
    monkeypatch.setattr(
        system_info,
        "ram",
        lambda: {"total_bytes": int(23.5 * GIB), "used_bytes": 0, "available_bytes": int(23.5 * GIB)},
    )
    monkeypatch.setattr(system_info, "gpu_memory", lambda: None)
    engine_page.set_model_footprint(footprint_from_synthetic("qwen3.6-35b-a3b"))  # bf16: 64.56 GiB of weights
    text = engine_page.machine_label.text()
    assert text.startswith("This machine: Does not fit this machine") and "23.50 GiB RAM, no GPU" in text
    engine_page.set_model_footprint(footprint_from_synthetic("qwen3.6-35b-a3b-nvfp4"))
    assert engine_page.machine_label.text().startswith("This machine: Fits")


def test_the_context_setting_says_what_the_model_and_the_plan_allow(qtbot, settings):
    from app.engine_worker import context_advice
    from app.pages.settings_page import context_note

    page = SettingsPage(settings)
    qtbot.addWidget(page)
    page.context_spin.setValue(8192)
    assert "up to the model's own maximum" in page.context_note.text()  # nothing loaded yet
    # the case: the setting says 8,192, the 4 GB plan's KV cache holds 4,096
    info = {
        "name": "Qwen3.6",
        "context_tokens": 4096,
        "max_context_tokens": 262144,
        "context_asked_tokens": 8192,
        "context_plan_tokens": 4096,
    }
    page.set_model(info)
    assert page.context_note.text() == (
        "Qwen3.6 runs at 4,096 tokens: the model allows 262,144 (max_position_embeddings), the VRAM plan's KV cache "
        "holds 4,096. This setting asks 8,192, so the plan's KV cache (a larger VRAM preset holds more) decides."
    )
    page.context_spin.setValue(2048)
    assert page.context_note.text().endswith("The new size applies when the model is loaded again.")
    cpu = {
        "name": "m",
        "context_tokens": 4096,
        "max_context_tokens": 4096,
        "context_asked_tokens": 8192,
        "context_plan_tokens": None,
    }
    assert context_note(8192, cpu) == (
        "m runs at 4,096 tokens: the model allows 4,096 (max_position_embeddings). "
        "This setting asks 8,192, so the model's maximum decides."
    )

    # the overflow advice is one that can help: none at the model's maximum, the preset when the plan caps it
    assert context_advice(4096, 8192, 4096, None) == ""
    assert "a larger VRAM preset" in context_advice(4096, 8192, 262144, 4096)
    assert context_advice(2048, 2048, 262144, None).startswith("raise the context size in Settings (now 2,048")
    assert context_advice(2048, 2048, 262144, 8192).startswith("raise the context size")  # the setting caps it
