"""Models page → Add remote engine…: an OpenAI-compatible server (vLLM, SGLang, llama-server, FreeToken, another
MoE Desk's `python -m engine serve`) as a model source.

The user types the server's address and, if it has one, its API key; "Test connection" asks the server for its
models on a ConnectionProbe's daemon thread (never the GUI thread) and lists them, or says in plain words why
the server cannot be used. Save keeps the chosen model in the RemoteStore and emits `saved(id)`. The key field
shows dots while typed and is never filled back in: a saved key is never shown again.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.remote_engine import ConnectionProbe, RemoteError, api_base, host_label
from app.remote_store import RemoteEndpoint, RemoteStore

PROBE_POLL_MS = 30  # how often the dialog looks whether its connection test is done
BANNER_STYLES = {
    "error": "background: #fdecec; color: #8a1c1c; border: 1px solid #f2b8b8;",
    "ok": "background: #e9f6ee; color: #1d5e36; border: 1px solid #b5dfc4;",
    "info": "background: #eef3fd; color: #1f3f7a; border: 1px solid #c4d4f4;",
}


class RemoteEngineDialog(QDialog):
    saved = Signal(str)  # the saved remote engine's id
    tested = Signal(bool)  # a connection test ended: True when it listed models

    def __init__(self, store: RemoteStore, parent: QWidget | None = None, transport=None):
        """`transport`: an httpx transport for the tests' fake servers; None is the network."""
        super().__init__(parent)
        self.setWindowTitle("Add a remote engine")
        self.store = store
        self._transport = transport
        self._probe: ConnectionProbe | None = None
        self._tested_url = ""  # the address the listed models came from
        self._poll = QTimer(self, interval=PROBE_POLL_MS)
        self._poll.timeout.connect(self._poll_probe)

        self.url_edit = QLineEdit()
        self.url_edit.setPlaceholderText("http://10.0.0.5:8000  (with or without /v1)")
        self.url_edit.returnPressed.connect(self.test_connection)
        self.key_edit = QLineEdit()
        self.key_edit.setEchoMode(QLineEdit.EchoMode.Password)
        self.key_edit.setPlaceholderText("optional: the key the server was started with (--api-key)")
        self.name_edit = QLineEdit()
        self.name_edit.setPlaceholderText("optional: a name for it (the server's own, e.g. vllm, when empty)")
        for edit in (self.url_edit, self.key_edit):
            edit.textEdited.connect(self._forget_models)  # models listed for another address or key
        form = QFormLayout()
        form.addRow("Address", self.url_edit)
        form.addRow("API key", self.key_edit)
        form.addRow("Name", self.name_edit)

        self.test_button = QPushButton("Test connection")
        self.test_button.clicked.connect(self.test_connection)
        self.banner = QLabel()
        self.banner.setObjectName("remoteBanner")
        self.banner.setWordWrap(True)
        self.banner.setTextFormat(Qt.TextFormat.PlainText)  # a server's words are data, never markup
        self.banner.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.banner.hide()
        self.model_list = QListWidget()
        self.model_list.itemSelectionChanged.connect(self._update_buttons)
        self.model_list.itemDoubleClicked.connect(self.save)
        self.save_button = QPushButton("Save")
        self.save_button.setDefault(True)
        self.save_button.clicked.connect(self.save)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(self.reject)

        test_row = QHBoxLayout()
        test_row.addWidget(self.test_button)
        test_row.addStretch(1)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        buttons.addWidget(self.cancel_button)
        buttons.addWidget(self.save_button)
        layout = QVBoxLayout(self)
        intro = QLabel(
            "Any OpenAI-compatible server: vLLM, SGLang, llama-server, FreeToken, or another MoE Desk "
            "(python -m engine serve). Its chats stream into the same chat view."
        )
        intro.setWordWrap(True)
        layout.addWidget(intro)
        layout.addLayout(form)
        layout.addLayout(test_row)
        layout.addWidget(self.banner)
        layout.addWidget(QLabel("Models on the server:"))
        layout.addWidget(self.model_list, 1)
        layout.addLayout(buttons)
        self.resize(560, 460)
        self._update_buttons()

    def testing(self) -> bool:
        return self._probe is not None

    def test_connection(self) -> None:
        """Ask the server for its models off the GUI thread; the list and the banner show the outcome."""
        if self.testing():
            return
        try:
            url = api_base(self.url_edit.text())
        except RemoteError as exc:
            self.show_banner("error", str(exc))
            return
        self._forget_models()
        self.show_banner("info", f"Connecting to {host_label(url)}…")
        self._probe = ConnectionProbe(url, self.key_edit.text().strip(), self._transport)
        self._tested_url = url
        self._poll.start()
        self._update_buttons()

    def _poll_probe(self) -> None:
        probe = self._probe
        if probe is None or not probe.done():
            return
        self._probe = None
        self._poll.stop()
        if probe.error is not None:
            self._tested_url = ""
            self.show_banner("error", str(probe.error))
        else:
            for model in probe.models:
                item = QListWidgetItem(model["id"] + (f"  ({model['owned_by']})" if model["owned_by"] else ""))
                item.setData(Qt.ItemDataRole.UserRole, model)
                self.model_list.addItem(item)
            self.model_list.setCurrentRow(0)
            count = len(probe.models)
            self.show_banner(
                "ok",
                f"Connected to {host_label(self._tested_url)}: {count} model"
                f"{'' if count == 1 else 's'}. Choose the one to chat with, then Save.",
            )
        self._update_buttons()
        self.tested.emit(probe.error is None)

    def _forget_models(self) -> None:
        self.model_list.clear()
        self._tested_url = ""
        self._update_buttons()

    def chosen_model(self) -> dict | None:
        item = self.model_list.currentItem()
        return item.data(Qt.ItemDataRole.UserRole) if item is not None and item.isSelected() else None

    def save(self) -> None:
        """Keep the chosen model of the tested server, emit `saved(id)` and close."""
        model = self.chosen_model()
        if model is None or not self._tested_url or self.testing():
            return
        name = " ".join(self.name_edit.text().split()) or model["owned_by"] or host_label(self._tested_url)
        endpoint = RemoteEndpoint(name, self._tested_url, model["id"], self.key_edit.text().strip())
        self.store.add(endpoint)
        self.key_edit.clear()  # the key is not kept in a widget once it is saved
        self.saved.emit(endpoint.id)
        self.accept()

    def show_banner(self, kind: str, text: str) -> None:
        self.banner.setText(text)
        self.banner.setStyleSheet(f"#remoteBanner {{ {BANNER_STYLES[kind]} border-radius: 6px; padding: 8px; }}")
        self.banner.setProperty("kind", kind)
        self.banner.show()

    def _update_buttons(self) -> None:
        self.test_button.setEnabled(not self.testing())
        self.save_button.setEnabled(not self.testing() and bool(self._tested_url) and self.chosen_model() is not None)

    def done(self, result: int) -> None:
        """Closing mid-test leaves the probe's daemon thread to end on its own: it touches no Qt object."""
        self._poll.stop()
        self._probe = None
        super().done(result)
