"""Model states on disk: the prefix cache's second tier, so a chat resumes without a prefill after a restart.

Each file is one cached prefix (the token ids, the state after them, the last token's logits) in safetensors
(no code runs when a file is read), written to a temporary name and renamed, so a crash leaves no half file.
A file belongs to one model fingerprint (model, preset, KV format); files of other fingerprints are never
read but count towards the folder's size budget, and the least recently used files go first. A file that
cannot be read back is deleted and counts as a miss.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.layers.attention import HostRows
from engine.layers.gated_deltanet import DeltaNetState
from engine.models.base import HostState
from engine.runtime.prefix_cache import CachedPrefix

log = logging.getLogger(__name__)

FORMAT = "moedesk-state-1"
SUFFIX = ".state.safetensors"
LAYER_KINDS = {cls.__name__: cls for cls in (HostRows, DeltaNetState)}


class StateFolder:
    """The files of one model fingerprint in a folder, indexed by their token ids, within `max_bytes` in all.

    Thread-safe; writes run on one background thread (`wait()` waits for them)."""

    def __init__(self, folder: Path, fingerprint: str, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"the disk budget for chat states must be 0 or more bytes, not {max_bytes}")
        self.folder, self.fingerprint, self.max_bytes = Path(folder), fingerprint, max_bytes
        self._index: dict[tuple[int, ...], Path] = {}
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="state-files")
        self._pending: list[Future] = []
        self.scan()

    def scan(self) -> None:
        """Index the folder's files of this fingerprint by reading their headers (no tensor data)."""
        index = {}
        for path in self._files():
            meta = _header(path)
            if meta is None:  # ours by its name, yet unreadable: cut short by a crash or a full disk
                self._forget(None, path)
            elif meta.get("fingerprint") == self.fingerprint:
                ids = _ids(meta)
                if ids is not None:
                    index[ids] = path
        with self._lock:
            self._index = index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def holds(self, ids: Sequence[int]) -> bool:
        """Whether a file holds exactly `ids`, or a sequence that begins with them."""
        ids = tuple(ids)
        with self._lock:
            return any(key[: len(ids)] == ids for key in self._index)

    def longest_prefix(self, ids: Sequence[int]) -> tuple[int, ...] | None:
        """The ids of the file holding the longest prefix of `ids`, or None."""
        ids = tuple(ids)
        with self._lock:
            keys = [key for key in self._index if len(key) <= len(ids) and ids[: len(key)] == key]
        return max(keys, key=len, default=None)

    def read(self, ids: Sequence[int]) -> CachedPrefix | None:
        """The state saved for exactly `ids`, marked as just used; None (and the file deleted) when it is missing
        or unreadable."""
        ids = tuple(ids)
        with self._lock:
            path = self._index.get(ids)
        if path is None:
            return None
        try:
            saved = _read(path, self.fingerprint)
            os.utime(path)
            return saved
        except Exception as exc:  # a damaged or foreign file: a miss, never a crash
            log.warning("a saved chat state could not be read back and was removed (%s): %s", path.name, exc)
            self._forget(ids, path)
            return None

    def write(self, saved: CachedPrefix) -> None:
        """Save `saved` in the background, then drop the least recently used files over the budget."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # host copies of GPU states may still be landing (non-blocking copies)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(self._writer.submit(self._write, saved))

    def wait(self) -> None:
        """Wait for the writes under way."""
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        """Finish the writes under way and stop the writer thread."""
        self.wait()
        self._writer.shutdown(wait=True)

    def _write(self, saved: CachedPrefix) -> None:
        tensors, layers = _flatten(saved)
        meta = {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "ids": json.dumps(list(saved.ids)),
            "position": str(saved.state.position),
            "layers": json.dumps(layers),
        }
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if size > self.max_bytes:
            return
        key = hashlib.sha256(f"{self.fingerprint}\n{saved.ids}".encode()).hexdigest()[:40]
        path = self.folder / f"{key}{SUFFIX}"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(path.name + ".partial")
            save_file(tensors, str(partial), metadata=meta)
            os.replace(partial, path)
        except OSError as exc:  # a full or read-only disk costs the next resume a prefill, nothing more
            log.warning("a chat state could not be saved to %s: %s", self.folder, exc)
            return
        with self._lock:
            self._index[saved.ids] = path
        self._trim(keep=path)

    def _trim(self, keep: Path) -> None:
        """Delete the least recently used files until the folder is within its budget (`keep` last of all)."""
        files = []
        for path in self._files():
            try:
                stat = path.stat()
            except OSError:
                continue
            files.append((path == keep, stat.st_mtime, stat.st_size, path))
        total = sum(size for _, _, size, _ in files)
        for _, _, size, path in sorted(files):
            if total <= self.max_bytes:
                break
            total -= size
            with self._lock:
                ids = next((k for k, p in self._index.items() if p == path), None)
            self._forget(ids, path)

    def _forget(self, ids: tuple[int, ...] | None, path: Path) -> None:
        with self._lock:
            if ids is not None and self._index.get(ids) == path:
                del self._index[ids]
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("could not delete the saved chat state %s: %s", path, exc)

    def _files(self) -> list[Path]:
        try:
            return [p for p in self.folder.iterdir() if p.name.endswith(SUFFIX) and p.is_file()]
        except OSError:
            return []


def _flatten(saved: CachedPrefix) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """(tensors by name, each layer's kind and how its fields map to them) for one file."""
    tensors = {"logits": saved.logits.contiguous()}
    layers = []
    for i, layer in enumerate(saved.state.layers):
        fields = {}
        for field in dataclasses.fields(layer):
            value = getattr(layer, field.name)
            if isinstance(value, torch.Tensor):
                tensors[f"{i}.{field.name}"] = value.contiguous()
                fields[field.name] = ["tensor"]
            elif isinstance(value, tuple) and all(isinstance(t, torch.Tensor) for t in value):
                for j, t in enumerate(value):
                    tensors[f"{i}.{field.name}.{j}"] = t.contiguous()
                fields[field.name] = ["tensors", len(value)]
            else:
                fields[field.name] = ["value", value]
        layers.append({"kind": type(layer).__name__, "fields": fields})
    return tensors, layers


def _read(path: Path, fingerprint: str) -> CachedPrefix:
    """The state in `path`, checked against its header; raises ValueError on anything unexpected."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT or meta.get("fingerprint") != fingerprint:
            raise ValueError("not a chat state of this model")
        ids, position = _ids(meta), int(meta.get("position", "-1"))
        if ids is None or position != len(ids):
            raise ValueError("its token ids do not match its length")
        names = set(f.keys())

        def tensor(name: str) -> torch.Tensor:
            if name not in names:
                raise ValueError(f"the tensor {name} is missing")
            return f.get_tensor(name)

        layers = []
        for i, layer in enumerate(json.loads(meta["layers"])):
            cls = LAYER_KINDS.get(layer.get("kind"))
            expected = {field.name for field in dataclasses.fields(cls)} if cls else None
            if expected is None or set(layer.get("fields", {})) != expected:
                raise ValueError(f"layer {i} is of an unknown kind")
            values = {}
            for name, how in layer["fields"].items():
                if how[0] == "tensor":
                    values[name] = tensor(f"{i}.{name}")
                elif how[0] == "tensors":
                    values[name] = tuple(tensor(f"{i}.{name}.{j}") for j in range(int(how[1])))
                else:
                    values[name] = how[1]
            layers.append(cls(**values))
        return CachedPrefix(ids, HostState(position, layers), tensor("logits").to(torch.float32))


def _header(path: Path) -> dict | None:
    """The file's metadata, or None when it is not a whole safetensors file of this format."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception:  # safetensors refuses a file cut short or not its format
        return None
    return meta if meta.get("format") == FORMAT else None


def _ids(meta: dict) -> tuple[int, ...] | None:
    try:
        ids = json.loads(meta["ids"])
    except (KeyError, ValueError, TypeError):
        return None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return None
    return tuple(ids)
