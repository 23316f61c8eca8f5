"""Models page → Download…: a model from the Hugging Face Hub, with its files, size and fit, then the download.

The curated list (engine.hub.CURATED_MODELS) shows each supported checkpoint's format, approximate size,
RAM and the VRAM presets it fits, from the planner and the model's built-in description (no network).
"Check files" asks the Hub for the exact file list, sizes and the fit from the real headers; "Download"
does the same and then downloads on a DownloadWorker thread, with per-file and total progress, speed and
ETA, Pause/Resume and Cancel. A finished model is announced with `downloaded(path)` (the Models page
rescans and selects it) and "Load now" asks the Models page to load it.

Closing the dialog during a download stops it and keeps what arrived: the same download resumes from it.
The token typed here goes straight to huggingface_hub's token file (engine.hub.save_token), never to the
settings or the log.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QAbstractTableModel, QEvent, QModelIndex, QPersistentModelIndex, Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QApplication,
    QCheckBox,
    QDialog,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QTableView,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.download_worker import start_download_worker
from app.machine_fit import Machine, MachineFit, judge, judge_weights
from app.paths import download_folder
from app.system_info import format_bytes
from engine.api import (
    CONFIG_FILE,
    CURATED_MODELS,
    Hub,
    client_offline,
    curated_fit,
    download_record,
    folder_name,
    footprint_from_synthetic,
    format_duration,
    has_saved_token,
    partial_download,
    save_token,
)

CURATED_COLUMNS = ("Model", "Format", "Download ≈", "RAM ≈", "This PC", "Presets", "Here")
FILE_COLUMNS = ("File", "Size", "Status")
PRESET_NAMES = {"4gb": "4 GB", "8gb": "8 GB", "12gb": "12 GB"}
ASKING_THE_HUB = "Asking the Hub for the file list…"
FIT_COLOURS = {"too_big": QColor("#d14343"), "no_disk": QColor("#d14343"), "tight": QColor("#c47f00")}
BAR_STEPS = 1000  # progress bars count in thousandths: byte counts overflow a QProgressBar's int
BANNER_STYLES = {
    "error": "background: #fdecec; color: #8a1c1c; border: 1px solid #f2b8b8;",
    "ok": "background: #e9f6ee; color: #1d5e36; border: 1px solid #b5dfc4;",
    "info": "background: #eef3fd; color: #1f3f7a; border: 1px solid #c4d4f4;",
}
STATE_TEXT = {"paused": "paused", "retrying": "connection lost, retrying…", "verifying": "verifying…"}


def fits_text(fits: dict) -> str:
    """ "4 GB ✓  8 GB ✓  12 GB ✗"; "—" when unknown."""
    if not fits:
        return "—"
    return "  ".join(f"{PRESET_NAMES[p]} {'✓' if fits.get(p) else '✗'}" for p in PRESET_NAMES)


def local_status(models_dir: Path, repo_id: str, revision: str = "main") -> str:
    """ "downloaded", "partly downloaded" (it resumes) or "" for a repo in the download folder."""
    folder = models_dir / folder_name(repo_id, revision)
    if download_record(folder) and (folder / CONFIG_FILE).is_file():
        return "downloaded"
    return "partly downloaded" if partial_download(folder) else ""


class CuratedModelsModel(QAbstractTableModel):
    """The curated checkpoints with their fit from the built-in descriptions."""

    def __init__(self, models_dir: Path, parent=None):
        super().__init__(parent)
        self.models_dir = models_dir
        self.rows = [(model, curated_fit(model)) for model in CURATED_MODELS]
        self._footprints = [footprint_from_synthetic(model.synthetic) for model in CURATED_MODELS]
        self.machine_fits: list[MachineFit] = []
        self.set_machine(Machine.read(models_dir))

    def set_machine(self, machine: Machine) -> None:
        """Judge each model against `machine` (this PC's RAM, VRAM and free disk)."""
        self.beginResetModel()
        self.machine = machine
        self.machine_fits = [judge(footprint, machine) for footprint in self._footprints]
        self.endResetModel()

    def set_models_dir(self, models_dir: Path) -> None:
        self.models_dir = models_dir
        self.set_machine(Machine.read(models_dir))  # the free disk is the new folder's

    def refresh_status(self) -> None:
        if self.rows:
            column = CURATED_COLUMNS.index("Here")
            self.dataChanged.emit(self.index(0, column), self.index(len(self.rows) - 1, column))

    def rowCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.rows)

    def columnCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(CURATED_COLUMNS)

    def headerData(self, section, orientation, role=Qt.ItemDataRole.DisplayRole):
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            return CURATED_COLUMNS[section]
        return None

    def data(self, index: QModelIndex | QPersistentModelIndex, role=Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        model, fit = self.rows[index.row()]
        column = CURATED_COLUMNS[index.column()]
        if role == Qt.ItemDataRole.DisplayRole:
            return {
                "Model": model.repo_id,
                "Format": model.format,
                "Download ≈": format_bytes(fit.weight_bytes),
                "RAM ≈": format_bytes(fit.ram_bytes),
                "This PC": self.machine_fits[index.row()].short,
                "Presets": fits_text(fit.fits),
                "Here": local_status(self.models_dir, model.repo_id),
            }[column]
        if role == Qt.ItemDataRole.ForegroundRole and column == "This PC":
            return FIT_COLOURS.get(self.machine_fits[index.row()].level)
        if role == Qt.ItemDataRole.ToolTipRole:
            if column == "This PC":
                return self.machine_fits[index.row()].text
            if column == "Presets":
                return "\n".join(
                    f"{PRESET_NAMES[p]}: fits" if ok else f"{PRESET_NAMES[p]}: {fit.errors[p]}"
                    for p, ok in fit.fits.items()
                )
            if column in ("Download ≈", "RAM ≈"):
                return (
                    "The weights the engine reads, by the planner from " + fit.basis + ". The exact download "
                    "size comes from the Hub with Check files."
                )
            return model.note
        return None


class DownloadDialog(QDialog):
    downloaded = Signal(str)  # a finished, verified model folder
    loadRequested = Signal(str)  # "Load now" on a finished model folder
    progressShown = Signal(dict)  # a progress report, after the bars and labels show it
    runEnded = Signal(str, str)  # after a check or download: outcome (planned | downloaded | failed | cancelled), text
    checkRequested = Signal(dict)  # -> DownloadWorker.check (queued)
    startRequested = Signal(dict)  # -> DownloadWorker.download (queued)

    def __init__(self, settings, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Download a model")
        self.settings = settings
        self.busy = False
        self.finished_folder = ""
        self.plan: dict | None = None
        self.outcome = ("", "")
        self._file_rows: dict[str, int] = {}
        # the thread and worker are owned by Qt, not by these references (app/download_worker.py): the dialog
        # deleted without being closed (its parent going) still stops the thread, which then deletes both
        self.worker, self.worker_thread = start_download_worker()
        self.destroyed.connect(self.worker_thread.stop)
        self.checkRequested.connect(self.worker.check)
        self.startRequested.connect(self.worker.download)
        self.worker.planned.connect(self._on_planned)
        self.worker.progress.connect(self._on_progress)
        self.worker.finished.connect(self._on_finished)
        self.worker.failed.connect(self._on_failed)
        self.worker.cancelled.connect(self._on_cancelled)
        self.worker.busyChanged.connect(self._on_busy)
        # the worker thread must end before the app tears the widgets down: the main window closing (which
        # quits the app) or the app quitting stops the download, keeping what arrived
        self._top_window = parent.window() if parent is not None else None
        if self._top_window is not None:
            self._top_window.installEventFilter(self)
        QApplication.instance().aboutToQuit.connect(self.shutdown)

        # ---- what to download
        self.curated = CuratedModelsModel(self.models_dir(), self)
        self.curated_view = QTableView()
        self.curated_view.setModel(self.curated)
        self.curated_view.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.curated_view.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.curated_view.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.curated_view.verticalHeader().hide()
        self.curated_view.setWordWrap(False)
        self.curated_view.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.curated_view.horizontalHeader().setStretchLastSection(True)
        row_height = self.fontMetrics().height() + 10
        self.curated_view.verticalHeader().setDefaultSectionSize(row_height)
        frame = 2 * self.curated_view.frameWidth() + 2
        self.curated_view.setFixedHeight(
            self.curated_view.horizontalHeader().sizeHint().height() + row_height * self.curated.rowCount() + frame
        )
        self.curated_view.selectionModel().selectionChanged.connect(self._on_curated_selected)

        self.repo_edit = QLineEdit()
        self.repo_edit.setPlaceholderText("ORGANISATION/NAME, e.g. Qwen/Qwen3-30B-A3B")
        self.repo_edit.returnPressed.connect(self.check)
        self.revision_edit = QLineEdit("main")
        self.revision_edit.setPlaceholderText("main")
        self.revision_edit.setMaximumWidth(160)
        repo_row = QHBoxLayout()
        repo_row.addWidget(self.repo_edit, 1)
        repo_row.addWidget(QLabel("Revision"))
        repo_row.addWidget(self.revision_edit)

        # ---- access
        self.token_edit = QLineEdit()
        self.token_edit.setEchoMode(QLineEdit.EchoMode.Password)
        self._update_token_placeholder()
        self.endpoint_edit = QLineEdit(settings.get("hf_endpoint"))
        self.endpoint_edit.setPlaceholderText(Hub().endpoint + "  (set a mirror's address here)")
        self.offline_box = QCheckBox("Offline mode: never contact the Hub")
        self.offline_box.setChecked(bool(settings.get("hub_offline")) or client_offline())
        self.folder_label = QLabel()
        self.folder_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.folder_button = QPushButton("Change…")
        self.folder_button.clicked.connect(self._choose_folder)
        folder_row = QHBoxLayout()
        folder_row.addWidget(self.folder_label, 1)
        folder_row.addWidget(self.folder_button)
        self._show_folder()
        access = QGroupBox("Access")
        form = QFormLayout(access)
        form.addRow("Token", self.token_edit)
        form.addRow("Endpoint", self.endpoint_edit)
        form.addRow("", self.offline_box)
        form.addRow("Saves to", folder_row)

        # ---- what it involves, and progress
        self.summary_label = QLabel("Choose a model above, or type a repo id, then Check files or Download.")
        self.summary_label.setWordWrap(True)
        self.summary_label.setTextFormat(Qt.TextFormat.PlainText)
        self.banner = QLabel()
        self.banner.setObjectName("downloadBanner")
        self.banner.setWordWrap(True)
        self.banner.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.banner.hide()
        self.files_table = QTableWidget(0, len(FILE_COLUMNS))
        self.files_table.setHorizontalHeaderLabels(FILE_COLUMNS)
        self.files_table.verticalHeader().hide()
        self.files_table.verticalHeader().setDefaultSectionSize(row_height)
        self.files_table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.files_table.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        header = self.files_table.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        header.setSectionResizeMode(1, QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(2, QHeaderView.ResizeMode.ResizeToContents)
        self.file_label = QLabel("File")
        self.file_bar = self._bar()
        self.total_label = QLabel("Total")
        self.total_bar = self._bar()
        self.speed_label = QLabel("")
        self.speed_label.setProperty("role", "muted")

        # ---- buttons
        self.check_button = QPushButton("Check files")
        self.check_button.clicked.connect(self.check)
        self.download_button = QPushButton("Download")
        self.download_button.setDefault(True)
        self.download_button.clicked.connect(self.start)
        self.pause_button = QPushButton("Pause")
        self.pause_button.clicked.connect(self.toggle_pause)
        self.cancel_button = QPushButton("Cancel download")
        self.cancel_button.setToolTip(
            "Stop and delete what this download fetched (closing the window keeps it instead, to resume later)"
        )
        self.cancel_button.clicked.connect(self.cancel)
        self.load_button = QPushButton("Load now")
        self.load_button.clicked.connect(lambda: self.loadRequested.emit(self.finished_folder))
        self.load_button.hide()
        self.close_button = QPushButton("Close")
        self.close_button.clicked.connect(self.reject)
        buttons = QHBoxLayout()
        for button in (self.check_button, self.download_button, self.pause_button, self.cancel_button):
            buttons.addWidget(button)
        buttons.addStretch(1)
        buttons.addWidget(self.load_button)
        buttons.addWidget(self.close_button)

        layout = QVBoxLayout(self)
        layout.addWidget(QLabel("<b>Supported models</b>"))
        layout.addWidget(self.curated_view)
        layout.addWidget(QLabel("<b>Repo</b> (any model on the Hub)"))
        layout.addLayout(repo_row)
        layout.addWidget(access)
        layout.addLayout(buttons)
        layout.addWidget(self.banner)
        layout.addWidget(self.summary_label)
        layout.addWidget(self.files_table, 1)
        for widget in (self.file_label, self.file_bar, self.total_label, self.total_bar, self.speed_label):
            layout.addWidget(widget)
        self.resize(860, 800)
        self._update_buttons()

    @staticmethod
    def _bar() -> QProgressBar:
        bar = QProgressBar()
        bar.setRange(0, BAR_STEPS)
        bar.setValue(0)
        bar.setTextVisible(True)
        bar.setFormat("%p%")
        return bar

    # ---- settings ----------------------------------------------------------------------------------

    def models_dir(self) -> Path:
        return download_folder(self.settings.get("download_folder"))

    def _show_folder(self) -> None:
        self.folder_label.setText(str(self.models_dir()))

    def _choose_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Where downloaded models go", str(self.models_dir()))
        if folder:
            self.settings.set("download_folder", folder)
            self._show_folder()
            self.curated.set_models_dir(self.models_dir())

    def _update_token_placeholder(self) -> None:
        self.token_edit.setPlaceholderText(
            "a token is saved (huggingface_hub's token file); type another to replace it"
            if has_saved_token()
            else "for gated models: an access token from huggingface.co/settings/tokens"
        )

    # ---- requests ----------------------------------------------------------------------------------

    def _on_curated_selected(self) -> None:
        rows = self.curated_view.selectionModel().selectedRows()
        if not rows:
            return
        model, fit = self.curated.rows[rows[0].row()]
        machine_fit = self.curated.machine_fits[rows[0].row()]
        self.repo_edit.setText(model.repo_id)
        self.revision_edit.setText("main")
        self.summary_label.setText(
            f"{model.repo_id}: {model.note}. {machine_fit.text}\nWeights ≈ {format_bytes(fit.weight_bytes)}; VRAM "
            f"presets: {fits_text(fit.fits)} (from {fit.basis}). Check files gives the exact list and size."
        )

    def request(self) -> dict | None:
        """What the worker needs, from the fields; saves the token (to huggingface_hub's store), the endpoint and
        the offline switch. None (with the reason shown) when the fields are not usable."""
        repo = self.repo_edit.text().strip()
        if not repo:
            self.show_banner("error", "Choose a model in the list, or type a repo id (ORGANISATION/NAME).")
            return None
        token = self.token_edit.text().strip()
        if token:
            save_token(token)  # straight to huggingface_hub's token file: never to our settings or log
            self.token_edit.clear()
            self._update_token_placeholder()
        self.settings.set("hf_endpoint", self.endpoint_edit.text().strip())
        self.settings.set("hub_offline", self.offline_box.isChecked())
        return {
            "repo_id": repo,
            "revision": self.revision_edit.text().strip() or "main",
            "endpoint": self.endpoint_edit.text().strip(),
            "offline": self.offline_box.isChecked(),
            "models_dir": str(self.models_dir()),
        }

    def check(self) -> None:
        self._ask(self.checkRequested)

    def start(self) -> None:
        self._ask(self.startRequested)

    def _ask(self, signal) -> None:
        """Send the form's request to the worker through `signal`, unless one is running or the form is bad."""
        if self.busy or self.worker_thread is None:  # None: shut down, the worker is gone
            return
        request = self.request()
        if request is not None:
            self._begin(ASKING_THE_HUB)
            signal.emit(request)

    def _begin(self, text: str) -> None:
        self.worker.new_request()
        self.busy = True  # at once, not when the worker says so: a second click must not queue a second run
        self.outcome = ("", "")
        self.banner.hide()
        self.load_button.hide()
        self.finished_folder = ""
        self.pause_button.setText("Pause")
        self.summary_label.setText(text)
        self._update_buttons()

    def toggle_pause(self) -> None:
        if self.worker.paused:
            self.worker.resume()
            self.pause_button.setText("Pause")
        else:
            self.worker.pause()
            self.pause_button.setText("Resume")

    def cancel(self) -> None:
        self.worker.resume()  # a paused download must wake up to stop
        self.worker.cancel()
        self.speed_label.setText("Cancelling…")

    # ---- worker signals ----------------------------------------------------------------------------

    def _on_planned(self, plan: dict) -> None:
        self.plan = plan
        self.outcome = ("planned", plan["folder"])
        self._file_rows = {}
        self.files_table.setRowCount(len(plan["files"]))
        for row, f in enumerate(plan["files"]):
            self._file_rows[f["path"]] = row
            size = QTableWidgetItem(format_bytes(f["size"]))
            size.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            self.files_table.setItem(row, 0, QTableWidgetItem(f["path"]))
            self.files_table.setItem(row, 1, size)
            self.files_table.setItem(
                row,
                2,
                QTableWidgetItem(
                    "here ✓" if f["done"] else f"{100 * f['have'] // max(f['size'], 1)} % here" if f["have"] else ""
                ),
            )
        self.summary_label.setText(plan_summary(plan, self.curated.machine))
        self.total_bar.setValue(_steps(plan["have_bytes"], plan["total_bytes"]))
        self.total_label.setText(f"Total: {format_bytes(plan['have_bytes'])} of {format_bytes(plan['total_bytes'])}")
        if not plan["disk_ok"]:
            self.show_banner("error", plan["disk_message"])

    def _on_progress(self, p: dict) -> None:
        row = self._file_rows.get(p["file"])
        state = STATE_TEXT.get(p["state"], "")
        if row is not None:
            if p["file_done"] >= p["file_size"] and p["state"] in ("downloading", "done"):
                status = "done ✓"
            else:
                status = state or f"{100 * p['file_done'] // max(p['file_size'], 1)} %"
            self.files_table.setItem(row, 2, QTableWidgetItem(status))
        self.file_label.setText(f"{p['file']}: {format_bytes(p['file_done'])} of {format_bytes(p['file_size'])}")
        self.file_bar.setValue(_steps(p["file_done"], p["file_size"]))
        self.total_label.setText(
            f"Total: {format_bytes(p['done'])} of {format_bytes(p['total'])}, file "
            f"{min(p['files_done'] + 1, p['files_total'])} of {p['files_total']}"
        )
        self.total_bar.setValue(_steps(p["done"], p["total"]))
        if p["state"] == "downloading" and p["speed"] > 0:
            self.speed_label.setText(f"{format_bytes(p['speed'])}/s, about {format_duration(p['eta_s'])} left")
        elif state:
            self.speed_label.setText(state[:1].upper() + state[1:])
        self.progressShown.emit(p)

    def _on_finished(self, folder: str) -> None:
        self.finished_folder = folder
        self.outcome = ("downloaded", folder)
        self.file_bar.setValue(BAR_STEPS)
        self.total_bar.setValue(BAR_STEPS)
        self.speed_label.setText("")
        self.show_banner("ok", f"Downloaded and verified: {folder}. It is in the Models list; Load now opens it.")
        self.load_button.show()
        self.curated.refresh_status()
        self.downloaded.emit(folder)

    def _on_failed(self, kind: str, message: str) -> None:
        self.outcome = ("failed", kind)
        self.speed_label.setText("")
        if self.summary_label.text() == ASKING_THE_HUB:  # the Hub answered, with an error: the banner says it
            self.summary_label.setText("")
        self.show_banner("error", message)
        self.curated.refresh_status()

    def _on_cancelled(self, discarded: bool) -> None:
        self.outcome = ("cancelled", "discarded" if discarded else "kept")
        self.speed_label.setText("")
        self.file_bar.setValue(0)
        if discarded:
            self.total_bar.setValue(0)
            if self.plan:
                for row in range(self.files_table.rowCount()):
                    self.files_table.setItem(row, 2, QTableWidgetItem(""))
        self.show_banner(
            "info",
            "Download cancelled; what it fetched was deleted."
            if discarded
            else "Download stopped; what arrived is kept and the next download of this model resumes it.",
        )
        self.curated.refresh_status()

    def _on_busy(self, busy: bool) -> None:
        self.busy = busy
        if not busy:
            self.pause_button.setText("Pause")
        self._update_buttons()
        if not busy:  # the worker's busyChanged(False) comes after its outcome signal
            self.runEnded.emit(*self.outcome)

    def _update_buttons(self) -> None:
        for widget in (
            self.check_button,
            self.download_button,
            self.repo_edit,
            self.revision_edit,
            self.curated_view,
            self.token_edit,
            self.endpoint_edit,
            self.offline_box,
            self.folder_button,
        ):
            widget.setEnabled(not self.busy)
        self.pause_button.setEnabled(self.busy)
        self.cancel_button.setEnabled(self.busy)

    def show_banner(self, kind: str, text: str) -> None:
        self.banner.setText(text)
        self.banner.setStyleSheet(f"#downloadBanner {{ {BANNER_STYLES[kind]} border-radius: 6px; padding: 8px; }}")
        self.banner.setProperty("kind", kind)
        self.banner.show()

    # ---- closing -----------------------------------------------------------------------------------

    def done(self, result: int) -> None:
        """Closing stops a download in progress and keeps what arrived; the worker thread ends with the dialog."""
        self.shutdown()
        super().done(result)

    def eventFilter(self, watched, event) -> bool:
        if watched is self._top_window and event.type() == QEvent.Type.Close:
            self.shutdown()
        return False

    def shutdown(self) -> None:
        """Stop a download in progress (keeping what arrived) and end the worker thread; safe to call twice."""
        if self.worker_thread is None:
            return
        self.worker_thread.stop()
        # the download stops at its next piece, or at the read timeout; a thread still running after the wait
        # is not destroyed by dropping this reference (the application owns it) and deletes itself when it ends
        self.worker_thread.wait(30_000)
        self.worker_thread = None


def _steps(done: int, total: int) -> int:
    return BAR_STEPS if total <= 0 else min(BAR_STEPS, int(BAR_STEPS * done / total))


def plan_summary(plan: dict, machine: Machine) -> str:
    """One paragraph: files and size, what is here, the disk, the fit on `machine` and the presets."""
    files = plan["files"]
    text = (
        f"{plan['repo_id']} @ {plan['revision']} (commit {plan['commit'][:12]}): {len(files)} files the engine "
        f"needs, {format_bytes(plan['total_bytes'])}"
    )
    if plan["skipped"]:
        text += f" ({len(plan['skipped'])} other files of the repo are not downloaded)"
    text += "."
    if plan["complete"]:
        text += " Already downloaded and verified."
    elif plan["have_bytes"]:
        text += f" {format_bytes(plan['have_bytes'])} is already here; the download resumes from it."
    text += f" To download: {format_bytes(plan['need_bytes'])}; free disk: {format_bytes(plan['free_bytes'])}."
    fit = plan.get("fit")
    if fit:
        verdict = judge_weights(fit["weight_bytes"], machine)
        text += f"\n{verdict.text} VRAM presets: {fits_text(fit['fits'])}."
    elif plan.get("fit_note"):
        text += "\n" + plan["fit_note"]
    if plan.get("gated"):
        text += "\nThis repo is gated: your token has access to it."
    return text
