"""The transcript: a scrollable column of message bubbles.

User messages and assistant replies render Markdown safely (app/widgets/rich_text.py: raw HTML stays text);
user messages have an Edit action; replies give each fenced code block token colours and a Copy button, keep the
reasoning in a collapsible, muted section and end with a stats line. A message with other versions shows a ◀ n/m ▶
pager; each has Delete, and a cut last reply Continue. A streaming reply re-renders at most RENDER_INTERVAL_MS apart
however fast the deltas come,
and the view follows the bottom only while the user is there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from PySide6.QtCore import QEvent, QSize, Qt, QTimer, Signal
from PySide6.QtGui import QFontDatabase, QGuiApplication
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.widgets.chat_input import ChatInput
from app.widgets.rich_text import CodeHighlighter, markdown_html, natural_width, open_link

RENDER_INTERVAL_MS = 50  # at most 20 re-renders a second while a reply streams
FOLLOW_SLACK_PX = 24  # "at the bottom" allows for a line's worth of rounding
COPIED_FEEDBACK_MS = 1500
CUT_REASONS = ("length", "cancelled")  # a reply that ended so can be continued
MESSAGE_WIDTH_PX = 560  # a user message wraps here, or earlier in a narrow window
READABLE_WIDTH_PX = 880  # the column of messages in a wide or maximized window: lines stay easy to read
USER_INDENT_PX = 64  # user bubbles never span the whole width, so the two sides read apart

THEME_EVENTS = (QEvent.Type.PaletteChange, QEvent.Type.StyleChange)  # apply_theme's palette and style sheet

# A fence opens with ``` or ~~~ (three or more) indented by at most three spaces, then an optional language.
_OPENING_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)")

STYLE = """
QFrame#userBubble { background: rgba(64, 128, 255, 0.14); border-radius: 10px; }
QFrame#assistantBubble { border: 1px solid rgba(128, 128, 128, 0.25); border-radius: 10px; }
QFrame#codeBlock { background: rgba(128, 128, 128, 0.12); border-radius: 6px; }
QFrame#codeBlock QPlainTextEdit { border: none; background: transparent; }
QLabel#codeLanguage, QLabel#statsLine, QLabel#reasoningText, QToolButton#reasoningToggle
    { color: rgba(128, 128, 128, 0.95); }
QToolButton#reasoningToggle { border: none; background: transparent; }
QLabel#errorText { background: rgba(220, 50, 47, 0.12); border: 1px solid rgba(220, 50, 47, 0.5);
    border-radius: 6px; padding: 6px; }
"""


@dataclass(frozen=True)
class Block:
    """A run of Markdown prose, or one fenced code block."""

    kind: str  # "markdown" | "code"
    text: str
    language: str = ""


def split_code_blocks(source: str) -> list[Block]:
    """Split Markdown into prose and fenced code blocks. An unclosed fence (a reply still streaming, or a
    model that forgot to close it) runs to the end."""
    blocks: list[Block] = []
    lines: list[str] = []
    closing: re.Pattern | None = None
    language = ""
    for line in source.split("\n"):
        if closing is None:
            opening = _OPENING_FENCE.match(line)
            if opening:
                if "".join(lines).strip():
                    blocks.append(Block("markdown", "\n".join(lines)))
                fence = opening.group(1)
                closing = re.compile(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
                language, lines = opening.group(2), []
                continue
        elif closing.match(line):
            blocks.append(Block("code", "\n".join(lines), language))
            closing, lines = None, []
            continue
        lines.append(line)
    if closing is not None:
        blocks.append(Block("code", "\n".join(lines), language))
    elif "".join(lines).strip():
        blocks.append(Block("markdown", "\n".join(lines)))
    return blocks


def format_stats(stats: dict) -> str:
    """The line under a reply, e.g. "42 tokens · TTFT 0.12 s · 23.4 tok/s · stop: eos", and which remote engine
    gave it; absent parts are skipped."""
    parts = []
    if stats.get("new_tokens") is not None:
        parts.append(f"{stats['new_tokens']} tokens")
    if stats.get("time_to_first_token_s") is not None:
        parts.append(f"TTFT {stats['time_to_first_token_s']:.2f} s")
    if stats.get("decode_tokens_per_s"):
        parts.append(f"{stats['decode_tokens_per_s']:.1f} tok/s")
    if stats.get("stop_reason"):
        parts.append(f"stop: {stats['stop_reason']}")
    if stats.get("remote"):
        parts.append(f"remote: {stats['remote']}")
    return " · ".join(parts)


def _make_selectable(label: QLabel, text_format: Qt.TextFormat) -> QLabel:
    """A wrapping label whose text can be selected and whose safe links (web, mail) open."""
    label.setTextFormat(text_format)
    label.setWordWrap(True)
    label.setTextInteractionFlags(
        Qt.TextInteractionFlag.TextSelectableByMouse | Qt.TextInteractionFlag.LinksAccessibleByMouse
    )
    label.setOpenExternalLinks(False)  # a link goes through open_link, which refuses javascript:, file: and the like
    label.linkActivated.connect(open_link)
    return label


class _MarkdownLabel(QLabel):
    """A label showing Markdown as safe rich text, rendered again in the new colours when the theme changes."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        _make_selectable(self, Qt.TextFormat.RichText)
        self.source = ""

    def set_markdown(self, source: str) -> None:
        if source != self.source:
            self.source = source
            self.setText(markdown_html(source))

    def changeEvent(self, event: QEvent) -> None:
        super().changeEvent(event)
        if event.type() in THEME_EVENTS and self.source:
            self.setText(markdown_html(self.source))


class MarkdownPart(_MarkdownLabel):
    """A run of Markdown prose."""

    kind = "markdown"

    def show_block(self, block: Block) -> None:
        self.set_markdown(block.text)


class CodeBlock(QFrame):
    """A fenced code block: monospace, scrolls sideways rather than wrapping, with a Copy button."""

    kind = "code"

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("codeBlock")
        self.language_label = QLabel()
        self.language_label.setObjectName("codeLanguage")
        self.copy_button = QToolButton()
        self.copy_button.setText("Copy")
        self.copy_button.setAutoRaise(True)
        self.editor = QPlainTextEdit()
        self.editor.setReadOnly(True)
        self.editor.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.editor.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        self.editor.setFrameShape(QFrame.Shape.NoFrame)
        self.editor.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.editor.viewport().setAutoFillBackground(False)  # the frame's tint shows through
        self.highlighter = CodeHighlighter(self.editor.document())
        self._copied_timer = QTimer(self, singleShot=True, interval=COPIED_FEEDBACK_MS)

        header = QHBoxLayout()
        header.setContentsMargins(0, 0, 0, 0)
        header.addWidget(self.language_label)
        header.addStretch(1)
        header.addWidget(self.copy_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 4, 8, 6)
        layout.setSpacing(2)
        layout.addLayout(header)
        layout.addWidget(self.editor)

        self.copy_button.clicked.connect(self.copy)
        self.editor.horizontalScrollBar().rangeChanged.connect(self._fit_height)  # a long line adds a scroll bar
        self._copied_timer.timeout.connect(self._show_copy_label)

    def code(self) -> str:
        return self.editor.toPlainText()

    def show_block(self, block: Block) -> None:
        self.language_label.setText(block.language)
        if block.text == self.code() and block.language == self.highlighter.language:
            return
        self.editor.setPlainText(block.text)
        self.highlighter.highlight(block.language)
        self._fit_height()

    def changeEvent(self, event: QEvent) -> None:
        super().changeEvent(event)
        if event.type() in THEME_EVENTS:  # the theme changed: its token colours too
            self.highlighter.highlight(self.highlighter.language)

    def _fit_height(self) -> None:
        """As tall as the code, so only the transcript scrolls vertically."""
        editor = self.editor
        lines = editor.document().blockCount()
        margins = 2 * (editor.frameWidth() + round(editor.document().documentMargin()))
        bar = editor.horizontalScrollBar()
        bar_height = bar.sizeHint().height() if bar.maximum() > 0 else 0
        editor.setFixedHeight(lines * editor.fontMetrics().lineSpacing() + margins + bar_height)

    def copy(self) -> None:
        QGuiApplication.clipboard().setText(self.code())
        self.copy_button.setText("Copied")
        self._copied_timer.start()

    def _show_copy_label(self) -> None:
        self.copy_button.setText("Copy")


class MarkdownView(QWidget):
    """Markdown split into prose labels and code blocks; re-showing grown text updates parts in place."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self._layout = QVBoxLayout(self)
        self._layout.setContentsMargins(0, 0, 0, 0)
        self._parts: list[MarkdownPart | CodeBlock] = []

    @property
    def parts(self) -> list[MarkdownPart | CodeBlock]:
        return list(self._parts)

    def set_markdown(self, source: str) -> None:
        blocks = split_code_blocks(source)
        for i, block in enumerate(blocks):
            if i < len(self._parts) and self._parts[i].kind == block.kind:
                self._parts[i].show_block(block)
                continue
            self._drop_parts_from(i)
            part = MarkdownPart() if block.kind == "markdown" else CodeBlock()
            part.show_block(block)
            self._layout.addWidget(part)
            self._parts.append(part)
        self._drop_parts_from(len(blocks))

    def _drop_parts_from(self, index: int) -> None:
        for part in self._parts[index:]:
            part.deleteLater()
        del self._parts[index:]


class ReasoningSection(QWidget):
    """The model's thinking: a toggle header over muted text."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.toggle = QToolButton()
        self.toggle.setObjectName("reasoningToggle")
        self.toggle.setCheckable(True)
        self.toggle.setAutoRaise(True)
        self.toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.toggle.setText("Thinking…")
        self.text_label = _make_selectable(QLabel(), Qt.TextFormat.PlainText)
        self.text_label.setObjectName("reasoningText")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(2)
        layout.addWidget(self.toggle, 0, Qt.AlignmentFlag.AlignLeft)
        layout.addWidget(self.text_label)
        self.toggle.toggled.connect(self._show_expanded)
        self.set_expanded(True)

    def is_expanded(self) -> bool:
        return self.toggle.isChecked()

    def set_expanded(self, expanded: bool) -> None:
        self.toggle.setChecked(expanded)
        self._show_expanded(expanded)

    def set_text(self, text: str) -> None:
        if text != self.text_label.text():
            self.text_label.setText(text)

    def _show_expanded(self, expanded: bool) -> None:
        self.toggle.setArrowType(Qt.ArrowType.DownArrow if expanded else Qt.ArrowType.RightArrow)
        self.text_label.setVisible(expanded)


class _MessageText(_MarkdownLabel):
    """The user's message as Markdown, preferring its natural width, up to MESSAGE_WIDTH_PX, before wrapping."""

    def __init__(self, text: str):
        super().__init__()
        self.set_markdown(text)

    def sizeHint(self) -> QSize:
        natural = natural_width(self.text(), self.font())
        width = min(round(natural) + 2 * self.margin() + 2, MESSAGE_WIDTH_PX)  # a pixel each side against rounding
        return QSize(width, self.heightForWidth(width))


class VersionPager(QWidget):
    """◀ 2/3 ▶ under a message with other versions: `stepRequested(-1 | 1)` asks for the previous or next one."""

    stepRequested = Signal(int)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.previous_button = QToolButton()
        self.previous_button.setText("◀")
        self.previous_button.setToolTip("Previous version")
        self.next_button = QToolButton()
        self.next_button.setText("▶")
        self.next_button.setToolTip("Next version")
        self.label = QLabel()
        self.label.setObjectName("statsLine")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(2)
        for widget in (self.previous_button, self.label, self.next_button):
            layout.addWidget(widget)
        for button in (self.previous_button, self.next_button):
            button.setAutoRaise(True)
        self.previous_button.clicked.connect(lambda: self.stepRequested.emit(-1))
        self.next_button.clicked.connect(lambda: self.stepRequested.emit(1))
        self.version = self.versions = 1
        self._enabled = True
        self.hide()

    def set_version(self, version: int, versions: int) -> None:
        """Show "version/versions"; a message with one version shows no pager."""
        self.version, self.versions = version, versions
        self.label.setText(f"{version}/{versions}")
        self.setVisible(versions > 1)
        self.set_enabled(self._enabled)

    def set_enabled(self, enabled: bool) -> None:
        self._enabled = enabled
        self.previous_button.setEnabled(enabled and self.version > 1)
        self.next_button.setEnabled(enabled and self.version < self.versions)


def _action_button(text: str, tip: str) -> QToolButton:
    button = QToolButton()
    button.setText(text)
    button.setToolTip(tip)
    button.setAutoRaise(True)
    return button


class UserBubble(QWidget):
    """A user message, right-aligned; Edit swaps the text for an inline editor whose Send emits
    `editSubmitted(text)`."""

    editSubmitted = Signal(str)
    deleteRequested = Signal()

    def __init__(self, text: str, parent: QWidget | None = None):
        super().__init__(parent)
        self.text = text
        self.frame = QFrame()
        self.frame.setObjectName("userBubble")
        self.text_label = _MessageText(text)
        self.edit_button = QToolButton()
        self.edit_button.setText("Edit")
        self.edit_button.setAutoRaise(True)
        self.pager = VersionPager()
        self.delete_button = _action_button("Delete", "Delete this message and the replies after it")
        self.editor: ChatInput | None = None  # made on demand: most messages are never edited

        self._content = QVBoxLayout(self.frame)
        self._content.setContentsMargins(12, 8, 12, 4)
        self._content.addWidget(self.text_label)
        self._actions = QHBoxLayout()
        self._actions.addWidget(self.pager)
        self._actions.addStretch(1)
        self._actions.addWidget(self.delete_button)
        self._actions.addWidget(self.edit_button)
        self._content.addLayout(self._actions)
        row = QHBoxLayout(self)
        row.setContentsMargins(USER_INDENT_PX, 0, 0, 0)
        row.addStretch(1)  # a short message makes a small bubble on the right
        row.addWidget(self.frame)
        self.edit_button.clicked.connect(self.start_editing)
        self.delete_button.clicked.connect(self.deleteRequested)

    def start_editing(self) -> None:
        if self.editor is not None:
            return
        self.editor = ChatInput(cancel_on_escape=True)
        self.editor.setPlaceholderText("Edit the message (Enter to send, Esc to cancel)")
        self.editor.setPlainText(self.text)
        self.editor.setMaximumHeight(self.editor.fontMetrics().lineSpacing() * 8)
        self.editor.submitted.connect(self._submit)
        self.editor.cancelled.connect(self.stop_editing)
        self.save_button = QPushButton("Send")
        self.cancel_button = QPushButton("Cancel")
        self.save_button.clicked.connect(self._submit_editor_text)
        self.cancel_button.clicked.connect(self.stop_editing)
        self._content.insertWidget(0, self.editor)
        self._actions.addWidget(self.cancel_button)
        self._actions.addWidget(self.save_button)
        self.text_label.hide()
        self.edit_button.hide()
        self.frame.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)  # room to edit
        self.editor.setFocus()

    def stop_editing(self) -> None:
        if self.editor is None:
            return
        for widget in (self.editor, self.save_button, self.cancel_button):
            widget.deleteLater()
        self.editor = None
        self.text_label.show()
        self.edit_button.show()
        self.frame.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Preferred)

    def set_actions_enabled(self, enabled: bool) -> None:
        self.edit_button.setEnabled(enabled)
        self.delete_button.setEnabled(enabled)
        self.pager.set_enabled(enabled)
        if self.editor is not None:
            self.save_button.setEnabled(enabled)

    def _submit_editor_text(self) -> None:
        self._submit(self.editor.toPlainText())

    def _submit(self, text: str) -> None:
        if text.strip() and self.save_button.isEnabled():
            self.editSubmitted.emit(text.strip())


class AssistantBubble(QFrame):
    """A reply: reasoning section, Markdown answer, error box, stats line and Regenerate.

    Made with a stored message it shows that message; made without one it streams: append_* collects
    deltas and a timer re-renders at most every RENDER_INTERVAL_MS until finish().
    """

    regenerateRequested = Signal()
    continueRequested = Signal()
    deleteRequested = Signal()

    def __init__(self, message: dict | None = None, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("assistantBubble")
        self.answer = ""
        self.reasoning = ""
        self.streaming = message is None
        self._collapsed_for_answer = False  # the thinking folds away once, when the answer begins

        self.reasoning_section = ReasoningSection()
        self.answer_view = MarkdownView()
        self.error_label = _make_selectable(QLabel(), Qt.TextFormat.PlainText)
        self.error_label.setObjectName("errorText")
        self.stats_label = QLabel()
        self.stats_label.setObjectName("statsLine")
        self.stats_label.setWordWrap(True)  # a narrow window wraps the stats rather than cutting Regenerate
        self.stats_label.setTextFormat(Qt.TextFormat.PlainText)  # a remote engine's name is data, never markup
        self.regenerate_button = QToolButton()
        self.regenerate_button.setText("Regenerate")
        self.regenerate_button.setAutoRaise(True)
        self.pager = VersionPager()
        self.continue_button = _action_button("Continue", "Write more of this reply, after where it was cut")
        self.delete_button = _action_button("Delete", "Delete this reply and the turns after it")
        self.stop_reason = ""
        self._render_timer = QTimer(self, singleShot=True, interval=RENDER_INTERVAL_MS)

        footer = QHBoxLayout()
        footer.addWidget(self.pager, 0, Qt.AlignmentFlag.AlignTop)
        footer.addWidget(self.stats_label, 1)
        footer.addWidget(self.delete_button, 0, Qt.AlignmentFlag.AlignTop)
        footer.addWidget(self.continue_button, 0, Qt.AlignmentFlag.AlignTop)
        footer.addWidget(self.regenerate_button, 0, Qt.AlignmentFlag.AlignTop)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 8, 12, 4)
        layout.addWidget(self.reasoning_section)
        layout.addWidget(self.answer_view)
        layout.addWidget(self.error_label)
        layout.addLayout(footer)

        self.regenerate_button.clicked.connect(self.regenerateRequested)
        self.continue_button.clicked.connect(self.continueRequested)
        self.delete_button.clicked.connect(self.deleteRequested)
        self._render_timer.timeout.connect(self._render)
        self.error_label.hide()
        self.regenerate_button.hide()
        self.continue_button.hide()
        self.delete_button.hide()
        if message is None:
            self.reasoning_section.hide()
            self.stats_label.setText("Generating…")
        else:
            self.answer, self.reasoning = message["content"], message.get("reasoning", "")
            self.reasoning_section.set_expanded(False)
            self._render()
            self._show_stats(message.get("stats") or {})

    def append_reasoning(self, text: str) -> None:
        self.reasoning += text
        self._schedule_render()

    def append_answer(self, text: str) -> None:
        self.answer += text
        if not self._collapsed_for_answer and self.answer.strip():
            self._collapsed_for_answer = True
            self.reasoning_section.set_expanded(False)
        self._schedule_render()

    def show_progress(self, progress: dict) -> None:
        rate = progress.get("decode_tokens_per_s") or 0.0
        self.stats_label.setText(f"Generating… {progress.get('new_tokens', 0)} tokens · {rate:.1f} tok/s")

    def finish(self, answer: str, reasoning: str, stats: dict) -> None:
        """The reply is over: show its final text and stats."""
        self.streaming = False
        self._render_timer.stop()
        self.answer, self.reasoning = answer, reasoning
        self._render()
        self._show_stats(stats)

    def resume_streaming(self) -> None:
        """Continue: the reply streams again, its new text appended to what it shows."""
        self.streaming = True
        self._collapsed_for_answer = bool(self.answer.strip())
        self.stats_label.setText("Generating…")
        self.set_regenerate_visible(False)

    def set_regenerate_visible(self, visible: bool) -> None:
        """Regenerate and (after a reply cut by its length limit or Stop) Continue, on the last reply only."""
        self.regenerate_button.setVisible(visible and not self.streaming)
        self.continue_button.setVisible(
            visible and not self.streaming and self.stop_reason in CUT_REASONS and bool(self.answer or self.reasoning)
        )

    def set_actions_enabled(self, enabled: bool) -> None:
        self.delete_button.setVisible(not self.streaming)
        self.delete_button.setEnabled(enabled)
        self.pager.set_enabled(enabled)

    def _schedule_render(self) -> None:
        if not self._render_timer.isActive():  # a running timer already covers this delta
            self._render_timer.start()

    def _render(self) -> None:
        self.reasoning_section.toggle.setText("Thinking…" if self.streaming else "Thoughts")
        self.reasoning_section.setVisible(bool(self.reasoning))
        self.reasoning_section.set_text(self.reasoning)
        self.answer_view.set_markdown(self.answer)

    def _show_stats(self, stats: dict) -> None:
        self.stop_reason = stats.get("stop_reason") or ""
        self.stats_label.setText(format_stats(stats))
        failed = stats.get("stop_reason") == "error"
        if failed:
            self.error_label.setText(stats.get("error") or "The reply failed.")
        self.error_label.setVisible(failed)


class Transcript(QScrollArea):
    """The column of bubbles for one conversation; bubble i shows the conversation's message i."""

    editSubmitted = Signal(int, str)  # message index, new text
    regenerateRequested = Signal()
    EMPTY_HINT = (
        "Ask anything. For example: “Explain mixture-of-experts models in three sentences”, "
        "“Write a Python function that reverses a linked list”, or paste a text to summarise.\n"
        "Enter sends, Shift+Enter starts a new line; the System prompt button sets how this chat answers."
    )
    continueRequested = Signal()
    versionRequested = Signal(int, int)  # message index, step (-1 previous, 1 next)
    deleteRequested = Signal(int)  # message index

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setFrameShape(QFrame.Shape.NoFrame)
        column = QWidget()
        column.setStyleSheet(STYLE)
        column.setMaximumWidth(READABLE_WIDTH_PX)
        self._column = QVBoxLayout(column)
        self._column.setContentsMargins(16, 16, 16, 16)
        self._column.setSpacing(12)
        self.empty_hint = QLabel(self.EMPTY_HINT)
        self.empty_hint.setObjectName("emptyHint")
        self.empty_hint.setWordWrap(True)
        self.empty_hint.setProperty("role", "muted")
        self._column.addWidget(self.empty_hint)
        self._column.addStretch(1)  # bubbles sit at the top of a short chat
        centred = QWidget()  # a wide window puts the column in its middle, with margins either side
        row = QHBoxLayout(centred)
        row.setContentsMargins(0, 0, 0, 0)
        row.addStretch(1)
        row.addWidget(column, 100)
        row.addStretch(1)
        self.setWidget(centred)
        self._bubbles: list[UserBubble | AssistantBubble] = []
        self._busy = False
        self._follow_bottom = True

        bar = self.verticalScrollBar()
        bar.valueChanged.connect(self._on_scrolled)
        bar.rangeChanged.connect(self._on_range_changed)

    @property
    def bubbles(self) -> list[UserBubble | AssistantBubble]:
        return list(self._bubbles)

    def show_messages(self, messages: list[dict]) -> None:
        """Replace the transcript with a conversation's stored messages, scrolled to the end."""
        self.truncate(0)
        self._follow_bottom = True
        for message in messages:
            self._append(self._bubble_for(message))
        self._update_actions()  # once, not per bubble: a long chat opens in linear time

    def add_message(self, message: dict) -> UserBubble | AssistantBubble:
        bubble = self._append(self._bubble_for(message))
        self._update_actions()
        return bubble

    def start_reply(self) -> AssistantBubble:
        """A new, streaming reply bubble at the end."""
        bubble = self._append(AssistantBubble())
        self._update_actions()
        return bubble

    def truncate(self, keep: int) -> None:
        """Keep the first `keep` bubbles."""
        for bubble in self._bubbles[keep:]:
            self._column.removeWidget(bubble)
            bubble.deleteLater()
        del self._bubbles[keep:]
        self._update_actions()

    def set_busy(self, busy: bool) -> None:
        """While a reply is on its way, editing and regenerating wait."""
        self._busy = busy
        self._update_actions()

    def scroll_to_bottom(self) -> None:
        self._follow_bottom = True
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())

    def _bubble_for(self, message: dict) -> UserBubble | AssistantBubble:
        if message["role"] != "user":
            bubble = AssistantBubble(message)
        else:
            bubble = UserBubble(message["content"])
            bubble.editSubmitted.connect(self._on_edit_submitted)
        bubble.pager.set_version(message.get("version", 1), message.get("versions", 1))
        return bubble

    def _append(self, bubble):
        if isinstance(bubble, AssistantBubble):
            bubble.regenerateRequested.connect(self.regenerateRequested)
            bubble.continueRequested.connect(self.continueRequested)
        bubble.deleteRequested.connect(self._on_delete_requested)
        bubble.pager.stepRequested.connect(self._on_step_requested)
        self._column.insertWidget(self._column.count() - 1, bubble)  # before the closing stretch
        self._bubbles.append(bubble)
        return bubble

    def _on_edit_submitted(self, text: str) -> None:
        # looked up when it happens: a bubble's index is its message's position in the chat
        self.editSubmitted.emit(self._bubbles.index(self.sender()), text)

    def _on_delete_requested(self) -> None:
        self.deleteRequested.emit(self._bubbles.index(self.sender()))

    def _on_step_requested(self, step: int) -> None:
        pager = self.sender()
        index = next(i for i, b in enumerate(self._bubbles) if b.pager is pager)
        self.versionRequested.emit(index, step)

    def _update_actions(self) -> None:
        self.empty_hint.setVisible(not self._bubbles)
        for i, bubble in enumerate(self._bubbles):
            bubble.set_actions_enabled(not self._busy)
            if isinstance(bubble, AssistantBubble):
                bubble.set_regenerate_visible(i == len(self._bubbles) - 1 and not self._busy)

    def _on_scrolled(self, value: int) -> None:
        self._follow_bottom = value >= self.verticalScrollBar().maximum() - FOLLOW_SLACK_PX

    def _on_range_changed(self, _minimum: int, maximum: int) -> None:
        if self._follow_bottom:
            self.verticalScrollBar().setValue(maximum)
