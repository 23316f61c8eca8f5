"""Conversations on disk: one SQLite file, written as things happen so a crash loses nothing.

Every call commits; a streaming reply is saved as it grows (update_message), and the text in
the input box is kept as a draft per conversation. A conversation is a tree: each message has a
parent, Regenerate and Edit add a sibling (a version) instead of overwriting, and the conversation
remembers its shown branch by its last message (leaf_id) and, per message, the child last shown
(active_child). Deleting hides rows first (undo brings them back) and purge_deleted removes them.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    enable_thinking INTEGER NOT NULL DEFAULT 1,
    draft TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    role TEXT NOT NULL,
    content TEXT NOT NULL DEFAULT '',
    reasoning TEXT NOT NULL DEFAULT '',
    stats TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, position);
"""
# Schema 1: messages form a tree. Existing chats become one branch, each message the child of the one before it.
MIGRATION_TO_TREE = """
ALTER TABLE messages ADD COLUMN parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE;
ALTER TABLE messages ADD COLUMN active_child INTEGER;
ALTER TABLE messages ADD COLUMN hidden INTEGER NOT NULL DEFAULT 0;
ALTER TABLE conversations ADD COLUMN leaf_id INTEGER;
ALTER TABLE conversations ADD COLUMN hidden INTEGER NOT NULL DEFAULT 0;
UPDATE messages SET parent_id = (SELECT p.id FROM messages p WHERE p.conversation_id = messages.conversation_id
    AND p.position < messages.position ORDER BY p.position DESC LIMIT 1);
UPDATE messages SET active_child = (SELECT c.id FROM messages c WHERE c.parent_id = messages.id);
UPDATE conversations SET leaf_id = (SELECT m.id FROM messages m WHERE m.conversation_id = conversations.id
    ORDER BY m.position DESC LIMIT 1);
CREATE INDEX messages_by_parent ON messages(parent_id);
"""
SCHEMA_VERSION = 1
AFTER_SHOWN = object()  # add_message's default parent: the last message of the shown branch
DEFAULT_TITLE = "New chat"
IN_MEMORY = Path(":memory:")
log = logging.getLogger(__name__)


class StoreError(Exception):
    """The conversation file cannot be used as it is: `kind` is "damaged" or "read_only"."""

    def __init__(self, kind: str, path: Path, detail: str):
        self.kind, self.path, self.detail = kind, path, detail
        what = "is damaged" if kind == "damaged" else "cannot be written"
        super().__init__(f"The chat history {path} {what} ({detail}).")


class ConversationStore:
    def __init__(self, path: Path, copy_of: Path | None = None):
        """The conversations in `path`, checked whole and for writing first (StoreError when either fails).
        `copy_of`: with `path` IN_MEMORY, start from a copy of that file (kept unchanged on disk)."""
        self.path = path
        try:
            if path != IN_MEMORY:
                path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(path))
            if copy_of is not None:
                with sqlite3.connect(f"file:{copy_of.as_posix()}?mode=ro", uri=True) as source:
                    source.backup(self._db)
            self._db.row_factory = sqlite3.Row
            self._check()
            self._db.execute("PRAGMA journal_mode=WAL")  # a kill mid-write leaves the last commit intact
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.executescript(SCHEMA)
            self._db.commit()
            self._migrate()
            self.purge_deleted()  # what an earlier session deleted and did not undo
        except sqlite3.DatabaseError as exc:
            raise self._error(exc) from None
        except OSError as exc:
            raise StoreError("read_only", path, exc.strerror or str(exc)) from None

    def _check(self) -> None:
        """A damaged file fails here, before the app relies on it; so does one that cannot be written."""
        verdict = self._db.execute("PRAGMA quick_check").fetchone()[0]
        if verdict != "ok":
            raise sqlite3.DatabaseError(f"integrity check: {verdict}")
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        self._db.execute("BEGIN IMMEDIATE")
        self._db.execute(f"PRAGMA user_version = {int(version)}")  # a write: fails on a read-only file or mount
        self._db.rollback()

    def _migrate(self) -> None:
        """Bring an older file up to SCHEMA_VERSION in one transaction (a crash leaves it as it was)."""
        self._db.isolation_level = None  # the script's ALTERs run inside our own transaction
        try:
            self._db.execute("BEGIN IMMEDIATE")  # a second instance opening meanwhile waits, then sees version 1
            if self._db.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
                for statement in MIGRATION_TO_TREE.split(";"):
                    if statement.strip():
                        self._db.execute(statement)
                self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            self._db.execute("COMMIT")
        except sqlite3.Error:
            self._db.execute("ROLLBACK")
            raise
        finally:
            self._db.isolation_level = ""

    def _error(self, exc: sqlite3.DatabaseError) -> StoreError:
        text = str(exc)
        read_only = "readonly" in text or "read-only" in text or "unable to open" in text
        self._close_quietly()
        return StoreError("read_only" if read_only else "damaged", self.path, text)

    def _close_quietly(self) -> None:
        try:
            self._db.close()
        except (AttributeError, sqlite3.Error):
            pass

    def close(self) -> None:
        self._db.close()

    def _write(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        with self._db:  # commits, or rolls back on error
            return self._db.execute(sql, args)

    # ---- conversations --------------------------------------------------------------------------

    def create(self, title: str = DEFAULT_TITLE, system_prompt: str = "", enable_thinking: bool = True) -> int:
        now = time.time()
        return self._write(
            "INSERT INTO conversations (title, system_prompt, enable_thinking, created, updated) "
            "VALUES (?, ?, ?, ?, ?)",
            (title, system_prompt, int(enable_thinking), now, now),
        ).lastrowid

    def conversations(self, search: str = "") -> list[dict]:
        """Newest first, deleted ones left out; `search` matches the title or any message text (any branch),
        case-insensitively."""
        if search:
            pattern = f"%{search}%"
            rows = self._db.execute(
                "SELECT * FROM conversations WHERE hidden = 0 AND (title LIKE ? OR id IN "
                "(SELECT conversation_id FROM messages WHERE hidden = 0 AND content LIKE ?)) "
                "ORDER BY updated DESC, id DESC",
                (pattern, pattern),
            )
        else:
            rows = self._db.execute("SELECT * FROM conversations WHERE hidden = 0 ORDER BY updated DESC, id DESC")
        return [self._conversation(r) for r in rows]

    def conversation(self, conversation_id: int) -> dict | None:
        """The conversation's fields, or None when it does not exist or is deleted (waiting for its undo)."""
        row = self._db.execute("SELECT * FROM conversations WHERE id = ? AND hidden = 0", (conversation_id,)).fetchone()
        return self._conversation(row) if row else None

    @staticmethod
    def _conversation(row: sqlite3.Row) -> dict:
        return {
            "id": row["id"],
            "title": row["title"],
            "system_prompt": row["system_prompt"],
            "enable_thinking": bool(row["enable_thinking"]),
            "draft": row["draft"],
            "updated": row["updated"],
        }

    def rename(self, conversation_id: int, title: str) -> None:
        self._write(
            "UPDATE conversations SET title = ? WHERE id = ?", (title.strip() or DEFAULT_TITLE, conversation_id)
        )

    def delete(self, conversation_id: int) -> None:
        """Hide the conversation: restore() brings it back, purge_deleted() removes it for good."""
        self._write("UPDATE conversations SET hidden = 1 WHERE id = ?", (conversation_id,))

    def restore(self, conversation_id: int) -> None:
        """Undo delete()."""
        self._write("UPDATE conversations SET hidden = 0 WHERE id = ?", (conversation_id,))

    def purge_conversation(self, conversation_id: int) -> None:
        """Remove a deleted conversation for good."""
        self._write("DELETE FROM conversations WHERE id = ? AND hidden = 1", (conversation_id,))

    def purge_message(self, message_id: int) -> None:
        """Remove a deleted message and the turns after it for good."""
        self._write("DELETE FROM messages WHERE id = ? AND hidden = 1", (message_id,))

    def purge_deleted(self) -> None:
        """Remove deleted conversations and messages (with the branches under them) for good."""
        with self._db:
            self._db.execute("DELETE FROM conversations WHERE hidden = 1")
            self._db.execute("DELETE FROM messages WHERE hidden = 1")

    def set_options(
        self, conversation_id: int, *, system_prompt: str | None = None, enable_thinking: bool | None = None
    ) -> None:
        if system_prompt is not None:
            self._write("UPDATE conversations SET system_prompt = ? WHERE id = ?", (system_prompt, conversation_id))
        if enable_thinking is not None:
            self._write(
                "UPDATE conversations SET enable_thinking = ? WHERE id = ?", (int(enable_thinking), conversation_id)
            )

    def save_draft(self, conversation_id: int, text: str) -> None:
        self._write("UPDATE conversations SET draft = ? WHERE id = ?", (text, conversation_id))

    # ---- messages -------------------------------------------------------------------------------

    def tree(self, conversation_id: int) -> list[dict]:
        """Every message of every branch (deleted ones and the turns after them left out), parents before
        children, with `parent_id`."""
        rows = self._db.execute(
            "SELECT * FROM messages WHERE conversation_id = ? ORDER BY position, id", (conversation_id,)
        )
        kept: set = set()
        tree = []
        for r in rows.fetchall():
            if not r["hidden"] and (r["parent_id"] is None or r["parent_id"] in kept):
                kept.add(r["id"])
                tree.append(
                    {
                        "id": r["id"],
                        "parent_id": r["parent_id"],
                        "role": r["role"],
                        "content": r["content"],
                        "reasoning": r["reasoning"],
                        "stats": _stats(r["stats"], r["id"]),
                        "created": r["created"],
                        "active_child": r["active_child"],
                    }
                )
        return tree

    def leaf(self, conversation_id: int) -> int | None:
        """The last message of the shown branch (None for an empty chat)."""
        row = self._db.execute("SELECT leaf_id FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        return row["leaf_id"] if row else None

    def messages(self, conversation_id: int) -> list[dict]:
        """The shown branch, root first; each message also says which of its siblings it is (`version`, from 1)
        of how many (`versions`)."""
        return _branch(self.tree(conversation_id), self.leaf(conversation_id))

    def add_message(
        self,
        conversation_id: int,
        role: str,
        content: str = "",
        reasoning: str = "",
        stats: dict | None = None,
        parent_id=AFTER_SHOWN,
    ) -> int:
        """A new message under `parent_id` (None: a new root; default: after the shown branch's last message);
        the branch through it becomes the shown one."""
        now = time.time()
        with self._db:
            # the write lock before reading the shown branch: another writer cannot append to the same leaf
            self._db.execute("BEGIN IMMEDIATE")
            if parent_id is AFTER_SHOWN:
                parent_id = self.leaf(conversation_id)
            parent = (
                self._db.execute("SELECT position FROM messages WHERE id = ?", (parent_id,)).fetchone()
                if parent_id is not None
                else None
            )
            position = parent["position"] + 1 if parent else 0
            self._db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))
            message_id = self._db.execute(
                "INSERT INTO messages (conversation_id, position, role, content, reasoning, stats, created, "
                "parent_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, position, role, content, reasoning, json.dumps(stats or {}), now, parent_id),
            ).lastrowid
            self._show(conversation_id, message_id)
            return message_id

    def update_message(
        self, message_id: int, *, content: str | None = None, reasoning: str | None = None, stats: dict | None = None
    ) -> None:
        fields = {"content": content, "reasoning": reasoning, "stats": None if stats is None else json.dumps(stats)}
        for column, value in fields.items():
            if value is not None:
                self._write(f"UPDATE messages SET {column} = ? WHERE id = ?", (value, message_id))

    def show_version(self, conversation_id: int, message_id: int, step: int) -> None:
        """Show the sibling `step` places from `message_id` (-1: the previous version), with the branch that was
        last shown below it; past the first or last version nothing changes."""
        tree = self.tree(conversation_id)
        siblings = _siblings(tree, message_id)
        index = siblings.index(message_id) + step
        if 0 <= index < len(siblings):
            with self._db:
                self._show(conversation_id, _last_shown_leaf(tree, siblings[index]))

    def delete_message(self, conversation_id: int, message_id: int) -> int | None:
        """Hide a message and the turns after it, showing a sibling's branch (else the parent); returns the leaf
        shown before, for undelete_message."""
        tree = self.tree(conversation_id)
        previous_leaf = self.leaf(conversation_id)
        siblings = _siblings(tree, message_id)
        others = [s for s in siblings if s != message_id]
        index = siblings.index(message_id)
        parent_id = next(m["parent_id"] for m in tree if m["id"] == message_id)
        with self._db:
            self._db.execute("UPDATE messages SET hidden = 1 WHERE id = ?", (message_id,))
            remaining = [m for m in tree if m["id"] != message_id]
            if others:
                self._show(conversation_id, _last_shown_leaf(remaining, others[max(index - 1, 0)]))
            else:
                self._show(conversation_id, parent_id)
        return previous_leaf

    def undelete_message(self, conversation_id: int, message_id: int, leaf_id: int | None) -> None:
        """Undo delete_message: the message is back and `leaf_id`'s branch shown again."""
        with self._db:
            self._db.execute("UPDATE messages SET hidden = 0 WHERE id = ?", (message_id,))
            self._show(conversation_id, leaf_id)

    def _show(self, conversation_id: int, leaf_id: int | None) -> None:
        """Make the branch ending at `leaf_id` the shown one: each message on it remembers its shown child."""
        self._db.execute("UPDATE conversations SET leaf_id = ? WHERE id = ?", (leaf_id, conversation_id))
        child = leaf_id
        while child is not None:
            parent = self._db.execute("SELECT parent_id FROM messages WHERE id = ?", (child,)).fetchone()
            if parent is None or parent["parent_id"] is None:
                break
            self._db.execute("UPDATE messages SET active_child = ? WHERE id = ?", (child, parent["parent_id"]))
            child = parent["parent_id"]

    def import_tree(self, conversation: dict, messages: list[dict], shown_leaf: int | None) -> int:
        """A new conversation holding `messages` (export ids in `id`/`parent_id`, parents first); `shown_leaf` (an
        export id) is the branch shown. Returns the new conversation's id."""
        conversation_id = self.create(
            conversation.get("title") or DEFAULT_TITLE,
            conversation.get("system_prompt") or "",
            bool(conversation.get("enable_thinking", True)),
        )
        new_ids: dict = {}
        for m in messages:
            parent = new_ids[m["parent_id"]] if m.get("parent_id") is not None else None
            new_ids[m["id"]] = self.add_message(
                conversation_id,
                m["role"],
                m.get("content") or "",
                m.get("reasoning") or "",
                m.get("stats") or {},
                parent_id=parent,
            )
        with self._db:
            self._show(conversation_id, new_ids.get(shown_leaf))
        return conversation_id


def _siblings(tree: list[dict], message_id: int) -> list[int]:
    """The ids of `message_id` and its versions (the messages with its parent), oldest first."""
    parent = next(m["parent_id"] for m in tree if m["id"] == message_id)
    return [m["id"] for m in sorted(tree, key=lambda m: m["id"]) if m["parent_id"] == parent]


def _last_shown_leaf(tree: list[dict], message_id: int) -> int:
    """The end of the branch below `message_id` that was last shown (its newest child where none was)."""
    children: dict = {}
    for m in tree:
        children.setdefault(m["parent_id"], []).append(m)
    by_id = {m["id"]: m for m in tree}
    node = by_id[message_id]
    while children.get(node["id"]):
        below = children[node["id"]]
        node = next((c for c in below if c["id"] == node["active_child"]), max(below, key=lambda c: c["id"]))
    return node["id"]


def _branch(tree: list[dict], leaf_id: int | None) -> list[dict]:
    """The path from the root to `leaf_id`, each message with its version number and count."""
    by_id = {m["id"]: m for m in tree}
    counts: dict = {}
    for m in sorted(tree, key=lambda m: m["id"]):
        counts.setdefault(m["parent_id"], []).append(m["id"])
    path = []
    node = by_id.get(leaf_id)
    while node is not None:
        siblings = counts[node["parent_id"]]
        path.append(
            {
                "id": node["id"],
                "parent_id": node["parent_id"],
                "role": node["role"],
                "content": node["content"],
                "reasoning": node["reasoning"],
                "stats": node["stats"],
                "version": siblings.index(node["id"]) + 1,
                "versions": len(siblings),
            }
        )
        node = by_id.get(node["parent_id"])
    return path[::-1]


def _stats(text: str, message_id: int) -> dict:
    """A message's stored stats, or {} (with a warning) when the row holds something that is not a JSON object."""
    try:
        stats = json.loads(text)
    except (TypeError, ValueError):
        stats = None
    if not isinstance(stats, dict):
        log.warning("message %s has unreadable stats (%.40r); showing it without them", message_id, text)
        return {}
    return stats


def keep_aside(path: Path) -> Path:
    """Move a damaged conversation file (and its WAL files) aside under a new name; nothing is deleted."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.damaged-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.damaged-{stamp}-{n}")
    for suffix in ("", "-wal", "-shm"):
        part = path.with_name(path.name + suffix)
        if part.exists():
            part.rename(target.with_name(target.name + suffix))
    return target


def open_conversations(path: Path, ask) -> tuple[ConversationStore | None, str]:
    """The store at `path`, or what the user chose when it cannot be used: (store or None to quit, a note for the
    log). `ask(error)` answers "aside" (damaged: keep the file aside, start a new one), "memory" (read-only: keep
    this session's chats in memory, starting from what the file holds) or "quit"."""
    try:
        return ConversationStore(path), ""
    except StoreError as error:
        choice = ask(error)
        if choice == "aside" and error.kind == "damaged":
            kept = keep_aside(path)
            return ConversationStore(path), f"{error} It was kept as {kept}; a new history was started."
        if choice == "memory":
            try:
                store = ConversationStore(IN_MEMORY, copy_of=path)
            except StoreError:
                store = ConversationStore(IN_MEMORY)
            return store, f"{error} This session's chats are kept in memory only and will not be saved."
        return None, str(error)


def chat_history(messages: list[dict]) -> list[dict]:
    """Stored messages as the engine's conversation (role, content, reasoning_content)."""
    history = []
    for m in messages:
        entry = {"role": m["role"], "content": m["content"]}
        if m.get("reasoning"):
            entry["reasoning_content"] = m["reasoning"]
        history.append(entry)
    return history
