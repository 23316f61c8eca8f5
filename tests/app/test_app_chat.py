"""The Chat page and its widgets, driven with pytest-qt: a scripted FakeWorker for the page's own logic,
and the real EngineWorker on its QThread with a tiny checkpoint for the whole path."""

from __future__ import annotations

import time

import pytest
import torch
from app_fakes import FakeWorker
from PySide6.QtCore import QObject, Qt, QTimer, Signal, Slot
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QLineEdit, QMessageBox

from app.engine_worker import start_worker
from app.pages.chat import ChatPage, SystemPromptDialog, engine_history, title_from
from app.storage import chat_history
from app.widgets.chat_input import ChatInput
from app.widgets.conversation_list import ConversationList
from app.widgets.transcript import (
    RENDER_INTERVAL_MS,
    AssistantBubble,
    Block,
    CodeBlock,
    MarkdownPart,
    Transcript,
    UserBubble,
    format_stats,
    split_code_blocks,
)

REAL_REPLY_TIMEOUT_MS = 20_000


def make_page(qtbot, store, worker, settings) -> ChatPage:
    page = ChatPage(store, worker, settings)
    qtbot.addWidget(page)
    page.resize(1000, 700)
    page.show()
    return page


def last_bubble(page: ChatPage):
    return page.transcript.bubbles[-1]


def type_and_send(qtbot, page: ChatPage, text: str) -> None:
    qtbot.keyClicks(page.input, text)
    qtbot.keyClick(page.input, Qt.Key.Key_Return)


def shown_answer(bubble: AssistantBubble) -> str:
    """The answer as rendered: prose parts and code, in order."""
    parts = bubble.answer_view.parts
    return "\n".join(part.source if isinstance(part, MarkdownPart) else part.code() for part in parts)


# ---- widgets ------------------------------------------------------------------------------------


def test_enter_submits_and_shift_enter_inserts_a_newline(qtbot):
    box = ChatInput()
    qtbot.addWidget(box)
    qtbot.keyClicks(box, "first")
    qtbot.keyClick(box, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(box, "second")
    assert box.toPlainText() == "first\nsecond"
    with qtbot.waitSignal(box.submitted) as submitted:
        qtbot.keyClick(box, Qt.Key.Key_Enter)
    assert submitted.args == ["first\nsecond"]
    assert box.toPlainText() == "first\nsecond"  # clearing is the page's call, once it accepts the message


def test_fenced_code_blocks_are_split_from_prose():
    source = "Intro\n\n```python\nprint(1)\n\nprint(2)\n```\nMiddle\n~~~~\n```not a close\n~~~~\n\n```js\nlet x"
    assert split_code_blocks(source) == [
        Block("markdown", "Intro\n"),
        Block("code", "print(1)\n\nprint(2)", "python"),
        Block("markdown", "Middle"),
        Block("code", "```not a close", ""),
        Block("code", "let x", "js"),  # still streaming: the open fence runs to the end
    ]
    assert split_code_blocks("") == []


def test_stats_line_reads_like_the_other_apps():
    stats = {"new_tokens": 42, "time_to_first_token_s": 0.123, "decode_tokens_per_s": 23.44, "stop_reason": "eos"}
    assert format_stats(stats) == "42 tokens · TTFT 0.12 s · 23.4 tok/s · stop: eos"
    assert format_stats({"stop_reason": "error", "error": "boom"}) == "stop: error"


def test_code_block_copy_button_puts_its_code_on_the_clipboard(qtbot):
    bubble = AssistantBubble(
        {"role": "assistant", "content": "Run:\n```sh\nls -la\n```\nthen\n```\nexit\n```", "reasoning": "", "stats": {}}
    )
    qtbot.addWidget(bubble)
    code_blocks = [p for p in bubble.answer_view.parts if isinstance(p, CodeBlock)]
    assert [c.code() for c in code_blocks] == ["ls -la", "exit"]
    qtbot.mouseClick(code_blocks[0].copy_button, Qt.MouseButton.LeftButton)
    assert QGuiApplication.clipboard().text() == "ls -la"
    assert code_blocks[0].copy_button.text() == "Copied"


def test_streaming_bubble_coalesces_renders_and_folds_the_thinking_away(qtbot, monkeypatch):
    bubble = AssistantBubble()
    qtbot.addWidget(bubble)
    bubble.show()
    renders = []
    render = bubble.answer_view.set_markdown
    monkeypatch.setattr(bubble.answer_view, "set_markdown", lambda source: (renders.append(source), render(source)))

    bubble.append_reasoning("Let me think.")
    qtbot.waitUntil(lambda: bubble.reasoning_section.isVisible())
    assert bubble.reasoning_section.is_expanded()
    assert bubble.reasoning_section.toggle.text() == "Thinking…"

    started = time.perf_counter()
    for _ in range(100):
        bubble.append_answer("word ")
        qtbot.wait(2)
    qtbot.waitUntil(lambda: renders and renders[-1] == "word " * 100)
    elapsed_ms = (time.perf_counter() - started) * 1000
    assert len(renders) <= elapsed_ms / RENDER_INTERVAL_MS + 2  # about 20 a second, not one per delta
    assert not bubble.reasoning_section.is_expanded()  # folded once the answer began

    qtbot.mouseClick(bubble.reasoning_section.toggle, Qt.MouseButton.LeftButton)
    assert bubble.reasoning_section.is_expanded() and bubble.reasoning_section.text_label.isVisible()

    bubble.finish("Final **answer**", "Let me think.", {"new_tokens": 3, "stop_reason": "eos"})
    assert shown_answer(bubble) == "Final **answer**"
    assert bubble.stats_label.text() == "3 tokens · stop: eos"
    assert bubble.reasoning_section.toggle.text() == "Thoughts"


def test_transcript_follows_the_bottom_only_while_the_user_is_there(qtbot):
    transcript = Transcript()
    qtbot.addWidget(transcript)
    transcript.resize(500, 300)
    transcript.show()
    transcript.show_messages([{"role": "user", "content": f"message {i}\n" * 3} for i in range(20)])
    bar = transcript.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0 and bar.value() == bar.maximum())

    transcript.add_message({"role": "user", "content": "one more\n" * 3})
    qtbot.waitUntil(lambda: bar.value() == bar.maximum())

    bar.setValue(0)  # the user scrolls up to read
    old_maximum = bar.maximum()
    transcript.add_message({"role": "user", "content": "and another\n" * 3})
    qtbot.waitUntil(lambda: bar.maximum() > old_maximum)
    qtbot.wait(20)
    assert bar.value() == 0


def test_conversation_list_renames_with_f2_and_searches(qtbot, store):
    first = store.create("Holiday plans")
    second = store.create("Sorting in Rust")
    store.add_message(first, "user", "Where is the best beach?")
    panel = ConversationList(store)
    qtbot.addWidget(panel)
    panel.show()
    panel.select(second)

    with qtbot.waitSignal(panel.conversationRenamed) as renamed:
        panel.view.setFocus()
        qtbot.keyClick(panel.view, Qt.Key.Key_F2)
        editor = panel.view.viewport().findChild(QLineEdit)
        editor.selectAll()
        qtbot.keyClicks(editor, "Rust sorting")
        qtbot.keyClick(editor, Qt.Key.Key_Return)
    assert renamed.args == [second]
    assert store.conversation(second)["title"] == "Rust sorting"

    qtbot.keyClicks(panel.search_field, "beach")  # matches a message, not a title
    assert panel.model.rowCount() == 1 and panel.model.row_of(first) == 0
    panel.clear_search()
    assert panel.model.rowCount() == 2


# ---- the page, with a scripted worker -----------------------------------------------------------


def test_send_streams_into_a_bubble_and_saves_the_reply_as_it_grows(qtbot, store, fake, settings):
    page = make_page(qtbot, store, fake, settings)
    conversation_id = page.current_conversation_id()
    type_and_send(qtbot, page, "Hello there, what is a mixture of experts model anyway?")

    history, text, options = fake.sent[-1]
    assert (history, text) == ([], "Hello there, what is a mixture of experts model anyway?")
    assert options == {"enable_thinking": True, "system_prompt": "", "sampling": {}}
    assert page.input.toPlainText() == ""
    assert page.title_label.text() == title_from(text) == "Hello there, what is a mixture of…"
    assert store.conversation(conversation_id)["title"] == title_from(text)
    assert not page.send_button.isEnabled() and page.stop_button.isEnabled()

    fake.start_reply()
    fake.stream(reasoning=["The user asks ", "about MoE."], answer=["A model whose ", "layers pick experts."])
    bubble = last_bubble(page)
    qtbot.waitUntil(lambda: shown_answer(bubble) == "A model whose layers pick experts.")
    assert bubble.reasoning_section.text_label.text() == "The user asks about MoE."
    saved = lambda: store.messages(conversation_id)[-1]  # noqa: E731
    qtbot.waitUntil(lambda: saved()["content"] == "A model whose layers pick experts.", timeout=2000)
    assert saved()["reasoning"] == "The user asks about MoE."
    assert saved()["stats"] == {}  # the stats come with the end

    fake.finish("A model whose layers pick experts.", "The user asks about MoE.", new_tokens=9)
    assert saved()["stats"]["new_tokens"] == 9
    assert bubble.stats_label.text() == "9 tokens · TTFT 0.12 s · 23.4 tok/s · stop: eos"
    assert page.send_button.isEnabled() and not page.stop_button.isEnabled()
    assert bubble.regenerate_button.isVisibleTo(bubble)

    type_and_send(qtbot, page, "Thanks")
    history, text, _ = fake.sent[-1]
    assert history == chat_history(store.messages(conversation_id)[:2]) and text == "Thanks"


def test_send_is_held_while_the_worker_is_busy_but_stop_is_not(qtbot, store, fake, settings):
    page = make_page(qtbot, store, fake, settings)
    fake.busyChanged.emit(True)  # loading a model, say
    type_and_send(qtbot, page, "too early")
    assert fake.sent == [] and not page.send_button.isEnabled()
    assert page.input.toPlainText() == "too early"  # kept, to send once the model is ready
    fake.busyChanged.emit(False)
    qtbot.mouseClick(page.send_button, Qt.MouseButton.LeftButton)
    assert fake.sent[-1][1] == "too early"

    fake.start_reply()
    fake.stream(answer=["par"])
    qtbot.mouseClick(page.stop_button, Qt.MouseButton.LeftButton)
    assert fake.stop_calls == 1
    fake.finish("par", stop_reason="cancelled", new_tokens=1)
    assert store.messages(page.current_conversation_id())[-1]["content"] == "par"
    assert last_bubble(page).stats_label.text().endswith("stop: cancelled")


def test_a_failed_reply_shows_its_error_and_keeps_the_question(qtbot, store, fake, settings):
    page = make_page(qtbot, store, fake, settings)
    conversation_id = page.current_conversation_id()
    type_and_send(qtbot, page, "Summarise this very long text")
    fake.start_reply()
    fake.finish("", stop_reason="error", error="The prompt needs 9000 tokens but the context holds 8192.")

    bubble = last_bubble(page)
    assert bubble.error_label.isVisibleTo(bubble)
    assert bubble.error_label.text() == "The prompt needs 9000 tokens but the context holds 8192."
    messages = store.messages(conversation_id)
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[0]["content"] == "Summarise this very long text"
    assert page.send_button.isEnabled()

    # the worker refuses before starting when no model is loaded: no replyStarted at all
    type_and_send(qtbot, page, "Hello?")
    fake.replyFinished.emit(
        {
            "answer": "",
            "reasoning": "",
            "stats": {"stop_reason": "error", "error": "No model is loaded. Open one on the Models page."},
        }
    )
    assert last_bubble(page).error_label.text() == "No model is loaded. Open one on the Models page."

    # failed replies are not part of what the model is told happened
    type_and_send(qtbot, page, "Try again")
    history, _, _ = fake.sent[-1]
    assert history == [
        {"role": "user", "content": "Summarise this very long text"},
        {"role": "user", "content": "Hello?"},
    ]
    assert engine_history(store.messages(conversation_id)) == history + [{"role": "user", "content": "Try again"}]


def test_regenerate_adds_a_version_and_keeps_the_earlier_reply(qtbot, store, fake, settings):
    page = make_page(qtbot, store, fake, settings)
    conversation_id = page.current_conversation_id()
    type_and_send(qtbot, page, "Name a colour")
    fake.reply("Blue.")
    type_and_send(qtbot, page, "Another one")
    fake.reply("Red.")

    replies = [b for b in page.transcript.bubbles if isinstance(b, AssistantBubble)]
    assert [b.regenerate_button.isVisibleTo(b) for b in replies] == [False, True]  # only on the last reply
    qtbot.mouseClick(last_bubble(page).regenerate_button, Qt.MouseButton.LeftButton)
    history, text, _ = fake.sent[-1]
    assert text == "Another one"
    assert history == [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "Blue."}]
    assert len(page.transcript.bubbles) == 3

    fake.reply("Green.")
    shown = store.messages(conversation_id)
    assert [m["content"] for m in shown] == ["Name a colour", "Blue.", "Another one", "Green."]
    assert (shown[-1]["version"], shown[-1]["versions"]) == (2, 2)
    assert shown_answer(last_bubble(page)) == "Green."
    pager = last_bubble(page).pager
    assert pager.isVisibleTo(last_bubble(page)) and pager.label.text() == "2/2"
    assert "Red." in [m["content"] for m in store.tree(conversation_id)]  # the earlier reply is kept

    qtbot.mouseClick(pager.previous_button, Qt.MouseButton.LeftButton)
    assert shown_answer(last_bubble(page)) == "Red." and last_bubble(page).pager.label.text() == "1/2"
    assert store.messages(conversation_id)[-1]["content"] == "Red."  # the shown version is remembered


def test_edit_and_resend_makes_a_branch_and_keeps_the_old_one(qtbot, store, fake, settings):
    page = make_page(qtbot, store, fake, settings)
    conversation_id = page.current_conversation_id()
    type_and_send(qtbot, page, "What is 2 + 2?")
    fake.reply("4")
    type_and_send(qtbot, page, "And times 3?")
    fake.reply("12")

    first = page.transcript.bubbles[0]
    assert isinstance(first, UserBubble)
    qtbot.mouseClick(first.edit_button, Qt.MouseButton.LeftButton)
    assert first.editor.toPlainText() == "What is 2 + 2?"
    first.editor.setPlainText("What is 2 + 3?")
    qtbot.mouseClick(first.save_button, Qt.MouseButton.LeftButton)

    assert fake.sent[-1][:2] == ([], "What is 2 + 3?")
    assert [m["content"] for m in store.messages(conversation_id)] == ["What is 2 + 3?"]
    assert [b.text for b in page.transcript.bubbles] == ["What is 2 + 3?"]
    assert page.transcript.bubbles[0].pager.label.text() == "2/2"
    fake.reply("5")
    assert [m["content"] for m in store.messages(conversation_id)] == ["What is 2 + 3?", "5"]

    # paging back to the first version shows its branch's later turns, and the engine gets that branch next
    qtbot.mouseClick(page.transcript.bubbles[0].pager.previous_button, Qt.MouseButton.LeftButton)
    assert [m["content"] for m in store.messages(conversation_id)] == ["What is 2 + 2?", "4", "And times 3?", "12"]
    assert len(page.transcript.bubbles) == 4 and shown_answer(last_bubble(page)) == "12"
    type_and_send(qtbot, page, "And minus 1?")
    assert fake.sent[-1][0] == chat_history(store.messages(conversation_id)[:4])
    fake.reply("11")
    qtbot.mouseClick(page.transcript.bubbles[0].pager.next_button, Qt.MouseButton.LeftButton)
    assert [m["content"] for m in store.messages(conversation_id)] == ["What is 2 + 3?", "5"]


def test_the_draft_survives_a_restart(qtbot, store, fake, settings):
    page = make_page(qtbot, store, fake, settings)
    conversation_id = page.current_conversation_id()
    qtbot.keyClicks(page.input, "half a thought")
    qtbot.waitUntil(lambda: store.conversation(conversation_id)["draft"] == "half a thought", timeout=2000)
    page.close()

    reopened = make_page(qtbot, store, FakeWorker(), settings)
    assert reopened.current_conversation_id() == conversation_id
    assert reopened.input.toPlainText() == "half a thought"


def test_thinking_and_system_prompt_are_kept_per_chat(qtbot, store, fake, settings):
    page = make_page(qtbot, store, fake, settings)
    first = page.current_conversation_id()
    page.thinking_box.setChecked(False)
    qtbot.mouseClick(page.system_prompt_button, Qt.MouseButton.LeftButton)
    dialog = page.findChild(SystemPromptDialog)
    dialog.editor.setPlainText("Answer like a pirate.")
    dialog.accept()
    assert store.conversation(first)["enable_thinking"] is False
    assert store.conversation(first)["system_prompt"] == "Answer like a pirate."

    type_and_send(qtbot, page, "Hi")
    assert fake.sent[-1][2] == {"enable_thinking": False, "system_prompt": "Answer like a pirate.", "sampling": {}}
    fake.reply("Arr.")

    page.new_chat()
    assert page.thinking_box.isChecked()  # the settings' default for new chats
    page.open_conversation(first)
    assert not page.thinking_box.isChecked()
    assert page.system_prompt_button.toolTip() == "Answer like a pirate."


def test_new_rename_delete_from_the_page(qtbot, store, fake, settings, monkeypatch):
    page = make_page(qtbot, store, fake, settings)
    first = page.current_conversation_id()
    type_and_send(qtbot, page, "First chat")
    fake.reply("ok")

    qtbot.mouseClick(page.conversation_list.new_button, Qt.MouseButton.LeftButton)
    second = page.current_conversation_id()
    assert second != first and page.transcript.bubbles == [] and page.title_label.text() == "New chat"
    assert [c["id"] for c in store.conversations()] == [second, first]

    page.conversation_list.model.setData(page.conversation_list.model.index(1), "Renamed first")
    assert store.conversation(first)["title"] == "Renamed first"
    assert page.title_label.text() == "New chat"  # the open chat is the other one

    monkeypatch.setattr(QMessageBox, "question", lambda *args: QMessageBox.StandardButton.No)
    assert not page.conversation_list.delete(second)
    monkeypatch.setattr(QMessageBox, "question", lambda *args: QMessageBox.StandardButton.Yes)
    assert page.conversation_list.delete(second)
    assert store.conversation(second) is None
    assert page.current_conversation_id() == first  # the next chat opens
    assert page.title_label.text() == "Renamed first" and len(page.transcript.bubbles) == 2


def test_a_reply_keeps_streaming_into_its_own_chat_while_another_is_open(qtbot, store, fake, settings):
    page = make_page(qtbot, store, fake, settings)
    streaming = page.current_conversation_id()
    type_and_send(qtbot, page, "Write a long poem")
    fake.start_reply()
    fake.stream(answer=["Roses "])

    page.new_chat()
    fake.stream(answer=["are red"])
    assert page.transcript.bubbles == []  # nothing leaks into the other chat

    page.open_conversation(streaming)
    bubble = last_bubble(page)
    qtbot.waitUntil(lambda: shown_answer(bubble) == "Roses are red")
    fake.finish("Roses are red", new_tokens=3)
    assert store.messages(streaming)[-1]["content"] == "Roses are red"
    assert bubble.stats_label.text().startswith("3 tokens")


# ---- the page with the real engine on its thread ------------------------------------------------


class ModelLoader(QObject):
    """Asks the worker to load a model the way the app does: through a queued signal."""

    loadRequested = Signal(str, dict)


class ReplyWatcher(QObject):
    """Notes what the reply bubble had received when replyFinished reached the GUI thread; connected
    before the page, so it runs before the page's own handler."""

    def __init__(self, worker):
        super().__init__()
        self.page: ChatPage | None = None
        self.seen_before_end: list[tuple[str, str, str, str]] = []  # answer, reasoning received and shown
        worker.replyFinished.connect(self.on_reply_finished)

    @Slot(dict)
    def on_reply_finished(self, _result: dict) -> None:
        bubble = last_bubble(self.page)
        self.seen_before_end.append(
            (bubble.answer, bubble.reasoning, shown_answer(bubble), bubble.reasoning_section.text_label.text())
        )


class GuiThreadLoad(QObject):
    """How long the GUI thread went between the ticks of a 5 ms timer, in CPU time of its own and in wall time.
    Its own CPU time is the work done on it (rendering, handlers, a collector's pass it started); wall time adds
    what the OS or another thread's GIL hold cost, which a loaded 2-core CI machine stretched to 108 ms."""

    def __init__(self):
        super().__init__()
        self.worst_busy_ms = 0.0
        self.worst_wait_ms = 0.0
        self._last = (time.perf_counter(), time.thread_time())
        self._timer = QTimer(self, interval=5, timerType=Qt.TimerType.PreciseTimer, timeout=self._tick)
        self._timer.start()

    def _tick(self) -> None:
        now = (time.perf_counter(), time.thread_time())
        self.worst_wait_ms = max(self.worst_wait_ms, (now[0] - self._last[0]) * 1000 - 5)
        self.worst_busy_ms = max(self.worst_busy_ms, (now[1] - self._last[1]) * 1000)
        self._last = now


@pytest.fixture
def real_worker(qtbot, tiny_checkpoint):
    worker, thread = start_worker()
    loader = ModelLoader()
    loader.loadRequested.connect(worker.load)
    threads = torch.get_num_threads()
    # One engine thread leaves the 2-core test machine a core for the GUI thread, whose waits are checked
    with qtbot.waitSignal(worker.loaded, timeout=REAL_REPLY_TIMEOUT_MS):
        loader.loadRequested.emit(str(tiny_checkpoint("qwen3_5_moe", "bf16")), {"cpu_threads": 1})
    yield worker
    worker.stop()
    worker.shutdown()
    thread.quit()
    thread.wait()
    torch.set_num_threads(threads)


def wait_for_reply(qtbot, page: ChatPage, worker, action) -> dict:
    """Run `action`, wait for the reply it causes and for the page to take the next message."""
    with qtbot.waitSignal(worker.replyFinished, timeout=REAL_REPLY_TIMEOUT_MS) as finished:
        action()
    qtbot.waitUntil(page.send_button.isEnabled)  # the worker's busyChanged(False) follows its replyFinished
    return finished.args[0]


def test_real_engine_streams_a_reply_into_the_page(qtbot, store, settings, real_worker):
    settings.set("sampling", {"max_new_tokens": 160, "seed": 6})  # long enough for several renders mid-reply
    watcher = ReplyWatcher(real_worker)
    page = watcher.page = make_page(qtbot, store, real_worker, settings)
    conversation_id = page.current_conversation_id()

    load = GuiThreadLoad()
    started = time.perf_counter()
    result = wait_for_reply(qtbot, page, real_worker, lambda: type_and_send(qtbot, page, "Hello"))
    assert result["stats"]["stop_reason"] in ("eos", "length")

    # thinking is on, so the tiny model's text arrives as reasoning deltas, shown before the end
    [(answer, reasoning, shown, shown_reasoning)] = watcher.seen_before_end
    assert reasoning and shown_reasoning and reasoning.startswith(shown_reasoning)
    assert (answer, shown) == ("", "")
    reply_ms = (time.perf_counter() - started) * 1000
    assert load.worst_busy_ms < 50, f"the GUI thread was busy {load.worst_busy_ms:.0f} ms at a stretch in a reply"
    # a GUI that waited on the engine (a blocking call, a lock) would wait most of the reply
    assert load.worst_wait_ms < reply_ms / 2, f"the GUI thread waited {load.worst_wait_ms:.0f} of {reply_ms:.0f} ms"

    saved = store.messages(conversation_id)
    assert [m["role"] for m in saved] == ["user", "assistant"]
    assert saved[1]["reasoning"] == result["reasoning"] and saved[1]["stats"] == result["stats"]
    bubble = last_bubble(page)
    assert bubble.stats_label.text().startswith(f"{result['stats']['new_tokens']} tokens · TTFT")
    assert chat_history(saved) == real_worker.session.messages  # the engine saw what the store keeps


def test_real_engine_stop_regenerate_and_edit(qtbot, store, settings, real_worker):
    settings.set("enable_thinking", False)
    settings.set("sampling", {"max_new_tokens": 4000, "seed": 6})  # this seed runs for 500 tokens: time to stop it
    page = make_page(qtbot, store, real_worker, settings)
    conversation_id = page.current_conversation_id()

    def send_then_stop_once_text_shows():
        type_and_send(qtbot, page, "Count to a million")
        qtbot.waitUntil(lambda: bool(getattr(last_bubble(page), "answer", "")), timeout=REAL_REPLY_TIMEOUT_MS)
        page.stop()

    stats = wait_for_reply(qtbot, page, real_worker, send_then_stop_once_text_shows)["stats"]
    assert stats["stop_reason"] == "cancelled" and stats["new_tokens"] < 400
    saved = store.messages(conversation_id)
    assert saved[1]["content"] and saved[1]["content"] == last_bubble(page).answer
    assert last_bubble(page).answer_view.parts  # what streamed stays on screen
    assert saved[1]["stats"]["stop_reason"] == "cancelled"

    settings.set("sampling", {"max_new_tokens": 24, "seed": 1})
    regenerate = last_bubble(page).regenerate_button
    result = wait_for_reply(qtbot, page, real_worker, lambda: qtbot.mouseClick(regenerate, Qt.MouseButton.LeftButton))
    saved = store.messages(conversation_id)
    assert [m["role"] for m in saved] == ["user", "assistant"]
    assert saved[1]["content"] == result["answer"]
    assert saved[1]["stats"]["stop_reason"] == result["stats"]["stop_reason"] != "cancelled"

    wait_for_reply(qtbot, page, real_worker, lambda: type_and_send(qtbot, page, "Second question"))
    assert len(store.messages(conversation_id)) == 4
    first = page.transcript.bubbles[0]
    qtbot.mouseClick(first.edit_button, Qt.MouseButton.LeftButton)
    first.editor.setPlainText("Count to ten")
    result = wait_for_reply(qtbot, page, real_worker, lambda: qtbot.keyClick(first.editor, Qt.Key.Key_Return))
    saved = store.messages(conversation_id)
    assert [m["content"] for m in saved] == ["Count to ten", result["answer"]]
    assert chat_history(saved) == real_worker.session.messages  # the engine rolled back to the edit
    assert len(page.transcript.bubbles) == 2

    # back to the first version: its branch's turns show, and the engine answers from that branch
    qtbot.mouseClick(page.transcript.bubbles[0].pager.previous_button, Qt.MouseButton.LeftButton)
    assert [m["content"] for m in store.messages(conversation_id)][0::2] == ["Count to a million", "Second question"]
    wait_for_reply(qtbot, page, real_worker, lambda: type_and_send(qtbot, page, "Third"))
    saved = store.messages(conversation_id)
    assert len(saved) == 6 and chat_history(saved) == real_worker.session.messages


def test_real_engine_continues_a_reply_cut_by_its_length_limit(qtbot, store, settings, real_worker):
    settings.set("enable_thinking", False)
    settings.set("sampling", {"max_new_tokens": 6, "seed": 6})
    page = make_page(qtbot, store, real_worker, settings)
    conversation_id = page.current_conversation_id()
    stats = wait_for_reply(qtbot, page, real_worker, lambda: type_and_send(qtbot, page, "Count to a million"))["stats"]
    assert stats["stop_reason"] == "length"
    cut = store.messages(conversation_id)[-1]

    bubble = last_bubble(page)
    result = wait_for_reply(
        qtbot, page, real_worker, lambda: qtbot.mouseClick(bubble.continue_button, Qt.MouseButton.LeftButton)
    )
    assert result["stats"]["stop_reason"] != "error" and result["stats"]["prefill_tokens"] == 1  # no re-prefill
    saved = store.messages(conversation_id)
    assert len(saved) == 2 and saved[-1]["id"] == cut["id"]
    assert saved[-1]["content"].startswith(cut["content"]) and len(saved[-1]["content"]) > len(cut["content"])
    assert chat_history(saved) == real_worker.session.messages  # the engine holds the grown reply


def test_real_engine_continues_a_cut_reply_after_another_chat_ran(qtbot, store, settings, real_worker):
    settings.set("enable_thinking", False)
    settings.set("sampling", {"max_new_tokens": 6, "seed": 6})
    page = make_page(qtbot, store, real_worker, settings)
    cut_chat = page.current_conversation_id()
    wait_for_reply(qtbot, page, real_worker, lambda: type_and_send(qtbot, page, "Count to a million"))
    cut = store.messages(cut_chat)[-1]
    page.new_chat()
    wait_for_reply(qtbot, page, real_worker, lambda: type_and_send(qtbot, page, "Something else"))
    page.open_conversation(cut_chat)  # the engine's state now holds the other chat

    bubble = last_bubble(page)
    result = wait_for_reply(
        qtbot, page, real_worker, lambda: qtbot.mouseClick(bubble.continue_button, Qt.MouseButton.LeftButton)
    )
    assert result["stats"]["stop_reason"] in ("eos", "length") and result["stats"]["prefill_tokens"] > 1
    saved = store.messages(cut_chat)
    assert len(saved) == 2 and saved[-1]["id"] == cut["id"] and saved[-1]["content"].startswith(cut["content"])
    assert chat_history(saved) == real_worker.session.messages
