"""The local API inside the app: engine.server's HTTP application on uvicorn, answering with the window's model.

An ApiServer is a QObject on its own QThread: start() returns once uvicorn has opened the port (or failed to),
stop() once its thread has ended, so neither waits on the GUI thread. Requests reach the model through the
engine queue the chat window's turns use (app.engine_worker), so the two never run at once; while no model is
loaded every route answers 503. The key goes to the server's check and nowhere else: never a signal, never the
log.
"""

from __future__ import annotations

import errno
import socket
import threading
from collections.abc import Callable

from PySide6.QtCore import QObject, QThread, Signal, Slot

from app.engine_worker import start_on_thread

LOOPBACK_HOST = "127.0.0.1"
LAN_HOST = "0.0.0.0"  # every interface: other machines on the network reach it
MAX_BODY_BYTES = 16 * 2**20  # engine serve's default


def base_url(port: int) -> str:
    """The OpenAI base URL a program on this machine uses."""
    return f"http://{LOOPBACK_HOST}:{port}/v1"


def why_not_listening(host: str, port: int) -> str:
    """What keeps `host`:`port` from being listened on, in words, found by binding it once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, getattr(errno, "WSAEADDRINUSE", errno.EADDRINUSE)):
                return f"port {port} is already in use by another program (or another MoE Desk)"
            if exc.errno in (errno.EACCES, getattr(errno, "WSAEACCES", errno.EACCES)):
                return f"this system does not let MoE Desk listen on port {port}"
            return f"port {port} cannot be opened ({exc.strerror or exc})"
    return f"port {port} could not be opened"


class ApiServer(QObject):
    started = Signal(dict)  # port, base_url, lan
    failed = Signal(str)  # what happened and what to do
    stopped = Signal()
    log = Signal(str, str)  # level, message (never the key)

    def __init__(self, current: Callable[[], object]):
        """`current()` is the engine to answer with (engine.server.http.ServerContext), None while none is loaded;
        called from the server's thread at each request."""
        super().__init__()
        self._current = current
        self._http = None
        self._lock = threading.Lock()  # start/stop on this thread against shutdown() from the GUI's
        self._shut = False  # the app is closing: a start still opening its port closes it again

    @Slot(dict)
    def start(self, options: dict) -> None:
        """Serve on `options` (port, api_key, allow_lan), closing the server already running first."""
        from engine.api import ServerSettings, listen

        self._close()
        port, key, lan = int(options["port"]), options.get("api_key") or None, bool(options.get("allow_lan"))
        if lan and key is None:
            self.failed.emit(
                "The API is off: letting other machines in needs an API key. Set a key in Settings → "
                "Local API, or turn off “Allow other machines”."
            )
            return
        host = LAN_HOST if lan else LOOPBACK_HOST
        settings = ServerSettings(host, port, key, max_queue=0, prefix_cache_bytes=0, max_body_bytes=MAX_BODY_BYTES)
        try:
            http = listen(settings, self._current, log_level="warning")
        except RuntimeError:
            message = (
                f"The API is off: {why_not_listening(host, port)}. Choose another port in Settings → Local "
                f"API (or close the program using it), then turn the API on again."
            )
            self.log.emit("error", message)
            self.failed.emit(message)
            return
        with self._lock:
            closing = self._shut
            if not closing:
                self._http = http
        if closing:
            http.stop()
            return
        where = "this machine and the network" if lan else "this machine only"
        self.log.emit(
            "info", f"local API serving at {base_url(http.port)} for {where}{', key required' if key else ''}"
        )
        self.started.emit({"port": http.port, "base_url": base_url(http.port), "lan": lan})

    @Slot()
    def stop(self) -> None:
        """Close the port; requests still running are cancelled after a short grace."""
        if self._close():
            self.log.emit("info", "local API stopped")
        self.stopped.emit()

    def shutdown(self) -> None:
        """stop() for the app's exit, from any thread; no start after it serves."""
        with self._lock:
            self._shut = True
        self._close()

    def _close(self) -> bool:
        with self._lock:
            http, self._http = self._http, None
        if http is None:
            return False
        http.stop()
        return True


def start_api_server(current: Callable[[], object]) -> tuple[ApiServer, QThread]:
    """An ApiServer for `current` moved to a new, started QThread."""
    server = ApiServer(current)
    return server, start_on_thread(server, "api-server")
