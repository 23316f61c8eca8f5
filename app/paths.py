"""Where the app keeps things: its data folder, the conversation database, the built-in demo model, downloads."""

from __future__ import annotations

import os
from pathlib import Path

from PySide6.QtCore import QStandardPaths

from engine.api import DEMO_MODEL, RESOURCES  # noqa: F401  (re-exported for the app)


def data_folder() -> Path:
    """The app's own folder: MOEDESK_DATA_DIR where set (tests, a portable copy), else the platform's place."""
    chosen = os.environ.get("MOEDESK_DATA_DIR")
    if chosen:
        return Path(chosen)
    location = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.AppDataLocation)
    return Path(location or Path.home() / ".moedesk")


def conversations_db() -> Path:
    return data_folder() / "conversations.sqlite3"


def chat_states_folder() -> Path:
    """Where chats' engine states wait on disk between sessions (the prefix cache's disk tier)."""
    return data_folder() / "chat-states"


def download_folder(configured: str = "") -> Path:
    """Where downloaded models go: the folder set in the settings, else the one `python -m engine pull` uses."""
    from engine.api import default_models_dir

    return Path(configured).expanduser() if configured else default_models_dir()
