"""A bounded host-RAM cache of model states keyed by the token ids they hold, for reuse across requests.

Clients of an HTTP API resend the whole conversation on every request; an agent's conversation grows by a
few hundred tokens each time. Each entry is a host copy of a state (KV rows and recurrent states, see
ModelState.host_copy) after a token-id prefix, taken at a message boundary, with the logits of its last
token so a prompt the cache holds whole needs no prefill at all. An entry stored from a state that was
restored from (or grew from) another entry shares that entry's KV blocks: a conversation's KV rows are in
host RAM once however many of its prefixes are cached, and each entry adds its recurrent states and the rows
past the entry it grew from. A lookup finds the longest cached prefix of a request's ids; eviction is
least-recently-used, by the bytes an entry alone keeps alive. With a `spill` folder (state_files.StateFolder)
an evicted entry that no other entry extends is written to disk, `flush()` writes every such entry still only
in RAM, and a lookup reads a longer prefix from disk back into RAM: a chat resumes after a restart too.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.models.base import HostState, ModelState

if TYPE_CHECKING:
    from engine.runtime.state_files import StateFolder


@dataclass(frozen=True)
class CachedPrefix:
    """A state after `ids`, and the float32 logits of the last of them."""

    ids: tuple[int, ...]
    state: HostState
    logits: torch.Tensor

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [*self.state.tensors, self.logits]


class PrefixCache:
    """Longest-prefix lookup over saved states, least-recently-used entries dropped past `max_bytes` (host
    tensors shared by several entries counted once).

    Thread-safe: the engine's worker stores and looks up, a stats reader may ask for its size meanwhile."""

    def __init__(self, max_bytes: int, spill: StateFolder | None = None):
        if max_bytes < 0:
            raise ValueError(f"the prefix cache size must be 0 or more bytes, not {max_bytes}")
        self.max_bytes, self.spill = max_bytes, spill
        self._entries: OrderedDict[tuple[int, ...], CachedPrefix] = OrderedDict()  # oldest use first
        self._holders: dict[int, list] = {}  # id(tensor) -> [tensor, entries holding it]
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def longest_prefix(self, ids: Sequence[int]) -> CachedPrefix | None:
        """The entry holding the longest prefix of `ids` (all of them included), marked as just used; None when
        no entry is a prefix."""
        ids = tuple(ids)
        with self._lock:
            best = max(
                (entry for key, entry in self._entries.items() if len(key) <= len(ids) and ids[: len(key)] == key),
                key=lambda e: len(e.ids),
                default=None,
            )
            if best is not None:
                self._entries.move_to_end(best.ids)
        on_disk = self.spill.longest_prefix(ids) if self.spill is not None else None
        if on_disk is not None and (best is None or len(on_disk) > len(best.ids)):
            saved = self.spill.read(on_disk)
            if saved is not None:
                with self._lock:
                    self._insert(saved)
                best = saved
        return best

    def store(
        self, ids: Sequence[int], state: ModelState, logits: torch.Tensor, after: CachedPrefix | None = None
    ) -> CachedPrefix | None:
        """Keep a host copy of `state`, which holds `ids`, evicting the least recently used entries to stay
        within the size; `after`: the entry `state` was restored from or an entry stored from it since, whose
        KV blocks the copy shares. An entry already held for `ids` is kept as it is (marked as just used).
        Returns the entry, or None when it alone is larger than the whole cache (nothing is stored then)."""
        ids = tuple(ids)
        if not ids:
            return None
        if after is not None and ids[: len(after.ids)] != after.ids:
            raise ValueError("a cached state can only share the blocks of an entry whose ids begin its own")
        with self._lock:
            held = self._entries.get(ids)
            if held is not None:
                self._entries.move_to_end(ids)
                return held
        entry = CachedPrefix(
            ids,
            state.host_copy(after.state if after is not None else None),
            logits.detach().to("cpu", torch.float32, copy=True),
        )
        with self._lock:
            if self._alone_bytes(entry) > self.max_bytes:
                return None
            evicted = self._insert(entry)
        self._spill(evicted)
        return entry

    def flush(self) -> None:
        """Write to the spill folder every entry that only RAM holds and no other entry extends, and wait."""
        if self.spill is None:
            return
        with self._lock:
            entries = list(self._entries.values())
        self._spill(entries)
        self.spill.wait()

    def _insert(self, entry: CachedPrefix) -> list[CachedPrefix]:
        """(under the lock) Hold `entry` as the most recently used; the entries evicted to make room."""
        old = self._entries.pop(entry.ids, None)  # stored by another thread meanwhile
        if old is not None:
            self._release(old)
        self._entries[entry.ids] = entry
        self._hold(entry)
        evicted = []
        while self._bytes > self.max_bytes and len(self._entries) > 1:
            _, gone = self._entries.popitem(last=False)
            self._release(gone)
            evicted.append(gone)
        return evicted

    def _spill(self, entries: list[CachedPrefix]) -> None:
        """Write those of `entries` that end a sequence (no entry in RAM or on disk extends them) to disk."""
        if self.spill is None or not entries:
            return
        with self._lock:
            held = [*self._entries, *(e.ids for e in entries)]
        for entry in entries:
            n = len(entry.ids)
            extended = any(len(key) > n and key[:n] == entry.ids for key in held)
            if not extended and not self.spill.holds(entry.ids):
                self.spill.write(entry)

    def contains(self, ids: Sequence[int]) -> bool:
        """Whether the state after exactly `ids` is cached."""
        with self._lock:
            return tuple(ids) in self._entries

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._holders.clear()
            self._bytes = 0

    def _alone_bytes(self, entry: CachedPrefix) -> int:
        """The bytes `entry` would keep alive with no other entry cached."""
        return sum(_nbytes(t) for t in {id(t): t for t in entry.tensors}.values())

    def _hold(self, entry: CachedPrefix) -> None:
        for tensor in {id(t): t for t in entry.tensors}.values():
            holder = self._holders.setdefault(id(tensor), [tensor, 0])
            if holder[1] == 0:
                self._bytes += _nbytes(tensor)
            holder[1] += 1

    def _release(self, entry: CachedPrefix) -> None:
        for key in {id(t) for t in entry.tensors}:
            holder = self._holders[key]
            holder[1] -= 1
            if holder[1] == 0:
                self._bytes -= _nbytes(holder[0])
                del self._holders[key]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
