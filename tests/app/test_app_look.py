"""How the app looks: the theme's states, safe Markdown, code colours, and every page fitting small windows."""

from __future__ import annotations

import pytest
from pygments.styles import get_style_by_name
from pygments.token import Keyword
from PySide6.QtCore import QPoint, QRect, QSize, Qt
from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QAbstractButton, QAbstractScrollArea, QApplication, QLabel, QWidget

from app.main_window import PAGES, MainWindow, first_window_size
from app.pages.chat import DEFAULT_SPLITTER_SIZES
from app.storage import ConversationStore
from app.theme import COLOURS, apply_theme, theme_colours
from app.widgets.rich_text import BREAK_POINT, breakable, is_safe_link, markdown_html, open_link
from app.widgets.transcript import AssistantBubble, Block, CodeBlock, MarkdownPart, UserBubble

HOSTILE_REPLY = (
    'Look: <img src="https://evil.example/track.png"> <a href="javascript:alert(1)">click</a> '
    '<script>alert(2)</script>\n\n<iframe src="https://evil.example"></iframe>\n\n'
    "[docs](javascript:alert(3)) [site](https://example.com)"
)


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
    rich = part.text().replace(BREAK_POINT, "")  # long words get break points; the text is what is checked
    for tag in ("<img", "<script", "<iframe", 'href="javascript'):
        assert tag not in rich
    for shown in (
        "&lt;img src=&quot;https://evil.example/track.png&quot;&gt;",
        "&lt;script&gt;alert(2)",
        "&lt;a href=&quot;javascript:alert(1)&quot;&gt;click&lt;/a&gt;",
    ):
        assert shown in rich
    assert "[docs](javascript:alert(3))" in rich  # a javascript: Markdown link is not a link
    assert '<a href="https://example.com">site</a>' in rich


def test_only_web_and_mail_links_open(monkeypatch):
    opened = []
    monkeypatch.setattr(
        "app.widgets.rich_text.QDesktopServices.openUrl", lambda url: opened.append(url.toString()) or True
    )
    for url in ("javascript:alert(1)", "file:///etc/passwd", "data:text/html,x", " JAVASCRIPT:alert(1)"):
        assert not is_safe_link(url) and not open_link(url)
    assert open_link("https://example.com/a") and open_link("mailto:a@example.com")
    assert opened == ["https://example.com/a", "mailto:a@example.com"]


def test_inline_code_and_quotes_are_styled_in_the_theme(theme):
    colours = COLOURS[theme]
    rich = markdown_html("Run `ls`.\n\n> quoted", theme)
    assert f"background-color:{colours['code_background']}" in rich and "ls" in rich
    assert f'bgcolor="{colours["quote_bar"]}"' in rich  # the quote's bar


def test_a_theme_switch_recolours_shown_replies(qtbot):
    bubble = AssistantBubble(
        {"role": "assistant", "content": "Run `ls`.\n\n```python\ndef f(): pass\n```", "reasoning": "", "stats": {}}
    )
    qtbot.addWidget(bubble)
    prose, code = bubble.answer_view.parts
    apply_theme(QApplication.instance(), "dark")
    try:
        assert COLOURS["dark"]["code_background"] in prose.text()
        dark_keyword = get_style_by_name(COLOURS["dark"]["pygments_style"]).style_for_token(Keyword)["color"]
        assert _colours_in(code)["def"] == f"#{dark_keyword}"
    finally:
        apply_theme(QApplication.instance(), "light")
    assert COLOURS["light"]["code_background"] in prose.text()


def test_the_users_own_markdown_is_rendered(qtbot):
    bubble = UserBubble("Make it **bold** and <b>not this</b>")
    qtbot.addWidget(bubble)
    rich = bubble.text_label.text()
    assert "<strong>bold</strong>" in rich and "&lt;b&gt;not this&lt;/b&gt;" in rich


def test_long_words_get_break_points_but_keep_their_text():
    word = "x" * 60
    assert breakable(f"a {word} b").replace(BREAK_POINT, "") == f"a {word} b"
    assert breakable(word).count(BREAK_POINT) == 2 and breakable("short words stay") == "short words stay"


def _colours_in(block: CodeBlock) -> dict[str, str]:
    """Each highlighted piece of the block's first line, with its colour."""
    line = block.editor.document().firstBlock()
    return {
        line.text()[r.start : r.start + r.length]: r.format.foreground().color().name() for r in line.layout().formats()
    }


def test_a_python_block_gets_token_colours(qtbot, theme):
    block = CodeBlock()
    qtbot.addWidget(block)
    block.show_block(Block("code", 'def greet(name):\n    return "hi " + name  # say it', "python"))
    colours = _colours_in(block)
    assert "def" in colours and "greet" in colours and colours["def"] != colours["greet"]
    assert (
        colours["def"]
        == "#" + get_style_by_name(theme_colours(theme)["pygments_style"]).style_for_token(Keyword)["color"]
    )
    plain = CodeBlock()
    qtbot.addWidget(plain)
    plain.show_block(Block("code", "def greet(name):", "no-such-language"))
    assert _colours_in(plain) == {}  # an unknown language is plain text, not an error


# ---- every page fits small windows --------------------------------------------------------------

LONG_WORD = "supercalifragilisticexpialidocious" * 3
FIT_SIZES = [QSize(1092, 614), QSize(1024, 640), QSize(800, 500)]  # 1366x768 @125 %, target, 1600x1000 @200 %


def _seed_chat(store) -> None:
    chat = store.create()
    store.rename(chat, "A chat whose title is much longer than the header has room for at small widths")
    store.add_message(chat, "user", f"Short? {LONG_WORD}")
    store.add_message(
        chat,
        "assistant",
        f"Prose with {LONG_WORD} and a long line of code:\n\n```python\n"
        f"print('{'x' * 300}')\n```\n\n> a quote\n\n| a | b |\n|---|---|\n| 1 | 2 |",
        "",
        {
            "new_tokens": 12345,
            "time_to_first_token_s": 1.5,
            "decode_tokens_per_s": 12.3,
            "stop_reason": "max_tokens",
            "remote": "a remote engine with a long name",
        },
    )


def _scroll_view_of(widget: QWidget, window: QWidget) -> QAbstractScrollArea | None:
    """The innermost scroll area `widget` sits in (its content may lie beyond the visible part)."""
    parent = widget.parentWidget()
    while parent is not None and parent is not window:
        if isinstance(parent, QAbstractScrollArea) and parent.viewport().isAncestorOf(widget):
            return parent
        parent = parent.parentWidget()
    return None


def clipped_widgets(window: QWidget) -> list[str]:
    """Each visible widget that is cut off by its window, its parent, or (sideways) by a scroll area that
    cannot scroll sideways; and each button or label laid out smaller than its minimum size."""
    problems = []
    for widget in window.findChildren(QWidget):
        if widget.isWindow() or not widget.isVisibleTo(window) or widget.width() == 0:
            continue
        text = widget.text() if isinstance(widget, (QAbstractButton, QLabel)) else ""
        name = f"{type(widget).__name__} {widget.objectName() or text!r:.40}"
        rect = QRect(widget.mapTo(window, QPoint(0, 0)), widget.size())
        area = _scroll_view_of(widget, window)
        if area is None:
            if not window.rect().contains(rect):
                problems.append(f"{name} at {rect.getRect()} outside the window {window.size().toTuple()}")
        elif area.horizontalScrollBarPolicy() == Qt.ScrollBarPolicy.ScrollBarAlwaysOff:
            view = QRect(area.viewport().mapTo(window, QPoint(0, 0)), area.viewport().size())
            if rect.left() < view.left() or rect.right() > view.right():
                problems.append(f"{name} at {rect.getRect()} cut off sideways by {view.getRect()}")
        if isinstance(widget, (QAbstractButton, QLabel)) and (widget.width() < widget.minimumSizeHint().width()):
            problems.append(f"{name} squeezed to {widget.width()} < {widget.minimumSizeHint().width()} px")
    return problems


@pytest.fixture
def fit_window(qtbot, tmp_path, settings, tiny_checkpoint, monkeypatch):
    """fit_window(screen) -> a loaded main window on a fake screen of that size, with a chat that is hard to fit."""

    def make(screen: QSize) -> MainWindow:
        monkeypatch.setattr("app.main_window.available_geometry", lambda: QRect(QPoint(0, 0), screen))
        store = ConversationStore(tmp_path / f"{screen.width()}.sqlite3")
        _seed_chat(store)
        window = MainWindow(store, settings, tiny_checkpoint("qwen3_5_moe", "bf16"))
        qtbot.addWidget(window)
        with qtbot.waitSignal(window.worker.loaded, timeout=60000):
            window.show()
        qtbot.waitUntil(lambda: window.model_info is not None, timeout=10000)
        return window

    return make


@pytest.mark.parametrize("theme_name", ["light", "dark"])
def test_every_page_fits_small_windows(qtbot, fit_window, theme_name):
    apply_theme(QApplication.instance(), theme_name)
    window = fit_window(FIT_SIZES[-1])
    first = window.size()
    assert first.width() <= FIT_SIZES[-1].width() and first.height() <= FIT_SIZES[-1].height()
    problems = []
    try:
        for size in FIT_SIZES:
            window.resize(size)
            for page in PAGES:
                window.show_page(page)
                qtbot.wait(120)  # layouts settle, the transcript's throttled render runs
                if window.size() != size:
                    problems.append(f"{page} forces the window to {window.size().toTuple()}")
                problems += [f"{page} at {size.toTuple()}: {problem}" for problem in clipped_widgets(window)]
        assert not problems, "\n".join(problems)
    finally:
        apply_theme(QApplication.instance(), "light")
        window.close()


def test_size_maximized_state_and_splitter_are_remembered(qtbot, fit_window, settings):
    window = fit_window(QSize(1600, 1000))
    assert window.size() == first_window_size(QSize(1600, 1000)) == QSize(1200, 780)
    window.resize(780, 560)  # within the offscreen platform's own 800x600 screen, which restoreGeometry checks
    window.chat_page.splitter.setSizes([150, 630])
    qtbot.wait(50)
    kept = window.chat_page.splitter.sizes()
    window.close()
    assert settings.get("chat_splitter") == kept and kept[0] < DEFAULT_SPLITTER_SIZES[0]  # moved by the user
    again = fit_window(QSize(1600, 1000))
    assert again.size() == QSize(780, 560) and again.chat_page.splitter.sizes() == kept
    again.showMaximized()
    qtbot.waitUntil(again.isMaximized)
    again.close()
    third = fit_window(QSize(1600, 1000))
    assert third.isMaximized() or third.windowState() & Qt.WindowState.WindowMaximized
    third.close()


def test_a_saved_window_too_big_for_this_screen_is_fitted_again(qtbot, fit_window):
    window = fit_window(QSize(1600, 1000))
    window.resize(1500, 950)
    window.close()
    small = fit_window(QSize(800, 500))  # the same settings on a smaller (or more scaled) screen
    assert small.width() <= 800 and small.height() <= 500
    small.close()


def _icon_colours(icon, mode=None) -> set[tuple[int, int, int]]:
    """The colours of the icon's opaque pixels, rounded to a step of 8 (scaled drawing blends the odd edge)."""
    image = icon.pixmap(QSize(18, 18), mode or icon.Mode.Normal).toImage()
    return {
        tuple(round(c / 8) for c in image.pixelColor(x, y).getRgb()[:3])
        for x in range(image.width())
        for y in range(image.height())
        if image.pixelColor(x, y).alpha() == 255
    }


def _rounded(colour: str) -> set[tuple[int, int, int]]:
    return {tuple(round(c / 8) for c in QColor(colour).getRgb()[:3])}


def test_sidebar_icons_follow_the_theme(qtbot, fit_window):
    window = fit_window(QSize(1024, 640))
    for theme_name in ("dark", "light"):
        window._use_theme(theme_name)
        for row, page in enumerate(PAGES):
            icon = window.sidebar.item(row).icon()
            assert _icon_colours(icon) == _rounded(COLOURS[theme_name]["text"]), page  # drawn, in the text colour
            assert _icon_colours(icon, icon.Mode.Selected) == _rounded("#ffffff")  # on the selected row's accent
    window.close()
