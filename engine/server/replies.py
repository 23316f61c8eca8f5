"""A reply's engine events as the APIs need them: reasoning, answer text and tool calls, then the end.

The answer text goes through the model's tool-call parser when the request offered tools, so `<tool_call>`
blocks leave as structured calls (arguments streamed as they arrive) and everything else as text.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.runtime import tool_calls as tc
from engine.runtime.events import AnswerDelta, ReasoningDelta, TurnFinished
from engine.server.fields import BadRequest
from engine.server.worker import STOPPED_MESSAGE

log = logging.getLogger("engine.server")


@dataclass(frozen=True)
class ToolAbandoned:
    """A started call that did not read: its text follows as answer text."""

    index: int


@dataclass
class Reply:
    """What a finished reply holds, for the non-streaming answers and the closing events."""

    reasoning: list[str] = field(default_factory=list)
    answer: list[str] = field(default_factory=list)
    tool_calls: list[tc.ToolCallFinished] = field(default_factory=list)
    final: TurnFinished | None = None


class EngineFailed(Exception):
    """The engine could not answer: `message` says why, `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.message, self.status = message, status


@dataclass(frozen=True)
class RequiredCall:
    """A tool call the request requires (tool_choice required/any, or a named tool): `name` None lets the model
    choose which of the request's tools."""

    name: str | None = None


def check_required_call(required: RequiredCall, tools: list[dict] | None, name_field: str) -> RequiredCall:
    """Return `required` once the request's tools can meet it; else raise BadRequest naming the field."""
    names = [tool["function"]["name"] for tool in tools or ()]
    if required.name is not None and required.name not in names:
        raise BadRequest(
            f"'{name_field}' is {required.name!r}, which is not one of the request's tools "
            f"({', '.join(map(repr, names)) or 'none'})",
            name_field,
        )
    if not names:
        raise BadRequest(
            "'tool_choice' requires a tool call but 'tools' is empty: send the tools, or tool_choice auto",
            "tool_choice",
        )
    return required


def required_call_ids(tokenizer, required: RequiredCall | None) -> tuple[int, ...]:
    """Token ids that open the required call in the template's call format, for ChatSession.complete's
    answer_start: <tool_call> alone when the model chooses the tool (it writes the rest as it was trained to),
    else up to the named tool's arguments, read as plain text (a tool's name is data); none when nothing is
    required."""
    if required is None:
        return ()
    style = tc.tool_call_style(tokenizer.template_source)
    if style is None or tokenizer.token_id(tc.CALL_OPEN) is None:
        raise BadRequest(
            "this model's chat template has no tool-call format, so a tool call cannot be required; "
            "send tool_choice auto or none",
            "tool_choice",
        )
    opening = tc.call_opening(style, required.name) if required.name is not None else ""
    return (tokenizer.token_id(tc.CALL_OPEN), *tokenizer.encode_text(opening))


def tool_parser(template_source: str | None, tools: list[dict] | None, seed: int | None):
    """The model's tool-call parser when the request has tools and the template a call format, else None."""
    if not tools or template_source is None:
        return None
    style = tc.tool_call_style(template_source)
    return tc.ToolCallParser(style, tools=tools, seed=seed) if style is not None else None


def _from_parser(parsed: list) -> list:
    out = []
    for event in parsed:
        if isinstance(event, tc.TextDelta):
            out.append(AnswerDelta(event.text))
        elif isinstance(event, (tc.ToolCallStarted, tc.ToolCallArgumentsDelta, tc.ToolCallFinished)):
            out.append(event)
        elif isinstance(event, tc.ToolCallWarning):  # the raw text follows as a TextDelta
            log.warning("%s", event.message)
            if event.index is not None:
                out.append(ToolAbandoned(event.index))
    return out


async def reply_events(job, parser, reply: Reply) -> AsyncIterator:
    """ReasoningDelta, AnswerDelta and the tool-call parser's ToolCallStarted/ArgumentsDelta/Finished events,
    filling `reply`; ends with the
    TurnFinished. Raises EngineFailed when the engine reports an error or its worker stopped (503), and ends
    early when its client cancelled it."""
    async for event in job.stream():
        if isinstance(event, Exception):
            log.error("request failed", exc_info=event)
            raise EngineFailed(f"the engine failed ({type(event).__name__}: {event}); the log has the details")
        if isinstance(event, TurnFinished):
            tail = _from_parser(parser.finish()) if parser is not None else []
            for item in tail:
                _keep(reply, item)
                yield item
            if event.stats.error:
                raise EngineFailed(event.stats.error)
            if job.dropped:
                raise EngineFailed(STOPPED_MESSAGE, 503)
            reply.final = event
            yield event
            return
        items = (
            _from_parser(parser.feed(event.text)) if parser is not None and isinstance(event, AnswerDelta) else [event]
        )
        for item in items:
            _keep(reply, item)
            yield item
    if job.dropped:
        raise EngineFailed(STOPPED_MESSAGE, 503)


def _keep(reply: Reply, item) -> None:
    if isinstance(item, ReasoningDelta):
        reply.reasoning.append(item.text)
    elif isinstance(item, AnswerDelta):
        reply.answer.append(item.text)
    elif isinstance(item, tc.ToolCallFinished):
        reply.tool_calls.append(item)
