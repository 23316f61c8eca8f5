"""A fake OpenAI-compatible server for the remote engine tests: FastAPI served by uvicorn on a free loopback port
in a thread. Each test scripts what it answers (FakeOpenAI.script) and reads what it was asked (requests)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

HANG = "hang"  # in a script: keep the stream open (with keep-alive comments) until the client goes
KEEP_ALIVE_S = 0.02


def chunk(
    content: str | None = None,
    reasoning: str | None = None,
    reasoning_key: str = "reasoning_content",
    finish: str | None = None,
    usage: dict | None = None,
) -> dict:
    """One chat.completion.chunk as vLLM sends it."""
    delta = {}
    if content is not None:
        delta["content"] = content
    if reasoning is not None:
        delta[reasoning_key] = reasoning
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "model": "fake/model",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if usage is not None:
        body = {**body, "choices": [], "usage": usage}
    return body


@dataclass
class FakeOpenAI:
    """What the server answers: `models` for /v1/models, `script` for a streamed chat (dicts are sent as data
    events, strings as they are, HANG keeps the stream open), `api_key` to require one, `raw_models` to answer
    /v1/models with these bytes instead."""

    models: list[dict] = field(default_factory=lambda: [{"id": "fake/model", "object": "model", "owned_by": "vllm"}])
    script: list = field(default_factory=list)
    api_key: str = ""
    raw_models: bytes | None = None
    requests: list[dict] = field(default_factory=list)  # each chat request's JSON body
    headers: list[dict] = field(default_factory=list)  # each request's headers
    disconnected: threading.Event = field(default_factory=threading.Event)  # a HANG stream saw the client go

    def refused(self, request: Request) -> Response | None:
        self.headers.append(dict(request.headers))
        if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
            return JSONResponse({"error": {"message": "Unauthorized", "type": "invalid_request_error"}}, 401)
        return None


def make_app(fake: FakeOpenAI) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models(request: Request):
        if (refusal := fake.refused(request)) is not None:
            return refusal
        if fake.raw_models is not None:
            return Response(fake.raw_models, media_type="application/json")
        return {"object": "list", "data": fake.models}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        if (refusal := fake.refused(request)) is not None:
            return refusal
        fake.requests.append(await request.json())

        async def events():
            for item in fake.script:
                if item == HANG:
                    try:  # until sending fails or the client is seen gone, whichever Starlette notices first
                        while not await request.is_disconnected():
                            yield ": keep-alive\n\n"
                            await asyncio.sleep(KEEP_ALIVE_S)
                    finally:
                        fake.disconnected.set()
                    return
                yield item if isinstance(item, str) else f"data: {json.dumps(item)}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


class FakeServer:
    """`make_app(fake)` on 127.0.0.1 at a free port, in a daemon thread; `url` is its address."""

    def __init__(self, fake: FakeOpenAI):
        self.fake = fake
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(make_app(fake), log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the fake OpenAI server did not start")
            self._thread.join(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._socket.close()


def free_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
