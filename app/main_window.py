"""The main window: a sidebar of pages (Chat, Models, Engine, Logs, Settings), the system footer,
the one engine worker every page talks to, the remote worker the chat uses when a remote engine answers, and
the local API server (its state in the status bar) answering with the engine worker's model."""

from __future__ import annotations

import gc
from pathlib import Path

from PySide6.QtCore import QByteArray, QRect, QSize, Qt, Signal
from PySide6.QtGui import QGuiApplication, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QApplication,
    QFrame,
    QHBoxLayout,
    QLabel,
    QListWidget,
    QMainWindow,
    QPushButton,
    QStackedWidget,
    QVBoxLayout,
    QWidget,
)

from app.about import AboutDialog, acknowledge_cpu_notice, cpu_notice
from app.api_server import start_api_server
from app.engine_worker import start_worker
from app.pages.chat import ChatPage
from app.pages.engine_page import EnginePage
from app.pages.logs import LogsPage
from app.pages.models import ModelsPage
from app.pages.settings_page import SettingsPage
from app.paths import DEMO_MODEL
from app.remote_store import RemoteStore
from app.remote_worker import start_remote_worker
from app.settings import AppSettings, load_options
from app.storage import ConversationStore
from app.theme import apply_theme, theme_colours
from app.widgets.gauges import SystemFooter
from app.widgets.page_icons import ICON_PX, page_icon

PAGES = ("Chat", "Models", "Engine", "Logs", "Settings")
WORKER_SHUTDOWN_MS = 5000
SIDEBAR_ROW_HEIGHT = 36
SIDEBAR_WIDTH_PX = 180
DEFAULT_WINDOW_SIZE = QSize(1200, 780)
SCREEN_SHARE = 0.9  # a first window leaves some of the screen around it
MIN_WINDOW_SIZE = QSize(760, 480)  # a 1600x1000 screen at 200 % is 800x500 logical, less the task bar


def available_geometry() -> QRect:
    """The primary screen's area free of task bars and docks, in logical pixels."""
    screen = QGuiApplication.primaryScreen()
    return screen.availableGeometry() if screen is not None else QRect(0, 0, 1024, 640)


def first_window_size(available: QSize) -> QSize:
    """The size of a first window: the default, shrunk to SCREEN_SHARE of a smaller screen."""
    return QSize(
        min(DEFAULT_WINDOW_SIZE.width(), int(available.width() * SCREEN_SHARE)),
        min(DEFAULT_WINDOW_SIZE.height(), int(available.height() * SCREEN_SHARE)),
    )


class MainWindow(QMainWindow):
    loadRequested = Signal(str, dict)  # queued to the worker: opening a model never blocks the window
    planSwitchRequested = Signal(dict)  # queued to the worker: the loaded model takes the plan shown, in place
    reserveRequested = Signal()  # queued to the worker before the first load: the GPU's runtime reserve
    modelReady = Signal(dict)  # re-emitted on the GUI thread once the window has taken the model in
    modelFailed = Signal(str)
    remoteEndpointChosen = Signal(dict)  # queued to the remote worker: the endpoint its next replies use

    def __init__(self, store: ConversationStore, settings: AppSettings, model_folder: Path | None = None):
        super().__init__()
        self.setWindowTitle("MoE Desk")
        self.store, self.settings = store, settings
        self.worker, self.worker_thread = start_worker()
        self.loadRequested.connect(self.worker.load)
        self.planSwitchRequested.connect(self.worker.switch_plan)
        self.reserveRequested.connect(self.worker.measure_reserve)
        self.remote_worker, self.remote_thread = start_remote_worker()
        self.remoteEndpointChosen.connect(self.remote_worker.use_endpoint)
        self.remotes = RemoteStore(settings.remote_engines_path())
        worker = self.worker  # read by the server's thread at each request: the model loaded at that moment
        self.api_server, self.api_thread = start_api_server(lambda: worker.server_context)

        self.chat_page = ChatPage(store, self.worker, settings)
        self.models_page = ModelsPage(self.worker, settings, remotes=self.remotes)
        self.engine_page = EnginePage(self.worker, settings)
        self.logs_page = LogsPage(self.worker)
        settings.report_warnings(self.logs_page.add_record)  # settings refused at load are said there
        self.remote_worker.log.connect(self.logs_page.add_record)
        for message in self.remotes.warnings:
            self.logs_page.add_record("warning", message)
        self.settings_page = SettingsPage(settings)
        self.api_indicator = QLabel()
        self.api_indicator.setTextFormat(Qt.TextFormat.PlainText)
        self.api_indicator.hide()
        self.statusBar().addPermanentWidget(self.api_indicator)
        self._api_busy = False
        self._wire_api_server()
        self.pages = QStackedWidget()
        for page in (self.chat_page, self.models_page, self.engine_page, self.logs_page, self.settings_page):
            self.pages.addWidget(page)

        self.sidebar = QListWidget()
        self.sidebar.setObjectName("sidebar")
        self.sidebar.addItems(PAGES)
        for row in range(self.sidebar.count()):  # style sheets pad the text, not the row: size rows here
            self.sidebar.item(row).setSizeHint(QSize(0, SIDEBAR_ROW_HEIGHT))
        self.sidebar.setIconSize(QSize(ICON_PX, ICON_PX))
        self._show_sidebar_icons()
        self.sidebar.currentRowChanged.connect(self.pages.setCurrentIndex)
        self.footer = SystemFooter()
        self.model_label = QLabel("No model loaded")
        self.model_label.setProperty("role", "muted")
        self.model_label.setWordWrap(True)
        self.model_label.setContentsMargins(8, 4, 8, 0)  # in line with the footer's gauges

        left = QVBoxLayout()
        left.setContentsMargins(0, 0, 0, 0)
        left.addWidget(self.sidebar, 1)
        left.addWidget(self.model_label)
        left.addWidget(self.footer)
        left_panel = QWidget()
        left_panel.setLayout(left)
        left_panel.setFixedWidth(SIDEBAR_WIDTH_PX)
        body = QHBoxLayout()
        body.setContentsMargins(0, 0, 0, 0)
        body.addWidget(left_panel)
        body.addLayout(self._with_cpu_notice(self.pages), 1)
        central = QWidget()
        central.setLayout(body)
        self.setCentralWidget(central)
        self.sidebar.setCurrentRow(0)
        self._restore_geometry()
        self.chat_page.focus_input()  # the window opens ready to type in

        self.model_info: dict | None = None
        self.load_error: str | None = None
        self.worker.loaded.connect(self._on_loaded)
        self.worker.loadFailed.connect(self._on_load_failed)
        self.worker.unloaded.connect(self._on_unloaded)
        self.worker.planSwitched.connect(self._on_plan_switched)
        self.worker.planSwitchFailed.connect(self.statusBar().showMessage)
        self.engine_page.switchRequested.connect(self.switch_plan)
        self.engine_page.planChanged.connect(self.logs_page.set_plan)
        self.models_page.log.connect(self.logs_page.add_record)  # downloads report to the Logs page too
        self.models_page.engineChosen.connect(self.use_engine)
        self.settings_page.themeChanged.connect(self._use_theme)
        self.settings_page.aboutRequested.connect(self.show_about)
        self.about_dialog: AboutDialog | None = None
        self._shortcuts()
        self.use_engine(self.models_page.chosen_remote_id())
        self.reserveRequested.emit()  # measured on a clean GPU, before any model takes its memory
        self.load_model(model_folder or self._startup_model())

    def _use_theme(self, name: str) -> None:
        apply_theme(QApplication.instance(), name)
        self._show_sidebar_icons()

    def _show_sidebar_icons(self) -> None:
        """Page icons in the current theme's text colour."""
        colour, scale = theme_colours()["text"], self.devicePixelRatioF()
        for row, page in enumerate(PAGES):
            self.sidebar.item(row).setIcon(page_icon(page, colour, scale))

    def _restore_geometry(self) -> None:
        """The size, place and maximized state of the last session, else a size that fits this screen."""
        available = available_geometry()
        self.setMinimumSize(MIN_WINDOW_SIZE.boundedTo(available.size()))
        saved = self.settings.get("window_geometry")
        if saved and self.restoreGeometry(QByteArray.fromBase64(saved.encode("ascii"))):
            if available.contains(self.frameGeometry()) or self.isMaximized():
                return
        # nothing saved, or a window bigger than this screen (another monitor, another scale): fit it anew
        size = first_window_size(available.size())
        self.resize(size)
        self.move(available.center() - QRect(0, 0, size.width(), size.height()).center())

    def save_geometry(self) -> None:
        """Remember the window's size, place and maximized state, and the chat's splitter, for the next start."""
        self.settings.set("window_geometry", bytes(self.saveGeometry().toBase64()).decode("ascii"))
        self.settings.set("chat_splitter", self.chat_page.splitter.sizes())

    def _wire_api_server(self) -> None:
        """The Settings page's Local API section drives the server; its state shows there and in the status bar."""
        section = self.settings_page.server_section
        section.startRequested.connect(self.api_server.start)
        section.stopRequested.connect(self.api_server.stop)
        self.api_server.started.connect(section.show_running)
        self.api_server.started.connect(self._on_api_started)
        self.api_server.failed.connect(section.show_failed)
        self.api_server.failed.connect(self._on_api_failed)
        self.api_server.stopped.connect(section.show_stopped)
        self.api_server.stopped.connect(self.api_indicator.hide)
        self.api_server.log.connect(self.logs_page.add_record)
        self.worker.activity.connect(section.show_activity)
        self.worker.activity.connect(self._on_engine_activity)
        section.start_if_enabled()

    def _on_api_started(self, info: dict) -> None:
        self.api_indicator.setText(f"API :{info['port']}")
        self.api_indicator.setToolTip(f"The local API serves the loaded model at {info['base_url']}")
        self.api_indicator.setStyleSheet("")
        self.api_indicator.show()
        self.statusBar().clearMessage()  # an earlier failure's

    def _on_api_failed(self, message: str) -> None:
        self.api_indicator.setText("API off: see Settings")
        self.api_indicator.setToolTip(message)
        self.api_indicator.setStyleSheet("color: #d14343;")
        self.api_indicator.show()
        self.statusBar().showMessage(message)

    def _on_engine_activity(self, activity: dict) -> None:
        self._api_busy = activity["api_busy"]
        self._show_api_busy()

    def _show_api_busy(self) -> None:
        """The chat says the local engine is busy with an API request, when the local engine answers it."""
        self.chat_page.set_api_busy(self._api_busy and self.chat_page.worker is self.worker)

    def _with_cpu_notice(self, pages: QWidget) -> QVBoxLayout:
        """The pages under a banner saying why the app runs on the CPU, shown until acknowledged (once per reason)."""
        self.cpu_notice = QFrame()
        self.cpu_notice.setObjectName("cpuNotice")
        self.cpu_notice.setStyleSheet(
            "#cpuNotice { background: #fff4d6; border-bottom: 1px solid #e8c66a; }#cpuNotice QLabel { color: #4a3b10; }"
        )
        self.cpu_notice_label = QLabel()
        self.cpu_notice_label.setWordWrap(True)
        dismiss = QPushButton("Got it")
        dismiss.clicked.connect(self.dismiss_cpu_notice)
        row = QHBoxLayout(self.cpu_notice)
        row.setContentsMargins(12, 8, 12, 8)
        row.addWidget(self.cpu_notice_label, 1)
        row.addWidget(dismiss)
        notice = cpu_notice(self.settings)
        self.cpu_notice_label.setText(notice or "")
        self.cpu_notice.setVisible(notice is not None)
        column = QVBoxLayout()
        column.setContentsMargins(0, 0, 0, 0)
        column.setSpacing(0)
        column.addWidget(self.cpu_notice)
        column.addWidget(pages, 1)
        return column

    def dismiss_cpu_notice(self) -> None:
        acknowledge_cpu_notice(self.settings)
        self.cpu_notice.hide()

    def show_about(self) -> AboutDialog:
        if self.about_dialog is None:
            self.about_dialog = AboutDialog(self)
        self.about_dialog.open()
        return self.about_dialog

    def _startup_model(self) -> Path:
        last = self.settings.get("last_model")
        return Path(last) if last and Path(last).is_dir() else DEMO_MODEL

    def load_model(self, folder: Path) -> None:
        self.model_info, self.load_error = None, None
        self.model_label.setText(f"Loading {folder.name}…")
        self.loadRequested.emit(str(folder), load_options(self.settings))

    def switch_plan(self) -> None:
        """Ask the worker to give the loaded model the plan the settings (the Engine page's) describe, in place."""
        self.planSwitchRequested.emit(load_options(self.settings))

    def use_engine(self, endpoint_id: str) -> None:
        """Let the remote engine `endpoint_id` answer the chats, or the local engine for "" (or one since removed)."""
        endpoint = self.remotes.get(endpoint_id) if endpoint_id else None
        if endpoint is not None:
            self.remoteEndpointChosen.emit(endpoint.to_dict())
            self.chat_page.set_engine(self.remote_worker, f"remote: {endpoint.label()}")
        else:
            self.chat_page.set_engine(self.worker, self._local_engine_text())
        self._show_api_busy()

    def _local_engine_text(self) -> str:
        return f"local: {self.model_info['name']}" if self.model_info else "local (no model loaded)"

    def _on_loaded(self, info: dict) -> None:
        self._show_model(info)
        self.engine_page.set_model_footprint(info["footprint"])
        self.settings_page.set_model(info)
        if self.chat_page.worker is self.worker:
            self.chat_page.set_engine(self.worker, self._local_engine_text())
        self.modelReady.emit(info)

    def _on_plan_switched(self, info: dict) -> None:
        """The loaded model runs another plan: its context size changed, and what the Settings page says of it."""
        self._show_model(info)
        self.settings_page.set_model(info)
        self.statusBar().showMessage(
            f"The loaded model runs the new plan: {info['context_tokens']:,} tokens of context"
        )

    def _show_model(self, info: dict) -> None:
        """Name the loaded model under the sidebar: its architecture, context size and where it runs."""
        self.model_info = info
        placement = info.get("placement") or {}
        where = "GPU" if placement.get("device") == "cuda" else "CPU"
        architecture = info.get("architecture") or info["model_type"]  # as the Models list names it
        self.model_label.setText(f"{info['name']}\n{architecture}, {info['context_tokens']:,} tokens, {where}")
        self.model_label.setToolTip(placement.get("note", ""))

    def _on_unloaded(self) -> None:
        self.model_info = None
        self.settings_page.set_model(None)
        self.model_label.setText("No model loaded")
        if self.chat_page.worker is self.worker:
            self.chat_page.set_engine(self.worker, self._local_engine_text())

    def _on_load_failed(self, message: str) -> None:
        self.load_error = message
        self.settings_page.set_model(None)
        self.model_label.setText("No model loaded")
        self.modelFailed.emit(message)

    def _shortcuts(self) -> None:
        bindings = {
            QKeySequence.StandardKey.New: self._new_chat,
            QKeySequence("Ctrl+L"): self._focus_input,
            QKeySequence("Esc"): self.chat_page.stop,
            QKeySequence.StandardKey.HelpContents: self.show_about,
        }
        for sequence, action in bindings.items():
            QShortcut(sequence, self, activated=action, context=Qt.ShortcutContext.ApplicationShortcut)
        for row in range(len(PAGES)):
            QShortcut(QKeySequence(f"Ctrl+{row + 1}"), self, activated=lambda r=row: self.sidebar.setCurrentRow(r))

    def _new_chat(self) -> None:
        self.sidebar.setCurrentRow(0)
        self.chat_page.new_chat()

    def _focus_input(self) -> None:
        self.sidebar.setCurrentRow(0)
        self.chat_page.focus_input()

    def show_page(self, name: str) -> None:
        self.sidebar.setCurrentRow(PAGES.index(name))

    def closeEvent(self, event) -> None:
        self.save_geometry()
        for worker, thread in ((self.worker, self.worker_thread), (self.remote_worker, self.remote_thread)):
            worker.stop()
            thread.quit()
        self.worker.shutdown()  # requests still waiting get 503 now, so closing the port has no grace to wait out
        self.api_server.shutdown()
        self.api_thread.quit()
        for thread in (self.api_thread, self.worker_thread, self.remote_thread):
            thread.wait(WORKER_SHUTDOWN_MS)
        gc.unfreeze()  # what the worker froze at load is finalised at exit like the rest (bindings report leaks)
        super().closeEvent(event)
