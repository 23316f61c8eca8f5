"""Where the app keeps things: its data folder, the conversation database, the built-in demo model, downloads."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QStandardPaths

from engine.api import DEMO_MODEL, RESOURCES  # noqa: F401  (re-exported for the app)


def data_folder() -> Path:
    location = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.AppDataLocation)
    return Path(location or Path.home() / ".moedesk")


def conversations_db() -> Path:
    return data_folder() / "conversations.sqlite3"


def download_folder(configured: str = "") -> Path:
    """Where downloaded models go: the folder set in the settings, else the one `python -m engine pull` uses."""
    from engine.api import default_models_dir

    return Path(configured).expanduser() if configured else default_models_dir()
