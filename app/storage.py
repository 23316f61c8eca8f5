"""Conversations on disk: one SQLite file, written as things happen so a crash loses nothing.

Every call commits; a streaming reply is saved as it grows (update_message), and the text in
the input box is kept as a draft per conversation.
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
        return self._write("INSERT INTO conversations (title, system_prompt, enable_thinking, created, updated) "
                           "VALUES (?, ?, ?, ?, ?)", (title, system_prompt, int(enable_thinking), now, now)).lastrowid

    def conversations(self, search: str = "") -> list[dict]:
        """Newest first; `search` matches the title or any message text, case-insensitively."""
        if search:
            pattern = f"%{search}%"
            rows = self._db.execute(
                "SELECT * FROM conversations WHERE title LIKE ? OR id IN "
                "(SELECT conversation_id FROM messages WHERE content LIKE ?) ORDER BY updated DESC, id DESC",
                (pattern, pattern))
        else:
            rows = self._db.execute("SELECT * FROM conversations ORDER BY updated DESC, id DESC")
        return [self._conversation(r) for r in rows]

    def conversation(self, conversation_id: int) -> dict | None:
        row = self._db.execute("SELECT * FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        return self._conversation(row) if row else None

    @staticmethod
    def _conversation(row: sqlite3.Row) -> dict:
        return {"id": row["id"], "title": row["title"], "system_prompt": row["system_prompt"],
                "enable_thinking": bool(row["enable_thinking"]), "draft": row["draft"], "updated": row["updated"]}

    def rename(self, conversation_id: int, title: str) -> None:
        self._write("UPDATE conversations SET title = ? WHERE id = ?", (title.strip() or DEFAULT_TITLE, conversation_id))

    def delete(self, conversation_id: int) -> None:
        self._write("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def set_options(self, conversation_id: int, *, system_prompt: str | None = None,
                    enable_thinking: bool | None = None) -> None:
        if system_prompt is not None:
            self._write("UPDATE conversations SET system_prompt = ? WHERE id = ?", (system_prompt, conversation_id))
        if enable_thinking is not None:
            self._write("UPDATE conversations SET enable_thinking = ? WHERE id = ?",
                        (int(enable_thinking), conversation_id))

    def save_draft(self, conversation_id: int, text: str) -> None:
        self._write("UPDATE conversations SET draft = ? WHERE id = ?", (text, conversation_id))

    # ---- messages -------------------------------------------------------------------------------

    def messages(self, conversation_id: int) -> list[dict]:
        rows = self._db.execute("SELECT * FROM messages WHERE conversation_id = ? ORDER BY position",
                                (conversation_id,))
        return [{"id": r["id"], "role": r["role"], "content": r["content"], "reasoning": r["reasoning"],
                 "stats": _stats(r["stats"], r["id"])} for r in rows]

    def add_message(self, conversation_id: int, role: str, content: str = "", reasoning: str = "",
                    stats: dict | None = None) -> int:
        now = time.time()
        with self._db:
            # the write lock before reading the next position: another writer cannot take the same one
            self._db.execute("BEGIN IMMEDIATE")
            position = self._db.execute("SELECT COALESCE(MAX(position) + 1, 0) FROM messages WHERE conversation_id = ?",
                                        (conversation_id,)).fetchone()[0]
            self._db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))
            return self._db.execute(
                "INSERT INTO messages (conversation_id, position, role, content, reasoning, stats, created) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, position, role, content, reasoning, json.dumps(stats or {}), now)).lastrowid

    def update_message(self, message_id: int, *, content: str | None = None, reasoning: str | None = None,
                       stats: dict | None = None) -> None:
        fields = {"content": content, "reasoning": reasoning, "stats": None if stats is None else json.dumps(stats)}
        for column, value in fields.items():
            if value is not None:
                self._write(f"UPDATE messages SET {column} = ? WHERE id = ?", (value, message_id))

    def truncate(self, conversation_id: int, keep: int) -> None:
        """Keep the first `keep` messages (for regenerate and edit-and-resend)."""
        self._write("DELETE FROM messages WHERE conversation_id = ? AND position >= ?", (conversation_id, keep))


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
