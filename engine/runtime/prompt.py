"""A request's prompt as token ids: a conversation through the chat template, or raw text for completions."""

from __future__ import annotations

from dataclasses import dataclass

from engine.runtime.tokenizer import ChatTokenizer


@dataclass(frozen=True)
class Prompt:
    """A whole request's prompt: its token ids, the text they encode, and where a prefix cache should keep the
    state (token counts at message boundaries; the prompt's end is always one)."""

    ids: list[int]
    rendered: str
    save_at: tuple[int, ...] = ()


def chat_prompt(
    tokenizer: ChatTokenizer, messages: list[dict], *, tools: list[dict] | None = None, enable_thinking: bool = True
) -> Prompt:
    """A conversation (system prompt, tool specs and results included) as the template renders it with the
    generation prompt; message texts are data (ChatTokenizer.encode_chat). Earlier replies keep their reasoning
    where the template offers it (preserve_thinking, as in ChatSession), so an agent's growing conversation
    stays a prefix of the next request's. Raises CheckpointError when the template refuses it."""
    options = dict(enable_thinking=enable_thinking, tools=tools, preserve_thinking=True)
    ids, rendered = tokenizer.encode_chat(messages, add_generation_prompt=True, **options)
    # The messages' end: the next request re-renders the reply after it (a template drops an earlier turn's
    # reasoning) but shares everything before it.
    head, _ = tokenizer.encode_chat(messages, add_generation_prompt=False, **options)
    kept = 0 < len(head) < len(ids) and ids[: len(head)] == head
    return Prompt(ids, rendered, (len(head),) if kept else ())


def text_prompt(tokenizer: ChatTokenizer, text: str) -> Prompt:
    """Raw prompt text read as plain text (no control tokens), for completions."""
    return Prompt(tokenizer.encode_text(text), "")
