"""How the app looks: the theme's states, safe Markdown, code colours, and every page fitting small windows."""

from __future__ import annotations

import pytest
from PySide6.QtGui import QPalette
from pygments.styles import get_style_by_name
from pygments.token import Keyword
from PySide6.QtWidgets import QApplication

from app.theme import COLOURS, apply_theme, theme_colours
from app.widgets.rich_text import is_safe_link, markdown_html, open_link
from app.widgets.transcript import AssistantBubble, Block, CodeBlock, MarkdownPart, UserBubble

HOSTILE_REPLY = ('Look: <img src="https://evil.example/track.png"> <a href="javascript:alert(1)">click</a> '
                 '<script>alert(2)</script>\n\n<iframe src="https://evil.example"></iframe>\n\n'
                 '[docs](javascript:alert(3)) [site](https://example.com)')


@pytest.fixture(params=["light", "dark"])
def theme(request):
    app = QApplication.instance()
    apply_theme(app, request.param)
    yield request.param
    apply_theme(app, "light")


def test_every_theme_has_a_disabled_group_and_readable_links(qtbot, theme):
    palette = QApplication.instance().palette()
    roles, disabled, active = QPalette.ColorRole, QPalette.ColorGroup.Disabled, QPalette.ColorGroup.Active
    for role in (roles.ButtonText, roles.Text, roles.WindowText):
        assert palette.color(disabled, role) != palette.color(active, role)  # a disabled button looks disabled
    assert palette.color(active, roles.Link).name() == COLOURS[theme]["link"]
    link, base = palette.color(active, roles.Link), palette.color(active, roles.Base)
    assert abs(link.lightness() - base.lightness()) > 90  # readable on the theme's background
    style = QApplication.instance().styleSheet()
    for state in (":hover", ":pressed", ":checked", ":focus", ":disabled"):
        assert f"QPushButton{state}" in style


def test_raw_html_from_a_model_is_shown_as_text(qtbot, theme):
    bubble = AssistantBubble({"role": "assistant", "content": HOSTILE_REPLY, "reasoning": "", "stats": {}})
    qtbot.addWidget(bubble)
    (part,) = [p for p in bubble.answer_view.parts if isinstance(p, MarkdownPart)]
    rich = part.text()
    for tag in ("<img", "<script", "<iframe", 'href="javascript'):
        assert tag not in rich
    for shown in ("&lt;img src=&quot;https://evil.example/track.png&quot;&gt;", "&lt;script&gt;alert(2)",
                  "&lt;a href=&quot;javascript:alert(1)&quot;&gt;click&lt;/a&gt;"):
        assert shown in rich
    assert "[docs](javascript:alert(3))" in rich  # a javascript: Markdown link is not a link
    assert '<a href="https://example.com">site</a>' in rich


def test_only_web_and_mail_links_open(monkeypatch):
    opened = []
    monkeypatch.setattr("app.widgets.rich_text.QDesktopServices.openUrl", lambda url: opened.append(url.toString())
                        or True)
    for url in ("javascript:alert(1)", "file:///etc/passwd", "data:text/html,x", " JAVASCRIPT:alert(1)"):
        assert not is_safe_link(url) and not open_link(url)
    assert open_link("https://example.com/a") and open_link("mailto:a@example.com")
    assert opened == ["https://example.com/a", "mailto:a@example.com"]


def test_inline_code_and_quotes_are_styled_in_the_theme(theme):
    colours = COLOURS[theme]
    rich = markdown_html("Run `ls`.\n\n> quoted", theme)
    assert f'background-color:{colours["code_background"]}' in rich and "ls" in rich
    assert f'bgcolor="{colours["quote_bar"]}"' in rich  # the quote's bar


def test_the_users_own_markdown_is_rendered(qtbot):
    bubble = UserBubble("Make it **bold** and <b>not this</b>")
    qtbot.addWidget(bubble)
    rich = bubble.text_label.text()
    assert "<strong>bold</strong>" in rich and "&lt;b&gt;not this&lt;/b&gt;" in rich


def _colours_in(block: CodeBlock) -> dict[str, str]:
    """Each highlighted piece of the block's first line, with its colour."""
    line = block.editor.document().firstBlock()
    return {line.text()[r.start:r.start + r.length]: r.format.foreground().color().name()
            for r in line.layout().formats()}


def test_a_python_block_gets_token_colours(qtbot, theme):
    block = CodeBlock()
    qtbot.addWidget(block)
    block.show_block(Block("code", 'def greet(name):\n    return "hi " + name  # say it', "python"))
    colours = _colours_in(block)
    assert "def" in colours and "greet" in colours and colours["def"] != colours["greet"]
    assert colours["def"] == "#" + get_style_by_name(theme_colours(theme)["pygments_style"]).style_for_token(
        Keyword)["color"]
    plain = CodeBlock()
    qtbot.addWidget(plain)
    plain.show_block(Block("code", "def greet(name):", "no-such-language"))
    assert _colours_in(plain) == {}  # an unknown language is plain text, not an error
