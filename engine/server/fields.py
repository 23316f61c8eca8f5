"""Reading a request body's fields with 400s that name the field, shared by the OpenAI and Anthropic routes."""

from __future__ import annotations

import math
from dataclasses import replace

from engine.runtime.sampling import SamplingParams

_MISSING = object()


class BadRequest(Exception):
    """A request the API refuses: `param` names the field, the message says what is wrong and what to send."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def _kind_name(kinds: tuple[type, ...]) -> str:
    names = {
        str: "a string",
        bool: "true or false",
        int: "a whole number",
        float: "a number",
        list: "an array",
        dict: "an object",
    }
    return " or ".join(dict.fromkeys(names[k] for k in kinds))


def get(body: dict, name: str, kinds: type | tuple[type, ...], default=None, *, where: str = "", required=False):
    """body[name] when it has one of `kinds` (null counts as absent); BadRequest naming `where + name` otherwise."""
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        if required:
            raise BadRequest(f"'{where}{name}' is required", where + name)
        return default
    number = float in kinds and isinstance(value, int) and not isinstance(value, bool)
    if isinstance(value, bool) and bool not in kinds or not (isinstance(value, kinds) or number):
        raise BadRequest(f"'{where}{name}' must be {_kind_name(kinds)}, got {type(value).__name__}", where + name)
    if isinstance(value, float) and not math.isfinite(value):
        raise BadRequest(f"'{where}{name}' must be a finite number", where + name)
    return value


def text_of(content, where: str) -> str:
    """A message's text: a string, or a list of text parts ({"type": "text", "text": ...}) joined."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise BadRequest(f"'{where}' must be a string or a list of text parts", where)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadRequest(
                f"'{where}[{i}]' is a {kind!r} part; this model reads text only: send "
                f'{{"type": "text", "text": ...}} parts',
                f"{where}[{i}]",
            )
        texts.append(part["text"])
    return "".join(texts)


def check_text(text: str, where: str) -> str:
    """text, refused when it holds lone surrogates (text that cannot be UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"'{where}' is not valid Unicode text (a lone surrogate)", where) from None
    return text


def stops(value, where: str) -> tuple[str, ...]:
    """A stop string or a list of them."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise BadRequest(f"'{where}' must be a non-empty string or a list of them", where)
    return tuple(check_text(s, where) for s in items)


def sampling(defaults: SamplingParams, names: dict[str, str], **values) -> SamplingParams:
    """defaults with the request's values that are not None; BadRequest naming the first one out of range by
    its name in the request (`names` maps SamplingParams fields to request fields where they differ)."""
    chosen = {k: v for k, v in values.items() if v is not None}
    params = replace(defaults, **chosen)
    try:
        params.validate()
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        raise BadRequest(str(exc).replace(field, names.get(field, field), 1), names.get(field, field)) from None
    return params
