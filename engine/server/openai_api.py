"""OpenAI's chat completions and completions, as vLLM and SGLang serve them (`reasoning_content` apart)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from engine.runtime.events import AnswerDelta, ReasoningDelta, TurnFinished
from engine.runtime.sampling import SamplingParams
from engine.runtime.prompt import chat_prompt, text_prompt
from engine.runtime.tool_calls import ToolCallArgumentsDelta, ToolCallFinished, ToolCallStarted
from engine.server import fields
from engine.server.fields import BadRequest, get
from engine.server.http import drain, error_response, prepare, unix_now
from engine.server.replies import (
    EngineFailed,
    Reply,
    RequiredCall,
    check_required_call,
    reply_events,
    required_call_ids,
    tool_parser,
)

_THINKING_EFFORTS = {"none": False, "minimal": False, "low": True, "medium": True, "high": True, "xhigh": True}


@dataclass
class Chat:
    """A chat request in the engine's terms."""

    messages: list[dict]
    tools: list[dict] | None
    required_call: RequiredCall | None
    enable_thinking: bool
    sampling: SamplingParams
    stream: bool
    include_usage: bool


def _arguments(value, where: str) -> dict:
    """A tool call's arguments: OpenAI sends a JSON string of an object; the template needs the object."""
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise BadRequest(f"'{where}' must be a JSON string of an object", where)
    try:
        parsed = json.loads(value) if value.strip() else {}
    except json.JSONDecodeError as exc:
        raise BadRequest(f"'{where}' is not valid JSON ({exc})", where) from None
    if not isinstance(parsed, dict):
        raise BadRequest(f"'{where}' must be a JSON object", where)
    return parsed


def read_messages(body: dict) -> list[dict]:
    """`messages` as the chat template takes them; BadRequest naming the first bad field."""
    raw = get(body, "messages", list, required=True)
    if not raw:
        raise BadRequest("'messages' must hold at least one message", "messages")
    messages = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(f"'{where}' must be an object", where)
        role = get(message, "role", str, where=f"{where}.", required=True)
        text = fields.check_text(fields.text_of(message.get("content"), f"{where}.content"), f"{where}.content")
        if role in ("system", "developer"):
            messages.append({"role": "system", "content": text})
        elif role == "user":
            messages.append({"role": "user", "content": text})
        elif role == "tool":
            messages.append(
                {
                    "role": "tool",
                    "content": text,
                    "tool_call_id": get(message, "tool_call_id", str, "", where=f"{where}."),
                }
            )
        elif role == "assistant":
            entry = {"role": "assistant", "content": text}
            reasoning = message.get("reasoning_content", message.get("reasoning"))
            if reasoning is not None:
                entry["reasoning_content"] = fields.check_text(
                    fields.text_of(reasoning, f"{where}.reasoning_content"), f"{where}.reasoning_content"
                )
            calls = get(message, "tool_calls", list, [], where=f"{where}.")
            if calls:
                entry["tool_calls"] = [_tool_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(calls)]
            messages.append(entry)
        else:
            raise BadRequest(
                f"'{where}.role' must be system, developer, user, assistant or tool, got {role!r}", f"{where}.role"
            )
    return messages


def _tool_call(call, where: str) -> dict:
    if not isinstance(call, dict):
        raise BadRequest(f"'{where}' must be an object", where)
    function = get(call, "function", dict, where=f"{where}.", required=True)
    name = get(function, "name", str, where=f"{where}.function.", required=True)
    return {
        "type": "function",
        "id": get(call, "id", str, "", where=f"{where}."),
        "function": {
            "name": name,
            "arguments": _arguments(function.get("arguments", "{}"), f"{where}.function.arguments"),
        },
    }


def read_tools(body: dict) -> list[dict] | None:
    """`tools` (function specs) unless tool_choice is "none"."""
    tools = get(body, "tools", list, [])
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise BadRequest(f'\'{where}\' must be a function tool: {{"type": "function", "function": {{...}}}}', where)
        function = get(tool, "function", dict, where=f"{where}.", required=True)
        get(function, "name", str, where=f"{where}.function.", required=True)
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("none", "auto", "required") and not isinstance(choice, dict):
        raise BadRequest("'tool_choice' must be none, auto, required or a function choice", "tool_choice")
    return tools or None if choice != "none" else None


def read_tool_choice(body: dict, tools: list[dict] | None) -> RequiredCall | None:
    """The call tool_choice requires: "required" (any of the tools) or {"type": "function", "function":
    {"name": ...}} (that one); None for auto and none."""
    choice = body.get("tool_choice")
    if choice in (None, "none", "auto"):
        return None
    name = None
    if choice != "required":
        function = get(choice, "function", dict, where="tool_choice.", required=True)
        name = get(function, "name", str, where="tool_choice.function.", required=True)
    return check_required_call(RequiredCall(name), tools, "tool_choice.function.name")


def read_thinking(body: dict) -> bool:
    """chat_template_kwargs.enable_thinking, else reasoning_effort (none/minimal: off), else on."""
    kwargs = get(body, "chat_template_kwargs", dict, {})
    enable = get(kwargs, "enable_thinking", bool, where="chat_template_kwargs.")
    if enable is not None:
        return enable
    effort = get(body, "reasoning_effort", str)
    if effort is None:
        return True
    if effort not in _THINKING_EFFORTS:
        raise BadRequest(
            f"'reasoning_effort' must be one of {', '.join(_THINKING_EFFORTS)}, got {effort!r}", "reasoning_effort"
        )
    return _THINKING_EFFORTS[effort]


def read_sampling(body: dict, context, default_max: int | None = None) -> SamplingParams:
    """The sampling settings of an OpenAI request (Anthropic's fields are a subset); `default_max` is the token
    limit when the request sets none (None: the model's default)."""
    if get(body, "n", int, 1) != 1:
        raise BadRequest("'n' must be 1: the engine answers one sequence at a time", "n")
    if get(body, "logprobs", (bool, int), False):
        raise BadRequest("'logprobs' is not supported by this server; leave it out", "logprobs")
    max_tokens = get(body, "max_completion_tokens", int, get(body, "max_tokens", int, default_max))
    stop = body.get("stop")
    limit_name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    return fields.sampling(
        context.defaults,
        {"max_new_tokens": limit_name},
        temperature=get(body, "temperature", float),
        top_p=get(body, "top_p", float),
        top_k=get(body, "top_k", int),
        min_p=get(body, "min_p", float),
        presence_penalty=get(body, "presence_penalty", float),
        frequency_penalty=get(body, "frequency_penalty", float),
        repetition_penalty=get(body, "repetition_penalty", float),
        max_new_tokens=max_tokens,
        seed=get(body, "seed", int),
        stop=fields.stops(stop, "stop") if stop is not None else None,
    )


def read_chat(body: dict, context) -> Chat:
    """A chat completion request's fields, checked."""
    response_format = get(body, "response_format", dict)
    if response_format is not None and response_format.get("type", "text") != "text":
        raise BadRequest(
            "'response_format' other than text is not supported (the engine does not constrain its "
            "output); describe the format in the prompt instead",
            "response_format",
        )
    options = get(body, "stream_options", dict, {})
    # no limit given: the reply may fill the context, as other OpenAI-compatible servers allow
    tools = read_tools(body)
    return Chat(
        read_messages(body),
        tools,
        read_tool_choice(body, tools),
        read_thinking(body),
        read_sampling(body, context, default_max=context.context_tokens),
        bool(get(body, "stream", bool, False)),
        bool(get(options, "include_usage", bool, False, where="stream_options.")),
    )


def usage(final: TurnFinished) -> dict:
    s = final.stats
    return {
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.new_tokens,
        "total_tokens": s.prompt_tokens + s.new_tokens,
        "prompt_tokens_details": {"cached_tokens": s.cached_tokens},
    }


def finish_reason(final: TurnFinished, tool_calls: bool) -> str:
    if tool_calls:
        return "tool_calls"
    return "length" if final.stats.stop_reason == "length" else "stop"


def _call(done: ToolCallFinished) -> dict:
    return {
        "id": done.call_id,
        "type": "function",
        "function": {"name": done.name, "arguments": json.dumps(done.arguments, ensure_ascii=False)},
    }


async def chat_completions(request: Request, body: dict, context):
    chat = read_chat(body, context)
    prompt = await prepare(
        context,
        lambda: chat_prompt(context.tokenizer, chat.messages, tools=chat.tools, enable_thinking=chat.enable_thinking),
    )
    parser = tool_parser(context.tokenizer.template_source, chat.tools, chat.sampling.seed)
    opening = required_call_ids(context.tokenizer, chat.required_call)
    job = context.worker.submit(
        lambda session: session.complete(
            prompt, sampling=chat.sampling, prefix_cache=context.worker.prefix_cache, answer_start=opening
        )
    )
    ident, created = f"chatcmpl-{uuid.uuid4().hex}", unix_now()
    reply = Reply()
    events = reply_events(job, parser, reply)
    if not chat.stream:
        try:
            await drain(request, job, events)
        except EngineFailed as exc:
            return _failure(request, exc)
        if reply.final is None:  # cancelled: the client has gone, nobody reads this
            return JSONResponse({}, status_code=499)
        message = {
            "role": "assistant",
            "content": "".join(reply.answer).strip() or None,
            "reasoning_content": reply.final.reasoning or None,
        }
        if reply.tool_calls:
            message["tool_calls"] = [_call(c) for c in reply.tool_calls]
        return {
            "id": ident,
            "object": "chat.completion",
            "created": created,
            "model": context.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": finish_reason(reply.final, bool(reply.tool_calls)),
                }
            ],
            "usage": usage(reply.final),
        }

    def chunk(delta: dict, finish: str | None = None) -> dict:
        return {
            "data": json.dumps(
                {
                    "id": ident,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": context.model_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                },
                ensure_ascii=False,
            )
        }

    async def stream():
        try:
            yield chunk({"role": "assistant", "content": ""})
            async for item in events:
                if isinstance(item, ReasoningDelta):
                    yield chunk({"reasoning_content": item.text})
                elif isinstance(item, AnswerDelta):
                    yield chunk({"content": item.text})
                elif isinstance(item, ToolCallStarted):
                    yield chunk(
                        {
                            "tool_calls": [
                                {
                                    "index": item.index,
                                    "id": item.call_id,
                                    "type": "function",
                                    "function": {"name": item.name, "arguments": ""},
                                }
                            ]
                        }
                    )
                elif isinstance(item, ToolCallArgumentsDelta):
                    yield chunk({"tool_calls": [{"index": item.index, "function": {"arguments": item.delta}}]})
                elif isinstance(item, TurnFinished):
                    yield chunk({}, finish_reason(item, bool(reply.tool_calls)))
                    if chat.include_usage:
                        yield {
                            "data": json.dumps(
                                {
                                    "id": ident,
                                    "object": "chat.completion.chunk",
                                    "created": created,
                                    "model": context.model_name,
                                    "choices": [],
                                    "usage": usage(item),
                                }
                            )
                        }
                    yield {"data": "[DONE]"}
        except EngineFailed as exc:
            yield {
                "data": json.dumps(
                    {"error": {"message": exc.message, "type": "api_error", "param": None, "code": None}}
                )
            }
        finally:
            job.cancel()  # the client left (or the reply ended, when this does nothing)

    return EventSourceResponse(stream(), ping=15)


async def completions(request: Request, body: dict, context):

    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("'prompt' must be a non-empty string (one prompt per request)", "prompt")
    fields.check_text(prompt, "prompt")
    if get(body, "echo", bool, False):
        raise BadRequest("'echo' is not supported by this server; leave it out", "echo")
    sampling = read_sampling(body, context, default_max=16)  # OpenAI's default for completions
    stream = bool(get(body, "stream", bool, False))
    include_usage = bool(
        get(get(body, "stream_options", dict, {}), "include_usage", bool, False, where="stream_options.")
    )
    tokens = await prepare(context, lambda: text_prompt(context.tokenizer, prompt))
    job = context.worker.submit(
        lambda session: session.complete(tokens, sampling=sampling, prefix_cache=context.worker.prefix_cache)
    )
    ident, created = f"cmpl-{uuid.uuid4().hex}", unix_now()
    reply = Reply()
    events = reply_events(job, None, reply)

    def body_of(text: str, finish: str | None, **extra) -> dict:
        return {
            "id": ident,
            "object": "text_completion",
            "created": created,
            "model": context.model_name,
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}],
            **extra,
        }

    if not stream:
        try:
            await drain(request, job, events)
        except EngineFailed as exc:
            return _failure(request, exc)
        if reply.final is None:
            return JSONResponse({}, status_code=499)
        return body_of(
            "".join(reply.reasoning + reply.answer), finish_reason(reply.final, False), usage=usage(reply.final)
        )

    async def chunks():
        try:
            async for item in events:
                if isinstance(item, (ReasoningDelta, AnswerDelta)):
                    yield {"data": json.dumps(body_of(item.text, None), ensure_ascii=False)}
                elif isinstance(item, TurnFinished):
                    yield {"data": json.dumps(body_of("", finish_reason(item, False)))}
                    if include_usage:
                        yield {"data": json.dumps(dict(body_of("", None), choices=[], usage=usage(item)))}
                    yield {"data": "[DONE]"}
        except EngineFailed as exc:
            yield {"data": json.dumps({"error": {"message": exc.message, "type": "api_error"}})}
        finally:
            job.cancel()

    return EventSourceResponse(chunks(), ping=15)


def _failure(request: Request, exc: EngineFailed):

    return error_response(request.url.path, exc.status, exc.message)
