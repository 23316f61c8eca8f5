"""The local API inside the app: the Settings page's switch serves the window's loaded demo model on loopback, the
status bar shows the port, API requests and window chats wait in one queue, the key never reaches a log, a port in
use is said in words, unloading answers 503, and switching off frees the port."""

from __future__ import annotations

import logging
import socket
import threading

import httpx
import pytest
from fake_openai_server import free_port
from PySide6.QtCore import QSettings
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QLineEdit

from app.main_window import MainWindow
from app.pages.server_section import KEY_SET_PLACEHOLDER
from app.paths import DEMO_MODEL
from app.settings import AppSettings
from app.storage import ConversationStore

KEY = "sk-app-server-7f3c9e"
LOAD_MS = 60_000
REPLY_MS = 60_000
QUESTION = [{"role": "user", "content": "What is 12 + 30?"}]


@pytest.fixture
def port():
    return free_port()


@pytest.fixture
def window(qtbot, tmp_path, settings, port):
    """The main window with the demo model loaded on the CPU; the API set to `port`, off."""
    settings.set("api_port", port)
    settings.set("cpu_threads", 1)  # the other core stays with the GUI thread
    settings.set("sampling", {"max_new_tokens": 8, "temperature": 0.0})
    window = MainWindow(ConversationStore(tmp_path / "c.sqlite3"), settings, DEMO_MODEL)
    qtbot.addWidget(window)
    window.show()
    qtbot.waitUntil(lambda: window.model_info is not None and window.chat_page.send_button.isEnabled(), timeout=LOAD_MS)
    yield window
    window.close()


def switch_api(qtbot, window, on: bool) -> None:
    """Turn the API on or off on the Settings page and wait until the status bar agrees."""
    window.settings_page.server_section.enable_check.setChecked(on)
    indicator = window.api_indicator
    qtbot.waitUntil(
        lambda: indicator.isVisible() and indicator.text().startswith("API :") if on else not indicator.isVisible(),
        timeout=10_000,
    )


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def chat(url: str, headers: dict | None = None, **fields) -> httpx.Response:
    body = {"model": "demo", "messages": QUESTION, "max_tokens": 6, "temperature": 0, **fields}
    return httpx.post(f"{url}/chat/completions", json=body, headers=headers or {}, timeout=REPLY_MS / 1000)


def test_the_switch_serves_the_windows_model_and_the_status_bar_shows_the_port(qtbot, window, port):
    section = window.settings_page.server_section
    url = f"http://127.0.0.1:{port}/v1"
    assert not window.api_indicator.isVisible() and section.url_field.text() == url
    switch_api(qtbot, window, True)
    assert window.api_indicator.text() == f"API :{port}"

    models = httpx.get(f"{url}/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [window.model_info["name"]]
    reply = chat(url)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["usage"]["completion_tokens"] == 6 and body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["reasoning_content"].startswith("12 + 30")  # the demo model's thinking
    prompt_tokens = body["usage"]["prompt_tokens"]
    qtbot.waitUntil(lambda: section.activity_label.text().startswith("API requests answered: 1."), timeout=10_000)
    assert f"{prompt_tokens:,} prompt tokens (0 cached), 6 generated at" in section.activity_label.text()

    section.copy_button.click()
    assert QGuiApplication.clipboard().text() == url

    switch_api(qtbot, window, False)
    assert port_is_free(port)  # the switch closed the port, not just the indicator
    assert section.status_label.text() == "Off."


def hold_engine(queue, delivered: list) -> threading.Event:
    """Submit an API request to `queue` that holds the engine until the returned event is set."""
    release = threading.Event()

    def held_request(session):
        release.wait(REPLY_MS / 1000)
        return iter(())

    queue.submit(held_request, delivered.append)
    return release


def test_a_window_chat_sent_while_an_api_request_runs_waits_then_answers(qtbot, window):
    queue, delivered = window.worker.queue, []
    release = hold_engine(queue, delivered)
    page = window.chat_page
    qtbot.waitUntil(lambda: page.api_note.isVisible(), timeout=10_000)
    assert queue.busy_with_api and page.api_note.text() == "Answering an API request…"
    assert page.send_button.isEnabled()  # the window may still send: its turn waits in the queue

    started = []
    window.worker.replyStarted.connect(lambda: started.append(True))
    page.input.setPlainText("What is 2 + 3?")
    page.send_current()
    qtbot.waitUntil(lambda: queue.queued == 1, timeout=10_000)  # the window's turn waits behind the request
    assert page.api_note.text() == "Answering an API request… your message is next."
    assert not started and not page.send_button.isEnabled()

    release.set()
    qtbot.waitUntil(lambda: page.send_button.isEnabled() and not page.api_note.isVisible(), timeout=REPLY_MS)
    assert delivered == [None] and started
    messages = window.store.messages(page.current_conversation_id())
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[1]["stats"]["stop_reason"] == "length" and messages[1]["stats"]["new_tokens"] == 8
    assert queue.requests_served == 0  # the window's turn is not an API request


def test_stopping_a_waiting_window_chat_takes_it_out_of_the_queue(qtbot, window):
    queue = window.worker.queue
    release = hold_engine(queue, [])
    page = window.chat_page
    qtbot.waitUntil(lambda: page.api_note.isVisible(), timeout=10_000)
    page.input.setPlainText("Never mind")
    page.send_current()
    qtbot.waitUntil(lambda: queue.queued == 1, timeout=10_000)
    page.stop()
    qtbot.waitUntil(page.send_button.isEnabled, timeout=10_000)
    assert queue.queued == 0
    messages = window.store.messages(page.current_conversation_id())
    assert messages[-1]["role"] == "assistant" and messages[-1]["stats"]["stop_reason"] == "cancelled"
    release.set()


def all_log_text(window, caplog, capfd) -> str:
    records = window.logs_page.records
    shown = [records.data(records.index(row)) for row in range(records.rowCount())]
    out, err = capfd.readouterr()
    return "\n".join([r.getMessage() for r in caplog.records] + shown + [out, err])


def test_the_key_guards_the_api_and_never_reaches_a_log(qtbot, window, port, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    section = window.settings_page.server_section
    assert section.key_field.echoMode() == QLineEdit.EchoMode.Password
    section.key_field.setText(KEY)
    section.key_field.editingFinished.emit()
    assert section.key_field.text() == "" and section.key_field.placeholderText() == KEY_SET_PLACEHOLDER
    assert window.settings.get("api_key") == KEY  # the settings file keeps it; nothing else shows it
    switch_api(qtbot, window, True)
    url = f"http://127.0.0.1:{port}/v1"
    assert chat(url).status_code == 401
    assert chat(url, {"Authorization": "Bearer sk-wrong"}).status_code == 401
    assert chat(url, {"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(f"{url}/models", headers={"x-api-key": KEY}, timeout=10).status_code == 200

    section.lan_check.setChecked(True)  # allowed now that a key is set: the server starts again on every interface
    qtbot.waitUntil(lambda: "other machines too" in section.status_label.text(), timeout=10_000)
    switch_api(qtbot, window, False)

    # a hand-edited key the settings cannot read is refused without quoting it
    store = QSettings(window.settings._store.fileName(), QSettings.Format.IniFormat)
    store.setValue("api_key", KEY)  # not JSON: unreadable
    AppSettings(store).get("api_key")
    text = all_log_text(window, caplog, capfd)
    assert "local API serving at" in text and "setting api_key" in text  # the logs were captured
    assert KEY not in text
    assert all(KEY not in label.text() for label in window.findChildren(type(section.status_label)))


def test_the_network_needs_a_key(qtbot, window):
    section = window.settings_page.server_section
    assert not section.lan_check.isEnabled()  # no key yet
    section.key_field.setText(KEY)
    section.key_field.editingFinished.emit()
    assert section.lan_check.isEnabled()
    section.lan_check.setChecked(True)
    section.remove_key_button.click()
    assert not section.lan_check.isChecked() and not section.lan_check.isEnabled()
    assert window.settings.get("api_allow_lan") is False and window.settings.get("api_key") == ""


def test_a_port_in_use_is_said_in_words_and_another_port_works(qtbot, window, port):
    section = window.settings_page.server_section
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        section.enable_check.setChecked(True)
        qtbot.waitUntil(lambda: "already in use" in section.status_label.text(), timeout=10_000)
    message = section.status_label.text()
    assert message == (
        f"The API is off: port {port} is already in use by another program (or another MoE Desk). "
        f"Choose another port in Settings → Local API (or close the program using it), then turn the "
        f"API on again."
    )
    assert window.api_indicator.text() == "API off: see Settings" and window.api_indicator.toolTip() == message
    assert not section.enable_check.isChecked() and window.isVisible()
    assert window.logs_page.last_error == message

    other = free_port()
    section.port_spin.setValue(other)
    section.port_spin.editingFinished.emit()
    switch_api(qtbot, window, True)
    assert window.api_indicator.text() == f"API :{other}"
    assert httpx.get(f"http://127.0.0.1:{other}/v1/models", timeout=10).status_code == 200


def test_while_no_model_is_loaded_the_api_answers_503_and_serves_the_next(qtbot, window, port):
    switch_api(qtbot, window, True)
    url = f"http://127.0.0.1:{port}/v1"
    with qtbot.waitSignal(window.worker.unloaded, timeout=10_000):
        window.models_page.unload_button.click()
    for reply in (httpx.get(f"{url}/models", timeout=10), chat(url)):
        assert reply.status_code == 503
        assert reply.json()["error"]["message"] == (
            "no model is loaded: open one in MoE Desk (its Models page), then send the request again"
        )
    claude = httpx.post(
        f"http://127.0.0.1:{port}/v1/messages",
        timeout=10,
        json={"model": "demo", "max_tokens": 4, "messages": QUESTION},
    )
    assert claude.status_code == 503 and claude.json()["type"] == "error"  # in Anthropic's shape there

    window.load_model(DEMO_MODEL)
    qtbot.waitUntil(lambda: window.model_info is not None, timeout=LOAD_MS)
    assert chat(url).status_code == 200  # the same server, the new model
    assert window.api_indicator.text() == f"API :{port}"


def test_closing_the_window_frees_the_port(qtbot, window, port):
    switch_api(qtbot, window, True)
    window.close()
    assert port_is_free(port) and not window.api_thread.isRunning()


def test_a_saved_switch_serves_at_startup(qtbot, tmp_path, settings, port):
    settings.set("api_server", True)
    settings.set("api_port", port)
    window = MainWindow(ConversationStore(tmp_path / "c.sqlite3"), settings, DEMO_MODEL)
    qtbot.addWidget(window)
    window.show()
    qtbot.waitUntil(lambda: window.api_indicator.text() == f"API :{port}", timeout=10_000)
    assert window.settings_page.server_section.enable_check.isChecked()
    window.close()


def test_a_request_waiting_when_the_model_is_unloaded_gets_503_in_words(qtbot, window, port):
    switch_api(qtbot, window, True)
    queue, url, replies = window.worker.queue, f"http://127.0.0.1:{port}/v1", []
    release = hold_engine(queue, [])
    qtbot.waitUntil(lambda: queue.busy_with_api, timeout=10_000)
    waiting = threading.Thread(target=lambda: replies.append(chat(url)))
    waiting.start()
    qtbot.waitUntil(lambda: queue.queued == 1, timeout=10_000)  # the request waits behind the held one
    window.models_page.unload_button.click()
    qtbot.waitUntil(lambda: bool(replies), timeout=10_000)  # answered while the held job still runs
    release.set()
    waiting.join(10)
    qtbot.waitUntil(lambda: window.model_info is None, timeout=10_000)
    assert replies[0].status_code == 503
    assert replies[0].json()["error"]["message"] == (
        "the model was unloaded (or the server stopped) before this "
        "request was answered; send it again once a model is loaded"
    )


def send_and_wait(qtbot, page, text: str) -> None:
    page.input.setPlainText(text)
    with qtbot.waitSignal(page.worker.replyFinished, timeout=REPLY_MS):
        page.send_current()
    qtbot.waitUntil(page.send_button.isEnabled, timeout=REPLY_MS)


def test_a_chat_goes_on_after_an_api_request_used_the_engine(qtbot, window, port):
    from app.storage import chat_history

    page = window.chat_page
    send_and_wait(qtbot, page, "What is 2 + 3?")
    switch_api(qtbot, window, True)
    assert chat(f"http://127.0.0.1:{port}/v1").status_code == 200  # the session's state now holds its prompt
    send_and_wait(qtbot, page, "And 4 + 4?")
    saved = window.store.messages(page.current_conversation_id())
    assert [m["role"] for m in saved] == ["user", "assistant"] * 2 and saved[3]["stats"]["stop_reason"] == "length"
    assert chat_history(saved) == window.worker.session.messages  # the chat's history was read again, whole


def test_a_failure_in_a_window_turn_ends_that_reply_and_the_queue_lives_on(qtbot, window, monkeypatch):
    from app.engine_worker import EngineWorker

    def broken(session):
        raise RuntimeError("the counters could not be read")

    monkeypatch.setattr(EngineWorker, "_runtime_measures", staticmethod(broken))
    page = window.chat_page
    send_and_wait(qtbot, page, "What is 2 + 3?")
    stats = window.store.messages(page.current_conversation_id())[-1]["stats"]
    assert stats["stop_reason"] == "error" and "the counters could not be read" in stats["error"]
    assert "RuntimeError: the counters could not be read" in window.logs_page.last_error

    monkeypatch.undo()
    send_and_wait(qtbot, page, "What is 2 + 3?")
    assert window.store.messages(page.current_conversation_id())[-1]["stats"]["stop_reason"] == "length"


def test_a_request_reaching_a_stopped_queue_gets_503_at_once(qtbot, window, port):
    """An unload between a route reading the model and queueing its job: the job is refused, never left waiting."""
    switch_api(qtbot, window, True)
    window.worker.queue.stop()  # as _release_model does, before server_context is cleared
    reply = chat(f"http://127.0.0.1:{port}/v1")
    assert reply.status_code == 503 and reply.json()["error"]["message"].startswith("the model was unloaded")
