"""Render the download dialog mid-download and save a screenshot (docs/screenshot-download.png).

    .venv/bin/python -m tools.screenshot_download [OUT.png]

Nothing leaves the machine: the dialog downloads the built-in demo model (resources/demo-model, 21 MB in
two shards) from the local fake Hub of the tests (engine/testing/hub_server.py) on 127.0.0.1, slowed down
so the picture catches it halfway, into a temporary folder. The window is offscreen unless
QT_QPA_PLATFORM says otherwise. Exits non-zero when the download does not reach the middle in time.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "screenshot-download.png"
REPO = "moedesk/demo-model"
SHOT_AT = 0.45  # fraction of the total bytes
TIMEOUT_MS = 60_000


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else DEFAULT_OUT
    scratch = Path(tempfile.mkdtemp(prefix="moedesk-screenshot-"))
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    os.environ["HF_HOME"] = str(scratch / "hf-home")  # no token of the user's is read or written
    os.environ["MOEDESK_MODELS_DIR"] = str(scratch / "models")
    os.environ.pop("HF_HUB_OFFLINE", None)

    from huggingface_hub import constants
    from PySide6.QtCore import QSettings, QTimer
    from PySide6.QtWidgets import QApplication

    from app.dialogs.download_dialog import DownloadDialog
    from app.settings import AppSettings
    from app.theme import apply_theme
    from engine.resources import DEMO_MODEL
    from engine.testing.hub_server import FakeHub

    constants.HF_HUB_OFFLINE = False
    constants.HF_TOKEN_PATH = str(scratch / "hf-home" / "token")
    app = QApplication.instance() or QApplication(sys.argv[:1])
    apply_theme(app, "light")
    settings = AppSettings(QSettings(str(scratch / "settings.ini"), QSettings.Format.IniFormat))
    fake = FakeHub()
    fake.add_repo(REPO, DEMO_MODEL)
    result = {"code": 1}
    with fake:
        dialog = DownloadDialog(settings)
        dialog.endpoint_edit.setText(fake.endpoint)
        dialog.repo_edit.setText(REPO)
        dialog.show()
        # planning at full speed, then about 6 MB/s so the picture finds the download under way
        dialog.worker.planned.connect(lambda plan: setattr(fake, "throttle", (64 * 1024, 0.01)))

        def maybe_shoot(p: dict) -> None:
            if result["code"] == 1 and p["done"] >= SHOT_AT * p["total"] and p["speed"] > 0:
                QTimer.singleShot(150, shoot)  # let the labels settle on this report
                result["code"] = 2

        def shoot() -> None:
            out.parent.mkdir(parents=True, exist_ok=True)
            ok = dialog.grab().save(str(out))
            result["code"] = 0 if ok else 1
            print(f"saved {out}" if ok else f"could not write {out}")
            dialog.worker.cancel()

        dialog.progressShown.connect(maybe_shoot)
        dialog.runEnded.connect(lambda outcome, detail: app.quit())
        QTimer.singleShot(TIMEOUT_MS, app.quit)
        QTimer.singleShot(0, dialog.start)
        app.exec()
        dialog.shutdown()
    return result["code"]


if __name__ == "__main__":
    sys.exit(main())
