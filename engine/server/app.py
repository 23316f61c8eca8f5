"""The HTTP application: key check and body limit in front, then the OpenAI and Anthropic routes, health and stats.

No route reads or writes a file: requests carry text, the engine answers with text. The model a route uses is
the one served at that moment: `engine serve` always has one, the desktop app none while no model is loaded
(every route then answers 503).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from engine.errors import CheckpointError
from engine.runtime.prompt import chat_prompt
from engine.server import anthropic_api, openai_api
from engine.server.fields import BadRequest
from engine.server.http import ServerContext, error_response, json_body
from engine.server.worker import QueueFull, Stopped

DEFAULT_MAX_BODY_BYTES = 16 * 2**20  # an agent's 60K-token conversation with its tools is well under 1 MiB
NO_MODEL_MESSAGE = "no model is loaded: open one in MoE Desk (its Models page), then send the request again"


class NoModel(Exception):
    """The server is up but holds no model to answer with."""


class Guard:
    """ASGI middleware: refuses requests without the key (when one is set) and bodies over the limit, before
    any route runs; the key itself is never logged or echoed."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key is not None and not self._authorized(headers):
            response = error_response(
                path,
                401,
                "missing or wrong API key: send it as 'Authorization: Bearer KEY' "
                "or 'x-api-key: KEY' (the key given to engine serve --api-key)",
            )
            return await response(scope, receive, send)
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await self._too_large(path, scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return await self._too_large(path, scope, receive, send)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # afterwards: the client's disconnect

        await self.app(scope, replay, send)

    def _authorized(self, headers: dict[str, str]) -> bool:
        given = headers.get("x-api-key")
        bearer = headers.get("authorization", "")
        if given is None and bearer[:7].lower() == "bearer ":
            given = bearer[7:].strip()
        return given is not None and hmac.compare_digest(given.encode(), self.api_key.encode())

    async def _too_large(self, path, scope, receive, send):
        response = error_response(
            path,
            413,
            f"the request body is larger than {self.max_body_bytes:,} bytes, the "
            f"server's limit; send a shorter conversation",
            kind="request_too_large",
        )
        await response(scope, receive, send)


def create_app(
    current: Callable[[], ServerContext | None],
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The FastAPI application serving the engine that `current()` returns at each request (None: no model)."""
    app = FastAPI(title="MoE Desk engine", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)

    def served() -> ServerContext:
        context = current()
        if context is None:
            raise NoModel()
        return context

    @app.exception_handler(NoModel)
    async def no_model(request: Request, exc: NoModel):
        return error_response(request.url.path, 503, NO_MODEL_MESSAGE)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest):
        return error_response(request.url.path, exc.status, exc.message, exc.param)

    @app.exception_handler(CheckpointError)
    async def template_refused(request: Request, exc: CheckpointError):
        return error_response(
            request.url.path, 400, f"the model's chat template cannot render these messages: {exc}", "messages"
        )

    @app.exception_handler(Stopped)
    async def stopped(request: Request, exc: Stopped):
        return error_response(request.url.path, 503, str(exc))

    @app.exception_handler(QueueFull)
    async def queue_full(request: Request, exc: QueueFull):
        return error_response(request.url.path, 429, str(exc))

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        return error_response(
            request.url.path,
            404,
            f"no such endpoint: {request.method} {request.url.path} (see the README's API section for the endpoints)",
        )

    @app.exception_handler(405)
    async def wrong_method(request: Request, exc):
        return error_response(
            request.url.path, 405, f"{request.method} is not served at {request.url.path}", kind="invalid_request_error"
        )

    @app.get("/health")
    async def health():
        context = served()
        w = context.worker
        return {"status": "ok", "model": context.model_name, "busy": w.busy, "queued": w.queued}

    @app.get("/v1/stats")
    async def stats():
        context = served()
        w = context.worker
        cache = w.prefix_cache
        return {
            "model": context.model_name,
            "requests_served": w.requests_served,
            "requests_refused": w.requests_refused,
            "queued": w.queued,
            "busy": w.busy,
            "last_request": vars(w.last),
            "prefix_cache": {
                "entries": len(cache) if cache else 0,
                "bytes": cache.nbytes if cache else 0,
                "max_bytes": cache.max_bytes if cache else 0,
            },
        }

    @app.get("/v1/models")
    async def models():
        context = served()
        return {
            "object": "list",
            "data": [{"id": context.model_name, "object": "model", "created": context.started, "owned_by": "moedesk"}],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await openai_api.chat_completions(request, await json_body(request), served())

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await openai_api.completions(request, await json_body(request), served())

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await anthropic_api.messages(request, await json_body(request), served())

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        context, body = served(), await json_body(request)
        chat = anthropic_api.read_chat(body, require_max_tokens=False)
        prompt = await run_in_threadpool(
            lambda: chat_prompt(
                context.tokenizer, chat.messages, tools=chat.tools, enable_thinking=chat.enable_thinking
            )
        )
        return {"input_tokens": len(prompt.ids)}

    return app
