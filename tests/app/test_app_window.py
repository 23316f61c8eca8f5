"""The whole window: startup with a model, history across a restart, the smoke test, the Qt binding."""

import asyncio
import sys

import pytest
from PySide6.QtWidgets import QApplication, QLabel

from app.main_window import MainWindow
from app.storage import ConversationStore


@pytest.fixture
def model_folder(tiny_checkpoint):
    return tiny_checkpoint("qwen3_5_moe", "bf16")


def open_window(qtbot, store, settings, folder):
    window = MainWindow(store, settings, folder)
    qtbot.addWidget(window)
    with qtbot.waitSignal(window.worker.loaded, timeout=60000):
        window.show()
    # the worker's signal reaches the window's slot through the event loop: wait until the window took it
    qtbot.waitUntil(lambda: window.model_info is not None and window.chat_page.send_button.isEnabled(), timeout=10000)
    return window


def test_qt_binding_does_not_leak_none(qtbot):
    """PySide6 6.12.0 on Python 3.11 drops a reference to None per void call and aborts minutes into a
    reply; pyproject.toml keeps it out."""
    label = QLabel()
    qtbot.addWidget(label)
    before = sys.getrefcount(None)
    for _ in range(1000):
        label.setText("x")
    assert sys.getrefcount(None) - before > -50


def test_window_loads_the_model_and_pages_switch(qtbot, tmp_path, settings, model_folder):
    window = open_window(qtbot, ConversationStore(tmp_path / "c.sqlite3"), settings, model_folder)
    assert model_folder.name in window.model_label.text()
    # the sidebar names the architecture as the Models list does (config.json's model_type, not the text config's)
    assert "\nqwen3_5_moe, " in window.model_label.text() and window.model_info["architecture"] == "qwen3_5_moe"
    assert f"of host RAM for {model_folder.name}." in window.settings_page.snapshots_cost.text()  # what it costs
    for name in ("Models", "Engine", "Logs", "Settings", "Chat"):
        window.show_page(name)
        assert window.pages.currentIndex() == ["Chat", "Models", "Engine", "Logs", "Settings"].index(name)
    # the Engine page plans for the loaded model, not the synthetic placeholder
    window.engine_page.set_preset("4gb")
    assert window.engine_page.plan() is not None
    window.close()


def test_apply_now_reaches_the_worker_and_its_answer_the_status_bar(qtbot, tmp_path, settings, model_folder):
    window = open_window(qtbot, ConversationStore(tmp_path / "c.sqlite3"), settings, model_folder)
    with qtbot.waitSignal(window.worker.planSwitchFailed, timeout=60000) as failed:
        window.engine_page.switchRequested.emit()  # Apply now, queued to the worker with the settings' options
    assert failed.args[0].startswith("This plan needs the model loaded again: the loaded model runs on the CPU")
    qtbot.waitUntil(lambda: window.statusBar().currentMessage() == failed.args[0], timeout=10000)
    window.worker.planSwitched.emit(dict(window.model_info, context_tokens=2048))  # as after a switch on a GPU
    assert ", 2,048 tokens, CPU" in window.model_label.text() and window.model_info["context_tokens"] == 2048
    assert window.settings_page.model_info["context_tokens"] == 2048
    window.close()


def test_history_survives_a_restart(qtbot, tmp_path, settings, model_folder):
    settings.set("sampling", {"max_new_tokens": 4, "temperature": 0.0})
    db = tmp_path / "c.sqlite3"
    window = open_window(qtbot, ConversationStore(db), settings, model_folder)
    window.chat_page.input.setPlainText("Remember me")
    with qtbot.waitSignal(window.worker.replyFinished, timeout=60000):
        window.chat_page.send_current()
    window.chat_page.input.setPlainText("an unsent draft")
    qtbot.wait(600)  # the draft is saved after a short pause in typing
    window.close()
    window.store.close()

    store = ConversationStore(db)
    again = open_window(qtbot, store, settings, model_folder)
    chats = store.conversations()
    assert len(chats) == 1 and chats[0]["title"] == "Remember me"
    messages = store.messages(chats[0]["id"])
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[0]["content"] == "Remember me"
    assert messages[1]["stats"]["new_tokens"] == 4
    assert again.chat_page.input.toPlainText() == "an unsent draft"
    again.close()


def test_smoke_test_routine(qtbot, tmp_path, settings, model_folder):
    from app.__main__ import smoke_test

    settings.set("sampling", {"max_new_tokens": 4})
    window = MainWindow(ConversationStore(tmp_path / "c.sqlite3"), settings, model_folder)
    qtbot.addWidget(window)
    window.show()
    out = tmp_path / "shot.png"
    import qasync

    loop = qasync.QEventLoop(QApplication.instance(), already_running=False)
    asyncio.set_event_loop(loop)
    try:
        code = loop.run_until_complete(smoke_test(window, out))
    finally:
        asyncio.set_event_loop(None)
        loop.close()  # now, while Qt objects it uses still exist
    assert code == 0
    assert out.stat().st_size > 1000 and (tmp_path / "shot-engine.png").stat().st_size > 1000
    window.close()


def test_bad_model_folder_shows_the_error(qtbot, tmp_path, settings):
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    window = MainWindow(ConversationStore(tmp_path / "c.sqlite3"), settings, empty)
    qtbot.addWidget(window)
    window.show()
    # the load starts in the constructor, so its failure may come before any waitSignal could listen
    qtbot.waitUntil(lambda: window.load_error is not None, timeout=30000)
    assert "has no config.json" in window.load_error
    qtbot.waitUntil(
        lambda: window.models_page.error_banner.isVisible() or "config.json" in window.models_page.error_banner.text(),
        timeout=5000,
    )
    assert "config.json" in window.models_page.error_banner.text()
    window.close()


def test_settings_refused_at_startup_are_warnings_on_the_logs_page(qtbot, tmp_path, settings, model_folder):
    from app.pages.logs import LEVEL_ROLE, MESSAGE_ROLE

    settings._store.setValue("cpu_threads", "10000")
    settings.get("cpu_threads")  # read before the window exists: kept until the Logs page can show it
    window = open_window(qtbot, ConversationStore(tmp_path / "c.sqlite3"), settings, model_folder)
    records = window.logs_page.records
    found = [
        (records.index(row).data(LEVEL_ROLE), records.index(row).data(MESSAGE_ROLE))
        for row in range(records.rowCount())
    ]
    assert [r for r in found if "setting cpu_threads" in r[1]] == [("warning", settings.warnings[0])]
    assert "is '10000', not a whole number from 0 (physical cores)" in settings.warnings[0]
