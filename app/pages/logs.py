"""The Logs page: the engine worker's log records, filterable by level and text, and "Copy diagnostics".

Diagnostics are what a bug report needs in one paste: versions, OS, GPU and RAM
(system_info.diagnostics()), the last error and the current memory plan.
"""

from __future__ import annotations

import dataclasses
import time

from PySide6.QtCore import QAbstractListModel, QModelIndex, QSortFilterProxyModel, Qt
from PySide6.QtGui import QColor, QFontDatabase, QGuiApplication
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QLineEdit, QListView, QPushButton, QVBoxLayout, QWidget

from app import system_info
from engine.api import MemoryPlan

LEVELS = ("info", "warning", "error")
LEVEL_CHOICES = (("All levels", "info"), ("Warnings and errors", "warning"), ("Errors only", "error"))
LEVEL_COLOURS = {"warning": QColor("#b7791f"), "error": QColor("#d14343")}
MAX_RECORDS = 5000  # a long session must not grow the log without bound; the oldest records go first
LEVEL_ROLE = Qt.ItemDataRole.UserRole
MESSAGE_ROLE = Qt.ItemDataRole.UserRole + 1


@dataclasses.dataclass(frozen=True)
class LogRecord:
    time: float  # seconds since the epoch
    level: str
    message: str

    def text(self) -> str:
        return f"{time.strftime('%H:%M:%S', time.localtime(self.time))}  {self.level.upper():<7}  {self.message}"


class LogRecordModel(QAbstractListModel):
    def __init__(self, parent=None):
        super().__init__(parent)
        self._records: list[LogRecord] = []

    def append(self, level: str, message: str) -> None:
        if len(self._records) >= MAX_RECORDS:
            self.beginRemoveRows(QModelIndex(), 0, 0)
            del self._records[0]
            self.endRemoveRows()
        row = len(self._records)
        self.beginInsertRows(QModelIndex(), row, row)
        self._records.append(LogRecord(time.time(), level, message))
        self.endInsertRows()

    def rowCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self._records)

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        record = self._records[index.row()]
        if role == Qt.ItemDataRole.DisplayRole:
            return record.text()
        if role == Qt.ItemDataRole.ForegroundRole:
            return LEVEL_COLOURS.get(record.level)
        if role == LEVEL_ROLE:
            return record.level
        if role == MESSAGE_ROLE:
            return record.message
        return None


def level_pattern(minimum_level: str) -> str:
    """A filter for the level role that keeps records at or above `minimum_level`."""
    if minimum_level == LEVELS[0]:
        return ""  # everything, including levels this page does not know yet
    return "^(" + "|".join(LEVELS[LEVELS.index(minimum_level) :]) + ")$"


def plan_text(plan: dict) -> str:
    """The planner's own table for a MemoryPlan.to_dict(), so the report reads like `engine plan`."""
    fields = {f.name for f in dataclasses.fields(MemoryPlan)}
    return MemoryPlan(**{k: v for k, v in plan.items() if k in fields}).format_table()


class LogsPage(QWidget):
    def __init__(self, worker, parent: QWidget | None = None):
        super().__init__(parent)
        self.records = LogRecordModel(self)
        # Two stock proxies, level then text, instead of a subclass: no custom invalidation to keep right.
        self.by_level = QSortFilterProxyModel(self)
        self.by_level.setSourceModel(self.records)
        self.by_level.setFilterRole(LEVEL_ROLE)
        self.filtered = QSortFilterProxyModel(self)
        self.filtered.setSourceModel(self.by_level)
        self.filtered.setFilterRole(MESSAGE_ROLE)
        self.filtered.setFilterCaseSensitivity(Qt.CaseSensitivity.CaseInsensitive)
        self.view = QListView()
        self.view.setModel(self.filtered)
        self.view.setUniformItemSizes(False)
        self.view.setWordWrap(True)
        self.view.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.view.setSelectionMode(QListView.SelectionMode.ExtendedSelection)
        self.level_combo = QComboBox()
        for label, level in LEVEL_CHOICES:
            self.level_combo.addItem(label, level)
        self.level_combo.currentIndexChanged.connect(
            lambda: self.by_level.setFilterRegularExpression(level_pattern(self.level_combo.currentData()))
        )
        self.search_field = QLineEdit()
        self.search_field.setPlaceholderText("Filter messages…")
        self.search_field.setClearButtonEnabled(True)
        self.search_field.textChanged.connect(self.filtered.setFilterFixedString)
        self.copy_button = QPushButton("Copy diagnostics")
        self.copy_button.setToolTip("Versions, OS, GPU, RAM, the last error and the memory plan, for a bug report.")
        self.copy_button.clicked.connect(self.copy_diagnostics)
        self.copied_label = QLabel()
        self.copied_label.setProperty("role", "muted")

        tools = QHBoxLayout()
        tools.addWidget(self.level_combo)
        tools.addWidget(self.search_field, 1)
        tools.addWidget(self.copy_button)
        layout = QVBoxLayout(self)
        layout.addWidget(QLabel("<h2>Logs</h2>"))
        layout.addLayout(tools)
        layout.addWidget(self.view, 1)
        layout.addWidget(self.copied_label)

        self.last_error = ""
        self._plan: dict = {}
        worker.log.connect(self.add_record)

    def add_record(self, level: str, message: str) -> None:
        self.records.append(level, message)
        if level == "error":
            self.last_error = message
        self.view.scrollToBottom()

    def set_plan(self, plan: dict) -> None:
        """The memory plan to report (EnginePage.planChanged); {} when none fits."""
        self._plan = dict(plan)

    def diagnostics_text(self) -> str:
        return "\n\n".join(
            (
                system_info.diagnostics(),
                "Last error:\n" + (self.last_error or "none"),
                "Memory plan:\n" + (plan_text(self._plan) if self._plan else "none"),
            )
        )

    def copy_diagnostics(self) -> None:
        QGuiApplication.clipboard().setText(self.diagnostics_text())
        self.copied_label.setText("Diagnostics copied to the clipboard.")
