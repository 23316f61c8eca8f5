"""Remote engines in the app, offscreen with pytest-qt against a fake OpenAI-compatible server on a loopback port:
the RemoteWorker on its QThread, the Add remote engine dialog, the Models page's remote rows, and the Chat page
streaming a remote reply through the same transcript."""

from __future__ import annotations

import pytest
from app_fakes import FakeWorker
from fake_openai_server import HANG, chunk, free_port
from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import QLineEdit

from app.dialogs.remote_dialog import RemoteEngineDialog
from app.pages.chat import ChatPage
from app.pages.models import COLUMNS, ModelsPage
from app.remote_store import RemoteEndpoint, RemoteStore
from app.storage import ConversationStore

KEY = "sk-remote-test-91c2"
REPLY_TIMEOUT_MS = 10_000
REPLY = [
    chunk(reasoning="Two and two "),
    chunk(reasoning="make four."),
    chunk(content="It is "),
    chunk(content="**4**."),
    chunk(finish="stop"),
    chunk(usage={"prompt_tokens": 20, "completion_tokens": 6}),
    "data: [DONE]\n\n",
]


@pytest.fixture
def remotes(settings):
    return RemoteStore(settings.remote_engines_path())


class EndpointSender(QObject):
    """Queues an endpoint to the worker's thread, as the main window does."""

    chosen = Signal(dict)


def choose(worker, endpoint: RemoteEndpoint) -> EndpointSender:
    sender = EndpointSender()
    sender.chosen.connect(worker.use_endpoint)
    sender.chosen.emit(endpoint.to_dict())
    return sender


class Recorder:
    """Every reply signal a worker emits, in order, as (name, args)."""

    def __init__(self, worker):
        self.events = []
        for name in (
            "replyStarted",
            "reasoningDelta",
            "answerDelta",
            "progress",
            "replyFinished",
            "busyChanged",
            "log",
        ):
            getattr(worker, name).connect(lambda *args, name=name: self.events.append((name, args)))

    def names(self):
        return [name for name, _ in self.events]

    def text(self, name):
        return "".join(args[0] for n, args in self.events if n == name)

    def finished(self):
        return next((args[0] for n, args in self.events if n == "replyFinished"), None)


class Asker(QObject):
    """Queues a send to the worker's thread, as the chat page does."""

    ask = Signal(list, str, dict)


def ask(worker, text, options=None) -> Asker:
    asker = Asker()
    asker.ask.connect(worker.send)
    asker.ask.emit([], text, options or {"enable_thinking": True, "system_prompt": "", "sampling": {}})
    return asker


# ---- the worker ---------------------------------------------------------------------------------------


def test_deltas_are_batched_between_emits_by_the_clock():
    from app.engine_worker import DELTA_INTERVAL_S, DeltaBuffer

    class Deltas(QObject):
        reasoning = Signal(str)
        answer = Signal(str)

    deltas, emitted = Deltas(), []
    deltas.reasoning.connect(lambda text: emitted.append(("reasoning", text)))
    deltas.answer.connect(lambda text: emitted.append(("answer", text)))
    now = [0.0]
    buffer = DeltaBuffer(deltas.reasoning, deltas.answer, clock=lambda: now[0])
    assert buffer.add("reasoning", "z")  # a reply's first text is due at once: a stalled stream still shows it
    buffer.flush()
    assert emitted == [("reasoning", "z")]
    emitted.clear()
    assert not buffer.add("reasoning", "a") and not buffer.add("answer", "b")
    now[0] = DELTA_INTERVAL_S / 2
    assert not buffer.add("answer", "c") and emitted == []
    now[0] = DELTA_INTERVAL_S
    assert buffer.add("reasoning", "d")
    buffer.flush()
    assert emitted == [("reasoning", "ad"), ("answer", "bc")]
    assert not buffer.add("answer", "e")  # the interval starts again at the flush
    buffer.flush()
    assert emitted[-1] == ("answer", "e")


def test_the_remote_worker_streams_a_reply_with_the_engine_worker_s_signals(qtbot, server, fake_api, remote):
    fake_api.script = REPLY
    events = Recorder(remote)
    keep = [choose(remote, RemoteEndpoint("vllm", server.url, "fake/model"))]
    keep.append(ask(remote, "2+2?", {"enable_thinking": False, "system_prompt": "terse", "sampling": {"seed": 1}}))
    qtbot.waitUntil(lambda: ("busyChanged", (False,)) in events.events, timeout=REPLY_TIMEOUT_MS)
    names = events.names()
    assert names[:2] == ["busyChanged", "replyStarted"] and names[-2:] == ["replyFinished", "busyChanged"]
    assert events.text("reasoningDelta") == "Two and two make four." and events.text("answerDelta") == "It is **4**."
    result = events.finished()
    assert (result["answer"], result["reasoning"]) == ("It is **4**.", "Two and two make four.")
    stats = result["stats"]
    assert stats["stop_reason"] == "eos" and stats["new_tokens"] == 6 and stats["error"] is None
    assert stats["remote"] == f"vllm @ {server.url.removeprefix('http://')}, model fake/model"
    sent = fake_api.requests[-1]
    assert sent["messages"] == [{"role": "system", "content": "terse"}, {"role": "user", "content": "2+2?"}]
    assert sent["chat_template_kwargs"] == {"enable_thinking": False} and sent["seed"] == 1


def test_stop_closes_the_remote_stream_and_keeps_what_came(qtbot, server, fake_api, remote):
    fake_api.script = [chunk(content="partial"), HANG]
    events = Recorder(remote)
    keep = [choose(remote, RemoteEndpoint("vllm", server.url, "fake/model")), ask(remote, "go on")]
    qtbot.waitUntil(lambda: events.text("answerDelta") == "partial", timeout=REPLY_TIMEOUT_MS)
    remote.stop()  # from the GUI thread, as the Stop button does
    qtbot.waitUntil(lambda: events.finished() is not None, timeout=REPLY_TIMEOUT_MS)
    assert events.finished()["answer"] == "partial"
    assert events.finished()["stats"]["stop_reason"] == "cancelled"
    assert fake_api.disconnected.wait(10)
    assert keep


def test_a_remote_failure_ends_the_reply_with_what_to_do_and_never_the_key(qtbot, remote):
    events = Recorder(remote)
    keep = [choose(remote, RemoteEndpoint("vllm", f"http://127.0.0.1:{free_port()}", "m", KEY)), ask(remote, "hi")]
    qtbot.waitUntil(lambda: events.finished() is not None, timeout=REPLY_TIMEOUT_MS)
    stats = events.finished()["stats"]
    assert stats["stop_reason"] == "error" and "refused the connection" in stats["error"]
    logged = [args for name, args in events.events if name == "log"]
    assert logged and all(KEY not in message for _, message in logged)
    assert keep


def test_without_a_remote_engine_the_worker_says_where_to_choose_one(qtbot, remote):
    events = Recorder(remote)
    keep = ask(remote, "hi")
    qtbot.waitUntil(lambda: events.finished() is not None, timeout=REPLY_TIMEOUT_MS)
    assert "Models page" in events.finished()["stats"]["error"]
    assert keep


# ---- the dialog ---------------------------------------------------------------------------------------


def open_dialog(qtbot, remotes) -> RemoteEngineDialog:
    dialog = RemoteEngineDialog(remotes)
    qtbot.addWidget(dialog)
    dialog.show()
    return dialog


def test_the_dialog_tests_the_connection_lists_the_models_and_saves_the_choice(qtbot, server, fake_api, remotes):
    fake_api.api_key = KEY
    fake_api.models = [{"id": "Qwen/Qwen3-30B-A3B", "owned_by": "sglang"}, {"id": "second", "owned_by": "sglang"}]
    dialog = open_dialog(qtbot, remotes)
    assert dialog.key_edit.echoMode() == QLineEdit.EchoMode.Password and not dialog.save_button.isEnabled()
    qtbot.keyClicks(dialog.url_edit, server.url.removeprefix("http://"))  # typed without the scheme
    qtbot.keyClicks(dialog.key_edit, KEY)
    with qtbot.waitSignal(dialog.tested, timeout=REPLY_TIMEOUT_MS) as tested:
        qtbot.mouseClick(dialog.test_button, Qt.MouseButton.LeftButton)
        assert not dialog.test_button.isEnabled()  # the test runs off the GUI thread; the dialog waits
    assert tested.args == [True]
    assert [dialog.model_list.item(i).text() for i in range(dialog.model_list.count())] == [
        "Qwen/Qwen3-30B-A3B  (sglang)",
        "second  (sglang)",
    ]
    assert dialog.banner.property("kind") == "ok" and "2 models" in dialog.banner.text()
    dialog.model_list.setCurrentRow(1)
    with qtbot.waitSignal(dialog.saved) as saved:
        qtbot.mouseClick(dialog.save_button, Qt.MouseButton.LeftButton)
    endpoint = remotes.get(saved.args[0])
    assert (endpoint.name, endpoint.base_url, endpoint.model, endpoint.api_key) == (
        "sglang",
        server.url + "/v1",
        "second",
        KEY,
    )
    assert dialog.key_edit.text() == "" and not dialog.isVisible()


@pytest.mark.parametrize(
    "address, key, words",
    [
        ("{server}", "wrong", "the key was refused"),
        ("{server}/elsewhere", KEY, "no OpenAI-compatible API at this URL"),
        ("http://127.0.0.1:{free}", KEY, "refused the connection"),
    ],
)
def test_the_dialog_says_why_a_server_cannot_be_used(qtbot, server, fake_api, remotes, address, key, words):
    fake_api.api_key = KEY
    dialog = open_dialog(qtbot, remotes)
    dialog.url_edit.setText(address.format(server=server.url, free=free_port()))
    dialog.key_edit.setText(key)
    with qtbot.waitSignal(dialog.tested, timeout=REPLY_TIMEOUT_MS) as tested:
        dialog.test_connection()
    assert tested.args == [False]
    assert dialog.banner.property("kind") == "error" and words in dialog.banner.text()
    assert dialog.model_list.count() == 0 and not dialog.save_button.isEnabled()
    assert key not in dialog.banner.text()


def test_a_bad_address_is_refused_before_any_connection(qtbot, remotes):
    dialog = open_dialog(qtbot, remotes)
    dialog.url_edit.setText("ftp://files.example.com")
    dialog.test_connection()
    assert not dialog.testing() and "not a server address" in dialog.banner.text()


def test_editing_the_address_after_a_test_forgets_its_models(qtbot, server, fake_api, remotes):
    dialog = open_dialog(qtbot, remotes)
    dialog.url_edit.setText(server.url)
    with qtbot.waitSignal(dialog.tested, timeout=REPLY_TIMEOUT_MS):
        dialog.test_connection()
    assert dialog.save_button.isEnabled()
    qtbot.keyClicks(dialog.url_edit, "0")  # another port now: its models are unknown
    assert dialog.model_list.count() == 0 and not dialog.save_button.isEnabled()


# ---- the Models page ----------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def empty_library(tmp_path, monkeypatch):
    """The Models page lists only what a test adds: no Hugging Face cache, no demo model."""
    (tmp_path / "hub").mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("app.model_library.DEMO_MODEL", tmp_path / "no-demo-model")


def models_page(qtbot, settings, remotes) -> ModelsPage:
    page = ModelsPage(FakeWorker(), settings, remotes=remotes)
    qtbot.addWidget(page)
    qtbot.waitSignal(page.libraryScanned).wait()
    return page


def cell(page, row, column):
    return page.library.index(row, COLUMNS.index(column)).data()


def test_a_saved_remote_is_listed_with_its_host_and_answers_once_used(qtbot, server, fake_api, settings, remotes):
    page = models_page(qtbot, settings, remotes)
    dialog = page.open_remote_dialog()
    dialog.url_edit.setText(server.url)
    with qtbot.waitSignal(dialog.tested, timeout=REPLY_TIMEOUT_MS):
        dialog.test_connection()
    dialog.save()
    host = server.url.removeprefix("http://")
    row = page.selected_row()
    assert row == 0 and [cell(page, row, c) for c in ("Name", "Architecture", "Format", "Status")] == [
        "fake/model",
        "remote: vllm",
        "OpenAI API",
        f"remote @ {host}",
    ]
    assert page.load_button.text() == "Use" and page.load_button.isEnabled() and page.remove_button.isVisibleTo(page)
    assert "no API key" in page.library.index(row, 0).data(Qt.ItemDataRole.ToolTipRole)
    endpoint_id = remotes.endpoints()[0].id
    with qtbot.waitSignal(page.engineChosen) as chosen:
        qtbot.mouseClick(page.load_button, Qt.MouseButton.LeftButton)
    assert chosen.args == [endpoint_id] and settings.get("chat_engine") == endpoint_id
    assert cell(page, row, "Status") == f"answering chats · remote @ {host}"
    assert f"remote: vllm @ {host}, model fake/model" in page.status_label.text()

    with qtbot.waitSignal(page.engineChosen) as chosen:
        qtbot.mouseClick(page.remove_button, Qt.MouseButton.LeftButton)
    assert chosen.args == [""] and settings.get("chat_engine") == "" and page.library.rowCount() == 0
    assert RemoteStore(settings.remote_engines_path()).endpoints() == []


def test_loading_a_local_model_takes_the_chats_back_from_a_remote(qtbot, settings, remotes, tmp_path):
    from engine.testing.tiny_checkpoints import write_tiny_checkpoint

    endpoint = RemoteEndpoint("vllm", "http://10.0.0.5:8000", "big/model", KEY)
    remotes.add(endpoint)
    settings.set("chat_engine", endpoint.id)
    folder = write_tiny_checkpoint(tmp_path / "m", "qwen3_5_moe", "bf16")
    settings.set("model_folders", [str(folder)])
    page = models_page(qtbot, settings, remotes)
    assert page.chosen_remote_id() == endpoint.id
    remote_row = page.library.remote_row(endpoint.id)
    assert remote_row == 1 and cell(page, remote_row, "Status") == "answering chats · remote @ 10.0.0.5:8000"
    assert "an API key is saved (never shown)" in page.library.index(remote_row, 0).data(Qt.ItemDataRole.ToolTipRole)
    assert all(KEY not in str(cell(page, remote_row, c)) for c in COLUMNS)
    with qtbot.waitSignal(page.engineChosen) as chosen:
        page.load_row(page.library.row_of(str(folder)))
    assert chosen.args == [""] and settings.get("chat_engine") == ""
    assert cell(page, remote_row, "Status") == "remote @ 10.0.0.5:8000"


# ---- the Chat page --------------------------------------------------------------------------------------


def test_the_chat_page_streams_a_remote_reply_and_says_who_answers(qtbot, server, fake_api, settings, remote, tmp_path):
    fake_api.script = REPLY
    endpoint = RemoteEndpoint("vllm", server.url, "fake/model")
    keep = choose(remote, endpoint)
    store = ConversationStore(tmp_path / "c.sqlite3")
    page = ChatPage(store, FakeWorker(), settings)
    qtbot.addWidget(page)
    page.show()
    assert page.engine_text() == "Answering: local"
    page.set_engine(remote, f"remote: {endpoint.label()}")
    assert page.engine_text() == f"Answering: remote: vllm @ {endpoint.host}, model fake/model"
    qtbot.keyClicks(page.input, "2+2?")
    qtbot.keyClick(page.input, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: page.send_button.isEnabled(), timeout=REPLY_TIMEOUT_MS)
    bubble = page.transcript.bubbles[-1]
    assert bubble.reasoning_section.text_label.text() == "Two and two make four."
    assert bubble.answer == "It is **4**."
    assert bubble.stats_label.text().startswith("6 tokens · TTFT ")
    assert bubble.stats_label.text().endswith(f"stop: eos · remote: vllm @ {endpoint.host}, model fake/model")
    saved = store.messages(page.current_conversation_id())[-1]
    assert (saved["content"], saved["reasoning"]) == ("It is **4**.", "Two and two make four.")
    assert fake_api.requests[-1]["messages"][-1] == {"role": "user", "content": "2+2?"}
    assert keep


def test_switching_engines_mid_reply_waits_for_the_reply_to_end(qtbot, settings, tmp_path):
    local, other = FakeWorker(), FakeWorker()
    page = ChatPage(ConversationStore(tmp_path / "c.sqlite3"), local, settings, engine="local: demo")
    qtbot.addWidget(page)
    qtbot.keyClicks(page.input, "first")
    qtbot.keyClick(page.input, Qt.Key.Key_Return)
    local.start_reply()
    page.set_engine(other, "remote: elsewhere")
    assert page.worker is local and page.engine_text() == "Answering: local: demo"
    local.stream(answer=["still local"])
    local.finish("still local")
    assert page.worker is other and page.engine_text() == "Answering: remote: elsewhere"
    assert page.transcript.bubbles[-1].answer == "still local"
    local.busyChanged.emit(True)  # the local engine loading a model no longer holds the remote chat
    qtbot.keyClicks(page.input, "second")
    qtbot.keyClick(page.input, Qt.Key.Key_Return)
    assert [text for _, text, _ in other.sent] == ["second"] and [text for _, text, _ in local.sent] == ["first"]


# ---- the window -----------------------------------------------------------------------------------------


def test_the_window_chats_through_the_chosen_remote_and_back_to_local(
    qtbot, server, fake_api, settings, remotes, tmp_path, tiny_checkpoint
):
    from app.main_window import MainWindow

    fake_api.script = REPLY
    endpoint = RemoteEndpoint("vllm", server.url, "fake/model", KEY)
    remotes.add(endpoint)
    settings.set("chat_engine", endpoint.id)  # chosen in an earlier session
    folder = tiny_checkpoint("qwen3_5_moe", "bf16")
    window = MainWindow(ConversationStore(tmp_path / "c.sqlite3"), settings, folder)
    qtbot.addWidget(window)
    with qtbot.waitSignal(window.worker.loaded, timeout=60_000):
        window.show()
    page = window.chat_page
    assert page.worker is window.remote_worker
    assert page.engine_text() == f"Answering: remote: vllm @ {endpoint.host}, model fake/model"
    qtbot.keyClicks(page.input, "2+2?")
    qtbot.keyClick(page.input, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: page.send_button.isEnabled() and bool(page.transcript.bubbles[-1].answer), timeout=20_000)
    assert page.transcript.bubbles[-1].answer == "It is **4**."
    assert fake_api.headers[-1]["authorization"] == f"Bearer {KEY}"

    window.models_page.choose_engine("")  # as loading a local model does
    assert page.worker is window.worker and page.engine_text() == f"Answering: local: {folder.name}"
    window.close()
