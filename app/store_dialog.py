"""The dialog shown at start when the chat history file is damaged or cannot be written."""

from __future__ import annotations

from PySide6.QtWidgets import QMessageBox

from app.storage import StoreError


def ask_about_store(error: StoreError) -> str:
    """Ask what to do with an unusable history file: "aside", "memory" or "quit" (app.storage.open_conversations)."""
    box = QMessageBox()
    box.setIcon(QMessageBox.Icon.Warning)
    box.setWindowTitle("MoE Desk: chat history")
    if error.kind == "damaged":
        box.setText(f"The chat history file is damaged and cannot be opened:\n{error.path}")
        box.setInformativeText(
            f"{error.detail}.\n\nMoE Desk can keep the file aside under a new name (nothing is "
            f"deleted, so it can still be recovered) and start a new, empty history."
        )
        answers = {box.addButton("Keep it aside and start a new history", QMessageBox.ButtonRole.AcceptRole): "aside"}
    else:
        box.setText(f"The chat history file cannot be written:\n{error.path}")
        box.setInformativeText(
            f"{error.detail}.\n\nCheck the file's and its folder's permissions, or whether the "
            f"disk is mounted read-only. MoE Desk can open it without saving: this session's "
            f"chats would be lost when you quit."
        )
        answers = {box.addButton("Continue without saving", QMessageBox.ButtonRole.AcceptRole): "memory"}
    quit_button = box.addButton("Quit", QMessageBox.ButtonRole.RejectRole)
    box.setDefaultButton(quit_button)
    box.exec()
    return answers.get(box.clickedButton(), "quit")
