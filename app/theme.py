"""Light and dark themes: a Fusion palette with every colour group (Disabled included) and style rules that give
buttons, fields and lists visible hover, pressed, checked, focus and disabled states (spin boxes and combo boxes
keep Fusion's own drawing, which follows the palette: a style sheet on them loses their arrows)."""

from __future__ import annotations

from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QApplication

COLOURS = {
    "light": {
        "window": "#f5f6f8",
        "base": "#ffffff",
        "text": "#1d1f23",
        "muted": "#6b7280",
        "accent": "#2f6fed",
        "sidebar": "#eceef2",
        "border": "#c9cdd4",
        "hover": "#e6ebf5",
        "pressed": "#d3dcee",
        "disabled_text": "#a3a8b0",
        "disabled_base": "#eef0f3",
        "link": "#1f5bd0",
        "link_visited": "#6b3fc4",
        "code_background": "#eceef2",
        "quote_bar": "#9aa4b5",
        "error": "#c53030",
        "pygments_style": "default",
    },
    "dark": {
        "window": "#1e2025",
        "base": "#26292f",
        "text": "#e6e8eb",
        "muted": "#9aa1ab",
        "accent": "#5b8def",
        "sidebar": "#17191d",
        "border": "#454a54",
        "hover": "#30343c",
        "pressed": "#3a4150",
        "disabled_text": "#666c76",
        "disabled_base": "#22252a",
        "link": "#8ab4ff",
        "link_visited": "#c3a6ff",
        "code_background": "#33373f",
        "quote_bar": "#6b7385",
        "error": "#ff7b72",
        "pygments_style": "monokai",
    },
}
FOCUS_RING_PX = 2


def theme_colours(name: str | None = None) -> dict:
    """The colours of theme `name`, or of the theme the running app uses when None."""
    if name is None:
        app = QApplication.instance()
        name = app.property("moedeskTheme") if app is not None else None
    return COLOURS.get(name or "light", COLOURS["light"])


def _palette(colours: dict) -> QPalette:
    palette = QPalette()
    roles = QPalette.ColorRole
    normal = {
        roles.Window: "window",
        roles.Base: "base",
        roles.AlternateBase: "window",
        roles.Text: "text",
        roles.WindowText: "text",
        roles.Button: "base",
        roles.ButtonText: "text",
        roles.Highlight: "accent",
        roles.PlaceholderText: "muted",
        roles.ToolTipBase: "base",
        roles.ToolTipText: "text",
        roles.Link: "link",
        roles.LinkVisited: "link_visited",
        roles.Mid: "border",
        roles.Dark: "border",
    }
    for role, key in normal.items():
        palette.setColor(role, QColor(colours[key]))
    palette.setColor(roles.HighlightedText, QColor("#ffffff"))
    palette.setColor(roles.BrightText, QColor("#ffffff"))
    disabled = QPalette.ColorGroup.Disabled
    for role in (roles.Text, roles.WindowText, roles.ButtonText, roles.PlaceholderText, roles.Link):
        palette.setColor(disabled, role, QColor(colours["disabled_text"]))
    for role in (roles.Base, roles.Button):
        palette.setColor(disabled, role, QColor(colours["disabled_base"]))
    palette.setColor(disabled, roles.Highlight, QColor(colours["border"]))
    # an unfocused window keeps its colours: the Inactive group follows Active
    return palette


def style_sheet(colours: dict) -> str:
    """The app-wide style rules for theme colours `colours`."""
    c = colours
    return f"""
        #sidebar {{ background: {c["sidebar"]}; border: none; outline: none; }}
        #sidebar::item {{ padding-left: 12px; border-radius: 6px; margin: 2px 6px; }}
        #sidebar::item:hover {{ background: {c["hover"]}; }}
        #sidebar::item:selected {{ background: {c["accent"]}; color: #ffffff; }}
        #sidebar:focus {{ border: 1px solid {c["accent"]}; }}
        QLabel[role="muted"] {{ color: {c["muted"]}; }}
        QLabel[role="error"] {{ color: {c["error"]}; }}
        QLabel[role="status"] {{ padding: 4px 10px; }}
        QPushButton {{ background: {c["base"]}; color: {c["text"]}; border: 1px solid {c["border"]};
            border-radius: 6px; padding: 4px 12px; min-height: 20px; }}
        QPushButton:hover {{ background: {c["hover"]}; }}
        QPushButton:pressed, QPushButton:checked {{ background: {c["pressed"]}; }}
        QPushButton:default {{ border-color: {c["accent"]}; }}
        QPushButton:focus {{ border: {FOCUS_RING_PX}px solid {c["accent"]}; padding: 3px 11px; }}
        QPushButton:disabled {{ background: {c["disabled_base"]}; color: {c["disabled_text"]};
            border-color: {c["disabled_base"]}; }}
        QToolButton {{ border: 1px solid transparent; border-radius: 4px; padding: 2px 6px; color: {c["text"]}; }}
        QToolButton:hover {{ background: {c["hover"]}; border-color: {c["border"]}; }}
        QToolButton:pressed, QToolButton:checked {{ background: {c["pressed"]}; }}
        QToolButton:focus {{ border: {FOCUS_RING_PX}px solid {c["accent"]}; }}
        QToolButton:disabled {{ color: {c["disabled_text"]}; }}
        QLineEdit, QPlainTextEdit, QTextEdit {{ border: 1px solid {c["border"]}; border-radius: 4px;
            padding: 2px 4px; }}
        QLineEdit:focus, QPlainTextEdit:focus, QTextEdit:focus {{ border: {FOCUS_RING_PX}px solid {c["accent"]};
            padding: 1px 3px; }}
        QLineEdit:disabled, QPlainTextEdit:disabled {{ background: {c["disabled_base"]};
            color: {c["disabled_text"]}; }}
        QListView:focus, QTableView:focus, QTreeView:focus {{ border: {FOCUS_RING_PX}px solid {c["accent"]}; }}
        QCheckBox:focus, QRadioButton:focus {{ color: {c["accent"]}; }}
        QCheckBox:disabled, QRadioButton:disabled {{ color: {c["disabled_text"]}; }}
    """


def apply_theme(app: QApplication, name: str) -> None:
    """Switch the whole app to theme `name` ("light" or "dark"; anything else is light)."""
    name = name if name in COLOURS else "light"
    colours = COLOURS[name]
    app.setProperty("moedeskTheme", name)  # first: widgets re-render on the change events that follow
    app.setStyle("Fusion")
    app.setPalette(_palette(colours))
    app.setStyleSheet(style_sheet(colours))
