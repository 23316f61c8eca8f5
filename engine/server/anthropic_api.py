"""Anthropic's Messages API: system, tools as tool_use blocks, tool_result inputs, thinking blocks."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from engine.runtime.events import AnswerDelta, ReasoningDelta, TurnFinished
from engine.runtime.prompt import chat_prompt
from engine.runtime.tool_calls import ToolCallArgumentsDelta, ToolCallFinished, ToolCallStarted
from engine.server import fields
from engine.server.fields import BadRequest, get
from engine.server.http import drain, error_response, prepare
from engine.server.openai_api import read_sampling
from engine.server.replies import (
    EngineFailed,
    Reply,
    RequiredCall,
    ToolAbandoned,
    check_required_call,
    reply_events,
    required_call_ids,
    tool_parser,
)

_STOP_REASONS = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens"}


@dataclass
class Chat:
    messages: list[dict]
    tools: list[dict] | None
    required_call: RequiredCall | None
    enable_thinking: bool


def _blocks(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise BadRequest(f"'{where}' must be a string or a list of content blocks", where)
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise BadRequest(f"'{where}[{i}]' must be a content block with a type", f"{where}[{i}]")
    return content


def _text(block: dict, key: str, where: str) -> str:
    return fields.check_text(get(block, key, str, "", where=f"{where}."), f"{where}.{key}")


def _tool_result(block: dict, where: str) -> dict:
    content = block.get("content", "")
    if isinstance(content, list):  # text blocks only: the model reads text
        content = fields.text_of(content, f"{where}.content")
    elif not isinstance(content, str):
        raise BadRequest(f"'{where}.content' must be a string or a list of text blocks", f"{where}.content")
    if block.get("is_error"):
        content = f"Error: {content}"
    return {
        "role": "tool",
        "content": fields.check_text(content, f"{where}.content"),
        "tool_call_id": get(block, "tool_use_id", str, "", where=f"{where}."),
    }


def read_messages(body: dict) -> list[dict]:
    """system and messages as the chat template takes them."""
    messages = []
    system = body.get("system")
    if system is not None:
        text = fields.text_of(system, "system")
        if text:
            messages.append({"role": "system", "content": fields.check_text(text, "system")})
    raw = get(body, "messages", list, required=True)
    if not raw:
        raise BadRequest("'messages' must hold at least one message", "messages")
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(f"'{where}' must be an object", where)
        role = get(message, "role", str, where=f"{where}.", required=True)
        if role not in ("user", "assistant"):
            raise BadRequest(f"'{where}.role' must be user or assistant, got {role!r}", f"{where}.role")
        texts, thinking, calls, results = [], [], [], []
        for j, block in enumerate(_blocks(message.get("content"), f"{where}.content")):
            at, kind = f"{where}.content[{j}]", block["type"]
            if kind == "text":
                texts.append(_text(block, "text", at))
            elif kind == "thinking" and role == "assistant":
                thinking.append(_text(block, "thinking", at))
            elif kind == "redacted_thinking" and role == "assistant":
                continue  # another model's encrypted reasoning: nothing this one can read
            elif kind == "tool_use" and role == "assistant":
                calls.append(
                    {
                        "type": "function",
                        "id": get(block, "id", str, "", where=f"{at}."),
                        "function": {
                            "name": get(block, "name", str, where=f"{at}.", required=True),
                            "arguments": get(block, "input", dict, {}, where=f"{at}."),
                        },
                    }
                )
            elif kind == "tool_result" and role == "user":
                results.append(_tool_result(block, at))
            else:
                raise BadRequest(
                    f"'{at}' is a {kind!r} block, which a {role} message here cannot hold (this "
                    f"model reads text, and tool results in user messages)",
                    at,
                )
        if role == "user":
            messages += results
            if texts or not results:
                messages.append({"role": "user", "content": "".join(texts)})
        else:
            entry = {"role": "assistant", "content": "".join(texts)}
            if thinking:
                entry["reasoning_content"] = "".join(thinking)
            if calls:
                entry["tool_calls"] = calls
            messages.append(entry)
    return messages


def read_tools(body: dict) -> list[dict] | None:
    """Anthropic tools ({name, description, input_schema}) as function specs; none when tool_choice is none."""
    tools = []
    for i, tool in enumerate(get(body, "tools", list, [])):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise BadRequest(f"'{where}' must be an object", where)
        function = {
            "name": get(tool, "name", str, where=f"{where}.", required=True),
            "parameters": get(tool, "input_schema", dict, {"type": "object"}, where=f"{where}."),
        }
        if tool.get("description") is not None:
            function["description"] = get(tool, "description", str, where=f"{where}.")
        tools.append({"type": "function", "function": function})
    choice = get(body, "tool_choice", dict)
    if choice is not None and choice.get("type") not in ("auto", "any", "tool", "none"):
        raise BadRequest("'tool_choice.type' must be auto, any, tool or none", "tool_choice.type")
    return tools or None if not (choice and choice.get("type") == "none") else None


def read_tool_choice(body: dict, tools: list[dict] | None) -> RequiredCall | None:
    """The call tool_choice requires: {"type": "any"} (any of the tools) or {"type": "tool", "name": ...} (that
    one); None for auto and none."""
    choice = get(body, "tool_choice", dict)
    if choice is None or choice.get("type") in ("auto", "none"):
        return None
    name = get(choice, "name", str, where="tool_choice.", required=True) if choice["type"] == "tool" else None
    return check_required_call(RequiredCall(name), tools, "tool_choice.name")


def read_chat(body: dict, *, require_max_tokens: bool = True) -> Chat:
    if require_max_tokens:
        get(body, "max_tokens", int, required=True)
    thinking = get(body, "thinking", dict)
    if thinking is not None and thinking.get("type") not in ("enabled", "disabled", "adaptive"):
        raise BadRequest("'thinking.type' must be enabled, disabled or adaptive", "thinking.type")
    enable = thinking is None or thinking.get("type") != "disabled"  # absent: the model's own default, on
    tools = read_tools(body)
    return Chat(read_messages(body), tools, read_tool_choice(body, tools), enable)


def _usage(final: TurnFinished) -> dict:
    s = final.stats
    return {
        "input_tokens": s.prompt_tokens - s.cached_tokens,
        "output_tokens": s.new_tokens,
        "cache_read_input_tokens": s.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def _stop_reason(final: TurnFinished, tool_calls: bool) -> str:
    return "tool_use" if tool_calls else _STOP_REASONS.get(final.stats.stop_reason, "end_turn")


async def messages(request: Request, body: dict, context):
    chat = read_chat(body)
    stop = body.get("stop_sequences")
    sampling_body = {k: body.get(k) for k in ("max_tokens", "temperature", "top_p", "top_k")}
    sampling_body["stop"] = stop
    try:
        sampling = read_sampling(sampling_body, context)
    except BadRequest as exc:
        raise BadRequest(
            exc.message.replace("'stop'", "'stop_sequences'"), "stop_sequences" if exc.param == "stop" else exc.param
        ) from None
    stream = bool(get(body, "stream", bool, False))
    prompt = await prepare(
        context,
        lambda: chat_prompt(context.tokenizer, chat.messages, tools=chat.tools, enable_thinking=chat.enable_thinking),
    )
    parser = tool_parser(context.tokenizer.template_source, chat.tools, sampling.seed)
    opening = required_call_ids(context.tokenizer, chat.required_call)
    job = context.worker.submit(
        lambda session: session.complete(
            prompt, sampling=sampling, prefix_cache=context.worker.prefix_cache, answer_start=opening
        )
    )
    ident = f"msg_{uuid.uuid4().hex[:24]}"
    reply = Reply()
    events = reply_events(job, parser, reply)
    if not stream:
        try:
            await drain(request, job, events)
        except EngineFailed as exc:
            return error_response(request.url.path, exc.status, exc.message)
        if reply.final is None:
            return JSONResponse({}, status_code=499)
        content = []
        if reply.final.reasoning:
            content.append({"type": "thinking", "thinking": reply.final.reasoning, "signature": ""})
        if "".join(reply.answer).strip():
            content.append({"type": "text", "text": "".join(reply.answer).strip()})
        content += [
            {"type": "tool_use", "id": c.call_id, "name": c.name, "input": c.arguments} for c in reply.tool_calls
        ]
        return {
            "id": ident,
            "type": "message",
            "role": "assistant",
            "model": context.model_name,
            "content": content,
            "stop_reason": _stop_reason(reply.final, bool(reply.tool_calls)),
            "stop_sequence": None,
            "usage": _usage(reply.final),
        }

    def event(name: str, data: dict) -> dict:
        return {"event": name, "data": json.dumps(dict(type=name, **data), ensure_ascii=False)}

    async def stream_events():
        blocks = {"open": None, "index": -1}  # the block being written: ("thinking" | "text" | tool index)

        def close():
            if blocks["open"] is None:
                return []
            out = []
            if blocks["open"] == "thinking":
                out.append(
                    event(
                        "content_block_delta",
                        {"index": blocks["index"], "delta": {"type": "signature_delta", "signature": ""}},
                    )
                )
            out.append(event("content_block_stop", {"index": blocks["index"]}))
            blocks["open"] = None
            return out

        def open_block(kind, block: dict):
            out = close()
            blocks["open"], blocks["index"] = kind, blocks["index"] + 1
            return out + [event("content_block_start", {"index": blocks["index"], "content_block": block})]

        try:
            yield event(
                "message_start",
                {
                    "message": {
                        "id": ident,
                        "type": "message",
                        "role": "assistant",
                        "model": context.model_name,
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": {"input_tokens": len(prompt.ids), "output_tokens": 0},
                    }
                },
            )
            async for item in events:
                out = []
                if isinstance(item, ReasoningDelta):
                    if blocks["open"] != "thinking":
                        out += open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                    out.append(
                        event(
                            "content_block_delta",
                            {"index": blocks["index"], "delta": {"type": "thinking_delta", "thinking": item.text}},
                        )
                    )
                elif isinstance(item, AnswerDelta):
                    if blocks["open"] != "text":
                        out += open_block("text", {"type": "text", "text": ""})
                    out.append(
                        event(
                            "content_block_delta",
                            {"index": blocks["index"], "delta": {"type": "text_delta", "text": item.text}},
                        )
                    )
                elif isinstance(item, ToolCallStarted):
                    out += open_block(
                        ("tool", item.index), {"type": "tool_use", "id": item.call_id, "name": item.name, "input": {}}
                    )
                elif isinstance(item, ToolCallArgumentsDelta):
                    out.append(
                        event(
                            "content_block_delta",
                            {
                                "index": blocks["index"],
                                "delta": {"type": "input_json_delta", "partial_json": item.delta},
                            },
                        )
                    )
                elif isinstance(item, (ToolCallFinished, ToolAbandoned)):
                    out += close()
                elif isinstance(item, TurnFinished):
                    out += close()
                    out.append(
                        event(
                            "message_delta",
                            {
                                "delta": {
                                    "stop_reason": _stop_reason(item, bool(reply.tool_calls)),
                                    "stop_sequence": None,
                                },
                                "usage": _usage(item),
                            },
                        )
                    )
                    out.append(event("message_stop", {}))
                for piece in out:
                    yield piece
        except EngineFailed as exc:
            yield event("error", {"error": {"type": "api_error", "message": exc.message}})
        finally:
            job.cancel()

    return EventSourceResponse(stream_events(), ping=15)
