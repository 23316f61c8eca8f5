"""A model folder's tokenizer and chat template, and a detokeniser that streams text as tokens arrive.

The tokenizer is the folder's tokenizer.json (run by the `tokenizers` library); the chat template is
chat_template.jinja or the one in tokenizer_config.json, rendered in a sandbox set up the way Hugging Face
renders it, so a model sees the prompt it was trained on.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from engine.errors import CheckpointError
from engine.runtime.sampling import SamplingParams

REFETCH = "the download may be incomplete; fetch the model's tokenizer files again"
REPLACE_TEMPLATE = "replace chat_template.jinja with the one from the model's original repository"
REPLACEMENT_CHARACTER = "\ufffd"


class _TemplateRejected(jinja2.TemplateError):
    """A template's own raise_exception(): the template refuses the conversation on purpose."""


def _raise_exception(message: str):
    raise _TemplateRejected(message)


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, > and & for HTML, which would change the prompt the model sees.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    """The Jinja setup chat templates are written for: sandboxed, block tags trimmed, HF's helpers."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENVIRONMENT = _environment()


def _read_json(path: Path) -> dict:
    """The JSON object in path, or {} when there is no such file."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(path, f"is not valid JSON ({exc})", REFETCH) from None
    if not isinstance(data, dict):
        raise CheckpointError(path, "does not hold a JSON object", REFETCH)
    return data


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with its content."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_source(folder: Path, config: dict) -> tuple[str | None, Path]:
    """The chat template's text (None if the folder has none) and the file it comes from."""
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():  # newer exports keep the template in its own file, which wins
        try:
            return jinja_path.read_text(encoding="utf-8"), jinja_path
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(jinja_path, f"cannot be read ({exc})", REFETCH) from None
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates; the chat one is called "default"
        template = next((t.get("template") for t in template
                         if isinstance(t, dict) and t.get("name") == "default"), None)
    return (template if isinstance(template, str) else None), folder / "tokenizer_config.json"


def _eos_ids(generation: dict, generation_path: Path, eos_id: int | None) -> frozenset[int]:
    """generation_config.json's eos_token_id (one id or a list) plus the id of tokenizer_config's eos_token."""
    value = generation.get("eos_token_id")
    ids = [] if value is None else [value] if isinstance(value, int) else value
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CheckpointError(generation_path, f"has an eos_token_id that is not a token id or a list of them: "
                                               f"{value!r}", REFETCH)
    return frozenset(ids) | ({eos_id} if eos_id is not None else set())


class ChatTokenizer:
    """Text to token ids and back, and conversations to prompt text, as the model folder defines them."""

    def __init__(self, tokenizer: Tokenizer, special_tokens: dict[str, str], template: jinja2.Template | None,
                 template_path: Path, eos_token_ids: frozenset[int], generation_defaults: dict):
        self._tokenizer = tokenizer
        self._special_tokens = special_tokens  # bos_token / eos_token text, for the template
        self._template = template
        self._template_path = template_path
        self.eos_token_ids = eos_token_ids
        self.generation_defaults = generation_defaults
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.think_start = "<think>" if self.token_id("<think>") is not None else None
        self.think_end = "</think>" if self.token_id("</think>") is not None else None

    @classmethod
    def from_folder(cls, folder: Path) -> ChatTokenizer:
        """Read tokenizer.json, tokenizer_config.json, chat_template.jinja and generation_config.json."""
        folder = Path(folder)
        tokenizer_path = folder / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise CheckpointError(folder, "has no tokenizer.json",
                                  "download the model's tokenizer files (tokenizer.json, tokenizer_config.json) "
                                  "into the folder along with the weights")
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # the tokenizers library raises a bare Exception for every kind of bad file
            raise CheckpointError(tokenizer_path, f"cannot be read as a tokenizer ({exc})", REFETCH) from None
        config = _read_json(folder / "tokenizer_config.json")
        special_tokens = {name: text for name in ("bos_token", "eos_token")
                          if (text := _token_text(config.get(name))) is not None}
        eos_text = special_tokens.get("eos_token")
        generation_path = folder / "generation_config.json"
        generation = _read_json(generation_path)
        eos_ids = _eos_ids(generation, generation_path, tokenizer.token_to_id(eos_text) if eos_text else None)
        try:  # checked once here, so every session that starts from these defaults can use them
            SamplingParams.from_generation_config(generation).validate()
        except ValueError as exc:
            raise CheckpointError(generation_path, f"has an unusable sampling setting: {exc}",
                                  "fix or delete that value in generation_config.json, or download the file "
                                  "again") from None
        source, template_path = _template_source(folder, config)
        template = None
        if source is not None:
            try:
                template = _ENVIRONMENT.from_string(source)
            except jinja2.TemplateSyntaxError as exc:
                raise CheckpointError(template_path, f"has a chat template that does not parse: {exc.message} "
                                                     f"(template line {exc.lineno})", REPLACE_TEMPLATE) from None
        return cls(tokenizer, special_tokens, template, template_path, eos_ids, generation)

    def encode(self, text: str) -> list[int]:
        """Token ids of text; special tokens written in it (<|im_start|>) become their ids. No BOS is added."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, text: str) -> int | None:
        """The id of a single token, or None when text is not one token of the vocabulary."""
        return self._tokenizer.token_to_id(text)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, enable_thinking: bool = True,
               tools: list[dict] | None = None) -> str:
        """The prompt text for a conversation of {"role", "content"} messages, by the model's chat template."""
        if self._template is None:
            raise CheckpointError(self._template_path.parent, "has no chat template",
                                  "add the model's chat_template.jinja (or a tokenizer_config.json with a "
                                  "chat_template) to the folder")
        context = dict(self._special_tokens, messages=messages, tools=tools,
                       add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking)
        try:
            return self._template.render(**context)
        except _TemplateRejected as exc:
            raise CheckpointError(self._template_path, f"the chat template rejects this conversation: {exc.message}",
                                  "check the order and roles of the messages") from None
        except Exception as exc:  # the template is foreign code; whatever fails inside it is the template's fault
            raise CheckpointError(self._template_path, f"the chat template fails to render "
                                                       f"({type(exc).__name__}: {exc})", REPLACE_TEMPLATE) from None


class IncrementalDetokenizer:
    """Text of a reply as its tokens arrive, never splitting a character whose bytes span several tokens.

    Byte-level BPE tokens can hold part of a UTF-8 character; decoding such a prefix ends in U+FFFD. So each
    token decodes a short window, the tokens of the last emitted piece (context for decoders that treat the
    start of a decode specially) plus the tokens still held, and new text is released only once the window's
    text no longer ends in U+FFFD. Work per token is bounded by the window, not the reply's length.
    """

    def __init__(self, tokenizer: ChatTokenizer, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window: list[int] = []
        self._read = 0  # window[:read] is the piece emitted last; window[read:] is held back

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def feed(self, token_id: int) -> str:
        """The text that token_id completes; "" while it ends inside a character."""
        self._window.append(token_id)
        text = self._decode(self._window)
        if text.endswith(REPLACEMENT_CHARACTER):
            return ""
        emitted = self._decode(self._window[:self._read])
        self._window = self._window[self._read:]
        self._read = len(self._window)
        return text[len(emitted):]

    def flush(self) -> str:
        """Whatever is still held at the end of the reply (an incomplete character decodes to U+FFFD)."""
        text = self._decode(self._window)
        emitted = self._decode(self._window[:self._read])
        self._window, self._read = [], 0
        return text[len(emitted):]
