"""Cutting streamed text at stop strings without ever showing part of one."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feeds on text deltas; shows what cannot belong to a stop string and ends at the first one."""

    def __init__(self, stops: Sequence[str]):
        if not all(stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = tuple(stops)
        self.matched: str | None = None  # the stop string that ended the text
        self._held = ""  # a tail that may be the start of a stop string

    def feed(self, delta: str) -> tuple[str, bool]:
        """(text safe to show now, whether a stop string was hit); after a hit nothing more is shown."""
        if self.matched is not None:
            return "", True
        text = self._held + delta
        hit = self._first_stop(text)
        if hit is not None:
            start, self.matched = hit
            self._held = ""
            return text[:start], True
        held_from = partial_match_start(text, self.stops)
        self._held = text[held_from:]
        return text[:held_from], False

    def flush(self) -> str:
        """The held-back text, once generation has ended without a stop string."""
        held, self._held = self._held, ""
        return held

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """(where, which) of the first stop string in text, or None."""
        hits = [(start, stop) for stop in self.stops if (start := text.find(stop)) >= 0]
        # Stops found at one start are prefixes of each other; the shortest sorts first and, streamed, completes first.
        return min(hits, default=None)


def partial_match_start(text: str, strings: Sequence[str]) -> int:
    """Where the longest tail of text that begins one of strings starts; len(text) when no tail does."""
    longest = max(map(len, strings), default=0)
    for start in range(max(0, len(text) - longest + 1), len(text)):
        tail = text[start:]
        if any(string.startswith(tail) for string in strings):
            return start
    return len(text)
