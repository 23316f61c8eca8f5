"""Issue 25's small things on the Chat page: each one a user tripped over, driven with pytest-qt."""

from __future__ import annotations

from PySide6.QtCore import QSettings, Qt
from PySide6.QtGui import QKeySequence, QShortcut

from app.__main__ import private_settings
from app.pages.chat import BUSY_NOTE_REPLY, SYSTEM_PROMPT_SET, SYSTEM_PROMPT_UNSET
from app.settings import AppSettings
from app.widgets import conversation_list
from app.widgets.conversation_list import CONVERSATION_ID_ROLE
from app.widgets.transcript import UserBubble


def send(qtbot, page, text):
    qtbot.keyClicks(page.input, text)
    qtbot.keyClick(page.input, Qt.Key.Key_Return)


def test_new_chat_reuses_an_empty_chat(qtbot, page, store, fake):
    first = page.current_conversation_id()
    page.new_chat()
    page.new_chat()
    assert page.current_conversation_id() == first and len(store.conversations()) == 1
    send(qtbot, page, "hello")
    fake.reply("hi")
    page.new_chat()
    second = page.current_conversation_id()
    page.new_chat()
    assert second != first and page.current_conversation_id() == second and len(store.conversations()) == 2


def test_an_empty_chat_shows_a_hint_that_goes_with_the_first_message(qtbot, page, fake):
    hint = page.transcript.empty_hint
    assert hint.isVisibleTo(page) and "For example" in hint.text()
    send(qtbot, page, "hello")
    assert not hint.isVisibleTo(page)


def test_enter_during_a_reply_says_why_nothing_is_sent(qtbot, page, fake):
    send(qtbot, page, "first")
    fake.start_reply()
    send(qtbot, page, "second")
    assert len(fake.sent) == 1 and page.input.toPlainText() == "second"  # kept, not lost
    assert page.busy_note.isVisibleTo(page) and page.busy_note.text() == BUSY_NOTE_REPLY
    fake.finish("done")
    assert not page.busy_note.isVisibleTo(page)
    qtbot.keyClick(page.input, Qt.Key.Key_Return)
    assert [text for _, text, _ in fake.sent] == ["first", "second"]


def test_escape_cancels_an_inline_edit_even_with_the_window_s_stop_shortcut(qtbot, page, fake):
    stops = []
    QShortcut(
        QKeySequence("Esc"), page, activated=lambda: stops.append(1), context=Qt.ShortcutContext.ApplicationShortcut
    )
    send(qtbot, page, "original")
    fake.reply("ok")
    bubble = next(b for b in page.transcript.bubbles if isinstance(b, UserBubble))
    assert bubble.text_label.isVisibleTo(bubble)
    bubble.start_editing()
    assert not bubble.text_label.isVisibleTo(bubble)
    qtbot.keyClicks(bubble.editor, " changed")
    qtbot.keyClick(bubble.editor, Qt.Key.Key_Escape)
    assert bubble.editor is None and bubble.text_label.isVisibleTo(bubble) and stops == []
    assert [text for _, text, _ in fake.sent] == ["original"]  # nothing was resent


def test_the_system_prompt_button_says_a_prompt_is_set(qtbot, page, store):
    assert page.system_prompt_button.text() == SYSTEM_PROMPT_UNSET
    page._set_system_prompt(page.current_conversation_id(), "Answer like a pirate.")
    assert page.system_prompt_button.text() == SYSTEM_PROMPT_SET
    page.new_chat()  # the empty chat is reused, and it has the prompt
    assert page.system_prompt_button.text() == SYSTEM_PROMPT_SET
    send(qtbot, page, "x")
    page.conversation_list.refresh()
    other = store.create()
    page.open_conversation(other)
    assert page.system_prompt_button.text() == SYSTEM_PROMPT_UNSET


def test_a_search_without_matches_says_so(qtbot, page, fake):
    send(qtbot, page, "about llamas")
    fake.reply("ok")
    panel = page.conversation_list
    panel.search_field.setText("llama")
    assert not panel.no_results.isVisibleTo(page)
    panel.search_field.setText("<b>zebra</b>")
    assert panel.no_results.isVisibleTo(page) and "“<b>zebra</b>”" in panel.no_results.text()
    assert panel.no_results.textFormat() == Qt.TextFormat.PlainText
    panel.search_field.clear()
    assert not panel.no_results.isVisibleTo(page)


def test_the_smoke_test_s_settings_are_a_copy_that_changes_nothing_of_the_user_s(tmp_path):
    user = AppSettings(QSettings(str(tmp_path / "user.ini"), QSettings.Format.IniFormat))
    user.set("preset", "8gb")
    user.set("window_geometry", "AAAA")
    private = private_settings(user, tmp_path / "smoke" / "settings.ini")
    assert private.get("preset") == "8gb" and private.get("window_geometry") == ""
    private.set("preset", "4gb")
    private.set("window_geometry", "BBBB")
    assert user.get("preset") == "8gb" and user.get("window_geometry") == "AAAA"


class _MenuClosedWithoutAChoice:
    """A context menu the user closes without choosing (a real one would wait for the user)."""

    def __init__(self, parent):
        del parent

    def addAction(self, text):  # noqa: N802 (Qt's name)
        return text

    def exec(self, where):
        del where

    def deleteLater(self):  # noqa: N802 (Qt's name)
        pass


def test_right_clicking_another_chat_keeps_the_open_one(qtbot, page, fake, monkeypatch):
    """The menu acts on the chat under the pointer; the transcript stays the open chat's (it painted two before)."""
    send(qtbot, page, "first chat")
    fake.reply("one")
    first = page.current_conversation_id()
    page.new_chat()
    send(qtbot, page, "second chat")
    fake.reply("two")
    second = page.current_conversation_id()
    panel = page.conversation_list
    view = panel.view
    other = view.visualRect(panel.model.index(panel.model.row_of(first))).center()
    asked = []
    view.customContextMenuRequested.connect(lambda position: asked.append(view.indexAt(position)))
    monkeypatch.setattr(conversation_list, "QMenu", _MenuClosedWithoutAChoice)
    qtbot.mouseClick(view.viewport(), Qt.MouseButton.RightButton, pos=other)
    view.customContextMenuRequested.emit(other)  # what Qt sends after the press on a desktop
    assert page.current_conversation_id() == second
    assert asked and asked[0].data(CONVERSATION_ID_ROLE) == first
    qtbot.mouseClick(view.viewport(), Qt.MouseButton.LeftButton, pos=other)
    assert page.current_conversation_id() == first
