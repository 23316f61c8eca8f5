"""A client for OpenAI-compatible servers (vLLM, SGLang, llama-server, FreeToken, `python -m engine serve`).

It lists a server's models (`GET /v1/models`) and streams a chat reply (`POST /v1/chat/completions` with
stream=true, read as server-sent events), keeping the reasoning deltas (`reasoning_content`, or `reasoning`
as some servers name it) apart from the answer and measuring time to first token and tokens per second from
the stream itself. Every failure becomes a RemoteError whose message says what happened and what to do.
Reads are bounded (a response larger than the limit is refused), and the API key goes only into the
Authorization header: never into a message, a repr or the log.

Nothing here touches Qt: the app runs it on a worker thread (app/remote_worker.py) or on a ConnectionProbe's
daemon thread, each in its own asyncio loop, so cancelling a reply is cancelling its task, which closes the
stream at once.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import httpx

CONNECT_TIMEOUT_S = 10.0
LIST_TIMEOUT_S = 15.0  # the model list and the connection test: a server that takes longer is not usable
REPLY_READ_TIMEOUT_S = 300.0  # between two pieces of a reply: a long prompt's prefill on a busy server
MAX_MODELS_BYTES = 4 * 2**20  # a model list is a few KiB; thousands of models still fit
MAX_STREAM_BYTES = 64 * 2**20  # ~200 bytes a token: far beyond any context a reply can fill
MAX_LINE_BYTES = 2**20  # one server-sent event line
SERVER_TEXT_CHARS = 300  # how much of a server's own error message is shown

# the app's sampling overrides (engine.runtime.sampling.SamplingParams) as the request fields vLLM, SGLang and
# llama-server read; top_k, min_p and repetition_penalty are their extensions to OpenAI's set
SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "max_new_tokens": "max_tokens",
    "stop": "stop",
    "seed": "seed",
}
# OpenAI's finish_reason in the engine's words (engine.runtime.events.STOP_REASONS); others pass as sent
STOP_REASONS = {"stop": "eos", "length": "length"}


class RemoteError(Exception):
    """A remote engine could not be used; `kind` says why (bad_url, refused, not_found_host, timeout, tls, auth,
    not_found, http, bad_response, too_large) and the message says what to do."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def api_base(url: str) -> str:
    """The API root of a server address: http(s)://host[:port][/path]/v1, whether or not it was typed with /v1."""
    text = url.strip()
    if "://" not in text:  # "10.0.0.5:8000", as people type it
        text = "http://" + text
    parts = urlsplit(text)
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise RemoteError(
            "bad_url",
            f"“{url.strip()[:80]}” is not a server address. Type one like "
            f"http://10.0.0.5:8000 or https://example.com/v1.",
        )
    path = parts.path.rstrip("/")
    if not path.endswith("/v1"):
        path += "/v1"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def host_label(url: str) -> str:
    """Host and port of a server address as a person would say it ("10.0.0.5:8000"), without any credentials."""
    parts = urlsplit(api_base(url))
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{parts.port}" if parts.port else host


def chat_messages(history: list[dict], text: str, system_prompt: str = "") -> list[dict]:
    """The OpenAI `messages` for `text` after `history`: role and content only, since earlier turns' reasoning
    is not part of OpenAI's format and the Qwen templates drop it anyway."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages += [{"role": m["role"], "content": m["content"]} for m in history]
    messages.append({"role": "user", "content": text})
    return messages


def request_fields(options: dict) -> dict:
    """The request's sampling and thinking fields from the chat page's options (enable_thinking, sampling)."""
    fields = {"chat_template_kwargs": {"enable_thinking": bool(options.get("enable_thinking", True))}}
    for ours, theirs in SAMPLING_FIELDS.items():
        value = (options.get("sampling") or {}).get(ours)
        if value is not None:
            fields[theirs] = list(value) if ours == "stop" else value
    return fields


@dataclass(frozen=True)
class StreamDelta:
    """A piece of a streamed reply, with the tokens counted so far and the decode rate measured so far."""

    kind: str  # "reasoning" | "answer"
    text: str
    tokens: int
    tokens_per_s: float


@dataclass
class TokenMeter:
    """When a reply's tokens arrived, by `clock`: time to first token and decode tokens per second."""

    started: float
    clock: object = time.perf_counter
    deltas: int = 0
    first: float | None = None
    last: float | None = None

    def count(self) -> None:
        now = self.clock()
        self.deltas += 1
        self.first = now if self.first is None else self.first
        self.last = now

    def rate(self, tokens: int) -> float:
        """Tokens after the first over the time they took (the decode rate other apps show); 0 before two."""
        if self.first is None or tokens < 2 or self.last <= self.first:
            return 0.0
        return (tokens - 1) / (self.last - self.first)

    @property
    def time_to_first_token_s(self) -> float | None:
        return None if self.first is None else self.first - self.started


@dataclass
class ChatStream:
    """One streamed reply: iterate it for StreamDeltas; `answer`, `reasoning` and `stats()` hold what came so
    far, also after a cancel or a failure mid-stream."""

    client: RemoteClient
    body: dict
    answer: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)
    meter: TokenMeter | None = None

    def stats(self, stop_reason: str | None = None) -> dict:
        """The reply's stats in the engine's TurnStats words, tokens from usage when the server sent it."""
        meter = self.meter or TokenMeter(0.0)
        counted = self.usage.get("completion_tokens")
        from_usage = isinstance(counted, int) and not isinstance(counted, bool) and counted >= 0
        tokens = counted if from_usage else meter.deltas
        prompt = self.usage.get("prompt_tokens")
        details = self.usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        reason = stop_reason or STOP_REASONS.get(self.finish_reason, self.finish_reason) or "eos"
        return {
            "stop_reason": reason,
            "new_tokens": tokens,
            "tokens_counted": "usage" if from_usage else "deltas",
            "time_to_first_token_s": meter.time_to_first_token_s,
            "decode_tokens_per_s": meter.rate(tokens),
            "prompt_tokens": prompt if isinstance(prompt, int) else None,
            "cached_tokens": cached if isinstance(cached, int) else None,
            "error": None,
        }

    async def __aiter__(self) -> AsyncIterator[StreamDelta]:
        client = self.client
        self.meter = TokenMeter(client.clock(), client.clock)
        async with client.translated("chat/completions"):
            async with client.http.stream(
                "POST", client.url("chat/completions"), json=self.body, timeout=client.timeout(REPLY_READ_TIMEOUT_S)
            ) as response:
                await client.check_status(response, "chat/completions")
                if not response.headers.get("content-type", "").startswith("text/event-stream"):
                    # a server that ignores stream=true answers with the whole completion at once
                    chunk = _json(await client.read_bounded(response, client.max_stream_bytes), "chat/completions")
                    for delta in self._take(chunk, message_key="message"):
                        yield delta
                    self._require_end()
                    return
                async for data in client.events(response):
                    if data.strip() == "[DONE]":
                        return
                    for delta in self._take(_json(data, "chat/completions stream"), message_key="delta"):
                        yield delta
        self._require_end()

    def _take(self, chunk, message_key: str) -> list[StreamDelta]:
        """The deltas in one chunk (or a whole completion), noting its finish reason and usage."""
        if not isinstance(chunk, dict):
            raise RemoteError(
                "bad_response",
                "The server's reply is not the JSON object an OpenAI-compatible "
                "server sends. Check the address points at such a server.",
            )
        if chunk.get("error") is not None:  # vLLM and SGLang report a failure mid-stream this way
            raise RemoteError("http", f"The server stopped the reply with an error: {_server_text(chunk)}.")
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        deltas = []
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            message = choice.get(message_key) or {}
            if not isinstance(message, dict):
                raise RemoteError("bad_response", f"The server sent a {message_key} that is not an object.")
            reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
            for kind, text in (("reasoning", reasoning), ("answer", message.get("content") or "")):
                if isinstance(text, str) and text:
                    self.meter.count()
                    if kind == "reasoning":
                        self.reasoning += text
                    else:
                        self.answer += text
                    tokens = self.meter.deltas
                    deltas.append(StreamDelta(kind, text, tokens, self.meter.rate(tokens)))
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
        return deltas

    def _require_end(self) -> None:
        if self.finish_reason is None:
            raise RemoteError(
                "bad_response",
                "The server ended the stream before the reply ended (no finish "
                "reason). It may have restarted or run out of memory; try again.",
            )


class RemoteClient:
    """An OpenAI-compatible server at `base_url` (with or without /v1), used as `async with RemoteClient(...)`.
    `transport` replaces the network (tests); `clock` times the stream."""

    def __init__(
        self,
        base_url: str,
        api_key: str = "",
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        max_models_bytes: int = MAX_MODELS_BYTES,
        max_stream_bytes: int = MAX_STREAM_BYTES,
        clock=time.perf_counter,
    ):
        self.base = api_base(base_url)
        self.host = host_label(base_url)
        self.max_models_bytes, self.max_stream_bytes, self.clock = max_models_bytes, max_stream_bytes, clock
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(headers=headers, transport=transport, timeout=self.timeout(LIST_TIMEOUT_S))

    async def __aenter__(self) -> RemoteClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.aclose()

    def url(self, endpoint: str) -> str:
        return f"{self.base}/{endpoint}"

    @staticmethod
    def timeout(read_s: float) -> httpx.Timeout:
        return httpx.Timeout(read_s, connect=CONNECT_TIMEOUT_S)

    async def list_models(self) -> list[dict]:
        """The server's models as {"id", "owned_by"} (owned_by often names the server: vllm, sglang, llamacpp)."""
        async with self.translated("models"):
            async with self.http.stream("GET", self.url("models")) as response:
                await self.check_status(response, "models")
                listing = _json(await self.read_bounded(response, self.max_models_bytes), "models")
        entries = listing.get("data") if isinstance(listing, dict) else None
        if not isinstance(entries, list):
            raise RemoteError(
                "bad_response",
                f"{self.host} answered /v1/models without a model list (no “data” "
                f"array). It does not look like an OpenAI-compatible server.",
            )
        models = [
            {"id": e["id"], "owned_by": e.get("owned_by") if isinstance(e.get("owned_by"), str) else ""}
            for e in entries
            if isinstance(e, dict) and isinstance(e.get("id"), str) and e["id"]
        ]
        if not models:
            raise RemoteError("bad_response", f"{self.host} lists no models. Load one on the server first.")
        return models

    def chat(self, model: str, messages: list[dict], fields: dict | None = None) -> ChatStream:
        """A streamed chat completion of `messages` by `model`; nothing is sent until it is iterated."""
        body = {
            "model": model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            **(fields or {}),
        }
        return ChatStream(self, body)

    # ---- reading responses -------------------------------------------------------------------------

    async def check_status(self, response: httpx.Response, endpoint: str) -> None:
        """Raise the RemoteError an HTTP error status means, with the server's own words when it sent any."""
        if response.status_code < 400:
            return
        try:
            said = _server_text(json.loads(await self.read_bounded(response, 64 * 1024)))
        except (RemoteError, ValueError):
            said = ""
        code = response.status_code
        because = f" (it said: {said})" if said else ""
        if code in (401, 403):
            raise RemoteError(
                "auth",
                f"{self.host} refused the request (HTTP {code}): the key was refused{because}. "
                f"Check the API key, or leave it empty for a server started without one.",
            )
        if code == 404 and endpoint == "models":
            raise RemoteError(
                "not_found",
                f"There is no OpenAI-compatible API at this URL: {self.url('models')} "
                f"answered HTTP 404. Check the address and port (the API is usually at "
                f"http://HOST:PORT/v1).",
            )
        raise RemoteError(
            "not_found" if code == 404 else "http", f"{self.host} answered /v1/{endpoint} with HTTP {code}{because}."
        )

    async def read_bounded(self, response: httpx.Response, limit: int) -> bytes:
        """The whole body, refusing one larger than `limit` bytes before it is all in memory."""
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise self._too_large(limit)
        body = bytearray()
        async for piece in response.aiter_bytes():
            body += piece
            if len(body) > limit:
                raise self._too_large(limit)
        return bytes(body)

    async def events(self, response: httpx.Response) -> AsyncIterator[str]:
        """The data of each server-sent event, the stream's size and each line's length bounded."""
        total, pending, data = 0, b"", []
        async for piece in response.aiter_bytes():
            total += len(piece)
            if total > self.max_stream_bytes:
                raise self._too_large(self.max_stream_bytes)
            pending += piece
            *lines, pending = pending.split(b"\n")
            if len(pending) > MAX_LINE_BYTES:
                raise self._too_large(MAX_LINE_BYTES)
            for raw in lines:
                line = raw.rstrip(b"\r").decode("utf-8", errors="replace")
                if not line:  # a blank line ends an event
                    if data:
                        yield "\n".join(data)
                    data = []
                elif line.startswith("data:"):
                    data.append(line[6:] if line.startswith("data: ") else line[5:])
                # comments (":" keep-alives), event: and id: lines carry nothing a chat chunk needs
        if data:
            yield "\n".join(data)

    def _too_large(self, limit: int) -> RemoteError:
        return RemoteError(
            "too_large",
            f"{self.host} sent more than {limit / 2**20:.0f} MiB in one response, more "
            f"than any reply needs; it was cut off. Check the address points at an "
            f"OpenAI-compatible server.",
        )

    def translated(self, endpoint: str) -> _Translated:
        return _Translated(self, endpoint)


class _Translated:
    """Turns httpx's network errors inside it into RemoteErrors that say what to do."""

    def __init__(self, client: RemoteClient, endpoint: str):
        self.client, self.endpoint = client, endpoint

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, kind, exc, tb) -> bool:
        if isinstance(exc, httpx.HTTPError):
            raise network_error(exc, self.client.host, self.endpoint) from None
        return False


def network_error(exc: httpx.HTTPError, host: str, endpoint: str) -> RemoteError:
    """The RemoteError for an httpx failure talking to `host`."""
    causes = _causes(exc)
    if any(isinstance(c, ssl.SSLError) for c in causes):
        return RemoteError(
            "tls",
            f"The secure connection to {host} failed ({_first_line(exc)}). If the server has "
            f"no TLS, use http://; if it has a self-signed certificate, install it.",
        )
    if isinstance(exc, httpx.TimeoutException):
        stage = "connecting" if isinstance(exc, (httpx.ConnectTimeout, httpx.PoolTimeout)) else "waiting for an answer"
        return RemoteError(
            "timeout",
            f"{host} did not answer in time ({stage}). Check the server is up and "
            f"reachable from this computer (a firewall may drop the connection).",
        )
    if any(isinstance(c, ConnectionRefusedError) for c in causes) or "refused" in str(exc).lower():
        return RemoteError(
            "refused",
            f"{host} refused the connection: nothing listens there. Check the server is "
            f"running, and the port; a server reached from another computer must listen "
            f"on its network address (vLLM, SGLang: --host 0.0.0.0).",
        )
    if any(isinstance(c, socket.gaierror) for c in causes):
        return RemoteError(
            "not_found_host",
            f"The host name in {host} could not be found. Check its spelling, or use the server's IP address.",
        )
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
        return RemoteError(
            "bad_response",
            f"{host} broke off /v1/{endpoint} ({_first_line(exc)}). The server may "
            f"have restarted, or this address is not an HTTP server.",
        )
    return RemoteError("http", f"Talking to {host} failed: {_first_line(exc)}.")


def _causes(exc: BaseException) -> list[BaseException]:
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:SERVER_TEXT_CHARS]


def _json(data: bytes | str, where: str):
    try:
        return json.loads(data)
    except ValueError:
        shown = data[:80].decode("utf-8", errors="replace") if isinstance(data, bytes) else data[:80]
        raise RemoteError(
            "bad_response",
            f"The server's {where} answer is not JSON (it begins {shown!r}). Check "
            f"the address points at an OpenAI-compatible API.",
        ) from None


def _server_text(body) -> str:
    """A server's own error message from an OpenAI-style ({"error": {"message"}}) or FastAPI-style body."""
    if not isinstance(body, dict):
        return ""
    said = body.get("error", body.get("detail", body.get("message")))
    if isinstance(said, dict):
        said = said.get("message", "")
    return " ".join(str(said or "").split())[:SERVER_TEXT_CHARS]


async def probe(url: str, api_key: str = "", transport: httpx.AsyncBaseTransport | None = None) -> list[dict]:
    """Test the connection to a server: its model list, or the RemoteError saying why it cannot be used."""
    async with RemoteClient(url, api_key, transport=transport) as client:
        return await client.list_models()


class ConnectionProbe:
    """One connection test on its own daemon thread, which touches no Qt object (the dialog polls `done()`):
    a dialog closed mid-test leaves nothing for Qt to deliver to. `models` or `error` holds the outcome."""

    def __init__(self, url: str, api_key: str = "", transport: httpx.AsyncBaseTransport | None = None):
        self.models: list[dict] = []
        self.error: RemoteError | None = None
        self._done = threading.Event()
        threading.Thread(target=self._run, args=(url, api_key, transport), name="remote probe", daemon=True).start()

    def _run(self, url: str, api_key: str, transport) -> None:
        try:
            self.models = asyncio.run(probe(url, api_key, transport))
        except RemoteError as exc:
            self.error = exc
        except Exception as exc:  # a test must answer, or the dialog would wait for ever
            self.error = RemoteError("http", f"The connection test failed unexpectedly: {exc!r}.")
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()
