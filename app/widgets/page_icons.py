"""The sidebar's page icons: small line drawings in SVG, drawn in the theme's text colour (white when selected)."""

from __future__ import annotations

from PySide6.QtCore import QByteArray, QSize, Qt
from PySide6.QtGui import QIcon, QPainter, QPixmap
from PySide6.QtSvg import QSvgRenderer

ICON_PX = 18
SELECTED_COLOUR = "#ffffff"  # the selected row is the accent colour with white text
DRAWINGS = {  # 24x24 strokes
    "Chat": '<path d="M4 5h16v11H10l-5 4v-4H4z"/>',
    "Models": '<path d="M12 3l9 5-9 5-9-5z"/><path d="M3 13l9 5 9-5"/>',
    "Engine": '<rect x="6" y="6" width="12" height="12" rx="2"/>'
    '<path d="M9 2v4M15 2v4M9 18v4M15 18v4M2 9h4M2 15h4M18 9h4M18 15h4"/>',
    "Logs": '<rect x="5" y="3" width="14" height="18" rx="1"/><path d="M8 8h8M8 12h8M8 16h5"/>',
    "Settings": '<path d="M3 6h11M18 6h3M3 12h4M11 12h10M3 18h13M20 18h1"/>'
    '<circle cx="16" cy="6" r="2"/><circle cx="9" cy="12" r="2"/><circle cx="18" cy="18" r="2"/>',
}


def _pixmap(drawing: str, colour: str, scale: float) -> QPixmap:
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" fill="none" stroke="{colour}" '
        f'stroke-width="2" stroke-linecap="round" stroke-linejoin="round">{drawing}</svg>'
    )
    size = round(ICON_PX * scale)
    pixmap = QPixmap(QSize(size, size))
    pixmap.fill(Qt.GlobalColor.transparent)
    painter = QPainter(pixmap)
    QSvgRenderer(QByteArray(svg.encode())).render(painter)
    painter.end()
    pixmap.setDevicePixelRatio(scale)
    return pixmap


def page_icon(page: str, colour: str, scale: float = 1.0) -> QIcon:
    """The icon of sidebar page `page` in `colour`, white in the selected row, sharp at device scale `scale`."""
    icon = QIcon()
    icon.addPixmap(_pixmap(DRAWINGS[page], colour, scale), QIcon.Mode.Normal)
    icon.addPixmap(_pixmap(DRAWINGS[page], SELECTED_COLOUR, scale), QIcon.Mode.Selected)
    return icon
