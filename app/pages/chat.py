"""The Chat page: conversation list on the left, the open chat on the right.

The page never runs the engine: it asks for replies through its `sendRequested` signal (connected to
the worker's `send` slot, queued onto the worker's thread) and follows the worker's reply signals.
Everything the user types or the model streams reaches the ConversationStore as it happens: the
draft a moment after typing stops, a reply every REPLY_SAVE_MS while it grows and in full at its end.
The worker is the local EngineWorker or a RemoteWorker (app/remote_worker.py), which emit the same reply
signals; `set_engine` switches between them and the header says which engine answers. While the local API
answers a request the page says so (`set_api_busy`): a message sent meanwhile waits for the engine.
Nothing is overwritten: Regenerate and Edit add versions (the store keeps the chat as a tree), Continue
grows a cut reply in place, and a delete can be undone for UNDO_MS before it is final.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QCoreApplication, QObject, QSignalBlocker, Qt, QTimer, Signal, Slot
from PySide6.QtWidgets import (
    QCheckBox,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QMenu,
    QMessageBox,
    QPlainTextEdit,
    QPushButton,
    QSplitter,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.chat_export import ChatImportError, from_json, to_json, to_markdown
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
BUSY_NOTE_REPLY = (
    "A reply is still on its way: your message stays here. Send it when the reply ends, or press Stop (Esc) first."
)
BUSY_NOTE_ENGINE = "The engine is busy (loading a model or answering): your message stays here until it is free."
SYSTEM_PROMPT_SET = "System prompt ●"
SYSTEM_PROMPT_UNSET = "System prompt…"
UNDO_MS = 8000  # how long a deleted chat or message can be brought back


def title_from(text: str) -> str:
    """A chat title from its first message: one line, at most TITLE_CHARS characters, cut between words."""
    line = " ".join(text.split())
    if len(line) <= TITLE_CHARS:
        return line
    cut = line[: TITLE_CHARS - 1]
    if " " in cut[TITLE_CHARS // 2 :]:  # a word boundary late enough to keep most of the text
        cut = cut[: cut.rindex(" ")]
    return cut.rstrip(" ,.;:") + "…"


def engine_history(messages: list[dict]) -> list[dict]:
    """Stored messages as the engine's history, without replies that failed or produced nothing: the
    model never gave those, and the engine's session does not keep them either."""
    return chat_history(
        [
            m
            for m in messages
            if m["role"] == "user" or (m["stats"].get("stop_reason") != "error" and (m["content"] or m["reasoning"]))
        ]
    )


@dataclass
class _Reply:
    """The reply in progress: where it is stored and shown, and the text streamed so far."""

    conversation_id: int
    parent_id: int | None  # the user message it answers
    message_id: int | None = None  # set when the worker starts the reply (at once when it continues one)
    answer: str = ""
    reasoning: str = ""
    bubble: AssistantBubble | None = None  # None while another conversation is on screen
    continued: bool = False  # Continue: more text onto the stored message `message_id`
    started: bool = False  # the worker began it (it may wait behind API requests first)
    discarded: bool = False  # its conversation was deleted for good: nothing more is written


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
    continueRequested = Signal(list, dict)  # history ending with the cut reply, options: the worker's continue_reply

    def __init__(
        self,
        store: ConversationStore,
        worker: QObject,
        settings: AppSettings,
        parent: QWidget | None = None,
        engine: str = "local",
    ):
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
        self.export_button = QToolButton()
        self.export_button.setText("Export")
        self.export_button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        export_menu = QMenu(self.export_button)
        export_menu.addAction("Export as Markdown…", lambda: self.export_chat("markdown"))
        export_menu.addAction("Export as JSON (all versions)…", lambda: self.export_chat("json"))
        export_menu.addSeparator()
        export_menu.addAction("Import a chat from JSON…", self.import_chat)
        self.export_button.setMenu(export_menu)
        self.undo_label = QLabel()
        self.undo_button = QPushButton("Undo")
        self.undo_bar = QWidget()
        undo_row = QHBoxLayout(self.undo_bar)
        undo_row.setContentsMargins(0, 0, 0, 0)
        undo_row.addWidget(self.undo_label, 1)
        undo_row.addWidget(self.undo_button)
        self.undo_bar.hide()
        self._undo = None  # (undo, purge) of the last delete, while it can be undone
        self._undo_timer = QTimer(self, singleShot=True, interval=UNDO_MS)
        self._draft_timer = QTimer(self, singleShot=True, interval=DRAFT_SAVE_MS)
        self._reply_save_timer = QTimer(self, singleShot=True, interval=REPLY_SAVE_MS)

        header = QHBoxLayout()
        header.addWidget(self.title_label, 1)
        header.addWidget(self.engine_label)  # whole while there is room; the title gives way first
        header.addWidget(self.thinking_box)
        header.addWidget(self.system_prompt_button)
        header.addWidget(self.export_button)
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
        chat_layout.addWidget(self.undo_bar)
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
        self.transcript.continueRequested.connect(self.continue_reply)
        self.transcript.versionRequested.connect(self.show_version)
        self.transcript.deleteRequested.connect(self.delete_message)
        self.undo_button.clicked.connect(self.undo_delete)
        self._undo_timer.timeout.connect(self._finish_undo)
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
        for signal, slot in (
            (self.sendRequested, worker.send),
            (self.continueRequested, worker.continue_reply),
            (worker.replyStarted, self._on_reply_started),
            (worker.reasoningDelta, self._on_reasoning_delta),
            (worker.answerDelta, self._on_answer_delta),
            (worker.progress, self._on_progress),
            (worker.replyFinished, self._on_reply_finished),
            (worker.busyChanged, self._on_worker_busy),
        ):
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
            if (
                conversation is not None
                and conversation["title"] == DEFAULT_TITLE
                and not self.store.messages(conversation_id)
                and (self._reply is None or self._reply.conversation_id != conversation_id)
            ):
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
        user_id = self.store.add_message(conversation_id, "user", text)
        self._draft_timer.stop()
        with QSignalBlocker(self.input):
            self.input.clear()
        self.store.save_draft(conversation_id, "")
        self.transcript.add_message({"role": "user", "content": text})
        self.transcript.scroll_to_bottom()
        self.conversation_list.refresh()  # it moved to the top, and may have a title now
        self._request_reply(conversation_id, engine_history(earlier), text, user_id)

    @Slot()
    def stop(self) -> None:
        """Cancel the reply in progress; the worker's stop() is safe from this thread."""
        if self._reply is not None:
            self.worker.stop()

    @Slot()
    def regenerate(self) -> None:
        """Answer the last user message again; the reply there stays as an earlier version."""
        if self._busy():
            return
        messages = self.store.messages(self._conversation_id)
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        if last_user is None:
            return
        self.transcript.truncate(last_user + 1)
        self._request_reply(
            self._conversation_id,
            engine_history(messages[:last_user]),
            messages[last_user]["content"],
            messages[last_user]["id"],
        )

    @Slot(int, str)
    def edit_and_resend(self, index: int, text: str) -> None:
        """Add `text` as a new version of user message `index` and answer it; the old version and the turns after
        it stay on their own branch."""
        messages = self.store.messages(self._conversation_id)
        text = text.strip()
        if self._busy() or not text or index >= len(messages) or messages[index]["role"] != "user":
            return
        user_id = self.store.add_message(self._conversation_id, "user", text, parent_id=messages[index]["parent_id"])
        shown = self.store.messages(self._conversation_id)
        self.transcript.truncate(index)
        self.transcript.add_message(shown[index])
        self.transcript.scroll_to_bottom()
        self._request_reply(self._conversation_id, engine_history(messages[:index]), text, user_id)

    @Slot()
    def continue_reply(self) -> None:
        """Write more of the last reply (cut by its length limit or Stop) onto the same message."""
        messages = self.store.messages(self._conversation_id)
        if self._busy() or not messages or messages[-1]["role"] != "assistant":
            return
        cut = messages[-1]
        bubble = self.transcript.bubbles[-1]
        self._reply = _Reply(
            self._conversation_id, cut["parent_id"], cut["id"], cut["content"], cut["reasoning"], bubble, continued=True
        )
        bubble.resume_streaming()
        self._update_controls()
        self.continueRequested.emit(engine_history(messages), self._options(self._conversation_id))

    @Slot(int, int)
    def show_version(self, index: int, step: int) -> None:
        """Page message `index` to its previous (-1) or next (1) version, showing that branch's later turns."""
        messages = self.store.messages(self._conversation_id)
        if self._busy() or index >= len(messages):
            return
        self.store.show_version(self._conversation_id, messages[index]["id"], step)
        self._show_transcript()

    @Slot(int)
    def delete_message(self, index: int) -> None:
        """Delete message `index` and the turns after it once the user confirms; Undo brings them back."""
        messages = self.store.messages(self._conversation_id)
        if self._busy() or index >= len(messages):
            return
        later = len(messages) - index - 1
        question = (
            "Delete this message"
            + (f" and the {later} after it" if later else "")
            + "? You can undo this for a few seconds."
        )
        answer = QMessageBox.question(
            self,
            "Delete message",
            question,
            QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
            QMessageBox.StandardButton.No,
        )
        if answer != QMessageBox.StandardButton.Yes:
            return
        conversation_id, message_id = self._conversation_id, messages[index]["id"]
        leaf = self.store.delete_message(conversation_id, message_id)
        self._show_transcript()

        def undo():
            self.store.undelete_message(conversation_id, message_id, leaf)
            if conversation_id == self._conversation_id:
                self._show_transcript()

        self._offer_undo("Message deleted.", undo, lambda: self.store.purge_message(message_id))

    @Slot(str)
    def export_chat(self, kind: str) -> None:
        """Ask where, then write the open chat as Markdown (the shown branch) or JSON (every version)."""
        conversation = self.store.conversation(self._conversation_id)
        suffix, filter_ = (".md", "Markdown (*.md)") if kind == "markdown" else (".json", "JSON (*.json)")
        name = "".join(c if c.isalnum() or c in " -_" else "_" for c in conversation["title"]).strip() or "chat"
        path, _ = QFileDialog.getSaveFileName(self, "Export chat", str(Path.home() / f"{name}{suffix}"), filter_)
        if not path:
            return
        text = (
            to_markdown(self.store, conversation["id"])
            if kind == "markdown"
            else to_json(self.store, conversation["id"])
        )
        try:
            Path(path).write_text(text, encoding="utf-8")
        except OSError as exc:
            QMessageBox.warning(
                self,
                "Export failed",
                f"The chat could not be written to {path} ({exc.strerror or exc}). Choose another folder.",
            )

    @Slot()
    def import_chat(self) -> None:
        """Ask for a JSON export and open it as a new chat."""
        path, _ = QFileDialog.getOpenFileName(self, "Import chat", str(Path.home()), "JSON (*.json)")
        if not path:
            return
        try:
            conversation_id = from_json(self.store, Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            QMessageBox.warning(self, "Import failed", f"{path} could not be read ({exc}).")
            return
        except ChatImportError as exc:
            QMessageBox.warning(self, "Import failed", f"{path} was not imported: {exc}")
            return
        self.conversation_list.clear_search()
        self.conversation_list.refresh()
        self.open_conversation(conversation_id)

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
        if streaming_here:
            # up to the message answered: the stored copy of the reply lags behind what streamed
            asked = next((i for i, m in enumerate(messages) if m["id"] == reply.parent_id), len(messages) - 1)
            self.transcript.show_messages(messages[: asked + 1])
            if reply.message_id is not None:
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
        """The list deleted a chat (hidden until the undo runs out): its reply stops, the next chat opens."""
        reply = self._reply
        if reply is not None and reply.conversation_id == conversation_id:
            reply.bubble = None
            self.worker.stop()  # what streamed is kept with the chat, for an undo
        if conversation_id == self._conversation_id:
            self._flush_draft()
            self._conversation_id = None
            self._open_latest()

        def undo():
            self.store.restore(conversation_id)
            self.conversation_list.clear_search()
            self.conversation_list.refresh()
            self.open_conversation(conversation_id)

        self._offer_undo("Chat deleted.", undo, lambda: self._purge_conversation(conversation_id))

    def _purge_conversation(self, conversation_id: int) -> None:
        """The chat is gone for good: a reply still finishing writes nothing more."""
        if self._reply is not None and self._reply.conversation_id == conversation_id:
            self._reply.discarded = True
        self.store.purge_conversation(conversation_id)

    # ---- undo -----------------------------------------------------------------------------------

    def _offer_undo(self, text: str, undo, purge) -> None:
        """Show "text [Undo]" for UNDO_MS, then `purge`; a delete before then makes the earlier one final."""
        self._finish_undo()
        self._undo = (undo, purge)
        self.undo_label.setText(f"{text} Undo brings it back for a few seconds.")
        self.undo_bar.show()
        self._undo_timer.start()

    @Slot()
    def undo_delete(self) -> None:
        """Bring back what was deleted last, while the undo bar shows."""
        if self._undo is None:
            return
        undo, _ = self._undo
        self._undo = None
        self._undo_timer.stop()
        self.undo_bar.hide()
        undo()

    @Slot()
    def _finish_undo(self) -> None:
        """The undo ran out: what was deleted is removed for good."""
        self._undo_timer.stop()
        self.undo_bar.hide()
        if self._undo is None:
            return
        _, purge = self._undo
        self._undo = None
        purge()

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

    def _options(self, conversation_id: int) -> dict:
        conversation = self.store.conversation(conversation_id)
        return {
            "enable_thinking": conversation["enable_thinking"],
            "system_prompt": conversation["system_prompt"],
            "sampling": self.settings.get("sampling"),
        }

    def _request_reply(self, conversation_id: int, history: list[dict], text: str, parent_id: int) -> None:
        """Ask the worker to answer `text` (stored as message `parent_id`) after `history`."""
        self._reply = _Reply(conversation_id, parent_id)  # before emitting: a worker on this thread answers at once
        self._update_controls()
        self.sendRequested.emit(history, text, self._options(conversation_id))

    @Slot()
    def _on_reply_started(self) -> None:
        reply = self._reply
        if reply is None or reply.discarded:
            return
        reply.started = True
        if reply.continued:
            return
        reply.message_id = self.store.add_message(reply.conversation_id, "assistant", parent_id=reply.parent_id)
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
                self.store.add_message(
                    reply.conversation_id, "assistant", answer, reasoning, stats, parent_id=reply.parent_id
                )
            else:
                self.store.update_message(reply.message_id, content=answer, reasoning=reasoning, stats=stats)
            if reply.bubble is None and reply.conversation_id == self._conversation_id:
                reply.bubble = self.transcript.start_reply()
        if reply.bubble is not None:
            reply.bubble.finish(answer, reasoning, stats)
            if not reply.discarded and reply.message_id is not None:
                shown = self.store.messages(reply.conversation_id)[-1]  # a regenerated reply is a new version
                reply.bubble.pager.set_version(shown["version"], shown["versions"])
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
        waiting = self._reply is not None and not self._reply.started
        self.api_note.setText(
            "Answering an API request… your message is next." if waiting else "Answering an API request…"
        )
        self.api_note.setVisible(self._api_busy)
