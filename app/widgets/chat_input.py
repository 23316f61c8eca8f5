"""The message box of the chat: Enter sends, Shift+Enter starts a new line, Esc (where asked) cancels."""

from __future__ import annotations

from PySide6.QtCore import QEvent, Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import QPlainTextEdit, QWidget

SEND_KEYS = (Qt.Key.Key_Return, Qt.Key.Key_Enter)


class ChatInput(QPlainTextEdit):
    """A plain-text editor that emits `submitted(text)` on Enter instead of inserting a line break."""

    submitted = Signal(str)
    cancelled = Signal()  # Esc, when made with cancel_on_escape (an inline edit)

    def __init__(self, parent: QWidget | None = None, cancel_on_escape: bool = False):
        super().__init__(parent)
        self.cancel_on_escape = cancel_on_escape
        self.setPlaceholderText("Message (Enter to send, Shift+Enter for a new line)")
        self.setTabChangesFocus(True)  # Tab moves on to the Send button rather than indenting a chat message

    def event(self, event: QEvent) -> bool:
        # the window's Esc (stop the reply) is an application shortcut: an inline edit claims the key first
        if event.type() == QEvent.Type.ShortcutOverride and self.cancel_on_escape and event.key() == Qt.Key.Key_Escape:
            event.accept()
            return True
        return super().event(event)

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() == Qt.Key.Key_Escape and self.cancel_on_escape:
            self.cancelled.emit()
            event.accept()
            return
        if event.key() not in SEND_KEYS:
            super().keyPressEvent(event)
            return
        if event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            self.insertPlainText("\n")  # a real newline; Qt's default would insert U+2028
        else:
            self.submitted.emit(self.toPlainText())
        event.accept()
