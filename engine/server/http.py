"""What the routes share: the server's context, error shapes, the JSON body, the prompt check, and the
client-disconnect watch."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from engine.errors import CheckpointError
from engine.runtime.sampling import SamplingParams
from engine.runtime.prompt import Prompt
from engine.runtime.tokenizer import ChatTokenizer
from engine.server.fields import BadRequest
from engine.server.worker import EngineWorker

ANTHROPIC_PATHS = ("/v1/messages",)


@dataclass
class ServerContext:
    """What every route needs: the engine, the model's name and tokenizer, the default sampling settings."""

    worker: EngineWorker
    model_name: str
    tokenizer: ChatTokenizer
    defaults: SamplingParams
    context_tokens: int
    started: int  # Unix time, for /v1/models


def error_response(
    request_path: str, status: int, message: str, param: str | None = None, kind: str | None = None
) -> JSONResponse:
    """An error in the shape the path's API uses: Anthropic's on /v1/messages*, OpenAI's elsewhere."""
    kind = kind or {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
    }.get(status, "api_error")
    if request_path.startswith(ANTHROPIC_PATHS):
        return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status)
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


async def json_body(request: Request) -> dict:
    """The body as a JSON object, or BadRequest saying why not."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON ({exc}); send a JSON object") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


async def until_disconnect(request: Request, job) -> None:
    """Cancel `job` as soon as the client's connection closes (run as a task; cancelled when not needed)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


async def prepare(context: ServerContext, build) -> Prompt:
    """build() (a chat_prompt or text_prompt call) off the event loop; BadRequest when the template refuses the
    conversation or it does not fit the context."""
    try:
        prompt = await run_in_threadpool(build)
    except CheckpointError as exc:
        raise BadRequest(f"the model's chat template cannot render these messages: {exc}", "messages") from None
    if not prompt.ids:
        raise BadRequest("the prompt is empty: give it some text", "prompt")
    if len(prompt.ids) + 1 > context.context_tokens:
        raise BadRequest(
            f"the prompt is {len(prompt.ids)} tokens and the server's context holds "
            f"{context.context_tokens} with the reply: shorten the conversation (or restart the server "
            f"with a larger --context)",
            "messages",
        )
    return prompt


async def drain(request: Request, job, events) -> None:
    """Run `events` (a reply_events stream) to its end, cancelling the job if the client leaves meanwhile or the
    server shuts down (its task cancelled)."""
    watcher = asyncio.create_task(until_disconnect(request, job))
    try:
        async for _ in events:
            pass
    finally:
        watcher.cancel()
        job.cancel()  # after the end this does nothing


def unix_now() -> int:
    return int(time.time())
