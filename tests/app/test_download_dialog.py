"""The download dialog, driven with pytest-qt against the local fake Hub (engine/testing/hub_server.py).

The dialog's DownloadWorker runs the real engine.hub on its own thread with the real huggingface_hub
client; the Models page around it has a FakeWorker for the engine, so "Load now" is only recorded.
Tests wait on the dialog's own signals (progressShown, runEnded), which it emits on the GUI thread after
its widgets show what the worker reported.
"""

from __future__ import annotations

import gc
import shutil
import weakref

import pytest
from app_fakes import FakeWorker
from hub_fixtures import GATED, SHARD1, SHARD2, TINY, TOKEN
from PySide6.QtCore import Qt
from shiboken6 import Shiboken

from app import system_info
from app.dialogs.download_dialog import BAR_STEPS, CURATED_COLUMNS, DownloadDialog
from app.model_library import DOWNLOAD_SOURCE
from app.pages.models import ModelsPage
from engine import hub
from engine.testing.hub_server import API, Fault

TIMEOUT_MS = 15_000


@pytest.fixture(autouse=True)
def private_library(tmp_path, monkeypatch, settings):
    """Downloads go to a temp folder; the library scans no real Hugging Face cache and no demo model."""
    hub_cache = tmp_path / "hf-cache"
    hub_cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr("app.model_library.DEMO_MODEL", tmp_path / "no-demo-model")
    settings.set("download_folder", str(tmp_path / "models"))
    return tmp_path / "models"


@pytest.fixture
def page(qtbot, settings):
    worker = FakeWorker()
    page = ModelsPage(worker, settings)
    qtbot.addWidget(page)
    page.fake_worker = worker
    return page


@pytest.fixture
def dialog(qtbot, page, fake_hub):
    page.download_button.click()
    dialog = page.download_dialog
    assert isinstance(dialog, DownloadDialog) and dialog.isVisible()
    dialog.endpoint_edit.setText(fake_hub.endpoint)
    yield dialog
    dialog.shutdown()


def _choose(dialog, repo: str) -> None:
    dialog.repo_edit.setText(repo)
    dialog.revision_edit.setText("main")


def _slow_after_planning(dialog, fake_hub, step=8192, pause=0.02):
    """Planning runs at full speed; the download itself trickles, so a test can act in the middle of a file."""
    dialog.worker.planned.connect(
        lambda plan: setattr(fake_hub, "throttle", (step, pause)), Qt.ConnectionType.DirectConnection
    )


def test_curated_list_shows_format_size_ram_and_fitting_presets(qtbot, page):
    dialog = page.open_download_dialog()
    model = dialog.curated
    rows = {
        model.index(r, 0).data(): {c: model.index(r, i).data() for i, c in enumerate(CURATED_COLUMNS)}
        for r in range(model.rowCount())
    }
    assert {
        "nvidia/Qwen3.6-35B-A3B-NVFP4",
        "Qwen/Qwen3.6-35B-A3B",
        "Qwen/Qwen3.6-35B-A3B-FP8",
        "Qwen/Qwen3.5-35B-A3B",
        "Qwen/Qwen3-30B-A3B",
    } <= set(rows)
    nvfp4 = rows["nvidia/Qwen3.6-35B-A3B-NVFP4"]
    assert nvfp4["Format"] == "nvfp4" and nvfp4["Presets"] == "4 GB ✓  8 GB ✓  12 GB ✓"
    assert nvfp4["Download ≈"].endswith("GiB") and nvfp4["RAM ≈"].endswith("GiB") and nvfp4["Here"] == ""
    bf16 = rows["Qwen/Qwen3.6-35B-A3B"]
    assert bf16["Presets"].startswith("4 GB ✗") and bf16["Format"] == "bf16"
    dialog.curated_view.selectRow(0)
    assert dialog.repo_edit.text() == "nvidia/Qwen3.6-35B-A3B-NVFP4"
    assert "VRAM presets: 4 GB ✓  8 GB ✓  12 GB ✓" in dialog.summary_label.text()
    dialog.shutdown()


def test_download_drives_the_bars_and_lands_in_the_library_ready_to_load(
    qtbot, page, dialog, fake_hub, private_library
):
    _choose(dialog, TINY)
    _slow_after_planning(dialog, fake_hub, step=16384, pause=0.01)
    seen = []  # what the bars and labels showed after each progress report
    dialog.progressShown.connect(
        lambda p: seen.append((p["file"], dialog.file_bar.value(), dialog.total_bar.value(), dialog.speed_label.text()))
    )
    with qtbot.waitSignal(dialog.runEnded, timeout=TIMEOUT_MS) as ended:
        dialog.download_button.click()
        assert not dialog.download_button.isEnabled() and dialog.cancel_button.isEnabled()
    outcome, folder = ended.args
    assert outcome == "downloaded"
    assert folder == str(private_library / hub.folder_name(TINY))
    totals = [total for _, _, total, _ in seen]
    assert totals == sorted(totals) and any(0 < t < BAR_STEPS for t in totals)
    assert any(0 < bar < BAR_STEPS for file, bar, _, _ in seen if file == SHARD1)  # the per-file bar moved
    assert any("/s, about" in speed for *_, speed in seen)
    assert dialog.total_bar.value() == BAR_STEPS and dialog.file_bar.value() == BAR_STEPS
    statuses = [dialog.files_table.item(r, 2).text() for r in range(dialog.files_table.rowCount())]
    assert statuses == ["done ✓"] * 9
    assert dialog.banner.property("kind") == "ok" and dialog.load_button.isVisible()
    assert "12 GB ✓" in dialog.summary_label.text() and "Fits: it needs" in dialog.summary_label.text()

    # the Models page lists it once its rescan is in, selected and usable; Load now hands it to the engine worker
    qtbot.waitUntil(lambda: page.library.row_of(folder) >= 0, timeout=TIMEOUT_MS)
    row = page.library.row_of(folder)
    entry = page.library.entry(row)
    assert entry["name"] == TINY and entry["source"] == DOWNLOAD_SOURCE and entry["error"] == ""
    assert page.selected_row() == row and page.load_button.isEnabled()
    with qtbot.waitSignal(page.loadRequested, timeout=TIMEOUT_MS):
        dialog.load_button.click()
    assert page.fake_worker.load_calls[-1][0] == folder


def test_pause_and_resume_from_the_dialog(qtbot, dialog, fake_hub):
    _choose(dialog, TINY)
    _slow_after_planning(dialog, fake_hub)
    paused = []

    def pause_in_shard(p):
        if p["file"] == SHARD1 and p["file_done"] > 0 and not paused:
            paused.append(p)
            dialog.pause_button.click()

    dialog.progressShown.connect(pause_in_shard)
    dialog.download_button.click()
    qtbot.waitUntil(lambda: dialog.speed_label.text() == "Paused", timeout=TIMEOUT_MS)
    assert dialog.pause_button.text() == "Resume"
    frozen = dialog.total_bar.value()
    qtbot.wait(300)
    assert dialog.total_bar.value() == frozen and 0 < frozen < BAR_STEPS
    with qtbot.waitSignal(dialog.runEnded, timeout=TIMEOUT_MS) as ended:
        dialog.pause_button.click()
    assert ended.args[0] == "downloaded"
    assert dialog.pause_button.text() == "Pause" and dialog.total_bar.value() == BAR_STEPS


def test_cancel_deletes_the_partial_download(qtbot, page, dialog, fake_hub, private_library):
    _choose(dialog, TINY)
    _slow_after_planning(dialog, fake_hub)
    dialog.progressShown.connect(
        lambda p: (
            p["file"] == SHARD2
            and p["file_done"] > 0
            and dialog.cancel_button.isEnabled()
            and dialog.cancel_button.click()
        )
    )
    with qtbot.waitSignal(dialog.runEnded, timeout=TIMEOUT_MS) as ended:
        dialog.download_button.click()
    assert ended.args == ["cancelled", "discarded"]
    assert dialog.banner.property("kind") == "info" and "cancelled" in dialog.banner.text()
    assert not (private_library / hub.folder_name(TINY)).exists()
    with qtbot.waitSignal(page.libraryScanned):
        page.refresh()
    assert page.library.rowCount() == 0
    assert dialog.download_button.isEnabled() and not dialog.cancel_button.isEnabled()


def test_cancel_stops_asking_a_stalled_hub(qtbot, dialog, fake_hub, private_library):
    fake_hub.faults[API] = Fault(stall=True, times=0)
    _choose(dialog, TINY)
    dialog.download_button.click()
    qtbot.waitUntil(fake_hub.stalled.is_set, timeout=TIMEOUT_MS)
    # well inside the client's read timeout (hub.TIMEOUT_S): the stop, not the timeout, ends the run
    with qtbot.waitSignal(dialog.runEnded, timeout=int(hub.TIMEOUT_S * 1000 / 2)) as ended:
        dialog.cancel_button.click()
    assert ended.args == ["cancelled", "discarded"]
    assert not private_library.exists() or not any(private_library.iterdir())
    assert dialog.check_button.isEnabled() and not dialog.cancel_button.isEnabled()


def test_closing_mid_download_keeps_what_arrived_for_next_time(qtbot, page, dialog, fake_hub, private_library):
    _choose(dialog, TINY)
    _slow_after_planning(dialog, fake_hub)
    with qtbot.waitSignal(
        dialog.progressShown, timeout=TIMEOUT_MS, check_params_cb=lambda p: p["file"] == SHARD1 and p["file_done"] > 0
    ):
        dialog.download_button.click()
    dialog.close_button.click()
    folder = private_library / hub.folder_name(TINY)
    assert hub.partial_download(folder) and not (folder / "config.json").exists()
    with qtbot.waitSignal(page.libraryScanned):
        page.refresh()
    assert page.library.rowCount() == 0  # an unfinished download is not a model
    again = page.open_download_dialog()
    statuses = {
        again.curated.index(r, 0).data(): again.curated.index(r, CURATED_COLUMNS.index("Here")).data()
        for r in range(again.curated.rowCount())
    }
    assert set(statuses.values()) == {""}  # the curated repos were not touched
    again.endpoint_edit.setText(fake_hub.endpoint)
    _choose(again, TINY)
    fake_hub.throttle = None
    with qtbot.waitSignal(again.runEnded, timeout=TIMEOUT_MS) as ended:
        again.check_button.click()
    assert ended.args[0] == "planned"
    assert 0 < again.plan["have_bytes"] < again.plan["total_bytes"]
    assert "already here; the download resumes from it" in again.summary_label.text()
    again.shutdown()


@pytest.mark.parametrize(
    "repo, message",
    [
        ("Org/No-Such-Model", "There is no model Org/No-Such-Model on 127.0.0.1:"),
        (GATED, f"{GATED} is gated: open "),
    ],
)
def test_hub_errors_are_shown_in_plain_words(qtbot, dialog, repo, message):
    _choose(dialog, repo)
    with qtbot.waitSignal(dialog.runEnded, timeout=TIMEOUT_MS) as ended:
        dialog.check_button.click()
    assert ended.args[0] == "failed"
    assert dialog.banner.isVisible() and dialog.banner.property("kind") == "error"
    assert dialog.banner.text().startswith(message)
    assert "Asking the Hub" not in dialog.summary_label.text()  # the question was answered, with an error
    assert dialog.check_button.isEnabled()


def test_size_mismatch_is_shown(qtbot, dialog, fake_hub):
    fake_hub.size_lies[SHARD2] = 100
    _choose(dialog, TINY)
    with qtbot.waitSignal(dialog.runEnded, timeout=TIMEOUT_MS) as ended:
        dialog.download_button.click()
    assert ended.args == ["failed", "mismatch"]
    assert dialog.banner.text().startswith(f"{SHARD2} does not match the Hub's listing")


def test_token_goes_to_huggingface_hub_store_and_nowhere_else(qtbot, dialog, settings, hf_home, tmp_path):
    logs = []
    dialog.worker.log.connect(lambda level, text: logs.append(text), Qt.ConnectionType.DirectConnection)
    _choose(dialog, GATED)
    dialog.token_edit.setText(TOKEN)
    with qtbot.waitSignal(dialog.runEnded, timeout=TIMEOUT_MS) as ended:
        dialog.download_button.click()
    assert ended.args[0] == "downloaded"
    assert (hf_home / "token").read_text() == TOKEN
    assert dialog.token_edit.text() == "" and "a token is saved" in dialog.token_edit.placeholderText()
    assert TOKEN not in (tmp_path / "s.ini").read_text()  # the settings file
    assert logs and not any(TOKEN in text for text in logs)
    assert "gated: your token has access" in dialog.summary_label.text()


def test_disk_refusal_and_offline_mode(qtbot, dialog, monkeypatch, private_library):
    import collections

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**30, 2**30 - 1000, 1000))
    _choose(dialog, TINY)
    with qtbot.waitSignal(dialog.runEnded, timeout=TIMEOUT_MS) as ended:
        dialog.download_button.click()
    assert ended.args == ["failed", "disk"] and dialog.banner.text().startswith("Not enough disk space in")
    assert not (private_library / hub.folder_name(TINY)).exists()

    dialog.offline_box.setChecked(True)
    with qtbot.waitSignal(dialog.runEnded, timeout=TIMEOUT_MS) as ended:
        dialog.check_button.click()
    assert ended.args == ["failed", "offline"] and dialog.banner.text().startswith("Offline mode is on")
    assert dialog.settings.get("hub_offline") is True
    assert dialog.settings.get("hf_endpoint") == dialog.endpoint_edit.text()


def test_closing_the_window_behind_the_dialog_stops_the_download_thread(qtbot, page, dialog, fake_hub, private_library):
    _choose(dialog, TINY)
    _slow_after_planning(dialog, fake_hub)
    with qtbot.waitSignal(
        dialog.progressShown, timeout=TIMEOUT_MS, check_params_cb=lambda p: p["file"] == SHARD1 and p["file_done"] > 0
    ):
        dialog.download_button.click()
    thread = dialog.worker_thread
    page.close()  # the main window closing: the app is about to tear its widgets down
    assert dialog.worker_thread is None and thread.isFinished()
    assert hub.partial_download(private_library / hub.folder_name(TINY))


def _failing_check(qtbot, dialog) -> None:
    _choose(dialog, "Org/No-Such-Model")
    with qtbot.waitSignal(dialog.runEnded, timeout=TIMEOUT_MS) as ended:
        dialog.check_button.click()
    assert ended.args[0] == "failed" and dialog.banner.text().startswith("There is no model Org/No-Such-Model")


def test_each_closed_dialog_s_worker_and_thread_are_deleted_by_qt_not_by_the_garbage_collector(qtbot, page, fake_hub):
    """Python's collector runs on whichever thread allocates (a download thread, the engine's): it must never be
    what deletes a worker or its QThread. Closing the dialog ends the thread; then the worker and the QThread are
    deleted on the GUI thread, while this test still holds references to both, and nothing keeps them after."""
    ended = []
    for _ in range(3):
        dialog = page.open_download_dialog()
        dialog.endpoint_edit.setText(fake_hub.endpoint)
        _failing_check(qtbot, dialog)
        worker, thread = dialog.worker, dialog.worker_thread
        assert Shiboken.isValid(worker) and thread.isRunning()
        dialog.close_button.click()
        assert dialog.worker_thread is None and thread.isFinished()
        # deleted on the GUI thread once the thread has ended, the worker first: with no Python reference dropped
        qtbot.waitUntil(
            lambda w=worker, t=thread: not Shiboken.isValid(w) and not Shiboken.isValid(t), timeout=TIMEOUT_MS
        )
        ended.append((weakref.ref(worker), weakref.ref(thread)))
        del dialog, worker, thread
        gc.collect()
        assert page.download_dialog is None
    assert all(w() is None and t() is None for w, t in ended)  # nothing kept them after they were deleted


def test_a_dialog_destroyed_mid_download_stops_its_thread_before_the_worker_goes(
    qtbot, page, fake_hub, private_library
):
    """The dialog deleted without being closed (its parent going), then its wrapper collected: the download
    stops, keeping what arrived, and the worker and its thread live until the thread has ended."""
    dialog = page.open_download_dialog()
    dialog.endpoint_edit.setText(fake_hub.endpoint)
    _choose(dialog, TINY)
    _slow_after_planning(dialog, fake_hub)
    with qtbot.waitSignal(
        dialog.progressShown, timeout=TIMEOUT_MS, check_params_cb=lambda p: p["file"] == SHARD1 and p["file_done"] > 0
    ):
        dialog.download_button.click()
    thread = weakref.ref(dialog.worker_thread)
    worker = weakref.ref(dialog.worker)
    assert thread().isRunning()
    Shiboken.delete(dialog)
    page.download_dialog = None
    del dialog
    gc.collect()  # before the fix: the worker deleted under its running thread, then the running QThread (abort)
    qtbot.waitUntil(lambda: thread() is None and worker() is None, timeout=TIMEOUT_MS)
    folder = private_library / hub.folder_name(TINY)
    assert hub.partial_download(folder) and not (folder / "config.json").exists()  # stopped, what arrived kept


GIB_ = 2**30
# (RAM, GPU or None) -> what "This PC" says for each curated model: a laptop without a GPU, a desktop with 8 GB
MACHINES = {
    "23.5 GiB RAM, no GPU": (
        (int(23.5 * GIB_), None),
        {
            "nvidia/Qwen3.6-35B-A3B-NVFP4": "✓ fits",
            "Qwen/Qwen3.6-35B-A3B-FP8": "✗ too big",
            "Qwen/Qwen3.6-35B-A3B": "✗ too big",
            "Qwen/Qwen3.5-35B-A3B": "✗ too big",
            "Qwen/Qwen3-30B-A3B": "✗ too big",
        },
    ),
    "32 GiB RAM + 8 GB GPU": (
        (32 * GIB_, {"name": "RTX 4060", "total_bytes": 8 * 10**9, "used_bytes": 0, "free_bytes": 8 * 10**9}),
        {
            "nvidia/Qwen3.6-35B-A3B-NVFP4": "✓ fits",
            "Qwen/Qwen3.6-35B-A3B-FP8": "⚠ tight",
            "Qwen/Qwen3.6-35B-A3B": "✗ too big",
            "Qwen/Qwen3.5-35B-A3B": "✗ too big",
            "Qwen/Qwen3-30B-A3B": "✗ too big",
        },
    ),
}


@pytest.mark.parametrize("machine", list(MACHINES))
def test_the_curated_list_judges_fit_on_this_machine(qtbot, page, monkeypatch, machine):
    (ram_bytes, gpu), expected = MACHINES[machine]
    monkeypatch.setattr(
        system_info, "ram", lambda: {"total_bytes": ram_bytes, "used_bytes": 0, "available_bytes": ram_bytes}
    )
    monkeypatch.setattr(system_info, "gpu_memory", lambda: gpu)
    monkeypatch.setattr(system_info, "disk_free", lambda folder: 500 * GIB_)
    dialog = page.open_download_dialog()
    model, here = dialog.curated, CURATED_COLUMNS.index("This PC")
    shown = {model.index(r, 0).data(): model.index(r, here).data() for r in range(model.rowCount())}
    assert shown == expected
    tips = {
        model.index(r, 0).data(): model.index(r, here).data(Qt.ItemDataRole.ToolTipRole)
        for r in range(model.rowCount())
    }
    bf16 = tips["Qwen/Qwen3.6-35B-A3B"]
    said = "23.50 GiB RAM, no GPU" if gpu is None else "32.00 GiB RAM, RTX 4060 with 7.45 GiB"
    assert bf16.startswith("Does not fit this machine") and "64.56 GiB in all" in bf16 and f"has {said}." in bf16
    if gpu is None:
        assert "CPU mode" in tips["nvidia/Qwen3.6-35B-A3B-NVFP4"]
    else:
        assert "RTX 4060 runs it" in tips["nvidia/Qwen3.6-35B-A3B-NVFP4"]
    # the presets stay, as the second question
    presets = {
        model.index(r, 0).data(): model.index(r, CURATED_COLUMNS.index("Presets")).data()
        for r in range(model.rowCount())
    }
    assert presets["Qwen/Qwen3.6-35B-A3B"] == "4 GB ✗  8 GB ✓  12 GB ✓"
    dialog.curated_view.selectRow(2)
    assert "Does not fit this machine" in dialog.summary_label.text()
    dialog.shutdown()


def test_a_model_bigger_than_the_free_disk_says_so(qtbot, page, monkeypatch):
    monkeypatch.setattr(
        system_info, "ram", lambda: {"total_bytes": 256 * GIB_, "used_bytes": 0, "available_bytes": 256 * GIB_}
    )
    monkeypatch.setattr(system_info, "gpu_memory", lambda: None)
    monkeypatch.setattr(system_info, "disk_free", lambda folder: 30 * GIB_)
    dialog = page.open_download_dialog()
    model, here = dialog.curated, CURATED_COLUMNS.index("This PC")
    shown = {model.index(r, 0).data(): model.index(r, here).data() for r in range(model.rowCount())}
    assert shown["nvidia/Qwen3.6-35B-A3B-NVFP4"] == "✓ fits" and shown["Qwen/Qwen3.6-35B-A3B"] == "✗ disk full"
    dialog.shutdown()
