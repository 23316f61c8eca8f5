"""A model folder's tokenizer and chat template, and a detokeniser that streams text as tokens arrive.

The tokenizer is the folder's tokenizer.json (run by the `tokenizers` library); the chat template is
chat_template.jinja or the one in tokenizer_config.json, rendered in a sandbox set up the way Hugging Face
renders it, so a model sees the prompt it was trained on.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from engine.errors import CheckpointError
from engine.models.base import Interrupted
from engine.runtime.sampling import SamplingParams

REFETCH = "the download may be incomplete; fetch the model's tokenizer files again"
REPLACE_TEMPLATE = "replace chat_template.jinja with the one from the model's original repository"
REPLACEMENT_CHARACTER = "\ufffd"
# Marks where a message's text goes when the template is rendered to find its own markup (private-use characters)
_PLACEHOLDER = re.compile("\ue000(\\d+)\ue001")


RENDER_SECONDS = 5.0  # a real chat template renders in milliseconds; one still running is one that never ends
MAX_TEMPLATE_TEXT = 64 * 2**20  # characters (or items) one template operation may build
MAX_POWER_EXPONENT = 4096


class _TemplateRejected(jinja2.TemplateError):
    """A template's own raise_exception(): the template refuses the conversation on purpose."""


class _TemplateRunaway(jinja2.TemplateError):
    """A template that runs past RENDER_SECONDS or builds text beyond MAX_TEMPLATE_TEXT."""


_RENDER = threading.local()  # the render in progress on this thread: its deadline and interrupt


def _check_render() -> None:
    """Raise when the render on this thread ran out of time or its caller asked it to stop."""
    interrupt = getattr(_RENDER, "interrupt", None)
    if interrupt is not None and interrupt():
        raise Interrupted()
    if time.monotonic() > getattr(_RENDER, "deadline", float("inf")):
        raise _TemplateRunaway(f"it ran for more than {RENDER_SECONDS:g} s")


def _checked_range(*args):
    """range() for templates: bounded like the sandbox's, and asking after the render's time as it goes."""
    for count, value in enumerate(range(*args)):
        if count == MAX_TEMPLATE_TEXT:
            raise _TemplateRunaway(f"a range of more than {MAX_TEMPLATE_TEXT:,} items")
        if count % 1024 == 0:
            _check_render()
        yield value


class _TemplateEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with every call and range step asking whether the render may go on, and * and ** bounded."""

    intercepted_binops = frozenset({"*", "**"})

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
        _check_render()
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context, operator, left, right):
        _check_render()
        if operator == "*":
            for sequence, times in ((left, right), (right, left)):
                if (
                    isinstance(sequence, (str, list, tuple))
                    and isinstance(times, int)
                    and len(sequence) * times > MAX_TEMPLATE_TEXT
                ):
                    raise _TemplateRunaway(f"a repetition of more than {MAX_TEMPLATE_TEXT:,} characters")
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > MAX_POWER_EXPONENT:
            raise _TemplateRunaway(f"a power of more than {MAX_POWER_EXPONENT}")
        return super().call_binop(context, operator, left, right)


def _raise_exception(message: str):
    raise _TemplateRejected(message)


def _tojson(
    value, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes <, > and & for HTML, which would change the prompt the model sees.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    """The Jinja setup chat templates are written for: sandboxed, block tags trimmed, HF's helpers."""
    env = _TemplateEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["range"] = _checked_range
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
        template = next(
            (t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None
        )
    return (template if isinstance(template, str) else None), folder / "tokenizer_config.json"


def _eos_ids(generation: dict, generation_path: Path, eos_id: int | None) -> frozenset[int]:
    """generation_config.json's eos_token_id (one id or a list) plus the id of tokenizer_config's eos_token."""
    value = generation.get("eos_token_id")
    ids = [] if value is None else [value] if isinstance(value, int) else value
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CheckpointError(
            generation_path, f"has an eos_token_id that is not a token id or a list of them: {value!r}", REFETCH
        )
    return frozenset(ids) | ({eos_id} if eos_id is not None else set())


class ChatTokenizer:
    """Text to token ids and back, and conversations to prompt text, as the model folder defines them."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        special_tokens: dict[str, str],
        template: jinja2.Template | None,
        template_path: Path,
        eos_token_ids: frozenset[int],
        generation_defaults: dict,
        template_source: str | None = None,
    ):
        self._tokenizer = tokenizer
        self.template_source = template_source  # the chat template's text (it defines the tool-call format)
        self._special_tokens = special_tokens  # bos_token / eos_token text, for the template
        self._template = template
        self._template_path = template_path
        self.eos_token_ids = eos_token_ids
        self.generation_defaults = generation_defaults
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        # every added token's text (<|im_end|>, <think>, <tool_call>...): only the template may write them
        self._controls = sorted(
            (t.content for t in tokenizer.get_added_tokens_decoder().values()), key=len, reverse=True
        )
        self._control_pattern = re.compile("|".join(map(re.escape, self._controls))) if self._controls else None
        self.think_start = "<think>" if self.token_id("<think>") is not None else None
        self.think_end = "</think>" if self.token_id("</think>") is not None else None

    @classmethod
    def from_folder(cls, folder: Path) -> ChatTokenizer:
        """Read tokenizer.json, tokenizer_config.json, chat_template.jinja and generation_config.json."""
        folder = Path(folder)
        tokenizer_path = folder / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise CheckpointError(
                folder,
                "has no tokenizer.json",
                "download the model's tokenizer files (tokenizer.json, tokenizer_config.json) "
                "into the folder along with the weights",
            )
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # the tokenizers library raises a bare Exception for every kind of bad file
            raise CheckpointError(tokenizer_path, f"cannot be read as a tokenizer ({exc})", REFETCH) from None
        config = _read_json(folder / "tokenizer_config.json")
        special_tokens = {
            name: text for name in ("bos_token", "eos_token") if (text := _token_text(config.get(name))) is not None
        }
        eos_text = special_tokens.get("eos_token")
        generation_path = folder / "generation_config.json"
        generation = _read_json(generation_path)
        eos_ids = _eos_ids(generation, generation_path, tokenizer.token_to_id(eos_text) if eos_text else None)
        try:  # checked once here, so every session that starts from these defaults can use them
            SamplingParams.from_generation_config(generation).validate()
        except ValueError as exc:
            raise CheckpointError(
                generation_path,
                f"has an unusable sampling setting: {exc}",
                "fix or delete that value in generation_config.json, or download the file again",
            ) from None
        source, template_path = _template_source(folder, config)
        template = None
        if source is not None:
            try:
                template = _ENVIRONMENT.from_string(source)
            except jinja2.TemplateSyntaxError as exc:
                raise CheckpointError(
                    template_path,
                    f"has a chat template that does not parse: {exc.message} (template line {exc.lineno})",
                    REPLACE_TEMPLATE,
                ) from None
        return cls(tokenizer, special_tokens, template, template_path, eos_ids, generation, source)

    @classmethod
    def from_parts(cls, tokenizer: Tokenizer, chat_template: str, eos_token: str) -> ChatTokenizer:
        """Build one from a tokenizer and template held in memory (a training script's, before any folder)."""
        eos_id = tokenizer.token_to_id(eos_token)
        return cls(
            tokenizer,
            {"eos_token": eos_token},
            _ENVIRONMENT.from_string(chat_template),
            Path("chat_template.jinja"),
            frozenset({eos_id} if eos_id is not None else ()),
            {},
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of text; special tokens written in it (<|im_start|>) become their ids. No BOS is added."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of text read as plain text: control-token strings in it (`<|im_end|>`, `<think>`) become
        ordinary tokens, never control tokens."""
        if self._control_pattern is None or not self._control_pattern.search(text):
            return self.encode(text)
        ids, last = [], 0
        for match in self._control_pattern.finditer(text):
            ids += self.encode(text[last : match.start()]) + self._encode_plain(match.group())
            last = match.end()
        return ids + self.encode(text[last:])

    def _encode_plain(self, text: str) -> list[int]:
        """text through the normaliser, pre-tokeniser and BPE model alone, past the added-token matching."""
        tokenizer = self._tokenizer
        if tokenizer.normalizer is not None:
            text = tokenizer.normalizer.normalize_str(text)
        pieces = tokenizer.pre_tokenizer.pre_tokenize_str(text) if tokenizer.pre_tokenizer else [(text, None)]
        return [token.id for piece, _ in pieces for token in tokenizer.model.tokenize(piece)]

    def encode_chat(self, messages: list[dict], *, after: str | None = None, **options) -> tuple[list[int], str]:
        """(token ids, text) of `messages` rendered by the template (options as `render`), where only the
        template's own markup yields control tokens: a control token's text inside any message text (content,
        reasoning, tool calls, tool results, tool specs) is encoded as plain text. `after`: keep only what
        follows the last place this string (a message's text) was rendered."""
        text = self.render(messages, **options)
        texts: list[str] = []
        masked = _replace_texts(messages, texts)
        masked_tools = _replace_texts(options.get("tools"), texts)
        if after is not None and after not in text or not text.strip():
            raise CheckpointError(
                self._template_path,
                "the chat template renders nothing of this conversation's messages",
                REPLACE_TEMPLATE,
            )
        if not any(self._control_pattern and self._control_pattern.search(t) for t in texts):
            kept = text.rsplit(after, 1)[1] if after is not None else text
            return self.encode(kept), kept
        segments = self._segments(text, self.render(masked, **dict(options, tools=masked_tools)), texts)
        if after is not None:
            last = max(i for i, (piece, data) in enumerate(segments) if data and piece == after)
            segments = segments[last + 1 :]
        ids = [i for piece, data in segments for i in (self.encode_text(piece) if data else self.encode(piece))]
        return ids, "".join(piece for piece, _ in segments)

    @staticmethod
    def _segments(text: str, masked: str, texts: list[str]) -> list[tuple[str, bool]]:
        """`text` cut into (piece, is message text) by aligning it with `masked`, the same render with each
        message text a placeholder; where the template changed a text beyond recognition, the masked render's
        markup with the texts as given."""
        parts = _PLACEHOLDER.split(masked)  # markup, index, markup, index, ..., markup
        segments, position = [], 0
        for k in range(0, len(parts) - 1, 2):
            markup, original, following = parts[k], texts[int(parts[k + 1])], parts[k + 2]
            if not text.startswith(markup, position):
                break
            position += len(markup)
            rendered = next(
                (
                    c
                    for c in _renderings(original)
                    if text.startswith(c, position) and text.startswith(following, position + len(c))
                ),
                None,
            )
            if rendered is None:
                break
            segments += [(markup, False), (rendered, True)]
            position += len(rendered)
        else:
            if text[position:] == parts[-1]:
                return segments + [(parts[-1], False)]
        return [(texts[int(part)], True) if k % 2 else (part, False) for k, part in enumerate(parts)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, text: str) -> int | None:
        """The id of a single token, or None when text is not one token of the vocabulary."""
        return self._tokenizer.token_to_id(text)

    def render(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        tools: list[dict] | None = None,
        preserve_thinking: bool = False,
        interrupt: Callable[[], bool] | None = None,
    ) -> str:
        """Render a conversation to the prompt text, by the model's chat template.

        Messages are Hugging Face's chat format: {"role", "content"} with role system, user, assistant or
        tool; an assistant message may add "reasoning_content" (its thinking) and "tool_calls"
        ([{"type": "function", "function": {"name", "arguments"}}], arguments a dict; Qwen3's template also
        takes a JSON string). `tools` are JSON-schema function specs. `preserve_thinking` asks templates that
        know it (Qwen3.5/3.6) to keep the reasoning of every assistant turn instead of only the current one's;
        templates that do not read it ignore it. A template still running after RENDER_SECONDS is refused;
        `interrupt` is asked as it runs, and raises Interrupted when it answers True.
        """
        if self._template is None:
            raise CheckpointError(
                self._template_path.parent,
                "has no chat template",
                "add the model's chat_template.jinja (or a tokenizer_config.json with a chat_template) to the folder",
            )
        context = dict(
            self._special_tokens,
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            preserve_thinking=preserve_thinking,
        )
        _RENDER.deadline, _RENDER.interrupt = time.monotonic() + RENDER_SECONDS, interrupt
        try:
            return self._template.render(**context)
        except Interrupted:
            raise
        except _TemplateRunaway as exc:
            raise CheckpointError(
                self._template_path, f"the chat template does not finish: {exc.message}", REPLACE_TEMPLATE
            ) from None
        except _TemplateRejected as exc:
            raise CheckpointError(
                self._template_path,
                f"the chat template rejects this conversation: {exc.message}",
                "check the order and roles of the messages",
            ) from None
        except Exception as exc:  # the template is foreign code: a failure inside it is the template's, or the input's
            hint = REPLACE_TEMPLATE
            if _has_string_arguments(messages):  # Qwen3.6's template iterates the arguments as a mapping
                hint = "give each tool call's arguments as a dict, not a JSON string, or " + REPLACE_TEMPLATE
            raise CheckpointError(
                self._template_path, f"the chat template fails to render ({type(exc).__name__}: {exc})", hint
            ) from None
        finally:
            _RENDER.deadline, _RENDER.interrupt = float("inf"), None


def _replace_texts(value, texts: list[str]):
    """A copy of `value` (messages or tool specs) with every string a numbered placeholder, the strings appended
    to `texts`; roles, types and dict keys stay, as the template branches on them."""
    if isinstance(value, str):
        texts.append(value)
        return f"\ue000{len(texts) - 1}\ue001"
    if isinstance(value, list):
        return [_replace_texts(v, texts) for v in value]
    if isinstance(value, dict):
        return {k: (v if k in ("role", "type") else _replace_texts(v, texts)) for k, v in value.items()}
    return value


def _renderings(text: str) -> list[str]:
    """How a template may have written a message text: as given, trimmed, or JSON-escaped."""
    escaped = json.dumps(text, ensure_ascii=False)[1:-1]
    return list(dict.fromkeys([text, text.strip(), text.strip("\n"), text.lstrip("\n"), text.rstrip(), escaped]))


def _has_string_arguments(messages: list[dict]) -> bool:
    """Whether any assistant tool call in messages gives its arguments as a string."""
    calls = [
        call
        for message in messages
        if isinstance(message, dict)
        for call in message.get("tool_calls") or ()
        if isinstance(call, dict)
    ]
    functions = [call.get("function", call) for call in calls]
    return any(isinstance(f, dict) and isinstance(f.get("arguments"), str) for f in functions)


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
        emitted = self._decode(self._window[: self._read])
        self._window = self._window[self._read :]
        self._read = len(self._window)
        return text[len(emitted) :]

    def flush(self) -> str:
        """Whatever is still held at the end of the reply (an incomplete character decodes to U+FFFD)."""
        text = self._decode(self._window)
        emitted = self._decode(self._window[: self._read])
        self._window, self._read = [], 0
        return text[len(emitted) :]
