"""The message box of the chat: Enter sends, Shift+Enter starts a new line."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import QPlainTextEdit, QWidget

SEND_KEYS = (Qt.Key.Key_Return, Qt.Key.Key_Enter)


class ChatInput(QPlainTextEdit):
    """A plain-text editor that emits `submitted(text)` on Enter instead of inserting a line break."""

    submitted = Signal(str)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setPlaceholderText("Message (Enter to send, Shift+Enter for a new line)")
        self.setTabChangesFocus(True)  # Tab moves on to the Send button rather than indenting a chat message

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() not in SEND_KEYS:
            super().keyPressEvent(event)
            return
        if event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            self.insertPlainText("\n")  # a real newline; Qt's default would insert U+2028
        else:
            self.submitted.emit(self.toPlainText())
        event.accept()
