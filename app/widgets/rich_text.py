"""Markdown to the rich text Qt labels show, safely: raw HTML from a model or a user is text, only web and mail
links are links, no image is fetched; and Pygments token colours for code blocks, in the app's theme."""

from __future__ import annotations

import html
import re
from collections import defaultdict

from markdown_it import MarkdownIt
from pygments.lexers import get_lexer_by_name
from pygments.styles import get_style_by_name
from pygments.util import ClassNotFound
from PySide6.QtCore import QUrl
from PySide6.QtGui import QColor, QDesktopServices, QFont, QSyntaxHighlighter, QTextCharFormat, QTextDocument

from app.theme import theme_colours

SAFE_LINK_SCHEMES = ("http", "https", "mailto")
QUOTE_BAR_PX = 3
LONG_WORD_CHARS = 24  # a longer run without spaces gets break points, so a narrow window wraps it
BREAK_POINT = "\u200b"  # zero-width space: Qt's labels wrap only at word boundaries
_LONG_WORD = re.compile(rf"\S{{{LONG_WORD_CHARS + 1},}}")


def is_safe_link(url: str) -> bool:
    """Whether a link may be opened: a web or mail address, never javascript:, file: or data:."""
    return QUrl(url.strip()).scheme().lower() in SAFE_LINK_SCHEMES


def open_link(url: str) -> bool:
    """Open a safe link in the user's browser or mail program; False (nothing opened) for any other."""
    if not is_safe_link(url):
        return False
    return QDesktopServices.openUrl(QUrl(url.strip()))


def _parser(colours: dict) -> MarkdownIt:
    # html=False: a tag in the text is escaped and shown as typed; images are links' text, never fetched
    parser = MarkdownIt("commonmark", {"html": False}).enable(["table", "strikethrough"]).disable("image")
    parser.validateLink = is_safe_link
    rules = parser.renderer.rules

    def code_inline(tokens, idx, _options, _env):
        return (
            f'<code style="background-color:{colours["code_background"]};">&nbsp;'
            f"{html.escape(tokens[idx].content)}&nbsp;</code>"
        )

    def code_block(tokens, idx, _options, _env):
        return (
            f'<pre style="background-color:{colours["code_background"]};">'
            f"{html.escape(tokens[idx].content.rstrip(chr(10)))}</pre>"
        )

    def blockquote_open(_tokens, _idx, _options, _env):
        # Qt's rich text draws borders only on tables: the quote's bar is a narrow coloured cell
        return (
            f'<table cellspacing="0" cellpadding="0" style="margin-top:4px; margin-bottom:4px;"><tr>'
            f'<td width="{QUOTE_BAR_PX}" bgcolor="{colours["quote_bar"]}"></td>'
            f'<td style="padding-left:10px; color:{colours["muted"]};">'
        )

    def blockquote_close(_tokens, _idx, _options, _env):
        return "</td></tr></table>"

    rules.update(
        code_inline=code_inline,
        code_block=code_block,
        fence=code_block,
        blockquote_open=blockquote_open,
        blockquote_close=blockquote_close,
    )
    return parser


_parsers: dict[tuple, MarkdownIt] = {}  # one per theme: the renderer rules carry its colours


def breakable(text: str) -> str:
    """Text with a zero-width break point every LONG_WORD_CHARS characters of a long word (URLs, hashes)."""
    return _LONG_WORD.sub(
        lambda m: BREAK_POINT.join(m[0][i : i + LONG_WORD_CHARS] for i in range(0, len(m[0]), LONG_WORD_CHARS)), text
    )


def markdown_html(source: str, theme: str | None = None) -> str:
    """Markdown as rich text in the colours of `theme` (the app's theme when None)."""
    colours = theme_colours(theme)
    key = tuple(sorted(colours.items()))
    if key not in _parsers:
        _parsers[key] = _parser(colours)
    parser = _parsers[key]
    tokens = parser.parse(source)
    for token in tokens:
        for child in token.children or ():
            if child.type in ("text", "code_inline"):
                child.content = breakable(child.content)
    return parser.renderer.render(tokens, parser.options, {})


def natural_width(rich_text: str, font: QFont) -> float:
    """How wide rich text lays out with no wrapping forced (its longest line)."""
    document = QTextDocument()
    document.setDefaultFont(font)
    document.setDocumentMargin(0)
    document.setHtml(rich_text)
    return document.idealWidth()


class CodeHighlighter(QSyntaxHighlighter):
    """Token colours from Pygments for one code block, lexed whole so strings and comments can span lines."""

    def __init__(self, document: QTextDocument):
        super().__init__(document)
        self.language = ""
        self._spans: dict[int, list[tuple[int, int, QTextCharFormat]]] = {}

    def highlight(self, language: str) -> None:
        """Lex the document's text as `language` (no colours for an unknown one) and repaint it."""
        self.language = language
        self._spans = self._lex(self.document().toPlainText(), language)
        self.rehighlight()

    def _lex(self, text: str, language: str) -> dict[int, list[tuple[int, int, QTextCharFormat]]]:
        try:
            lexer = get_lexer_by_name(language, stripnl=False, ensurenl=False) if language else None
        except ClassNotFound:
            lexer = None
        if lexer is None:
            return {}
        style = get_style_by_name(theme_colours()["pygments_style"])
        formats: dict = {}
        spans = defaultdict(list)
        block = column = 0
        for token, value in lexer.get_tokens(text):
            if token not in formats:
                formats[token] = _char_format(style.style_for_token(token))
            for i, piece in enumerate(value.split("\n")):
                if i:
                    block, column = block + 1, 0
                if piece and formats[token] is not None:
                    spans[block].append((column, len(piece), formats[token]))
                column += len(piece)
        return dict(spans)

    def highlightBlock(self, text: str) -> None:
        for start, length, char_format in self._spans.get(self.currentBlock().blockNumber(), ()):
            self.setFormat(start, length, char_format)


def _char_format(token_style: dict) -> QTextCharFormat | None:
    """A Pygments token style as a Qt character format, None for plain text."""
    if not (token_style["color"] or token_style["bold"] or token_style["italic"]):
        return None
    char_format = QTextCharFormat()
    if token_style["color"]:
        char_format.setForeground(QColor(f"#{token_style['color']}"))
    if token_style["bold"]:
        char_format.setFontWeight(QFont.Weight.Bold)
    if token_style["italic"]:
        char_format.setFontItalic(True)
    return char_format
