"""Replies are never lost: the conversation tree in SQLite (and its migration), paging versions, Continue,
delete with undo, and export/import, through the store and through the Chat page with a scripted worker."""

from __future__ import annotations

import json
import shutil
import sqlite3

import pytest
from locations import FIXTURES
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QMessageBox

from app.chat_export import ChatImportError, from_json, to_json, to_markdown
from app.pages.chat import UNDO_MS, ChatPage
from app.storage import SCHEMA_VERSION, ConversationStore, chat_history
from app.widgets.transcript import AssistantBubble, MarkdownPart

# Written by the flat-schema store of commit 7442f9f (app/storage.py before the tree): three chats, one edited
# the old way (the turns after the edit deleted), a draft, a system prompt, thinking off.
SCHEMA0_FILE = FIXTURES / "chats-schema0.sqlite3"


def send(qtbot, page: ChatPage, text: str) -> None:
    qtbot.keyClicks(page.input, text)
    qtbot.keyClick(page.input, Qt.Key.Key_Return)


def shown_texts(page: ChatPage) -> list[str]:
    """Each bubble's text as shown: a user message's text, a reply's rendered answer."""
    return [
        b.text
        if not isinstance(b, AssistantBubble)
        else "\n".join(p.source if isinstance(p, MarkdownPart) else p.code() for p in b.answer_view.parts)
        for b in page.transcript.bubbles
    ]


def contents(store: ConversationStore, conversation_id: int) -> list[str]:
    return [m["content"] for m in store.messages(conversation_id)]


def answer_yes(monkeypatch) -> None:
    monkeypatch.setattr(QMessageBox, "question", lambda *args: QMessageBox.StandardButton.Yes)


# ---- the store ------------------------------------------------------------------------------------


def test_a_file_written_by_the_flat_schema_opens_with_every_chat_as_one_branch(tmp_path):
    path = tmp_path / "conversations.sqlite3"
    shutil.copy(SCHEMA0_FILE, path)
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 0

    store = ConversationStore(path)
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    chats = {c["title"]: c for c in store.conversations()}
    assert set(chats) == {"Colours", "Empty chat", "Edited"}
    colours = chats["Colours"]
    assert (colours["system_prompt"], colours["enable_thinking"], colours["draft"]) == (
        "Be brief.",
        False,
        "half typed",
    )
    shown = store.messages(colours["id"])
    assert [(m["role"], m["content"]) for m in shown] == [
        ("user", "Name a colour"),
        ("assistant", "Blue."),
        ("user", "Another one"),
        ("assistant", "Red."),
    ]
    assert shown[1]["reasoning"] == "Pick one." and shown[3]["stats"] == {"stop_reason": "length", "new_tokens": 2}
    assert [m["parent_id"] for m in shown] == [None] + [m["id"] for m in shown[:-1]]
    assert all((m["version"], m["versions"]) == (1, 1) for m in shown)
    assert store.messages(chats["Empty chat"]["id"]) == []
    assert contents(store, chats["Edited"]["id"]) == ["new question", "new answer"]

    # a migrated chat branches like a new one, and a second open does not migrate again
    store.add_message(colours["id"], "assistant", "Green.", parent_id=shown[2]["id"])
    store.close()
    again = ConversationStore(path)
    assert contents(again, colours["id"]) == ["Name a colour", "Blue.", "Another one", "Green."]
    assert [m["content"] for m in again.tree(colours["id"])].count("Red.") == 1


def test_versions_page_with_the_branch_shown_below_each(store):
    cid = store.create()
    q1 = store.add_message(cid, "user", "q1")
    a1 = store.add_message(cid, "assistant", "a1")
    store.add_message(cid, "user", "q2")
    store.add_message(cid, "assistant", "a2")
    q1b = store.add_message(cid, "user", "q1 edited", parent_id=None)  # an edit of the first message
    store.add_message(cid, "assistant", "b1", parent_id=q1b)
    assert contents(store, cid) == ["q1 edited", "b1"]

    store.show_version(cid, q1b, -1)
    assert contents(store, cid) == ["q1", "a1", "q2", "a2"]  # the first branch, with its later turns
    store.add_message(cid, "assistant", "a1 again", parent_id=q1)
    store.show_version(cid, store.messages(cid)[1]["id"], -1)
    assert contents(store, cid) == ["q1", "a1", "q2", "a2"]
    store.show_version(cid, a1, 1)
    assert contents(store, cid) == ["q1", "a1 again"]
    store.show_version(cid, q1, 1)
    assert contents(store, cid) == ["q1 edited", "b1"]
    store.show_version(cid, q1b, 1)  # past the last version: nothing changes
    assert contents(store, cid) == ["q1 edited", "b1"]
    store.show_version(cid, q1b, -1)
    assert contents(store, cid) == ["q1", "a1 again"]  # each branch remembers what was shown below it


def test_a_deleted_message_comes_back_on_undo_and_goes_on_purge(store):
    cid = store.create()
    q = store.add_message(cid, "user", "q")
    store.add_message(cid, "assistant", "first")
    second = store.add_message(cid, "assistant", "second", parent_id=q)
    leaf = store.delete_message(cid, second)
    assert contents(store, cid) == ["q", "first"]
    assert "second" not in [m["content"] for m in store.tree(cid)]
    assert [c["id"] for c in store.conversations(search="second")] == []  # nor found by search
    store.undelete_message(cid, second, leaf)
    assert contents(store, cid) == ["q", "second"]
    store.delete_message(cid, q)
    assert contents(store, cid) == []
    store.purge_deleted()
    assert (
        store.tree(cid) == []
        and sqlite3.connect(store.path).execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0
    )  # the replies under it went too


# ---- export and import ----------------------------------------------------------------------------


def test_json_export_round_trips_every_branch(store):
    cid = store.create("Trip", system_prompt="Be kind.", enable_thinking=False)
    q = store.add_message(cid, "user", "hello <b>there</b> ```")
    store.add_message(cid, "assistant", "one", "thinking…", {"stop_reason": "length", "new_tokens": 3})
    store.add_message(cid, "assistant", "two", parent_id=q)
    store.add_message(cid, "user", "ünïcode 😀")
    store.show_version(cid, store.messages(cid)[1]["id"], -1)  # the first reply's branch is shown

    text = to_json(store, cid)
    copy = from_json(store, text)
    assert copy != cid
    assert store.conversation(copy) | {"id": cid, "updated": 0} == store.conversation(cid) | {"updated": 0}

    def shape(conversation_id):
        tree = store.tree(conversation_id)
        index = {m["id"]: i for i, m in enumerate(tree)}
        return [(index.get(m["parent_id"]), m["role"], m["content"], m["reasoning"], m["stats"]) for m in tree]

    assert shape(copy) == shape(cid)
    assert contents(store, copy) == contents(store, cid) == ["hello <b>there</b> ```", "one"]
    assert json.loads(to_json(store, copy))["messages"][0]["content"] == "hello <b>there</b> ```"


def test_markdown_export_is_the_shown_branch(store):
    cid = store.create("Colours", system_prompt="Be brief.")
    q = store.add_message(cid, "user", "Name a colour")
    store.add_message(cid, "assistant", "Blue.", "Pick one.")
    store.add_message(cid, "assistant", "Red.", parent_id=q)
    markdown = to_markdown(store, cid)
    assert markdown.startswith("# Colours\n")
    assert "> Be brief." in markdown and "## You\n\nName a colour" in markdown and "## Assistant\n\nRed." in markdown
    assert "Blue." not in markdown and "Pick one." not in markdown


@pytest.mark.parametrize(
    "text, says",
    [
        ("not json", "not JSON"),
        ('{"title": "x"}', "not a chat exported by MoE Desk"),
        ('{"format": "moe-desk-chat", "version": 99, "messages": []}', "version 99"),
        (
            '{"format": "moe-desk-chat", "version": 1, "messages": [{"id": 1, "role": "system", "content": ""}]}',
            "damaged",
        ),
        (
            '{"format": "moe-desk-chat", "version": 1, "messages": [{"id": 2, "parent_id": 1, "role": "user"}]}',
            "missing message",
        ),
    ],
)
def test_import_refuses_what_is_not_an_export_and_says_why(store, text, says):
    before = store.conversations()
    with pytest.raises(ChatImportError, match=says):
        from_json(store, text)
    assert store.conversations() == before


# ---- the page -------------------------------------------------------------------------------------


def test_continue_grows_the_cut_reply_in_place(qtbot, page, store, fake):
    cid = page.current_conversation_id()
    send(qtbot, page, "Write a story")
    fake.reply("Once upon a", stop_reason="length")
    bubble = page.transcript.bubbles[-1]
    assert bubble.continue_button.isVisibleTo(bubble)
    cut_id = store.messages(cid)[-1]["id"]

    qtbot.mouseClick(bubble.continue_button, Qt.MouseButton.LeftButton)
    history, _ = fake.continued[-1]
    assert history == [{"role": "user", "content": "Write a story"}, {"role": "assistant", "content": "Once upon a"}]
    assert not page.send_button.isEnabled() and not bubble.continue_button.isVisibleTo(bubble)
    fake.start_reply()
    fake.stream(answer=[" time"])
    qtbot.waitUntil(lambda: shown_texts(page)[-1] == "Once upon a time")
    fake.finish("Once upon a time, the end.")

    [user, reply] = store.messages(cid)
    assert reply["id"] == cut_id and reply["content"] == "Once upon a time, the end." and reply["versions"] == 1
    assert shown_texts(page) == ["Write a story", "Once upon a time, the end."]
    assert not page.transcript.bubbles[-1].continue_button.isVisibleTo(page.transcript.bubbles[-1])  # eos: done


def test_a_continue_that_fails_keeps_what_the_reply_had(qtbot, page, store, fake):
    cid = page.current_conversation_id()
    send(qtbot, page, "Count")
    fake.reply("1, 2, 3", stop_reason="cancelled")
    qtbot.mouseClick(page.transcript.bubbles[-1].continue_button, Qt.MouseButton.LeftButton)
    fake.finish("", stop_reason="error", error="This reply can no longer be continued.")
    assert contents(store, cid) == ["Count", "1, 2, 3"]
    assert shown_texts(page)[-1] == "1, 2, 3"
    assert page.transcript.bubbles[-1].error_label.text() == "This reply can no longer be continued."


def test_continue_is_offered_only_for_a_cut_last_reply(qtbot, page, fake):
    send(qtbot, page, "One")
    fake.reply("cut", stop_reason="length")
    send(qtbot, page, "Two")
    fake.reply("whole")
    first, last = page.transcript.bubbles[1], page.transcript.bubbles[3]
    assert not first.continue_button.isVisibleTo(first) and not last.continue_button.isVisibleTo(last)


def test_deleting_a_reply_asks_and_undo_brings_it_back(qtbot, page, store, fake, monkeypatch):
    cid = page.current_conversation_id()
    send(qtbot, page, "Hi")
    fake.reply("Hello!")
    reply = page.transcript.bubbles[-1]

    monkeypatch.setattr(QMessageBox, "question", lambda *args: QMessageBox.StandardButton.No)
    qtbot.mouseClick(reply.delete_button, Qt.MouseButton.LeftButton)
    assert contents(store, cid) == ["Hi", "Hello!"]  # the user said no
    answer_yes(monkeypatch)
    qtbot.mouseClick(reply.delete_button, Qt.MouseButton.LeftButton)
    assert contents(store, cid) == ["Hi"] and shown_texts(page) == ["Hi"]
    assert page.undo_bar.isVisibleTo(page) and page._undo_timer.interval() == UNDO_MS

    qtbot.mouseClick(page.undo_button, Qt.MouseButton.LeftButton)
    assert contents(store, cid) == ["Hi", "Hello!"] and shown_texts(page) == ["Hi", "Hello!"]
    assert not page.undo_bar.isVisibleTo(page)


def test_a_delete_not_undone_in_time_is_final(qtbot, page, store, fake, monkeypatch):
    cid = page.current_conversation_id()
    send(qtbot, page, "Hi")
    fake.reply("Hello!")
    answer_yes(monkeypatch)
    qtbot.mouseClick(page.transcript.bubbles[0].delete_button, Qt.MouseButton.LeftButton)
    assert contents(store, cid) == [] and page._undo_timer.isActive()
    page._undo_timer.timeout.emit()  # the undo's time runs out
    assert not page.undo_bar.isVisibleTo(page) and store.tree(cid) == []
    qtbot.mouseClick(page.undo_button, Qt.MouseButton.LeftButton)  # too late: nothing comes back
    assert store.tree(cid) == []


def test_deleting_a_chat_can_be_undone(qtbot, page, store, fake, monkeypatch):
    first = page.current_conversation_id()
    send(qtbot, page, "Keep me")
    fake.reply("Kept.")
    page.new_chat()
    second = page.current_conversation_id()
    answer_yes(monkeypatch)
    assert page.conversation_list.delete(first)
    assert [c["id"] for c in store.conversations()] == [second] and page.undo_bar.isVisibleTo(page)

    qtbot.mouseClick(page.undo_button, Qt.MouseButton.LeftButton)
    assert page.current_conversation_id() == first and shown_texts(page) == ["Keep me", "Kept."]
    assert {c["id"] for c in store.conversations()} == {first, second}

    assert page.conversation_list.delete(first)
    assert page.conversation_list.delete(second)  # a second delete makes the first one final
    assert store.conversation(first) is None
    qtbot.mouseClick(page.undo_button, Qt.MouseButton.LeftButton)
    ids = [c["id"] for c in store.conversations()]
    assert second in ids and first not in ids and store.tree(first) == []  # the last delete came back, not the first


def test_regenerate_then_delete_the_new_version_shows_the_old_one(qtbot, page, store, fake, monkeypatch):
    cid = page.current_conversation_id()
    send(qtbot, page, "Name a colour")
    fake.reply("Blue.")
    qtbot.mouseClick(page.transcript.bubbles[-1].regenerate_button, Qt.MouseButton.LeftButton)
    fake.reply("Red.")
    assert page.transcript.bubbles[-1].pager.label.text() == "2/2"
    answer_yes(monkeypatch)
    qtbot.mouseClick(page.transcript.bubbles[-1].delete_button, Qt.MouseButton.LeftButton)
    assert shown_texts(page) == ["Name a colour", "Blue."]
    assert not page.transcript.bubbles[-1].pager.isVisibleTo(page.transcript.bubbles[-1])  # one version left
    qtbot.mouseClick(page.undo_button, Qt.MouseButton.LeftButton)
    assert shown_texts(page) == ["Name a colour", "Red."] and contents(store, cid)[-1] == "Red."


def test_paging_is_held_while_a_reply_streams(qtbot, page, store, fake):
    cid = page.current_conversation_id()
    send(qtbot, page, "Q")
    fake.reply("A1")
    qtbot.mouseClick(page.transcript.bubbles[-1].regenerate_button, Qt.MouseButton.LeftButton)
    fake.reply("A2")
    send(qtbot, page, "Next")
    fake.start_reply()
    pager = page.transcript.bubbles[1].pager
    assert not pager.previous_button.isEnabled()
    page.show_version(1, -1)  # even asked directly, the branch does not change under a streaming reply
    fake.finish("done")
    assert contents(store, cid) == ["Q", "A2", "Next", "done"]
    assert chat_history(store.messages(cid))[:2] == [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A2"},
    ]


def test_export_and_import_from_the_page(qtbot, page, store, fake, tmp_path, monkeypatch):
    from PySide6.QtWidgets import QFileDialog

    send(qtbot, page, "Hi")
    fake.reply("Hello!")
    qtbot.mouseClick(page.transcript.bubbles[-1].regenerate_button, Qt.MouseButton.LeftButton)
    fake.reply("Hey!")
    for kind, name in (("markdown", "chat.md"), ("json", "chat.json")):
        monkeypatch.setattr(QFileDialog, "getSaveFileName", lambda *args, name=name: (str(tmp_path / name), ""))
        page.export_chat(kind)
    assert "## Assistant\n\nHey!" in (tmp_path / "chat.md").read_text(encoding="utf-8")
    assert [m["content"] for m in json.loads((tmp_path / "chat.json").read_text())["messages"]] == [
        "Hi",
        "Hello!",
        "Hey!",
    ]

    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *args: (str(tmp_path / "chat.json"), ""))
    original = page.current_conversation_id()
    page.import_chat()
    imported = page.current_conversation_id()
    assert imported != original and shown_texts(page) == ["Hi", "Hey!"]
    assert page.transcript.bubbles[-1].pager.label.text() == "2/2"

    (tmp_path / "bad.json").write_text("{}", encoding="utf-8")
    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *args: (str(tmp_path / "bad.json"), ""))
    warnings = []
    monkeypatch.setattr(QMessageBox, "warning", lambda parent, title, text: warnings.append(text))
    page.import_chat()
    assert page.current_conversation_id() == imported and "was not imported" in warnings[0]
    monkeypatch.setattr(QFileDialog, "getSaveFileName", lambda *args: (str(tmp_path / "missing" / "x.md"), ""))
    page.export_chat("markdown")
    assert "could not be written" in warnings[1] and "Choose another folder" in warnings[1]
