"""The model-library scan off the GUI thread: folders, the Hugging Face cache and downloads are read on a daemon
thread that touches no Qt object, so a slow disk or a folder that blocks never freezes the window, and a page
closed mid-scan leaves nothing behind for Qt to deliver to."""

from __future__ import annotations

import threading
from pathlib import Path

from app.model_library import scan_library


class LibraryScan:
    """One scan of the library on its own daemon thread; the GUI polls `done()` and reads `entries`."""

    def __init__(self, folders: list[str], downloads: Path):
        self.entries: list[dict] = []
        self._done = threading.Event()
        threading.Thread(
            target=self._run, args=(list(folders), Path(downloads)), name="library scan", daemon=True
        ).start()

    def _run(self, folders: list[str], downloads: Path) -> None:
        try:
            self.entries = scan_library([Path(f) for f in folders], downloads=downloads)
        except Exception as exc:  # a scan must answer, or the page would wait for ever
            self.entries = [
                {
                    "name": "(scan failed)",
                    "path": str(downloads),
                    "source": "",
                    "architecture": "",
                    "format": "",
                    "size_bytes": None,
                    "fits": {},
                    "fit_errors": {},
                    "error": f"the model folders could not be read ({exc}); check them and press Refresh",
                }
            ]
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()
