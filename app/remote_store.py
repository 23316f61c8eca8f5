"""The remote engines the user added: a JSON file beside the settings, holding each one's name, address, model
and API key.

The keys live in this file and not in QSettings because the settings' warnings quote a bad stored value, and a
key must never reach a warning or the log. The file is written whole (a temporary file, then a rename) and, on
POSIX systems, readable by the user alone; on Windows it sits in the user's own profile. A file that cannot be
read is kept aside under a new name and the list starts empty, with a warning that names no key.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from app.remote_engine import RemoteError, api_base, host_label
from app.storage import keep_aside

FILE_VERSION = 1
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemoteEndpoint:
    """One remote engine: an OpenAI-compatible server's address, the model it answers with, and its key."""

    name: str  # what the user calls it, e.g. "vllm" (the server's owned_by when left empty)
    base_url: str
    model: str
    api_key: str = field(default="", repr=False)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def host(self) -> str:
        return host_label(self.base_url)

    def label(self) -> str:
        """How the app names it: "vllm @ 10.0.0.5:8000, model Qwen/Qwen3-30B-A3B"."""
        return f"{self.name} @ {self.host}, model {self.model}"

    def to_dict(self) -> dict:
        """Everything the remote worker needs, the key included: for its queued signal, never for display."""
        return {**asdict(self), "host": self.host}


def _endpoint(entry) -> RemoteEndpoint | None:
    """A stored entry as an endpoint; None when it is not one (a hand edit, another version)."""
    names = ("id", "name", "base_url", "model", "api_key")
    if not isinstance(entry, dict) or not all(isinstance(entry.get(n), str) for n in names):
        return None
    if not entry["id"] or not entry["model"]:
        return None
    try:
        api_base(entry["base_url"])
    except RemoteError:
        return None
    return RemoteEndpoint(**{n: entry[n] for n in names})


class RemoteStore:
    """The remote engines in `path` (remote-engines.json), read once and written on every change."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.warnings: list[str] = []  # what could not be read, for the Logs page (no key is ever in one)
        self._endpoints = self._read()

    def _read(self) -> list[RemoteEndpoint]:
        if not self.path.exists():
            return []
        try:
            entries = json.loads(self.path.read_text(encoding="utf-8"))["engines"]
            if not isinstance(entries, list):
                raise TypeError("engines is not a list")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            kept = keep_aside(self.path)
            self._warn(
                f"the remote engines file {self.path} cannot be read ({type(exc).__name__}); it was kept as "
                f"{kept} and the list starts empty: add the remote engines again on the Models page"
            )
            return []
        endpoints = [e for e in map(_endpoint, entries) if e is not None]
        if len(endpoints) < len(entries):
            self._warn(
                f"{len(entries) - len(endpoints)} entries of {self.path} are not remote engines and were skipped"
            )
        return endpoints

    def _warn(self, message: str) -> None:
        log.warning(message)
        self.warnings.append(message)

    def endpoints(self) -> list[RemoteEndpoint]:
        return list(self._endpoints)

    def get(self, endpoint_id: str) -> RemoteEndpoint | None:
        return next((e for e in self._endpoints if e.id == endpoint_id), None)

    def add(self, endpoint: RemoteEndpoint) -> None:
        """Keep `endpoint` (replacing one with its id) and write the file."""
        self._endpoints = [e for e in self._endpoints if e.id != endpoint.id] + [endpoint]
        self._write()

    def remove(self, endpoint_id: str) -> None:
        self._endpoints = [e for e in self._endpoints if e.id != endpoint_id]
        self._write()

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(self.path.name + ".tmp")
        text = json.dumps({"version": FILE_VERSION, "engines": [asdict(e) for e in self._endpoints]}, indent=1)
        temporary.unlink(missing_ok=True)  # an old one would keep its mode
        # created readable by the user alone (the mode is ignored on Windows, whose profile is the user's own)
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(temporary, self.path)
