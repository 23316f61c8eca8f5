"""Where the engine keeps files in the user's data folder: downloaded models and the CPU/GPU calibration.

At the bottom of the engine, so that the expert backends and the runtime find their files without importing
the hub that downloads models.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def default_models_dir() -> Path:
    """Where downloads go unless told otherwise: $MOEDESK_MODELS_DIR, else MoE Desk's folder in the user's data."""
    if os.environ.get("MOEDESK_MODELS_DIR"):
        return Path(os.environ["MOEDESK_MODELS_DIR"]).expanduser()
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Application Support"
    else:
        base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "MoE Desk" / "models"


def calibration_file() -> Path:
    """Return calibration.json's path: next to the downloaded models, in the user's data folder."""
    return default_models_dir().parent / "calibration.json"
