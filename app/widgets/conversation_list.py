"""The list of conversations beside the chat: a model over the store, and the panel around its view.

The model reads titles from the ConversationStore and writes renames back to it; the panel adds the
"New chat" button, the search field and the context menu (rename, delete with confirmation).
"""

from __future__ import annotations

from PySide6.QtCore import QAbstractListModel, QModelIndex, QPersistentModelIndex, QPoint, Qt, Signal
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QAbstractItemView,
    QLabel,
    QLineEdit,
    QListView,
    QMenu,
    QMessageBox,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.storage import ConversationStore

CONVERSATION_ID_ROLE = Qt.ItemDataRole.UserRole

ModelIndex = QModelIndex | QPersistentModelIndex


class _ChatListView(QListView):
    """The chat list: a right-button press opens the item's menu without opening the chat, so the transcript under
    the menu stays the one the user was reading."""

    def mousePressEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        if event.button() == Qt.MouseButton.RightButton:
            event.accept()
            return
        super().mousePressEvent(event)


class ConversationListModel(QAbstractListModel):
    """Conversations newest first, optionally filtered by a search text; titles are editable."""

    def __init__(self, store: ConversationStore, parent=None):
        super().__init__(parent)
        self.store = store
        self.search = ""
        self._conversations: list[dict] = store.conversations()

    def rowCount(self, parent: ModelIndex = QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self._conversations)

    def data(self, index: ModelIndex, role: int = Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        conversation = self._conversations[index.row()]
        if role in (Qt.ItemDataRole.DisplayRole, Qt.ItemDataRole.EditRole, Qt.ItemDataRole.ToolTipRole):
            return conversation["title"]
        if role == CONVERSATION_ID_ROLE:
            return conversation["id"]
        return None

    def flags(self, index: ModelIndex) -> Qt.ItemFlag:
        return super().flags(index) | Qt.ItemFlag.ItemIsEditable

    def setData(self, index: ModelIndex, value, role: int = Qt.ItemDataRole.EditRole) -> bool:
        if role != Qt.ItemDataRole.EditRole or not index.isValid():
            return False
        conversation = self._conversations[index.row()]
        self.store.rename(conversation["id"], str(value))
        conversation["title"] = self.store.conversation(conversation["id"])["title"]  # the store's cleaned-up title
        self.dataChanged.emit(index, index)
        return True

    def set_search(self, text: str) -> None:
        self.search = text
        self.refresh()

    def refresh(self) -> None:
        """Read the list again (order changes as chats get new messages)."""
        self.beginResetModel()
        self._conversations = self.store.conversations(self.search)
        self.endResetModel()

    def row_of(self, conversation_id: int) -> int:
        """The row showing that conversation, or -1 when the search hides it."""
        return next((row for row, c in enumerate(self._conversations) if c["id"] == conversation_id), -1)


class ConversationList(QWidget):
    """New chat button, search field and the conversation list, with rename and delete."""

    conversationSelected = Signal(int)
    newChatRequested = Signal()
    conversationRenamed = Signal(int)
    conversationDeleted = Signal(int)

    def __init__(self, store: ConversationStore, parent: QWidget | None = None):
        super().__init__(parent)
        self.store = store
        self._current_id: int | None = None

        self.new_button = QPushButton("New chat")
        self.search_field = QLineEdit()
        self.search_field.setPlaceholderText("Search chats")
        self.search_field.setClearButtonEnabled(True)
        self.model = ConversationListModel(store, self)
        self.view = _ChatListView()
        self.view.setModel(self.model)
        self.view.setEditTriggers(
            QAbstractItemView.EditTrigger.DoubleClicked | QAbstractItemView.EditTrigger.EditKeyPressed
        )
        self.view.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.view.setUniformItemSizes(True)  # a long history stays fast to lay out

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.new_button)
        layout.addWidget(self.search_field)
        self.no_results = QLabel()
        self.no_results.setProperty("role", "muted")
        self.no_results.setWordWrap(True)
        self.no_results.setTextFormat(Qt.TextFormat.PlainText)  # the search text is the user's, never markup
        self.no_results.hide()
        layout.addWidget(self.no_results)
        layout.addWidget(self.view, 1)

        self.new_button.clicked.connect(self.newChatRequested)
        self.search_field.textChanged.connect(self._on_search_changed)
        self.view.selectionModel().currentRowChanged.connect(self._on_current_row_changed)
        self.view.customContextMenuRequested.connect(self._show_context_menu)
        self.model.dataChanged.connect(self._on_data_changed)
        delete_shortcut = QShortcut(QKeySequence.StandardKey.Delete, self.view)
        delete_shortcut.setContext(Qt.ShortcutContext.WidgetShortcut)
        delete_shortcut.activated.connect(self._delete_current)

    def refresh(self) -> None:
        self.model.refresh()
        self._show_current()

    def select(self, conversation_id: int) -> None:
        """Mark the open conversation in the list (if the search shows it)."""
        self._current_id = conversation_id
        self._show_current()

    def clear_search(self) -> None:
        self.search_field.clear()

    def rename(self, conversation_id: int) -> None:
        """Open the inline title editor on that conversation."""
        row = self.model.row_of(conversation_id)
        if row >= 0:
            self.view.edit(self.model.index(row))

    def delete(self, conversation_id: int) -> bool:
        """Delete the conversation after the user confirms; True if it was deleted."""
        conversation = self.store.conversation(conversation_id)
        if conversation is None:
            return False
        question = f"Delete “{conversation['title']}” and all its messages? You can undo this for a few seconds."
        answer = QMessageBox.question(
            self,
            "Delete chat",
            question,
            QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
            QMessageBox.StandardButton.No,
        )
        if answer != QMessageBox.StandardButton.Yes:
            return False
        self.store.delete(conversation_id)
        self.model.refresh()
        self.conversationDeleted.emit(conversation_id)
        self._show_current()
        return True

    def _show_current(self) -> None:
        searching = bool(self.model.search)
        self.no_results.setText(f"No chat title or message contains “{self.model.search}”." if searching else "")
        self.no_results.setVisible(searching and self.model.rowCount() == 0)
        row = -1 if self._current_id is None else self.model.row_of(self._current_id)
        if row < 0:
            self.view.clearSelection()
            return
        index = self.model.index(row)
        self.view.setCurrentIndex(index)
        self.view.scrollTo(index)

    def _on_search_changed(self, text: str) -> None:
        self.model.set_search(text.strip())
        self._show_current()

    def _on_current_row_changed(self, current: QModelIndex, _previous: QModelIndex) -> None:
        if current.isValid():  # a reset of the model passes through "no row"; that is not a choice
            self.conversationSelected.emit(current.data(CONVERSATION_ID_ROLE))

    def _on_data_changed(self, top_left: QModelIndex, _bottom_right: QModelIndex) -> None:
        self.conversationRenamed.emit(top_left.data(CONVERSATION_ID_ROLE))

    def _delete_current(self) -> None:
        index = self.view.currentIndex()
        if index.isValid():
            self.delete(index.data(CONVERSATION_ID_ROLE))

    def _show_context_menu(self, position: QPoint) -> None:
        index = self.view.indexAt(position)
        if not index.isValid():
            return
        conversation_id = index.data(CONVERSATION_ID_ROLE)
        menu = QMenu(self)
        rename = menu.addAction("Rename")
        delete = menu.addAction("Delete…")
        chosen = menu.exec(self.view.viewport().mapToGlobal(position))
        menu.deleteLater()
        if chosen is rename:
            self.rename(conversation_id)
        elif chosen is delete:
            self.delete(conversation_id)
