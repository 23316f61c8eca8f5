"""Starting the server: settings checked first, then uvicorn on a thread of its own beside the engine's worker."""

from __future__ import annotations

import ipaddress
import threading
import time
from dataclasses import dataclass

import uvicorn

from engine.runtime.prefix_cache import PrefixCache
from engine.runtime.session import ChatSession
from engine.server.app import create_app
from engine.server.http import ServerContext, unix_now
from engine.server.worker import EngineWorker

START_SECONDS = 30.0


@dataclass(frozen=True)
class ServerSettings:
    host: str
    port: int
    api_key: str | None
    max_queue: int
    prefix_cache_bytes: int
    max_body_bytes: int


def is_loopback(host: str) -> bool:
    """Whether `host` is this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def check_settings(
    *, host: str, port: int, api_key: str | None, max_queue: int, prefix_cache_mib: int, max_body_mib: float
) -> ServerSettings:
    """The settings, or ValueError saying which one is wrong and what to give instead."""
    if not is_loopback(host) and not api_key:
        raise ValueError(
            f"--host {host} opens the API to other machines; give it a key with --api-key KEY (or "
            f"$MOEDESK_API_KEY), or serve on 127.0.0.1"
        )
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be from 0 to 65535, got {port}")
    if max_queue < 0:
        raise ValueError(f"--max-queue must be 0 or more, got {max_queue}")
    if prefix_cache_mib < 0:
        raise ValueError(f"--prefix-cache-mib must be 0 or more, got {prefix_cache_mib}")
    if not max_body_mib > 0:
        raise ValueError(f"--max-body-mib must be a positive number, got {max_body_mib}")
    return ServerSettings(host, port, api_key, max_queue, prefix_cache_mib * 2**20, int(max_body_mib * 2**20))


class HttpServer:
    """uvicorn serving an application on a daemon thread with an event loop of its own."""

    def __init__(self, server: uvicorn.Server, thread: threading.Thread, host: str):
        self._server, self._thread, self.host = server, thread, host

    @property
    def port(self) -> int:
        return self._server.servers[0].sockets[0].getsockname()[1]

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def wait(self) -> None:
        while self._thread.is_alive():
            self._thread.join(0.5)

    def stop(self) -> None:
        """Close the port and end the thread; requests still running are cancelled after a short grace."""
        self._server.should_exit = True
        self._thread.join(timeout=10)


def _run(server: uvicorn.Server) -> None:
    try:
        server.run()
    except SystemExit:  # uvicorn ends its thread this way when it cannot listen; listen() says so in words
        pass


def listen(settings: ServerSettings, current, *, log_level: str = "info") -> HttpServer:
    """Serve the engine `current()` returns (None: no model, 503) with `settings`; returns once the port is
    open, RuntimeError saying so when it does not open."""
    app = create_app(current, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=2,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=_run, args=(server,), name="http-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_SECONDS
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(
                f"the server could not listen on {settings.host}:{settings.port} (is the port in use? "
                f"try another --port)"
            )
        time.sleep(0.02)
    return HttpServer(server, thread, settings.host)


class RunningServer:
    """`engine serve`: the HTTP server and the engine's worker it answers with; stop() ends both."""

    def __init__(self, http: HttpServer, worker: EngineWorker):
        self.http, self.worker = http, worker

    @property
    def port(self) -> int:
        return self.http.port

    @property
    def base_url(self) -> str:
        return self.http.base_url

    def wait(self) -> None:
        self.http.wait()

    def stop(self) -> None:
        self.worker.stop()  # what runs and waits ends first, so the server's grace is not spent on it
        self.http.stop()


def start(
    settings: ServerSettings,
    model,
    tokenizer,
    *,
    context_tokens: int,
    model_name: str,
    log_level: str = "info",
    **session_options,
) -> RunningServer:
    """Serve `model` with `settings`; returns once the port is open (RuntimeError when it does not open)."""
    session = ChatSession(model, tokenizer, context_tokens=context_tokens, **session_options)
    cache = PrefixCache(settings.prefix_cache_bytes) if settings.prefix_cache_bytes else None
    worker = EngineWorker(session, cache, max_queue=settings.max_queue)
    context = ServerContext(worker, model_name, tokenizer, session.sampling, context_tokens, unix_now())
    try:
        http = listen(settings, lambda: context, log_level=log_level)
    except RuntimeError:
        worker.stop()
        raise
    return RunningServer(http, worker)
