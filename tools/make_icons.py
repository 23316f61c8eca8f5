"""Render the app icon (resources/icons/moedesk.svg) to the PNG sizes and the Windows .ico committed beside it.

    python tools/make_icons.py            # rewrite resources/icons/moedesk-<size>.png and moedesk.ico
    python tools/make_icons.py --check    # exit 1 if a committed file differs from a fresh rendering

The PNGs serve the window icon and the Linux desktop entry (installed into the hicolor theme); the .ico serves
the Windows shortcuts and setup.exe. Qt (QtSvg) draws; the .ico container is written here: a directory of
PNG-compressed images, which Windows reads since Vista.
"""

from __future__ import annotations

import argparse
import struct
import sys
from pathlib import Path

ICONS = Path(__file__).resolve().parent.parent / "resources" / "icons"
SVG = ICONS / "moedesk.svg"
PNG_SIZES = (16, 24, 32, 48, 64, 128, 256, 512)
ICO_SIZES = (16, 24, 32, 48, 64, 128, 256)  # an .ico entry stores its size in a byte (0 meaning 256)


def png_path(size: int) -> Path:
    return ICONS / f"moedesk-{size}.png"


def render_png(svg: Path, size: int) -> bytes:
    from PySide6.QtCore import QBuffer, QByteArray, QIODevice, Qt
    from PySide6.QtGui import QGuiApplication, QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    if QGuiApplication.instance() is None:
        render_png.app = QGuiApplication(["make_icons", "-platform", "offscreen"])  # kept alive with the function
    renderer = QSvgRenderer(str(svg))
    if not renderer.isValid():
        raise SystemExit(f"{svg}: not a valid SVG")
    image = QImage(size, size, QImage.Format.Format_ARGB32)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    painter.setRenderHint(QPainter.RenderHint.SmoothPixmapTransform)
    renderer.render(painter)
    painter.end()
    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    if not image.save(buffer, "PNG"):
        raise SystemExit(f"could not encode a {size}px PNG")
    buffer.close()
    return bytes(data.data())


def ico_bytes(pngs: dict[int, bytes]) -> bytes:
    """An ICO file holding one PNG-compressed 32-bit image per size (ICONDIR, ICONDIRENTRYs, then the images)."""
    sizes = sorted(pngs)
    header = struct.pack("<HHH", 0, 1, len(sizes))  # reserved, type 1 = icon, image count
    offset = len(header) + 16 * len(sizes)
    entries, images = b"", b""
    for size in sizes:
        data = pngs[size]
        side = 0 if size == 256 else size
        entries += struct.pack("<BBBBHHII", side, side, 0, 0, 1, 32, len(data), offset)
        images += data
        offset += len(data)
    return header + entries + images


def outputs() -> dict[Path, bytes]:
    pngs = {size: render_png(SVG, size) for size in PNG_SIZES}
    files = {png_path(size): data for size, data in pngs.items()}
    files[ICONS / "moedesk.ico"] = ico_bytes({size: pngs[size] for size in ICO_SIZES})
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed files, write nothing")
    args = parser.parse_args(argv)
    stale = []
    for path, data in outputs().items():
        if args.check:
            if not path.exists() or path.read_bytes() != data:
                stale.append(path.name)
        else:
            path.write_bytes(data)
            print(f"wrote {path} ({len(data):,} bytes)")
    if stale:
        print("out of date (run python tools/make_icons.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
