"""Pause, resume and cancel a download or a planning request from any thread."""

from __future__ import annotations

import threading
import time
from typing import Callable

from engine.hub.errors import DownloadCancelled

STOP_POLL_S = 0.2  # how often a wait for the network looks at the stop flag (signal handlers run in between)


class DownloadControl:
    """Pause, resume and cancel a download from any thread; the download checks it between chunks."""

    def __init__(self):
        self._cond = threading.Condition()
        self._paused = False
        self._stop: str | None = None  # "cancel" (delete the files) or "interrupt" (keep them)

    def pause(self) -> None:
        with self._cond:
            self._paused = True
            self._cond.notify_all()

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def cancel(self) -> None:
        """Stop and delete what this download wrote."""
        self._set_stop("cancel")

    def interrupt(self) -> None:
        """Stop and keep what arrived, so the same download resumes from it."""
        self._set_stop("interrupt")

    def _set_stop(self, how: str) -> None:
        with self._cond:
            self._stop = self._stop or how
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def stopping(self) -> str | None:
        return self._stop

    def wait_while_paused(self) -> None:
        with self._cond:
            while self._paused and self._stop is None:
                self._cond.wait()

    def sleep(self, seconds: float) -> None:
        """Wait, but wake at once for a pause, a resume or a stop."""
        deadline = time.monotonic() + seconds
        with self._cond:
            while self._stop is None and (left := deadline - time.monotonic()) > 0:
                # in slices: on Windows a Ctrl-C handler runs only once the wait returns
                if self._cond.wait(min(left, STOP_POLL_S)):
                    return

    def call(self, fn: Callable):
        """Return fn() run on a helper thread, or raise DownloadCancelled as soon as a stop is asked.

        A blocked socket read cannot be woken from another thread, so the caller does not wait for it: an
        abandoned request ends on its own at its read timeout and its result is dropped."""
        outcome: dict = {}

        def run() -> None:
            try:
                outcome["value"] = fn()
            except BaseException as exc:  # handed to the waiting thread, which raises it
                outcome["error"] = exc
            with self._cond:
                outcome["done"] = True
                self._cond.notify_all()

        threading.Thread(target=run, name="hub-request", daemon=True).start()
        with self._cond:
            while "done" not in outcome and self._stop is None:
                self._cond.wait(STOP_POLL_S)  # in slices, as in sleep()
        if "done" not in outcome:
            raise DownloadCancelled(None, self._stop == "cancel")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]
