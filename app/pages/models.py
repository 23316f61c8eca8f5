"""The Models page: the local library (Hugging Face cache, the user's folders, downloads, the demo model), with load.

Scanning reads config.json and safetensors headers on a daemon thread (app/library_scanner.py)
the page polls; loading
goes to the engine worker through the queued `loadRequested` signal and reports back through the
worker's loadStarted / loaded / loadFailed signals. "Download…" opens the download dialog
(app/dialogs/download_dialog.py); a model it finishes is rescanned, selected and can be loaded at once.

Remote engines (OpenAI-compatible servers the user added with "Add remote engine…", app/dialogs/remote_dialog.py)
are listed after the local models, marked remote with their host. "Use" on one makes it answer the chats
(`engineChosen(id)`); loading a local model makes the local engine answer them again (`engineChosen("")`).
"""

from __future__ import annotations

import html
from pathlib import Path

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QPersistentModelIndex, Qt, QTimer, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QProgressBar,
    QPushButton,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from app.library_scanner import LibraryScan
from app.model_library import SIZE_PRESETS, default_hf_cache
from app.paths import DEMO_MODEL, download_folder
from app.remote_store import RemoteEndpoint, RemoteStore
from app.settings import load_options
from app.system_info import format_bytes

COLUMNS = ("Name", "Architecture", "Format", "Size", "This PC", "Presets", "Status")
PRESET_NAMES = {"4gb": "4 GB", "8gb": "8 GB", "12gb": "12 GB"}
ERROR_COLOUR = QColor("#d14343")
LOADED_COLOUR = QColor("#2e8b57")
REMOTE_COLOUR = QColor("#2f6fb5")
FIT_COLOURS = {"too_big": ERROR_COLOUR, "no_disk": ERROR_COLOUR, "tight": QColor("#c47f00")}
SCAN_POLL_MS = 30  # how often the page looks whether its library scan is done


def fits_text(entry: dict) -> str:
    """ "4 GB ✓  8 GB ✓  12 GB ✗" for a usable model; "—" for one that cannot be planned."""
    if not entry["fits"]:
        return "—"
    return "  ".join(f"{PRESET_NAMES[p]} {'✓' if entry['fits'][p] else '✗'}" for p in SIZE_PRESETS)


def remote_entry(endpoint: RemoteEndpoint) -> dict:
    """A remote engine as a library row: its model, marked remote, with its host."""
    return {
        "name": endpoint.model,
        "path": "",
        "source": endpoint.host,
        "architecture": f"remote: {endpoint.name}",
        "format": "OpenAI API",
        "size_bytes": None,
        "fits": {},
        "fit_errors": {},
        "error": "",
        "remote_id": endpoint.id,
        "remote_label": endpoint.label(),
        "has_key": bool(endpoint.api_key),
    }


class ModelLibraryModel(QAbstractTableModel):
    """The library entries (model_library.describe_model dicts), then the remote engines (remote_entry dicts), plus
    which model is loading or loaded and which remote engine answers the chats."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self._entries: list[dict] = []
        self._remotes: list[dict] = []
        self._loading_path = ""
        self._loaded_path = ""
        self._chosen_remote = ""

    def set_entries(self, entries: list[dict]) -> None:
        self.beginResetModel()
        self._entries = list(entries)
        self.endResetModel()

    def set_remotes(self, endpoints: list[RemoteEndpoint]) -> None:
        self.beginResetModel()
        self._remotes = [remote_entry(e) for e in endpoints]
        self.endResetModel()

    def entry(self, row: int) -> dict:
        return self._entries[row] if row < len(self._entries) else self._remotes[row - len(self._entries)]

    def remote_row(self, endpoint_id: str) -> int:
        """The row of a remote engine, -1 when it is not listed."""
        return next((len(self._entries) + i for i, e in enumerate(self._remotes) if e["remote_id"] == endpoint_id), -1)

    def set_chosen_remote(self, endpoint_id: str) -> None:
        self._chosen_remote = endpoint_id
        self._status_changed()

    def row_of(self, path: str) -> int:
        """The row of a model folder, -1 when it is not in the library."""
        wanted = _same_path_key(path)
        return next((i for i, e in enumerate(self._entries) if _same_path_key(e["path"]) == wanted), -1)

    def set_loading(self, path: str) -> None:
        self._loading_path = path
        self._status_changed()

    def set_loaded(self, path: str) -> None:
        self._loading_path, self._loaded_path = "", path
        self._status_changed()

    def _status_changed(self) -> None:
        if self.rowCount():
            column = COLUMNS.index("Status")
            self.dataChanged.emit(self.index(0, column), self.index(self.rowCount() - 1, column))

    def status_text(self, entry: dict) -> str:
        if entry.get("remote_id"):
            answering = "answering chats · " if entry["remote_id"] == self._chosen_remote else ""
            return f"{answering}remote @ {entry['source']}"
        key = _same_path_key(entry["path"])
        if self._loading_path and _same_path_key(self._loading_path) == key:
            return "loading…"
        if self._loaded_path and _same_path_key(self._loaded_path) == key:
            return "loaded"
        if entry["error"]:
            return "cannot open: " + entry["error"].split(": ", 1)[-1]
        return "ready"

    def rowCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self._entries) + len(self._remotes)

    def columnCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(COLUMNS)

    def headerData(self, section, orientation, role=Qt.ItemDataRole.DisplayRole):
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            return COLUMNS[section]
        return None

    def data(self, index: QModelIndex | QPersistentModelIndex, role=Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        entry, column = self.entry(index.row()), COLUMNS[index.column()]
        if role == Qt.ItemDataRole.DisplayRole:
            return {
                "Name": entry["name"],
                "Architecture": entry["architecture"] or "—",
                "Format": entry["format"] or "—",
                "Size": format_bytes(entry["size_bytes"]) if entry["size_bytes"] is not None else "—",
                "This PC": entry.get("machine_fit", {}).get("short", "—"),
                "Presets": fits_text(entry),
                "Status": self.status_text(entry),
            }[column]
        if role == Qt.ItemDataRole.ToolTipRole:
            return self._tooltip(entry, column)
        if role == Qt.ItemDataRole.ForegroundRole and column == "This PC":
            return FIT_COLOURS.get(entry.get("machine_fit", {}).get("level"))
        if role == Qt.ItemDataRole.ForegroundRole and column == "Status":
            status = self.status_text(entry)
            if status == "loaded":
                return LOADED_COLOUR
            if entry.get("remote_id"):
                return REMOTE_COLOUR
            if status.startswith("cannot open"):
                return ERROR_COLOUR
        return None

    def _tooltip(self, entry: dict, column: str) -> str:
        if entry.get("remote_id"):
            key = "an API key is saved (never shown)" if entry["has_key"] else "no API key"
            return f"{entry['remote_label']}\nan OpenAI-compatible server; {key}"
        if column == "This PC" and entry.get("machine_fit"):
            return entry["machine_fit"]["text"]
        if column == "Presets" and entry["fits"]:
            return "\n".join(
                f"{PRESET_NAMES[p]}: fits" if entry["fits"][p] else f"{PRESET_NAMES[p]}: {entry['fit_errors'][p]}"
                for p in SIZE_PRESETS
            )
        if column == "Status" and entry["error"]:
            return entry["error"]
        return f"{entry['path']}\n(from {entry['source']})"


def _same_path_key(path: str) -> str:
    return str(Path(path).expanduser().resolve())


class ModelsPage(QWidget):
    loadRequested = Signal(str, dict)  # model folder, app.settings.load_options(); connected to worker.load
    unloadRequested = Signal()  # connected to worker.unload
    log = Signal(str, str)  # level, message: what the download dialog's worker reports (never a token)
    libraryScanned = Signal()  # the newest scan's entries are listed
    engineChosen = Signal(str)  # which engine answers the chats: a remote engine's id, or "" for the local one

    def __init__(self, worker, settings, parent: QWidget | None = None, remotes: RemoteStore | None = None):
        super().__init__(parent)
        self.settings = settings
        self.remotes = remotes if remotes is not None else RemoteStore(settings.remote_engines_path())
        self.library = ModelLibraryModel(self)
        self.table = QTableView()
        self.table.setModel(self.library)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().hide()
        self.table.verticalHeader().setDefaultSectionSize(self.fontMetrics().height() + 10)
        self.table.setAlternatingRowColors(True)
        self.table.setWordWrap(False)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(COLUMNS.index("Status"), QHeaderView.ResizeMode.Stretch)
        self.table.doubleClicked.connect(lambda index: self.load_row(index.row()))
        self.table.selectionModel().selectionChanged.connect(self._update_buttons)

        self.open_button = QPushButton("Open folder…")
        self.open_button.clicked.connect(self._choose_folder)
        self.download_button = QPushButton("Download…")
        self.download_button.setToolTip("Download a model from the Hugging Face Hub")
        self.download_button.clicked.connect(self.open_download_dialog)
        self.download_dialog = None
        self.remote_button = QPushButton("Add remote engine…")
        self.remote_button.setToolTip(
            "Chat through an OpenAI-compatible server: vLLM, SGLang, llama-server, FreeToken or another MoE Desk"
        )
        self.remote_button.clicked.connect(self.open_remote_dialog)
        self.remote_dialog = None
        self.remove_button = QPushButton("Remove")
        self.remove_button.setToolTip("Forget the selected remote engine (its key too)")
        self.remove_button.clicked.connect(self._remove_selected)
        self.refresh_button = QPushButton("Refresh")
        self.refresh_button.clicked.connect(self.refresh)
        self.load_button = QPushButton("Load")
        self.load_button.setDefault(True)
        self.load_button.clicked.connect(self._load_selected)
        self.unload_button = QPushButton("Unload")
        self.unload_button.setEnabled(False)
        self.unload_button.clicked.connect(self.unloadRequested)

        self.error_banner = QLabel()
        self.error_banner.setObjectName("errorBanner")
        self.error_banner.setWordWrap(True)
        self.error_banner.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.error_banner.setStyleSheet(
            "#errorBanner { background: #fdecec; color: #8a1c1c; "
            "border: 1px solid #f2b8b8; border-radius: 6px; padding: 8px; }"
        )
        self.error_banner.hide()
        self.busy_bar = QProgressBar()
        self.busy_bar.setRange(0, 0)  # indeterminate: the loader reports no fraction done
        self.busy_bar.setFixedHeight(6)
        self.busy_bar.setTextVisible(False)
        self.busy_bar.hide()
        self.status_label = QLabel("No model loaded.")
        self.status_label.setWordWrap(True)
        self.sources_label = QLabel()
        self.sources_label.setProperty("role", "muted")
        self.sources_label.setWordWrap(True)

        title = QLabel("<h2>Models</h2>")
        buttons = QHBoxLayout()
        for button in (self.download_button, self.open_button, self.remote_button, self.refresh_button):
            buttons.addWidget(button)
        buttons.addStretch(1)
        buttons.addWidget(self.remove_button)
        buttons.addWidget(self.unload_button)
        buttons.addWidget(self.load_button)
        layout = QVBoxLayout(self)
        layout.addWidget(title)
        layout.addWidget(self.sources_label)
        layout.addLayout(buttons)
        layout.addWidget(self.error_banner)
        layout.addWidget(self.table, 1)
        layout.addWidget(self.busy_bar)
        layout.addWidget(self.status_label)

        self._busy = False
        self._scan: LibraryScan | None = None  # the newest scan; an older one still running is forgotten
        self._scan_poll = QTimer(self, interval=SCAN_POLL_MS)
        self._scan_poll.timeout.connect(self._poll_scan)
        self._after_scan: list = []  # what waits for the newest scan: selecting or loading what it found
        self.loadRequested.connect(worker.load)
        self.unloadRequested.connect(worker.unload)
        worker.unloaded.connect(self._on_unloaded)
        worker.loadStarted.connect(self._on_load_started)
        worker.loaded.connect(self._on_loaded)
        worker.loadFailed.connect(self._on_load_failed)
        worker.busyChanged.connect(self._on_busy_changed)
        self.library.set_remotes(self.remotes.endpoints())
        self.library.set_chosen_remote(self.chosen_remote_id())
        self.refresh()

    # ---- library ---------------------------------------------------------------------------------

    def refresh(self, then=None) -> None:
        """Scan the library again on the scanner's thread; `then()` runs once its entries are listed."""
        folders = self.settings.get("model_folders")
        downloads = download_folder(self.settings.get("download_folder"))
        where = [f"downloads ({downloads})", f"the Hugging Face cache ({default_hf_cache()})"] + folders
        self._sources = "Looking in " + "; ".join(where) + "."
        self.sources_label.setText(self._sources + " Scanning…")
        if then is not None:
            self._after_scan.append(then)
        self._scan = LibraryScan(folders, downloads)
        self._scan_poll.start()

    def _poll_scan(self) -> None:
        if self._scan is None or not self._scan.done():
            return
        entries, self._scan = self._scan.entries, None
        self._scan_poll.stop()
        self.library.set_entries(entries)
        self.sources_label.setText(self._sources)
        self._update_buttons()
        waiting, self._after_scan = self._after_scan, []
        for then in waiting:
            then()
        self.libraryScanned.emit()

    def add_folder(self, path: str | Path) -> None:
        """Remember a folder (a model, or a folder of models), rescan, and select what it added."""
        path = str(Path(path).expanduser())
        folders = self.settings.get("model_folders")
        if path not in folders:
            self.settings.set("model_folders", folders + [path])
        self.refresh(lambda: self._select_added(path))

    def _select_added(self, path: str) -> None:
        row = self.library.row_of(path)
        if row < 0:  # a folder of models: its first model, if any, is what to select
            row = next(
                (i for i in range(self.library.rowCount()) if Path(self.library.entry(i)["path"]).parent == Path(path)),
                -1,
            )
        if row >= 0:
            self.table.selectRow(row)
            entry = self.library.entry(row)
            if entry["error"]:
                self.show_error(f"This folder cannot be opened as a model.\n{entry['error']}")
                self.log.emit("error", f"{path} cannot be opened as a model: {entry['error']}")
            else:
                self.error_banner.hide()
        else:
            self.log.emit(
                "warning",
                f"no model found in {path}: open a folder with a config.json, or one that holds model folders",
            )

    def open_download_dialog(self):
        """Open (or bring back) the download dialog; returns it."""
        from app.dialogs.download_dialog import DownloadDialog

        if self.download_dialog is None:
            self.download_dialog = DownloadDialog(self.settings, self)
            self.download_dialog.downloaded.connect(self._on_downloaded)
            self.download_dialog.loadRequested.connect(self.load_path)
            self.download_dialog.finished.connect(self._on_download_dialog_closed)
            self.download_dialog.worker.log.connect(self.log)
        self.download_dialog.show()
        self.download_dialog.raise_()
        return self.download_dialog

    def _on_download_dialog_closed(self) -> None:
        self.download_dialog.deleteLater()
        self.download_dialog = None

    def _on_downloaded(self, path: str) -> None:
        """A download finished: list it and select it, ready to load."""
        self.refresh(lambda: self._select(path))

    def _select(self, path: str) -> None:
        row = self.library.row_of(path)
        if row >= 0:
            self.table.selectRow(row)

    def load_path(self, path: str) -> None:
        self.refresh(lambda: self.load_row(self.library.row_of(path)))

    def _choose_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Open a model folder", str(Path.home()))
        if folder:
            self.add_folder(folder)

    # ---- remote engines --------------------------------------------------------------------------

    def open_remote_dialog(self, transport=None):
        """Open (or bring back) the remote engine dialog; returns it. `transport`: the tests' fake network."""
        from app.dialogs.remote_dialog import RemoteEngineDialog

        if self.remote_dialog is None:
            self.remote_dialog = RemoteEngineDialog(self.remotes, self, transport)
            self.remote_dialog.saved.connect(self._on_remote_saved)
            self.remote_dialog.finished.connect(self._on_remote_dialog_closed)
        self.remote_dialog.show()
        self.remote_dialog.raise_()
        return self.remote_dialog

    def _on_remote_dialog_closed(self) -> None:
        self.remote_dialog.deleteLater()
        self.remote_dialog = None

    def _on_remote_saved(self, endpoint_id: str) -> None:
        """A remote engine was added: list it and select it, ready to use."""
        self.library.set_remotes(self.remotes.endpoints())
        self.table.selectRow(self.library.remote_row(endpoint_id))
        self.log.emit("info", f"remote engine added: {self.remotes.get(endpoint_id).label()}")

    def chosen_remote_id(self) -> str:
        """The remote engine that answers the chats, "" for the local engine (also when the chosen one is gone)."""
        chosen = self.settings.get("chat_engine")
        return chosen if chosen and self.remotes.get(chosen) is not None else ""

    def choose_engine(self, endpoint_id: str) -> None:
        """Make a remote engine (by id), or the local one (""), answer the chats from now on."""
        self.settings.set("chat_engine", endpoint_id)
        self.library.set_chosen_remote(endpoint_id)
        if endpoint_id:
            self.status_label.setText(f"Chats are answered by remote: {self.remotes.get(endpoint_id).label()}")
        self.engineChosen.emit(endpoint_id)

    def removable_folder(self) -> str:
        """The folder the user added that the selected row came from, when that row failed to open; else ""."""
        row = self.selected_row()
        if row < 0 or self.selected_remote_id() or not self.library.entry(row)["error"]:
            return ""
        path = Path(self.library.entry(row)["path"])
        added = {_same_path_key(folder): folder for folder in self.settings.get("model_folders")}
        return next(
            (added[key] for key in (_same_path_key(str(path)), _same_path_key(str(path.parent))) if key in added), ""
        )

    def _remove_selected(self) -> None:
        folder = self.removable_folder()
        if folder:
            self.settings.set("model_folders", [f for f in self.settings.get("model_folders") if f != folder])
            self.log.emit("info", f"model folder removed from the list: {folder}")
            self.error_banner.hide()
            self.refresh()
            return
        endpoint_id = self.selected_remote_id()
        if not endpoint_id:
            return
        label = self.remotes.get(endpoint_id).label()
        self.remotes.remove(endpoint_id)
        self.library.set_remotes(self.remotes.endpoints())
        self.log.emit("info", f"remote engine removed: {label}")
        if self.settings.get("chat_engine") == endpoint_id:
            self.choose_engine("")
        self._update_buttons()

    def selected_remote_id(self) -> str:
        row = self.selected_row()
        return self.library.entry(row).get("remote_id", "") if row >= 0 else ""

    # ---- loading ---------------------------------------------------------------------------------

    def selected_row(self) -> int:
        rows = self.table.selectionModel().selectedRows()
        return rows[0].row() if rows else -1

    def _load_selected(self) -> None:
        self.load_row(self.selected_row())

    def load_row(self, row: int) -> None:
        """Load the local model in `row`, or make the remote engine in it answer the chats."""
        if row < 0:
            return
        entry = self.library.entry(row)
        if entry.get("remote_id"):
            self.choose_engine(entry["remote_id"])
            return
        if self._busy:
            return
        if entry["error"]:
            self.show_error(f"This folder cannot be opened as a model.\n{entry['error']}")
            return
        path = entry["path"]
        # "" stands for the built-in demo, so a moved installation still finds it
        self.settings.set("last_model", "" if _same_path_key(path) == _same_path_key(str(DEMO_MODEL)) else path)
        self.error_banner.hide()
        self.loadRequested.emit(path, load_options(self.settings))
        if self.settings.get("chat_engine"):
            self.choose_engine("")  # a local model chosen: the local engine answers again

    def show_error(self, message: str) -> None:
        self.error_banner.setText(message)
        self.error_banner.show()

    def _on_load_started(self, path: str) -> None:
        self.library.set_loading(path)
        self.busy_bar.show()
        self.status_label.setText(f"Loading {Path(path).name}…")

    def _on_loaded(self, info: dict) -> None:
        self.library.set_loaded(info["path"])
        self.unload_button.setEnabled(True)
        self.busy_bar.hide()
        self.error_banner.hide()
        self.status_label.setText(
            f"<b>Loaded {html.escape(info['name'])}</b>: "
            f"{html.escape(info.get('architecture') or info['model_type'])}, {info['layers']} layers, "
            f"{info['experts']} experts ({info.get('experts_per_token', '?')} per token), "
            f"context {info['context_tokens']:,} tokens"
        )

    def _on_unloaded(self) -> None:
        self.library.set_loaded("")
        self.unload_button.setEnabled(False)
        self.status_label.setText("No model loaded.")

    def _on_load_failed(self, message: str) -> None:
        self.library.set_loaded("")
        self.busy_bar.hide()
        self.status_label.setText("No model loaded.")
        self.show_error(message)

    def _on_busy_changed(self, busy: bool) -> None:
        self._busy = busy
        self._update_buttons()

    def _update_buttons(self) -> None:
        row = self.selected_row()
        remote = bool(self.selected_remote_id())
        self.load_button.setText("Use" if remote else "Load")
        self.load_button.setEnabled(remote or (not self._busy and row >= 0 and not self.library.entry(row)["error"]))
        folder = self.removable_folder()
        self.remove_button.setVisible(remote or bool(folder))
        self.remove_button.setToolTip(
            f"Take {folder} off the list (nothing is deleted)"
            if folder
            else "Forget the selected remote engine (its key too)"
        )
