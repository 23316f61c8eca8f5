"""Tool calls in a model's streamed answer, read in the format its chat template renders them.

Qwen3.5/3.6 templates write a call as XML-like markup, each parameter's value as plain text ("qwen_xml"):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Qwen3 templates write it as one JSON object ("qwen_json"):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`ToolCallParser` takes the answer as it streams, split anywhere (even inside a tag), and returns events: text to
pass on, and each call's start, its arguments as JSON text while they arrive, and its end. The model's text is
data: a call that cannot be read is handed back as text with a warning, never raised. `<tool_call>` is a special
token of these tokenizers, so the answer must be decoded with special tokens kept.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from engine.runtime.stop import partial_match_start
from engine.runtime.tool_arguments import convert_value, declared_types, json_text, json_value, parameter_schemas

STYLES = ("qwen_xml", "qwen_json")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"

# The markup each template writes for an assistant's tool call, as it appears in the template's source
_XML_TEMPLATE = re.compile(r"<tool_call>.*?<function=.*?<parameter=", re.DOTALL)
_JSON_TEMPLATE = re.compile(r'<tool_call>(?:\\n|\n)\{\\?"name\\?":')
# The start of a qwen_json call up to its arguments' value: enough to announce the call and stream the rest
_JSON_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:')


@dataclass(frozen=True)
class TextDelta:
    """Ordinary answer text, to pass on as it is."""

    text: str


@dataclass(frozen=True)
class ToolCallStarted:
    """A tool call's name is known; its arguments follow as ToolCallArgumentsDelta events."""

    index: int  # 0, 1, ... in the order the answer's calls start
    call_id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgumentsDelta:
    """More of a call's arguments as JSON text; a call's deltas joined are the JSON of its arguments object."""

    index: int
    delta: str


@dataclass(frozen=True)
class ToolCallFinished:
    """A call read whole: its arguments are the object its deltas spelled."""

    index: int
    call_id: str
    name: str
    arguments: dict


@dataclass(frozen=True)
class ToolCallWarning:
    """A call that could not be read; its raw text follows as a TextDelta. `index` is set when a
    ToolCallStarted already announced the call, which then never finishes."""

    message: str
    raw_text: str
    index: int | None = None


def call_opening(style: str, name: str) -> str:
    """The text that follows <tool_call> in a call of `name` in `style`, up to its arguments."""
    if style not in STYLES:
        raise ValueError(f"unknown tool-call style {style!r}; use one of {', '.join(STYLES)}")
    if style == "qwen_xml":
        return f"\n{FUNCTION_OPEN}{name}>\n"
    return f'\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


def tool_call_style(template_source: str | None) -> str | None:
    """Name the tool-call format a chat template renders ("qwen_xml" or "qwen_json"), or None for another."""
    if not template_source:
        return None
    if _XML_TEMPLATE.search(template_source):
        return "qwen_xml"
    if _JSON_TEMPLATE.search(template_source):
        return "qwen_json"
    return None


class _MalformedCall(Exception):
    """A tool call's text does not read as a call; the message says what is wrong with it."""


class _CallBody:
    """Reads the text between <tool_call> and </tool_call> as it arrives, into a call's events."""

    def __init__(self, new_call: Callable[[], tuple[int, str]]):
        self._new_call = new_call  # hands out the next index and a fresh call id
        self.started: ToolCallStarted | None = None

    def feed(self, text: str) -> list:
        """Events for the next piece of the call's text."""
        raise NotImplementedError

    def close(self) -> list:
        """The call's last events once </tool_call> arrived; raises _MalformedCall when it does not read."""
        raise NotImplementedError

    def _start(self, name: str) -> ToolCallStarted:
        index, call_id = self._new_call()
        self.started = ToolCallStarted(index, call_id, name)
        return self.started

    def _delta(self, text: str) -> ToolCallArgumentsDelta:
        return ToolCallArgumentsDelta(self.started.index, text)

    def _finished(self, arguments: dict) -> ToolCallFinished:
        return ToolCallFinished(self.started.index, self.started.call_id, self.started.name, arguments)


class _XmlCallBody(_CallBody):
    """A qwen_xml call: <function=NAME>, then <parameter=KEY>\\nVALUE\\n</parameter> blocks, then </function>.

    A value is a string unless the tool's schema declares another type; string values stream as they arrive,
    others are converted once their </parameter> is read."""

    def __init__(self, new_call: Callable[[], tuple[int, str]], schemas: dict[str, dict[str, dict]]):
        super().__init__(new_call)
        self._schemas = schemas
        self._pending = ""  # text not yet read
        self._state = "function"  # function -> parameters <-> value -> done
        self._error: str | None = None
        self._misplaced: tuple[str, ...] = ()  # the tags expected where the text went wrong
        self._arguments: dict = {}
        self._key = ""  # the parameter being read, or the last one read
        self._types: list[str] = []
        self._value: list[str] = []
        self._value_begun = False  # the newline the template writes after <parameter=KEY> is behind us

    def feed(self, text: str) -> list:
        self._pending += text
        events: list = []
        while self._error is None and self._step(events):
            pass
        return events

    def close(self) -> list:
        if self._error is None and self._state != "done":
            self._error = {
                "function": f"it has no {FUNCTION_OPEN}NAME> tag",
                "parameters": f"{FUNCTION_CLOSE} is missing",
                "value": f"parameter {self._key!r} is not closed by {PARAMETER_CLOSE}",
            }[self._state]
        if self._misplaced:
            self._error = f"{self._pending[:20]!r} stands where {' or '.join(self._misplaced)} should"
        if self._error is not None:
            raise _MalformedCall(self._error)
        return [self._finished(self._arguments)]

    def _step(self, events: list) -> bool:
        """Read what the pending text allows in the current state; whether to go on reading."""
        if self._state == "value":
            return self._read_value(events)
        text = self._pending.lstrip()
        self._pending = text
        if not text:
            return False
        if self._state == "function":
            return self._read_tag(text, FUNCTION_OPEN, (FUNCTION_OPEN,), events)
        if self._state == "parameters":
            if text.startswith(FUNCTION_CLOSE):
                self._pending = text[len(FUNCTION_CLOSE) :]
                self._state = "done"
                events.append(self._delta("}" if self._key else "{}"))
                return True
            return self._read_tag(text, PARAMETER_OPEN, (PARAMETER_OPEN, FUNCTION_CLOSE), events)
        self._error = f"text follows {FUNCTION_CLOSE}"
        return False

    def _read_tag(self, text: str, tag: str, expected: tuple[str, ...], events: list) -> bool:
        """Read `tag`NAME> at the start of text (function or parameter); whether one was read."""
        if not text.startswith(tag):
            if not any(e.startswith(text) for e in expected):
                self._misplaced = expected
                self._error = "misplaced text"  # worded at close(), where all of the call's text is known
            return False
        end = text.find(">")
        if end < 0:
            return False
        name = text[len(tag) : end].strip()
        if not name or "\n" in name or "<" in name:
            self._error = f"{text[: end + 1]!r} does not name a {'function' if tag == FUNCTION_OPEN else 'parameter'}"
            return False
        self._pending = text[end + 1 :]
        if tag == FUNCTION_OPEN:
            events.append(self._start(name))
            self._state = "parameters"
        else:
            self._begin_parameter(name, events)
        return True

    def _begin_parameter(self, key: str, events: list) -> None:
        self._types = declared_types(self._schemas.get(self.started.name, {}).get(key))
        opening = (", " if self._key else "{") + json_text(key) + ": "  # _key: the previous parameter's, if any
        self._key, self._value, self._value_begun = key, [], False
        self._state = "value"
        events.append(self._delta(opening + ('"' if self._streams() else "")))

    def _streams(self) -> bool:
        """Whether the current value is a string, sent as its text arrives."""
        return not self._types or self._types == ["string"]

    def _read_value(self, events: list) -> bool:
        """Read the current parameter's value up to its </parameter>; whether that tag was reached."""
        if not self._value_begun:
            if not self._pending:
                return False
            if self._pending.startswith("\n"):
                self._pending = self._pending[1:]
            self._value_begun = True
        end = self._pending.find(PARAMETER_CLOSE)
        if end < 0:  # the template writes "\n</parameter>": that newline belongs to the tag, not the value
            safe = partial_match_start(self._pending, ("\n" + PARAMETER_CLOSE, PARAMETER_CLOSE))
            self._add_value(self._pending[:safe], events)
            self._pending = self._pending[safe:]
            return False
        piece = self._pending[:end]
        self._add_value(piece[:-1] if piece.endswith("\n") else piece, events)
        self._pending = self._pending[end + len(PARAMETER_CLOSE) :]
        value = "".join(self._value)
        if self._streams():
            events.append(self._delta('"'))
        else:
            value = convert_value(value, self._types)
            events.append(self._delta(json_text(value)))
        self._arguments[self._key] = value
        self._state = "parameters"
        return True

    def _add_value(self, piece: str, events: list) -> None:
        if not piece:
            return
        self._value.append(piece)
        if self._streams():  # JSON escapes character by character, so escaped pieces join to the escaped whole
            events.append(self._delta(json_text(piece)[1:-1]))


class _JsonCallBody(_CallBody):
    """A qwen_json call: {"name": NAME, "arguments": {...}}. An arguments object that follows the name streams
    as the model writes it; any other layout is read whole at </tool_call>."""

    def __init__(self, new_call: Callable[[], tuple[int, str]]):
        super().__init__(new_call)
        self._text = ""  # the call's text so far
        self._state = "header"  # header -> arguments -> rest, or whole when it is not streamed
        self._scanned = 0  # where the arguments scan goes on from
        self._arguments_text = ""
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> list:
        self._text += text
        events: list = []
        if self._state == "header":
            header = _JSON_HEADER.match(self._text)
            if header is None:
                return events
            name = json_value(header.group(1))
            if not isinstance(name, str) or not name:  # close() says what is wrong with it
                self._state = "whole"
                return events
            events.append(self._start(name))
            self._state, self._scanned = "arguments", header.end()
        if self._state == "arguments":
            piece = self._scan_arguments()
            if piece:
                self._arguments_text += piece
                events.append(self._delta(piece))
        return events

    def _scan_arguments(self) -> str:
        """Follow the arguments object's braces and strings through the new text; the part of it that is new."""
        begin = self._scanned
        for position in range(self._scanned, len(self._text)):
            char = self._text[position]
            if self._depth == 0:  # before the object opens
                if char.isspace():
                    begin = position + 1
                    continue
                if char != "{":
                    self._state = "whole"
                    return ""
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._state, self._scanned = "rest", position + 1
                    return self._text[begin : position + 1]
        self._scanned = len(self._text)
        return self._text[begin:]

    def close(self) -> list:
        try:
            call = json.loads(self._text)
        except json.JSONDecodeError as exc:
            raise _MalformedCall(f"its JSON does not parse ({exc.msg} at character {exc.pos})") from None
        except RecursionError:
            raise _MalformedCall("its JSON nests too deeply to read") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            raise _MalformedCall('it is not a JSON object with a "name" string')
        if self._state == "rest":  # what was streamed is what the call holds
            return [self._finished(json.loads(self._arguments_text))]
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments object as a JSON string
            arguments = json_value(arguments, arguments)
        if not isinstance(arguments, dict):
            raise _MalformedCall("its arguments are not a JSON object")
        events = [] if self.started else [self._start(call["name"])]
        return events + [self._delta(json_text(arguments)), self._finished(arguments)]


class ToolCallParser:
    """Splits a streamed answer into its text and its tool calls, in one template's tool-call style.

    Text that may begin a call (a tail that could be the start of <tool_call>) is held back until it is decided;
    so is whitespace before a call, which only separates it and is dropped, as is whitespace right after one. A
    call runs to the first </tool_call>; one that does not read, or that the answer ends inside, is handed back
    as text (with the whitespace before it) after a ToolCallWarning. `tools` (OpenAI-style specs) give qwen_xml
    values their declared types; `seed` makes the call ids repeatable.
    """

    def __init__(self, style: str, tools: list | None = None, seed: int | None = None):
        if style not in STYLES:
            raise ValueError(f"unknown tool-call style {style!r}; use one of {', '.join(STYLES)}")
        self.style = style
        self._schemas = parameter_schemas(tools)
        self._random = random.Random(seed) if seed is not None else random.SystemRandom()
        self._call_ids: set[str] = set()
        self._next_index = 0
        self._pending = ""  # undecided text: outside a call a tail that may open one, inside one that may close it
        self._call: _CallBody | None = None
        self._raw = ""  # the open call's text so far, handed back if it does not read
        self._separator = ""  # the whitespace held back before the open call, handed back with it
        self._after_call = False  # the answer so far ends with a call, so whitespace here only separates

    def feed(self, text: str) -> list:
        """Events for the next piece of streamed answer text."""
        self._pending += text
        events: list = []
        while self._read_text(events) if self._call is None else self._read_call(events):
            pass
        return events

    def finish(self) -> list:
        """Events for the end of the answer: the held-back text, or the open call handed back as text."""
        events: list = []
        if self._call is not None:
            self._abandon("the answer ended inside it, before </tool_call>", self._raw + self._pending, events)
        else:
            self._add_text(self._pending, events)
        self._pending, self._call, self._raw, self._separator, self._after_call = "", None, "", "", False
        return events

    def _read_text(self, events: list) -> bool:
        """Pass on the text before the next <tool_call> and open that call; whether one was opened."""
        start = self._pending.find(CALL_OPEN)
        if start < 0:
            held = partial_match_start(self._pending, (CALL_OPEN,))
            held = len(self._pending[:held].rstrip())
            self._add_text(self._pending[:held], events)
            self._pending = self._pending[held:]
            return False
        before = self._pending[:start]
        self._add_text(before.rstrip(), events)
        self._separator = before[len(before.rstrip()) :]
        self._pending = self._pending[start + len(CALL_OPEN) :]
        self._raw = CALL_OPEN
        self._call = (
            _XmlCallBody(self._new_call, self._schemas) if self.style == "qwen_xml" else _JsonCallBody(self._new_call)
        )
        return True

    def _read_call(self, events: list) -> bool:
        """Give the open call its text up to </tool_call> and close it there; whether it was closed."""
        end = self._pending.find(CALL_CLOSE)
        inside = self._pending[:end] if end >= 0 else self._pending[: partial_match_start(self._pending, (CALL_CLOSE,))]
        self._raw += inside
        events += self._call.feed(inside)
        self._pending = self._pending[len(inside) :]
        if end < 0:
            return False
        self._pending = self._pending[len(CALL_CLOSE) :]
        self._raw += CALL_CLOSE
        try:
            events += self._call.close()
        except _MalformedCall as exc:
            self._abandon(str(exc), self._raw, events)
        else:
            self._after_call = True
        self._call, self._raw = None, ""
        return True

    def _abandon(self, reason: str, raw: str, events: list) -> None:
        """Hand the open call back as text, after a warning that says why."""
        if self._separator:  # it separated nothing, so it is text after all
            events.append(TextDelta(self._separator))
        index = self._call.started.index if self._call.started else None
        name = f" to {self._call.started.name!r}" if self._call.started else ""
        events.append(
            ToolCallWarning(
                f"the model's tool call{name} could not be read: {reason}; it is passed on as text", raw, index
            )
        )
        events.append(TextDelta(raw))
        self._after_call = False

    def _add_text(self, text: str, events: list) -> None:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        if text:
            events.append(TextDelta(text))

    def _new_call(self) -> tuple[int, str]:
        """The next call's index and an id no earlier call of this answer has."""
        call_id = f"call_{self._random.getrandbits(96):024x}"
        while call_id in self._call_ids:
            call_id = f"call_{self._random.getrandbits(96):024x}"
        self._call_ids.add(call_id)
        self._next_index += 1
        return self._next_index - 1, call_id
