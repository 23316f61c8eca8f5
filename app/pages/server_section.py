"""The Settings page's Local API section: on/off, port, key, the network opt-in, the base URL, what it served.

The section stores its settings and asks for a start or a stop through signals (to app.api_server.ApiServer on
its own thread); it shows what the server says back and the engine queue's activity (app.engine_worker). The
key is never shown once entered: the field is masked, cleared when the key is saved, and says only that one is
set.
"""

from __future__ import annotations

from PySide6.QtCore import QSignalBlocker, Qt, Signal, Slot
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QCheckBox, QFormLayout, QGroupBox, QHBoxLayout, QLabel, QLineEdit, QPushButton, QSpinBox

from app.api_server import base_url

NO_KEY_PLACEHOLDER = "none: only programs on this machine can connect"
KEY_SET_PLACEHOLDER = "a key is set (hidden); type a new one to replace it"


def activity_text(activity: dict) -> str:
    """The API's request count and its last request's numbers, in words."""
    served = activity.get("requests_served", 0)
    if not served:
        return "No API requests answered yet."
    last = activity["last_request"]
    return (
        f"API requests answered: {served:,}. Last: {last['prompt_tokens']:,} prompt tokens "
        f"({last['cached_tokens']:,} cached), {last['generated_tokens']:,} generated at "
        f"{last['tokens_per_s']:.1f} tok/s."
    )


class ServerSection(QGroupBox):
    startRequested = Signal(dict)  # port, api_key, allow_lan: queued to ApiServer.start
    stopRequested = Signal()

    def __init__(self, settings, parent=None):
        super().__init__("Local API (OpenAI- and Anthropic-compatible)", parent)
        self.settings = settings
        self.running_port: int | None = None
        self.enable_check = QCheckBox("Serve the loaded model to other programs")
        self.enable_check.setChecked(bool(settings.get("api_server")))
        self.enable_check.setToolTip(
            "Programs send requests to the base URL below; they wait in one line with "
            "this window's chats, which share the same loaded model."
        )
        self.port_spin = QSpinBox()
        self.port_spin.setRange(1, 65535)
        self.port_spin.setValue(int(settings.get("api_port")))
        self.key_field = QLineEdit()
        self.key_field.setEchoMode(QLineEdit.EchoMode.Password)
        self.key_field.setToolTip("Programs send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'.")
        self.remove_key_button = QPushButton("Remove key")
        self.lan_check = QCheckBox("Allow other machines on the network (needs a key)")
        self.lan_check.setChecked(bool(settings.get("api_allow_lan")) and bool(settings.get("api_key")))
        self.url_field = QLineEdit()
        self.url_field.setReadOnly(True)
        self.copy_button = QPushButton("Copy")
        self.status_label = QLabel()
        self.status_label.setWordWrap(True)
        self.status_label.setTextFormat(Qt.TextFormat.PlainText)
        self.activity_label = QLabel(activity_text({}))
        self.activity_label.setProperty("role", "muted")

        key_row = QHBoxLayout()
        key_row.addWidget(self.key_field, 1)
        key_row.addWidget(self.remove_key_button)
        url_row = QHBoxLayout()
        url_row.addWidget(self.url_field, 1)
        url_row.addWidget(self.copy_button)
        form = QFormLayout(self)
        form.addRow(self.enable_check)
        form.addRow("Port", self.port_spin)
        form.addRow("API key", key_row)
        form.addRow(self.lan_check)
        form.addRow("Base URL", url_row)
        form.addRow(self.status_label)
        form.addRow(self.activity_label)

        self.enable_check.toggled.connect(self._on_enabled)
        self.port_spin.editingFinished.connect(self._on_port_changed)
        self.key_field.editingFinished.connect(self._save_key)
        self.remove_key_button.clicked.connect(self.remove_key)
        self.lan_check.toggled.connect(self._on_lan_toggled)
        self.copy_button.clicked.connect(self.copy_base_url)
        self._show_key_state()
        self._show_url()
        self.show_stopped()

    # ---- asked by the main window ---------------------------------------------------------------

    def start_if_enabled(self) -> None:
        """At startup: serve when the setting says so."""
        if self.enable_check.isChecked():
            self._request_start()

    @Slot(dict)
    def show_running(self, info: dict) -> None:
        self.running_port = info["port"]
        self._show_url()
        reach = "other machines too (with the key)" if info["lan"] else "programs on this machine"
        self._say(f"Serving the loaded model at {info['base_url']} for {reach}.")

    @Slot(str)
    def show_failed(self, message: str) -> None:
        self.running_port = None
        with QSignalBlocker(self.enable_check):  # the server is off; the stored wish stays for the next start
            self.enable_check.setChecked(False)
        self._say(message, error=True)

    @Slot()
    def show_stopped(self) -> None:
        self.running_port = None
        if not self.enable_check.isChecked():
            self._say("Off.")

    @Slot(dict)
    def show_activity(self, activity: dict) -> None:
        self.activity_label.setText(activity_text(activity))

    def copy_base_url(self) -> None:
        QGuiApplication.clipboard().setText(self.url_field.text())

    def remove_key(self) -> None:
        self.settings.set("api_key", "")
        with QSignalBlocker(self.lan_check):  # no key, no network
            self.lan_check.setChecked(False)
        self.settings.set("api_allow_lan", False)
        self._show_key_state()
        self._restart()

    # ---- the controls ---------------------------------------------------------------------------

    def _options(self) -> dict:
        return {
            "port": self.port_spin.value(),
            "api_key": self.settings.get("api_key"),
            "allow_lan": self.lan_check.isChecked(),
        }

    def _request_start(self) -> None:
        self._say("Starting…")
        self.startRequested.emit(self._options())

    def _restart(self) -> None:
        """Apply a changed setting: a running server starts again with it."""
        if self.enable_check.isChecked():
            self._request_start()

    def _on_enabled(self, on: bool) -> None:
        self.settings.set("api_server", on)
        if on:
            self._request_start()
        else:
            self.stopRequested.emit()
            self._say("Off.")

    def _on_port_changed(self) -> None:
        if self.port_spin.value() == self.settings.get("api_port"):
            return
        self.settings.set("api_port", self.port_spin.value())
        self._show_url()
        self._restart()

    def _save_key(self) -> None:
        key = self.key_field.text().strip()
        self.key_field.clear()  # never shown again once entered
        if not key:
            return
        self.settings.set("api_key", key)
        self._show_key_state()
        self._restart()

    def _on_lan_toggled(self, on: bool) -> None:
        self.settings.set("api_allow_lan", on)
        self._restart()

    def _show_key_state(self) -> None:
        has_key = bool(self.settings.get("api_key"))
        self.key_field.setPlaceholderText(KEY_SET_PLACEHOLDER if has_key else NO_KEY_PLACEHOLDER)
        self.remove_key_button.setEnabled(has_key)
        self.lan_check.setEnabled(has_key)
        self.lan_check.setToolTip("" if has_key else "Set an API key first: other machines must send it.")

    def _show_url(self) -> None:
        self.url_field.setText(base_url(self.running_port or self.port_spin.value()))

    def _say(self, text: str, error: bool = False) -> None:
        self.status_label.setText(text)
        self.status_label.setStyleSheet("color: #d14343;" if error else "")
