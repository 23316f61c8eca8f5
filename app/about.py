"""The app's identity: its version, its icon, the About box, and the one-time notice that it runs on the CPU.

The version comes from the installed package's metadata (pyproject.toml's [project] version), with the source
tree's pyproject.toml as the fallback when the code runs from a checkout that was never installed.
"""

from __future__ import annotations

import html
import re
from importlib import metadata
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtGui import QIcon
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from app.paths import RESOURCES

APP_NAME = "MoE Desk"
PACKAGE = "moedesk"  # pyproject.toml's [project] name
DESKTOP_FILE_NAME = "moedesk"  # the installed moedesk.desktop (installers/linux/install.sh)
ICONS = RESOURCES / "icons"
LICENCE = "Apache-2.0"
LICENCE_URL = "https://www.apache.org/licenses/LICENSE-2.0"


def app_version() -> str:
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        try:
            found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(encoding="utf-8"), re.MULTILINE)
        except OSError:
            found = None
        return found.group(1) if found else "unknown"


def app_icon() -> QIcon:
    """The icon in every size that resources/icons holds (PNGs, so no SVG plugin is needed)."""
    icon = QIcon()
    for png in sorted(ICONS.glob("moedesk-*.png")):
        icon.addFile(str(png))
    return icon


def gpu_status() -> tuple[bool, str]:
    """engine.runtime.placement.gpu_status, looked up at call time (tests replace it there)."""
    from engine.api import gpu_status as current_gpu_status

    return current_gpu_status()


def runtime_facts() -> dict:
    import torch

    usable, why = gpu_status()
    return {
        "version": app_version(),
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "gpu_usable": usable,
        "gpu": why,
    }


def about_html(facts: dict | None = None) -> str:
    facts = facts or runtime_facts()
    build = f"CUDA {facts['cuda_build']} build" if facts["cuda_build"] else "CPU-only build"
    gpu = f"GPU: {html.escape(facts['gpu'])}" if facts["gpu_usable"] else f"CPU mode: {html.escape(facts['gpu'])}"
    return (
        f"<h2>{APP_NAME}</h2>"
        f"<p>Version {html.escape(facts['version'])}</p>"
        f"<p>Frontier mixture-of-experts chat models on the graphics cards people already own.</p>"
        f"<p>PyTorch {html.escape(facts['torch'])} ({build})<br>{gpu}</p>"
        f'<p>Licence: <a href="{LICENCE_URL}">{LICENCE}</a>. Built on PyTorch and Qt for Python '
        f"(PySide6, LGPL-3.0).</p>"
    )


class AboutDialog(QDialog):
    def __init__(self, parent: QWidget | None = None, facts: dict | None = None):
        super().__init__(parent)
        self.setWindowTitle(f"About {APP_NAME}")
        logo = QLabel()
        logo.setPixmap(app_icon().pixmap(96, 96))
        logo.setAlignment(Qt.AlignmentFlag.AlignTop)
        self.text = QLabel(about_html(facts))
        self.text.setObjectName("aboutText")
        self.text.setWordWrap(True)
        self.text.setOpenExternalLinks(True)
        self.text.setTextInteractionFlags(Qt.TextInteractionFlag.TextBrowserInteraction)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        row = QHBoxLayout()
        row.addWidget(logo)
        row.addWidget(self.text, 1)
        layout = QVBoxLayout(self)
        layout.addLayout(row)
        layout.addWidget(buttons)
        self.setMinimumWidth(440)


def cpu_notice(settings) -> str | None:
    """The CPU-mode notice to show at start, or None: no notice while the GPU is usable, and none for a
    reason the user has already acknowledged (a different reason, e.g. after a driver change, shows again)."""
    usable, why = gpu_status()
    if usable or settings.get("cpu_notice_seen") == why:
        return None
    return (
        f"<b>MoE Desk is running in CPU mode</b>: {html.escape(why)}. Replies are computed on the "
        f"processor: fine for the built-in demo model, slow for large models."
    )


def acknowledge_cpu_notice(settings) -> None:
    settings.set("cpu_notice_seen", gpu_status()[1])
