"""Chats with a remote engine: a QObject on its own QThread that streams replies from an OpenAI-compatible server.

It emits the reply signals the EngineWorker emits (replyStarted, reasoningDelta, answerDelta, progress,
replyFinished, busyChanged, log) with the same shapes, so the Chat page shows a remote reply exactly as a
local one. Each reply runs in an asyncio loop on this thread; `stop()`, safe from any thread, cancels that
loop's task, which closes the stream at once. The endpoint comes through the queued `use_endpoint` slot; its
key goes to the server's Authorization header and nowhere else (never a signal to the GUI, never the log).
"""

from __future__ import annotations

import asyncio
import threading
import traceback

from PySide6.QtCore import QObject, QThread, Signal, Slot

from app.engine_worker import DeltaBuffer, start_on_thread
from app.remote_engine import RemoteClient, RemoteError, chat_messages, request_fields


class RemoteWorker(QObject):
    replyStarted = Signal()
    reasoningDelta = Signal(str)
    answerDelta = Signal(str)
    progress = Signal(dict)  # new_tokens, decode_tokens_per_s (measured from the stream)
    replyFinished = Signal(dict)  # answer, reasoning, stats (EngineWorker's, plus remote and tokens_counted)
    busyChanged = Signal(bool)
    log = Signal(str, str)  # level, message (never the key)

    def __init__(self, client_factory=RemoteClient):
        """`client_factory(base_url, api_key)` makes the RemoteClient each reply uses (tests give a transport)."""
        super().__init__()
        self._client_factory = client_factory
        self._endpoint: dict | None = None
        self._lock = threading.Lock()  # guards the running task against stop() from the GUI thread
        self._task: tuple[asyncio.AbstractEventLoop, asyncio.Task] | None = None
        self._stopped = False

    # ---- any thread -----------------------------------------------------------------------------

    def stop(self) -> None:
        """Cancel the reply in progress: its stream is closed at once."""
        with self._lock:
            self._stopped = True
            if self._task is not None:
                loop, task = self._task
                loop.call_soon_threadsafe(task.cancel)

    # ---- worker thread (queued) -----------------------------------------------------------------

    @Slot(dict)
    def use_endpoint(self, endpoint: dict) -> None:
        """Answer later sends with `endpoint` (app.remote_store.RemoteEndpoint.to_dict(): base_url, model, key)."""
        self._endpoint = dict(endpoint)

    @Slot(list, str, dict)
    def send(self, history: list, text: str, options: dict) -> None:
        """Answer `text` after `history` with the endpoint's model, streaming as the EngineWorker does."""
        endpoint = self._endpoint
        if endpoint is None:
            self.replyFinished.emit(
                {
                    "answer": "",
                    "reasoning": "",
                    "stats": {
                        "stop_reason": "error",
                        "error": "No remote engine is chosen. Choose one on the Models page.",
                    },
                }
            )
            return
        with self._lock:
            self._stopped = False
        messages = chat_messages(history, text, options.get("system_prompt") or "")
        self.busyChanged.emit(True)
        try:
            asyncio.run(self._reply(endpoint, messages, request_fields(options)))
        finally:
            self.busyChanged.emit(False)

    @Slot(list, dict)
    def continue_reply(self, history: list, options: dict) -> None:
        """A remote engine's API has no way to go on with a reply: say so, keeping what the reply holds."""
        self.replyFinished.emit(
            {
                "answer": "",
                "reasoning": "",
                "stats": {
                    "stop_reason": "error",
                    "error": "A remote engine cannot continue a reply (its API has no way to). "
                    "Regenerate it, or send “go on” to ask the model to carry on.",
                },
            }
        )

    async def _reply(self, endpoint: dict, messages: list[dict], fields: dict) -> None:
        with self._lock:
            self._task = (asyncio.get_running_loop(), asyncio.current_task())
            stopped = self._stopped  # Stop pressed while this send waited in the queue
        self.replyStarted.emit()
        pending = DeltaBuffer(self.reasoningDelta, self.answerDelta)
        stream = None
        remote = f"{endpoint['name']} @ {endpoint['host']}, model {endpoint['model']}"
        try:
            if stopped:
                raise asyncio.CancelledError
            async with self._client_factory(endpoint["base_url"], endpoint.get("api_key", "")) as client:
                stream = client.chat(endpoint["model"], messages, fields)
                async for delta in stream:
                    if pending.add(delta.kind, delta.text):
                        pending.flush()
                        self.progress.emit({"new_tokens": delta.tokens, "decode_tokens_per_s": delta.tokens_per_s})
            pending.flush()
            self.replyFinished.emit(
                {
                    "answer": stream.answer.strip(),
                    "reasoning": stream.reasoning.strip(),
                    "stats": {**stream.stats(), "remote": remote},
                }
            )
        except asyncio.CancelledError:
            pending.flush()
            self._finish_early(stream, remote, "cancelled")
        except RemoteError as exc:
            pending.flush()
            self.log.emit("error", f"remote engine {remote}: {exc}")
            self._finish_early(stream, remote, "error", str(exc))
        except Exception as exc:  # a bug must not take the app down; the log keeps the traceback
            pending.flush()
            self.log.emit("error", traceback.format_exc())
            self._finish_early(
                stream, remote, "error", f"The remote reply failed unexpectedly: {exc!r}. The log page has the details."
            )
        finally:
            with self._lock:
                self._task = None

    def _finish_early(self, stream, remote: str, reason: str, error: str | None = None) -> None:
        """End a cancelled or failed reply with what streamed before it ended."""
        stats = stream.stats(reason) if stream is not None else {"stop_reason": reason}
        self.replyFinished.emit(
            {
                "answer": stream.answer.strip() if stream else "",
                "reasoning": stream.reasoning.strip() if stream else "",
                "stats": {**stats, "error": error, "remote": remote},
            }
        )


def start_remote_worker(client_factory=RemoteClient) -> tuple[RemoteWorker, QThread]:
    """A RemoteWorker moved to a new, started QThread."""
    worker = RemoteWorker(client_factory)
    return worker, start_on_thread(worker, "remote engine")
