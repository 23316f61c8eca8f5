"""A chat as a file: Markdown (the shown branch, for reading) and JSON (every branch, for importing again)."""

from __future__ import annotations

import json

from app.storage import ConversationStore

EXPORT_FORMAT = "moe-desk-chat"
EXPORT_VERSION = 1
SPEAKERS = {"user": "You", "assistant": "Assistant"}


class ChatImportError(ValueError):
    """The file is not a chat this app exported; the message says what is wrong with it."""


def to_markdown(store: ConversationStore, conversation_id: int) -> str:
    """The shown branch as Markdown: a title, the system prompt, then each message under its speaker."""
    conversation = store.conversation(conversation_id)
    parts = [f"# {conversation['title']}\n"]
    if conversation["system_prompt"]:
        parts.append("**System prompt:**\n\n" + _quoted(conversation["system_prompt"]) + "\n")
    for message in store.messages(conversation_id):
        parts.append(f"## {SPEAKERS.get(message['role'], message['role'])}\n")
        if message["reasoning"]:
            parts.append("<details><summary>Thoughts</summary>\n\n" + message["reasoning"] + "\n\n</details>\n")
        parts.append(message["content"] + "\n")
    return "\n".join(parts)


def _quoted(text: str) -> str:
    return "\n".join("> " + line for line in text.split("\n"))


def to_json(store: ConversationStore, conversation_id: int) -> str:
    """Every branch as JSON: the chat's options, all messages with their parents, and which branch is shown."""
    conversation = store.conversation(conversation_id)
    messages = [
        {key: m[key] for key in ("id", "parent_id", "role", "content", "reasoning", "stats", "created")}
        for m in store.tree(conversation_id)
    ]
    document = {
        "format": EXPORT_FORMAT,
        "version": EXPORT_VERSION,
        "title": conversation["title"],
        "system_prompt": conversation["system_prompt"],
        "enable_thinking": conversation["enable_thinking"],
        "shown_leaf": store.leaf(conversation_id),
        "messages": messages,
    }
    return json.dumps(document, ensure_ascii=False, indent=2)


def from_json(store: ConversationStore, text: str) -> int:
    """Import a to_json document as a new chat (ChatImportError when it is not one); returns its id."""
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise ChatImportError(f"The file is not JSON ({exc}).") from None
    if not isinstance(document, dict) or document.get("format") != EXPORT_FORMAT:
        raise ChatImportError('The file is not a chat exported by MoE Desk (its "format" field is missing).')
    if document.get("version") != EXPORT_VERSION:
        raise ChatImportError(
            f"The file is a version {document.get('version')!r} export; this app reads version "
            f"{EXPORT_VERSION}. Update the app to import it."
        )
    messages = document.get("messages")
    if not isinstance(messages, list) or not all(_valid_message(m) for m in messages):
        raise ChatImportError("The file's messages are damaged (each needs an id, a role and text).")
    seen: set = set()
    for m in messages:
        if m.get("parent_id") is not None and m["parent_id"] not in seen:
            raise ChatImportError("The file's messages are out of order or refer to a missing message.")
        seen.add(m["id"])
    return store.import_tree(document, messages, document.get("shown_leaf"))


def _valid_message(m) -> bool:
    return (
        isinstance(m, dict)
        and "id" in m
        and m.get("role") in SPEAKERS
        and isinstance(m.get("content", ""), str)
        and isinstance(m.get("reasoning", ""), str)
        and isinstance(m.get("stats", {}), dict)
    )
