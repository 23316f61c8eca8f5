"""A damaged or unwritable chat history never takes the app down, and the file is never deleted."""

import sqlite3
import threading

import pytest

from app import storage
from app.storage import IN_MEMORY, ConversationStore, StoreError, open_conversations


def history(path):
    store = ConversationStore(path)
    cid = store.create("kept chat")
    for i in range(30):
        store.add_message(cid, "user", f"question {i} " + "x" * 300)
        store.add_message(cid, "assistant", f"answer {i}", stats={"tokens": i})
    store.close()
    return cid


def garbage(path):
    path.write_bytes(b"\x00\xffnot a database at all" * 500)


def garbled_pages(path):
    history(path)
    data = bytearray(path.read_bytes())
    for offset in range(4096 + 100, len(data), 4096):  # past the header: every page's contents
        data[offset : offset + 200] = b"\xa5" * 200
    path.write_bytes(bytes(data))


def truncated(path):
    history(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


def wal_checkpointed(path):
    history(path)
    con = sqlite3.connect(path)
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()


DAMAGES = {"garbage": garbage, "garbled pages": garbled_pages, "truncated": truncated}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_file_is_reported_at_start_and_kept_aside_on_request(tmp_path, damage):
    path = tmp_path / "conversations.sqlite3"
    if damage != "garbage":
        wal_checkpointed(path)  # the data in the main file, where the damage goes
    DAMAGES[damage](path)
    original = path.read_bytes()
    with pytest.raises(StoreError) as caught:
        ConversationStore(path)
    assert caught.value.kind == "damaged" and str(path) in str(caught.value)
    asked = []
    store, note = open_conversations(path, lambda error: asked.append(error.kind) or "aside")
    assert asked == ["damaged"] and store is not None and store.conversations() == []
    kept = [p for p in tmp_path.iterdir() if ".damaged-" in p.name and not p.name.endswith(("-wal", "-shm"))]
    assert len(kept) == 1 and kept[0].read_bytes() == original and str(kept[0]) in note
    store.add_message(store.create(), "user", "works again")


def test_quitting_leaves_the_damaged_file_where_it_was(tmp_path):
    path = tmp_path / "conversations.sqlite3"
    garbage(path)
    before = path.read_bytes()
    store, note = open_conversations(path, lambda error: "quit")
    assert store is None and "is damaged" in note
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_one_row_with_bad_stats_shows_the_rest(tmp_path, caplog):
    path = tmp_path / "conversations.sqlite3"
    cid = history(path)
    con = sqlite3.connect(path)
    with con:
        con.execute("UPDATE messages SET stats = '{not json' WHERE position = 3")
        con.execute("UPDATE messages SET stats = '[1, 2]' WHERE position = 5")
    con.close()
    messages = ConversationStore(path).messages(cid)
    assert len(messages) == 60 and messages[3]["stats"] == {} and messages[5]["stats"] == {}
    assert messages[1]["stats"] == {"tokens": 0}
    assert "unreadable stats" in caplog.text


def test_a_read_only_file_is_found_at_start_and_can_be_read_without_saving(tmp_path, monkeypatch):
    path = tmp_path / "conversations.sqlite3"
    cid = history(path)
    connect = sqlite3.connect

    def read_only(target, *args, **kwargs):  # what a write-protected file or a read-only mount gives
        if str(target) == str(path):
            return connect(f"file:{path.as_posix()}?mode=ro", uri=True)
        return connect(target, *args, **kwargs)

    monkeypatch.setattr(storage.sqlite3, "connect", read_only)
    with pytest.raises(StoreError) as caught:
        ConversationStore(path)
    assert caught.value.kind == "read_only"
    store, note = open_conversations(path, lambda error: "memory")
    assert store.path == IN_MEMORY and "will not be saved" in note
    assert [c["title"] for c in store.conversations()] == ["kept chat"] and len(store.messages(cid)) == 60
    store.add_message(cid, "user", "in memory only")
    monkeypatch.undo()
    assert len(ConversationStore(path).messages(cid)) == 60  # the file is as it was


def test_two_writers_never_share_a_position(tmp_path):
    path = tmp_path / "conversations.sqlite3"
    cid = ConversationStore(path).create()

    def write(n):
        store = ConversationStore(path)
        for i in range(40):
            store.add_message(cid, "user", f"{n}-{i}")
        store.close()

    writers = [threading.Thread(target=write, args=(n,)) for n in range(2)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    con = sqlite3.connect(path)
    positions = [row[0] for row in con.execute("SELECT position FROM messages WHERE conversation_id = ?", (cid,))]
    assert sorted(positions) == list(range(80))


@pytest.mark.parametrize(
    "kind, button, answer",
    [
        ("damaged", "Keep it aside and start a new history", "aside"),
        ("damaged", "Quit", "quit"),
        ("read_only", "Continue without saving", "memory"),
    ],
)
def test_the_start_dialog_offers_what_the_file_allows(qtbot, tmp_path, kind, button, answer):
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication, QMessageBox

    from app.store_dialog import ask_about_store

    seen = {}

    def click():
        box = next(w for w in QApplication.topLevelWidgets() if isinstance(w, QMessageBox) and w.isVisible())
        seen["text"] = box.text() + box.informativeText()
        seen["buttons"] = [b.text() for b in box.buttons()]
        next(b for b in box.buttons() if b.text() == button).click()

    QTimer.singleShot(100, click)
    assert ask_about_store(StoreError(kind, tmp_path / "c.sqlite3", "file is not a database")) == answer
    assert str(tmp_path / "c.sqlite3") in seen["text"] and "Quit" in seen["buttons"]
    assert ("nothing is deleted" in seen["text"]) == (kind == "damaged")
