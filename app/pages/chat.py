"""The Chat page: conversation list on the left, the open chat on the right.

The page never runs the engine: it asks for replies through its `sendRequested` signal (connected to
the worker's `send` slot, queued onto the worker's thread) and follows the worker's reply signals.
Everything the user types or the model streams reaches the ConversationStore as it happens: the
draft a moment after typing stops, a reply every REPLY_SAVE_MS while it grows and in full at its end.
The worker is the local EngineWorker or a RemoteWorker (app/remote_worker.py), which emit the same reply
signals; `set_engine` switches between them and the header says which engine answers. While the local API
answers a request the page says so (`set_api_busy`): a message sent meanwhile waits for the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QCoreApplication, QObject, QSignalBlocker, Qt, QTimer, Signal, Slot
from PySide6.QtWidgets import (QCheckBox, QDialog, QDialogButtonBox, QHBoxLayout, QLabel, QPlainTextEdit,
                               QPushButton, QSplitter, QVBoxLayout, QWidget)

from app.settings import AppSettings
from app.storage import DEFAULT_TITLE, ConversationStore, chat_history
from app.widgets.chat_input import ChatInput
from app.widgets.conversation_list import ConversationList
from app.widgets.eliding_label import ElidingLabel
from app.widgets.transcript import AssistantBubble, Transcript

TITLE_CHARS = 40
DRAFT_SAVE_MS = 300  # the draft is written once typing pauses, not on every key
REPLY_SAVE_MS = 500  # a streaming reply reaches the disk at most twice a second
DEFAULT_SPLITTER_SIZES = [220, 780]  # conversation list, chat
BUSY_NOTE_REPLY = ("A reply is still on its way: your message stays here. Send it when the reply ends, "
                   "or press Stop (Esc) first.")
BUSY_NOTE_ENGINE = "The engine is busy (loading a model or answering): your message stays here until it is free."
SYSTEM_PROMPT_SET = "System prompt ●"
SYSTEM_PROMPT_UNSET = "System prompt…"


def title_from(text: str) -> str:
    """A chat title from its first message: one line, at most TITLE_CHARS characters, cut between words."""
    line = " ".join(text.split())
    if len(line) <= TITLE_CHARS:
        return line
    cut = line[:TITLE_CHARS - 1]
    if " " in cut[TITLE_CHARS // 2:]:  # a word boundary late enough to keep most of the text
        cut = cut[:cut.rindex(" ")]
    return cut.rstrip(" ,.;:") + "…"


def engine_history(messages: list[dict]) -> list[dict]:
    """Stored messages as the engine's history, without replies that failed or produced nothing: the
    model never gave those, and the engine's session does not keep them either."""
    return chat_history([m for m in messages if m["role"] == "user" or (
        m["stats"].get("stop_reason") != "error" and (m["content"] or m["reasoning"]))])


@dataclass
class _Reply:
    """The reply in progress: where it is stored and shown, and the text streamed so far."""

    conversation_id: int
    message_id: int | None = None  # set when the worker starts the reply
    answer: str = ""
    reasoning: str = ""
    bubble: AssistantBubble | None = None  # None while another conversation is on screen
    discarded: bool = False  # its conversation was deleted: nothing more is written


class SystemPromptDialog(QDialog):
    """A small editor for one chat's system prompt; OK emits `promptAccepted(conversation_id, text)`."""

    promptAccepted = Signal(int, str)

    def __init__(self, conversation_id: int, prompt: str, parent: QWidget | None = None):
        super().__init__(parent)
        self.conversation_id = conversation_id
        self.setWindowTitle("System prompt")
        self.editor = QPlainTextEdit(prompt)
        self.editor.setPlaceholderText("Instructions the model follows throughout this chat (optional)")
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(QLabel("System prompt for this chat:"))
        layout.addWidget(self.editor)
        layout.addWidget(buttons)
        self.resize(480, 260)

    def prompt(self) -> str:
        return self.editor.toPlainText().strip()

    def accept(self) -> None:
        self.promptAccepted.emit(self.conversation_id, self.prompt())
        super().accept()


class ChatPage(QWidget):
    """Conversations, transcript, input, Send/Stop, regenerate and edit-and-resend.

    `worker` is an EngineWorker living on its own thread, or anything with its reply signals, a `send` slot
    and a thread-safe `stop()` (a RemoteWorker); `engine` names it in the header.
    """

    sendRequested = Signal(list, str, dict)  # history, user text, options: the worker's send slot

    def __init__(self, store: ConversationStore, worker: QObject, settings: AppSettings,
                 parent: QWidget | None = None, engine: str = "local"):
        super().__init__(parent)
        self.store, self.worker, self.settings = store, worker, settings
        self._conversation_id: int | None = None
        self._reply: _Reply | None = None
        self._worker_busy = False
        self._next_engine: tuple[QObject, str] | None = None  # set_engine's choice, waiting for a reply to end
        self._api_busy = False

        self.conversation_list = ConversationList(store)
        self.title_label = ElidingLabel()
        self.title_label.setStyleSheet("font-weight: 600; font-size: 14px;")
        self.engine_label = ElidingLabel()  # plain text: names from a server are data
        self.engine_label.setProperty("role", "muted")
        self.thinking_box = QCheckBox("Thinking")
        self.thinking_box.setToolTip("Let the model reason before it answers (slower, often better)")
        self.system_prompt_button = QPushButton(SYSTEM_PROMPT_UNSET)
        self.transcript = Transcript()
        self.input = ChatInput()
        self.input.setMaximumHeight(self.input.fontMetrics().lineSpacing() * 6)
        self.send_button = QPushButton("Send")
        self.send_button.setDefault(True)
        self.stop_button = QPushButton("Stop")
        self.api_note = QLabel()
        self.api_note.setProperty("role", "muted")
        self.api_note.hide()
        self.busy_note = QLabel()
        self.busy_note.setProperty("role", "muted")
        self.busy_note.setWordWrap(True)
        self.busy_note.hide()
        self._draft_timer = QTimer(self, singleShot=True, interval=DRAFT_SAVE_MS)
        self._reply_save_timer = QTimer(self, singleShot=True, interval=REPLY_SAVE_MS)

        header = QHBoxLayout()
        header.addWidget(self.title_label, 1)
        header.addWidget(self.engine_label)  # whole while there is room; the title gives way first
        header.addWidget(self.thinking_box)
        header.addWidget(self.system_prompt_button)
        buttons = QVBoxLayout()
        buttons.addWidget(self.send_button)
        buttons.addWidget(self.stop_button)
        buttons.addStretch(1)
        input_row = QHBoxLayout()
        input_row.addWidget(self.input, 1)
        input_row.addLayout(buttons)
        chat = QWidget()
        chat_layout = QVBoxLayout(chat)
        chat_layout.addLayout(header)
        chat_layout.addWidget(self.transcript, 1)
        chat_layout.addWidget(self.api_note)
        chat_layout.addWidget(self.busy_note)
        chat_layout.addLayout(input_row)
        self.splitter = QSplitter(Qt.Orientation.Horizontal)
        self.splitter.addWidget(self.conversation_list)
        self.splitter.addWidget(chat)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setChildrenCollapsible(False)
        self.splitter.setSizes(settings.get("chat_splitter") or DEFAULT_SPLITTER_SIZES)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.splitter)

        self.conversation_list.conversationSelected.connect(self.open_conversation)
        self.conversation_list.newChatRequested.connect(self.new_chat)
        self.conversation_list.conversationRenamed.connect(self._on_conversation_renamed)
        self.conversation_list.conversationDeleted.connect(self._on_conversation_deleted)
        self.thinking_box.toggled.connect(self._on_thinking_toggled)
        self.system_prompt_button.clicked.connect(self.edit_system_prompt)
        self.transcript.regenerateRequested.connect(self.regenerate)
        self.transcript.editSubmitted.connect(self.edit_and_resend)
        self.input.submitted.connect(self.send_current)
        self.input.textChanged.connect(self._on_input_changed)
        self.send_button.clicked.connect(self.send_current)
        self.stop_button.clicked.connect(self.stop)
        self._draft_timer.timeout.connect(self._write_draft)
        self._reply_save_timer.timeout.connect(self._save_reply_progress)
        QCoreApplication.instance().aboutToQuit.connect(self._save_now)

        self._follow(worker, True)
        self.engine_label.setText(f"Answering: {engine}")

        self._open_latest()
        self._update_controls()

    def _follow(self, worker: QObject, on: bool) -> None:
        """Connect (or disconnect) the page to a worker's send slot and reply signals."""
        for signal, slot in ((self.sendRequested, worker.send), (worker.replyStarted, self._on_reply_started),
                             (worker.reasoningDelta, self._on_reasoning_delta),
                             (worker.answerDelta, self._on_answer_delta), (worker.progress, self._on_progress),
                             (worker.replyFinished, self._on_reply_finished),
                             (worker.busyChanged, self._on_worker_busy)):
            if on:
                signal.connect(slot)
            else:
                signal.disconnect(slot)

    # ---- for the main window --------------------------------------------------------------------

    def set_engine(self, worker: QObject, engine: str) -> None:
        """Let `worker` answer from the next reply on, named `engine` in the header ("local: NAME", "remote:
        vllm @ 10.0.0.5:8000, model X"); a reply in progress ends with the worker it started on."""
        if self._reply is not None:
            self._next_engine = (worker, engine)
            return
        self._next_engine = None
        if worker is not self.worker:
            self._follow(self.worker, False)
            self._follow(worker, True)
            self.worker, self._worker_busy = worker, False
        self.engine_label.setText(f"Answering: {engine}")
        self._update_controls()

    def set_api_busy(self, busy: bool) -> None:
        """Say whether the engine answering this chat is busy with a local API request."""
        self._api_busy = busy
        self._update_controls()

    def engine_text(self) -> str:
        """Which engine answers, as the header says it."""
        return self.engine_label.text()

    def current_conversation_id(self) -> int | None:
        return self._conversation_id

    @Slot()
    def new_chat(self) -> None:
        """Open a new chat, or the newest one again when it is still empty (Ctrl+N twice makes one chat)."""
        conversation_id = self._empty_chat()
        if conversation_id is None:
            conversation_id = self.store.create(enable_thinking=bool(self.settings.get("enable_thinking")))
        self.conversation_list.clear_search()  # a search would hide the new chat
        self.conversation_list.refresh()
        self.open_conversation(conversation_id)
        self.focus_input()

    def _empty_chat(self) -> int | None:
        """The open or newest chat when it has no message and no title of its own yet, else None."""
        newest = self.store.conversations()[:1]
        for conversation_id in dict.fromkeys([self._conversation_id] + [c["id"] for c in newest]):
            conversation = None if conversation_id is None else self.store.conversation(conversation_id)
            if (conversation is not None and conversation["title"] == DEFAULT_TITLE
                    and not self.store.messages(conversation_id)
                    and (self._reply is None or self._reply.conversation_id != conversation_id)):
                return conversation_id
        return None

    def focus_input(self) -> None:
        self.input.setFocus()

    @Slot(int)
    def open_conversation(self, conversation_id: int) -> None:
        conversation = self.store.conversation(conversation_id)
        if conversation is None or conversation_id == self._conversation_id:
            return
        self._flush_draft()  # into the chat it was typed in
        self._conversation_id = conversation_id
        self._show_header(conversation)
        with QSignalBlocker(self.input):  # showing a stored draft is not typing
            self.input.setPlainText(conversation["draft"])
        self._show_transcript()
        self.conversation_list.select(conversation_id)

    @Slot()
    def send_current(self) -> None:
        """Send what is in the input box as the next message of the open chat."""
        text = self.input.toPlainText().strip()
        if not text:
            return
        if self._busy():  # said, not silent: the message stays in the box
            self.busy_note.setText(BUSY_NOTE_REPLY if self._reply is not None else BUSY_NOTE_ENGINE)
            self.busy_note.show()
            return
        conversation_id = self._conversation_id
        earlier = self.store.messages(conversation_id)
        if not earlier and self.store.conversation(conversation_id)["title"] == DEFAULT_TITLE:
            self.store.rename(conversation_id, title_from(text))
            self.title_label.setText(title_from(text))
        self.store.add_message(conversation_id, "user", text)
        self._draft_timer.stop()
        with QSignalBlocker(self.input):
            self.input.clear()
        self.store.save_draft(conversation_id, "")
        self.transcript.add_message({"role": "user", "content": text})
        self.transcript.scroll_to_bottom()
        self.conversation_list.refresh()  # it moved to the top, and may have a title now
        self._request_reply(conversation_id, engine_history(earlier), text)

    @Slot()
    def stop(self) -> None:
        """Cancel the reply in progress; the worker's stop() is safe from this thread."""
        if self._reply is not None:
            self.worker.stop()

    @Slot()
    def regenerate(self) -> None:
        """Answer the last user message again, replacing the reply after it."""
        if self._busy():
            return
        messages = self.store.messages(self._conversation_id)
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        if last_user is None:
            return
        self.store.truncate(self._conversation_id, last_user + 1)
        self.transcript.truncate(last_user + 1)
        self._request_reply(self._conversation_id, engine_history(messages[:last_user]),
                            messages[last_user]["content"])

    @Slot(int, str)
    def edit_and_resend(self, index: int, text: str) -> None:
        """Replace user message `index` with `text`, drop everything after it, and answer again."""
        messages = self.store.messages(self._conversation_id)
        text = text.strip()
        if self._busy() or not text or index >= len(messages) or messages[index]["role"] != "user":
            return
        self.store.update_message(messages[index]["id"], content=text)
        self.store.truncate(self._conversation_id, index + 1)
        self.transcript.truncate(index)
        self.transcript.add_message({"role": "user", "content": text})
        self.transcript.scroll_to_bottom()
        self._request_reply(self._conversation_id, engine_history(messages[:index]), text)

    @Slot()
    def edit_system_prompt(self) -> None:
        """Open the system prompt editor for the open chat (not blocking; saved when accepted)."""
        conversation = self.store.conversation(self._conversation_id)
        dialog = SystemPromptDialog(conversation["id"], conversation["system_prompt"], self)
        dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dialog.promptAccepted.connect(self._set_system_prompt)
        dialog.open()

    # ---- conversations --------------------------------------------------------------------------

    def _open_latest(self) -> None:
        conversations = self.store.conversations()
        if conversations:
            self.open_conversation(conversations[0]["id"])
        else:
            self.new_chat()

    def _show_header(self, conversation: dict) -> None:
        self.title_label.setText(conversation["title"])
        with QSignalBlocker(self.thinking_box):  # showing the chat's setting is not changing it
            self.thinking_box.setChecked(conversation["enable_thinking"])
        self._show_system_prompt(conversation["system_prompt"])

    def _show_transcript(self) -> None:
        """Show the open chat's messages; a reply still streaming into it gets its live bubble back."""
        messages = self.store.messages(self._conversation_id)
        reply = self._reply
        if reply is not None:
            reply.bubble = None
        streaming_here = reply is not None and reply.conversation_id == self._conversation_id
        if streaming_here and reply.message_id is not None:
            self.transcript.show_messages(messages[:-1])  # the stored copy lags behind what streamed
            reply.bubble = self.transcript.start_reply()
            reply.bubble.append_reasoning(reply.reasoning)
            reply.bubble.append_answer(reply.answer)
        else:
            self.transcript.show_messages(messages)
        self._update_controls()

    @Slot(int)
    def _on_conversation_renamed(self, conversation_id: int) -> None:
        if conversation_id == self._conversation_id:
            self.title_label.setText(self.store.conversation(conversation_id)["title"])

    @Slot(int)
    def _on_conversation_deleted(self, conversation_id: int) -> None:
        reply = self._reply
        if reply is not None and reply.conversation_id == conversation_id:
            reply.discarded = True
            reply.bubble = None
            self.worker.stop()
        if conversation_id == self._conversation_id:
            self._draft_timer.stop()  # the draft's conversation is gone
            self._conversation_id = None
            self._open_latest()

    @Slot(bool)
    def _on_thinking_toggled(self, enabled: bool) -> None:
        self.store.set_options(self._conversation_id, enable_thinking=enabled)

    @Slot(int, str)
    def _set_system_prompt(self, conversation_id: int, prompt: str) -> None:
        if self.store.conversation(conversation_id) is None:
            return  # deleted while the dialog was open
        self.store.set_options(conversation_id, system_prompt=prompt)
        if conversation_id == self._conversation_id:
            self._show_system_prompt(prompt)

    def _show_system_prompt(self, prompt: str) -> None:
        """The button says whether the open chat has a system prompt; its tooltip shows the prompt."""
        self.system_prompt_button.setText(SYSTEM_PROMPT_SET if prompt else SYSTEM_PROMPT_UNSET)
        self.system_prompt_button.setToolTip(prompt or "No system prompt")

    # ---- the draft ------------------------------------------------------------------------------

    @Slot()
    def _on_input_changed(self) -> None:
        self._draft_timer.start()  # restarted by each key: the write waits for a pause

    @Slot()
    def _write_draft(self) -> None:
        self.store.save_draft(self._conversation_id, self.input.toPlainText())

    def _flush_draft(self) -> None:
        """Write a draft still waiting for its timer now."""
        if self._draft_timer.isActive():
            self._draft_timer.stop()
            self._write_draft()

    @Slot()
    def _save_now(self) -> None:
        """Before the app quits: the pending draft and the streamed reply go to disk."""
        self._flush_draft()
        self._save_reply_progress()

    # ---- replies --------------------------------------------------------------------------------

    def _busy(self) -> bool:
        return self._reply is not None or self._worker_busy

    def _request_reply(self, conversation_id: int, history: list[dict], text: str) -> None:
        conversation = self.store.conversation(conversation_id)
        options = {"enable_thinking": conversation["enable_thinking"],
                   "system_prompt": conversation["system_prompt"],
                   "sampling": self.settings.get("sampling")}
        self._reply = _Reply(conversation_id)  # before emitting: a worker on this thread answers at once
        self._update_controls()
        self.sendRequested.emit(history, text, options)

    @Slot()
    def _on_reply_started(self) -> None:
        reply = self._reply
        if reply is None or reply.discarded:
            return
        reply.message_id = self.store.add_message(reply.conversation_id, "assistant")
        if reply.conversation_id == self._conversation_id:
            reply.bubble = self.transcript.start_reply()

    @Slot(str)
    def _on_reasoning_delta(self, text: str) -> None:
        if self._reply is not None:
            self._reply.reasoning += text
            if self._reply.bubble is not None:
                self._reply.bubble.append_reasoning(text)
            self._schedule_reply_save()

    @Slot(str)
    def _on_answer_delta(self, text: str) -> None:
        if self._reply is not None:
            self._reply.answer += text
            if self._reply.bubble is not None:
                self._reply.bubble.append_answer(text)
            self._schedule_reply_save()

    @Slot(dict)
    def _on_progress(self, progress: dict) -> None:
        if self._reply is not None and self._reply.bubble is not None:
            self._reply.bubble.show_progress(progress)

    def _schedule_reply_save(self) -> None:
        if not self._reply_save_timer.isActive():  # a running timer already covers this delta
            self._reply_save_timer.start()

    @Slot()
    def _save_reply_progress(self) -> None:
        reply = self._reply
        if reply is not None and reply.message_id is not None and not reply.discarded:
            self.store.update_message(reply.message_id, content=reply.answer, reasoning=reply.reasoning)

    @Slot(dict)
    def _on_reply_finished(self, result: dict) -> None:
        reply = self._reply
        if reply is None:
            return
        self._reply = None
        self._reply_save_timer.stop()
        stats = result.get("stats") or {}
        # the engine's final text is authoritative; after an error it is empty and what streamed stands
        answer = result.get("answer") or reply.answer.strip()
        reasoning = result.get("reasoning") or reply.reasoning.strip()
        if not reply.discarded:
            if reply.message_id is None:  # the worker refused before starting (no model loaded)
                self.store.add_message(reply.conversation_id, "assistant", answer, reasoning, stats)
            else:
                self.store.update_message(reply.message_id, content=answer, reasoning=reasoning, stats=stats)
            if reply.bubble is None and reply.conversation_id == self._conversation_id:
                reply.bubble = self.transcript.start_reply()
        if reply.bubble is not None:
            reply.bubble.finish(answer, reasoning, stats)
        if self._next_engine is not None:
            self.set_engine(*self._next_engine)
        self._update_controls()

    @Slot(bool)
    def _on_worker_busy(self, busy: bool) -> None:
        self._worker_busy = busy
        self._update_controls()

    def _update_controls(self) -> None:
        busy = self._busy()
        if not busy:
            self.busy_note.hide()
        self.send_button.setEnabled(not busy)
        self.stop_button.setEnabled(self._reply is not None)
        self.transcript.set_busy(busy)
        waiting = self._reply is not None and self._reply.message_id is None
        self.api_note.setText("Answering an API request… your message is next." if waiting
                              else "Answering an API request…")
        self.api_note.setVisible(self._api_busy)
