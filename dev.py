"""Set up the project's virtual environment and run the app or the tests (Linux, macOS, Windows).

python dev.py app     # set up .venv and start MoE Desk
python dev.py test    # set up .venv and run the test suite (extra arguments go to pytest)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
# The pinned CPU build that the development and CI machines hold on disk; an unpinned torch
# requirement would download a multi-GB CUDA build instead.
TORCH = "torch==2.13.0"
# The app's tests (they need a QApplication), run in a process of their own
APP_TESTS = "tests/app"
# Debian/Ubuntu packages of the system libraries Qt's X11 platform plugin loads, which pip cannot install
QT_SYSTEM_PACKAGES = {
    "libxcb-cursor.so.0": "libxcb-cursor0",
    "libxkbcommon-x11.so.0": "libxkbcommon-x11-0",
    "libxkbcommon.so.0": "libxkbcommon0",
    "libxcb-icccm.so.4": "libxcb-icccm4",
    "libxcb-keysyms.so.1": "libxcb-keysyms1",
    "libxcb-shape.so.0": "libxcb-shape0",
    "libxcb-image.so.0": "libxcb-image0",
    "libxcb-render-util.so.0": "libxcb-render-util0",
    "libxcb-randr.so.0": "libxcb-randr0",
    "libxcb-xinerama.so.0": "libxcb-xinerama0",
    "libxcb-xkb.so.1": "libxcb-xkb1",
    "libEGL.so.1": "libegl1",
    "libGL.so.1": "libgl1",
    "libOpenGL.so.0": "libopengl0",
    "libfontconfig.so.1": "libfontconfig1",
    "libdbus-1.so.3": "libdbus-1-3",
    "libX11-xcb.so.1": "libx11-xcb1",
}


def venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def run(*args: str | Path, **env: str) -> int:
    return subprocess.call([str(a) for a in args], cwd=ROOT, env={**os.environ, **env})


def setup(extras: str) -> None:
    if not venv_python().exists():
        print(f"creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    python = venv_python()
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    stamp = VENV / f".installed-{extras}"
    pyproject = ROOT / "pyproject.toml"
    if stamp.exists() and stamp.stat().st_mtime >= pyproject.stat().st_mtime:
        return
    for step in ([*pip, TORCH], [*pip, "-e", f".[{extras}]"]):
        if run(*step) != 0:
            sys.exit(f"setup failed while running: {' '.join(map(str, step))}")
    stamp.touch()


def missing_libraries(ldd_output: str) -> list[str]:
    """The libraries `ldd` reported as not found, each once, in its order."""
    missing = [line.split()[0] for line in ldd_output.splitlines() if "not found" in line]
    return list(dict.fromkeys(missing))


def qt_libraries_message(missing: list[str]) -> str:
    """What to tell a user whose system lacks the libraries of Qt's X11 plugin."""
    packages = sorted({QT_SYSTEM_PACKAGES[lib] for lib in missing if lib in QT_SYSTEM_PACKAGES})
    unknown = [lib for lib in missing if lib not in QT_SYSTEM_PACKAGES]
    lines = [f"MoE Desk's window needs system libraries that are missing: {', '.join(missing)}."]
    if packages:
        lines.append(f"On Debian or Ubuntu install them with: sudo apt install {' '.join(packages)}")
    if unknown:
        lines.append(f"Install the package that provides {', '.join(unknown)} with your distribution's tools.")
    lines.append("(To run without a desktop, set QT_QPA_PLATFORM=offscreen.)")
    return "\n".join(lines)


def check_qt_libraries() -> str | None:
    """On Linux, the message for missing libraries of Qt's X11 platform plugin, or None when all are there."""
    if not sys.platform.startswith("linux") or os.environ.get("QT_QPA_PLATFORM") or not shutil.which("ldd"):
        return None
    where = subprocess.run(
        [
            str(venv_python()),
            "-I",
            "-c",
            "import os, PySide6; print(os.path.join(os.path.dirname("
            "PySide6.__file__), 'Qt', 'plugins', 'platforms', 'libqxcb.so'))",
        ],
        capture_output=True,
        text=True,
    )
    plugin = where.stdout.strip()
    if where.returncode != 0 or not os.path.isfile(plugin):
        return None
    missing = missing_libraries(subprocess.run(["ldd", plugin], capture_output=True, text=True).stdout)
    return qt_libraries_message(missing) if missing else None


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("app", "test"):
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "app":
        setup("app")
        problem = check_qt_libraries()
        if problem:
            print(problem, file=sys.stderr)
            return 1
        return run(venv_python(), "-m", "app", *rest)
    setup("test")
    env = dict(QT_QPA_PLATFORM="offscreen", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    if rest:
        return run(venv_python(), "-m", "pytest", *rest, **env)
    # The app's tests run in a process of their own: with a QApplication left from them, the engine tests'
    # process crashed in Qt's event processing after a later test (2026-12-01, cause not found yet)
    app = run(venv_python(), "-m", "pytest", APP_TESTS, **env)
    engine = run(venv_python(), "-m", "pytest", f"--ignore={APP_TESTS}", **env)
    return app or engine


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
