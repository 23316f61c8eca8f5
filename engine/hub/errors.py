"""The two exceptions the hub raises: a failure in plain words, and a stop that was asked for."""

from __future__ import annotations

from pathlib import Path


class HubError(Exception):
    """A failure to report in plain words. kind: offline, invalid, not_found, revision, gated, network, disk,
    mismatch, unsupported, server."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class DownloadCancelled(Exception):
    """The download stopped because it was asked to. discarded: its files were deleted (Cancel); otherwise what
    arrived is kept and the same download resumes from it (an interrupted CLI run). folder None: it stopped
    while planning, before anything was written."""

    def __init__(self, folder: Path | None, discarded: bool):
        self.folder, self.discarded = folder, discarded
        if folder is None:
            kept = "nothing was downloaded yet"
        else:
            kept = "nothing was kept" if discarded else f"what arrived is kept in {folder}"
        super().__init__(f"download cancelled; {kept}")
