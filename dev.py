"""Set up the project's virtual environment and run the app or the tests (Linux, macOS, Windows).

    python dev.py app     # set up .venv and start MoE Desk
    python dev.py test    # set up .venv and run the test suite (extra arguments go to pytest)
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
# The pinned CPU build that the development and CI machines hold on disk; an unpinned torch
# requirement would download a multi-GB CUDA build instead.
TORCH = "torch==2.13.0"


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


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("app", "test"):
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "app":
        setup("app")
        return run(venv_python(), "-m", "app", *rest)
    setup("test")
    code = run(venv_python(), "-m", "pytest", *rest, QT_QPA_PLATFORM="offscreen", HF_HUB_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
