"""dev.py, the README's entry point: what it says when Qt's X11 plugin lacks system libraries."""

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("dev", Path(__file__).resolve().parent.parent / "dev.py")
dev = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dev)

LDD = """\tlinux-vdso.so.1 (0x00007ffd)
\tlibxcb-cursor.so.0 => not found
\tlibQt6XcbQpa.so.6 => /venv/PySide6/Qt/lib/libQt6XcbQpa.so.6 (0x00007f)
\tlibxcb-cursor.so.0 => not found
\tlibxkbcommon-x11.so.0 => not found
\tlibweird.so.9 => not found
\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)
"""


def test_missing_libraries_are_read_from_ldd_once_each():
    assert dev.missing_libraries(LDD) == ["libxcb-cursor.so.0", "libxkbcommon-x11.so.0", "libweird.so.9"]
    assert dev.missing_libraries("\tlibc.so.6 => /lib/libc.so.6 (0x1)\n") == []


def test_the_message_names_the_packages_to_install():
    message = dev.qt_libraries_message(dev.missing_libraries(LDD))
    assert "sudo apt install libxcb-cursor0 libxkbcommon-x11-0" in message
    assert "provides libweird.so.9" in message and "QT_QPA_PLATFORM=offscreen" in message


def test_no_check_off_linux_or_with_another_platform_chosen(monkeypatch):
    monkeypatch.setattr(dev.sys, "platform", "win32")
    assert dev.check_qt_libraries() is None
    monkeypatch.setattr(dev.sys, "platform", "linux")
    monkeypatch.setenv("QT_QPA_PLATFORM", "wayland")
    assert dev.check_qt_libraries() is None
