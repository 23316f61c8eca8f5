"""Light and dark themes: a Fusion palette plus a few style rules for the app's own widgets."""

from __future__ import annotations

from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QApplication

COLOURS = {
    "light": {"window": "#f5f6f8", "base": "#ffffff", "text": "#1d1f23", "muted": "#6b7280",
              "accent": "#2f6fed", "sidebar": "#eceef2", "border": "#d5d8de"},
    "dark": {"window": "#1e2025", "base": "#26292f", "text": "#e6e8eb", "muted": "#9aa1ab",
             "accent": "#5b8def", "sidebar": "#17191d", "border": "#3a3e46"},
}


def apply_theme(app: QApplication, name: str) -> None:
    colours = COLOURS.get(name, COLOURS["light"])
    app.setStyle("Fusion")
    palette = QPalette()
    palette.setColor(QPalette.ColorRole.Window, QColor(colours["window"]))
    palette.setColor(QPalette.ColorRole.Base, QColor(colours["base"]))
    palette.setColor(QPalette.ColorRole.AlternateBase, QColor(colours["window"]))
    palette.setColor(QPalette.ColorRole.Text, QColor(colours["text"]))
    palette.setColor(QPalette.ColorRole.WindowText, QColor(colours["text"]))
    palette.setColor(QPalette.ColorRole.Button, QColor(colours["base"]))
    palette.setColor(QPalette.ColorRole.ButtonText, QColor(colours["text"]))
    palette.setColor(QPalette.ColorRole.Highlight, QColor(colours["accent"]))
    palette.setColor(QPalette.ColorRole.HighlightedText, QColor("#ffffff"))
    palette.setColor(QPalette.ColorRole.PlaceholderText, QColor(colours["muted"]))
    palette.setColor(QPalette.ColorRole.ToolTipBase, QColor(colours["base"]))
    palette.setColor(QPalette.ColorRole.ToolTipText, QColor(colours["text"]))
    app.setPalette(palette)
    app.setStyleSheet(f"""
        #sidebar {{ background: {colours['sidebar']}; border: none; }}
        #sidebar::item {{ padding-left: 12px; border-radius: 6px; margin: 2px 6px; }}
        #sidebar::item:selected {{ background: {colours['accent']}; color: #ffffff; }}
        QLabel[role="muted"] {{ color: {colours['muted']}; }}
        QLabel[role="error"] {{ color: #d14343; }}
    """)
