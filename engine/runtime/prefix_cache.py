"""A bounded host-RAM cache of model states keyed by the token ids they hold, for reuse across requests.

Clients of an HTTP API resend the whole conversation on every request; an agent's conversation grows by a
few hundred tokens each time. Each entry is a full host copy of a state (KV rows and recurrent states, see
ModelState.host_copy) after a token-id prefix, taken at a message boundary, with the logits of its last
token so a prompt the cache holds whole needs no prefill at all. A lookup finds the longest cached prefix of
a request's ids; eviction is least-recently-used, by bytes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.models.base import HostState


@dataclass(frozen=True)
class CachedPrefix:
    """A state after `ids`, and the float32 logits of the last of them."""

    ids: tuple[int, ...]
    state: HostState
    logits: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.state.nbytes + self.logits.numel() * self.logits.element_size() + 8 * len(self.ids)


class PrefixCache:
    """Longest-prefix lookup over saved states, least-recently-used entries dropped past `max_bytes`.

    Thread-safe: the engine's worker stores and looks up, a stats reader may ask for its size meanwhile."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"the prefix cache size must be 0 or more bytes, not {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], CachedPrefix] = OrderedDict()  # oldest use first
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
            best = max((entry for key, entry in self._entries.items()
                        if len(key) <= len(ids) and ids[:len(key)] == key), key=lambda e: len(e.ids), default=None)
            if best is not None:
                self._entries.move_to_end(best.ids)
            return best

    def store(self, ids: Sequence[int], state: HostState, logits: torch.Tensor) -> bool:
        """Keep the state after `ids`, evicting the least recently used entries to stay within the size;
        False when it alone is larger than the whole cache (nothing is stored then)."""
        entry = CachedPrefix(tuple(ids), state, logits.detach().to("cpu", torch.float32, copy=True))
        if not entry.ids or entry.nbytes > self.max_bytes:
            return False
        with self._lock:
            old = self._entries.pop(entry.ids, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._entries[entry.ids] = entry
            self._bytes += entry.nbytes
            while self._bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
        return True

    def contains(self, ids: Sequence[int]) -> bool:
        """Whether the state after exactly `ids` is cached (a stored prefix is not re-copied)."""
        with self._lock:
            return tuple(ids) in self._entries

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
