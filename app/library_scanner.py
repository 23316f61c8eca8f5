"""The model-library scan off the GUI thread: folders, the Hugging Face cache and downloads are read on a pool
thread, so a slow disk or a folder that blocks never freezes the window."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QObject, QRunnable, QThreadPool, Signal

from app.model_library import scan_library


class _Answer(QObject):
    """Carries one scan's entries back to the GUI thread (queued: it is emitted on the pool thread)."""

    scanned = Signal(list, int)


class _Scan(QRunnable):
    def __init__(self, folders: list[str], downloads: Path, request: int, answer: _Answer):
        super().__init__()
        self.folders, self.downloads, self.request, self.answer = folders, downloads, request, answer

    def run(self) -> None:
        try:
            entries = scan_library([Path(f) for f in self.folders], downloads=self.downloads)
        except Exception as exc:  # a scan must answer, or the page would wait for ever
            entries = [{"name": "(scan failed)", "path": str(self.downloads), "source": "", "architecture": "",
                        "format": "", "size_bytes": None, "fits": {}, "fit_errors": {},
                        "error": f"the model folders could not be read ({exc}); check them and press Refresh"}]
        self.answer.scanned.emit(entries, self.request)


class LibraryScanner(QObject):
    """Scans on Qt's thread pool; `scanned(entries, request)` answers each `scan` by its request number."""

    scanned = Signal(list, int)

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self._answer = _Answer()
        self._answer.scanned.connect(self.scanned)

    def scan(self, folders: list[str], downloads: Path, request: int) -> None:
        """Start a scan; its entries arrive with `scanned` carrying the same `request`."""
        QThreadPool.globalInstance().start(_Scan(list(folders), Path(downloads), request, self._answer))
