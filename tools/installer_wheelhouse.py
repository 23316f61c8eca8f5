"""Download every wheel that installers/linux/install.sh needs into a local folder, so that the installer test
(tests/test_installers.py) installs offline and fast.

    python3 tools/installer_wheelhouse.py [DEST]     # default DEST: .whl/installer (ignored by git)

Run it with the Python the installer test will build its environment from: the one that makes `.venv`
(.ci/run runs it with python3 before `dev.py test`). The wheels are PyTorch (MOEDESK_TORCH_SPEC, default
torch==2.13.0, the CPU build on the development and CI machines), the app's dependencies with its `app` extra,
and the build backend, which pip fetches again to build MoE Desk's own wheel.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DEST = ROOT / ".whl" / "installer"
TORCH_SPEC = os.environ.get("MOEDESK_TORCH_SPEC", "torch==2.13.0")
SOURCE_ITEMS = ("pyproject.toml", "README.md", "app", "engine", "resources")


def build_requirements() -> list[str]:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    block = re.search(r"^\[build-system\]\s*\nrequires\s*=\s*\[([^\]]*)\]", text, re.MULTILINE)
    return re.findall(r'"([^"]+)"', block.group(1)) if block else ["setuptools"]


def main(argv: list[str]) -> int:
    dest = Path(argv[0]).resolve() if argv else DEFAULT_DEST
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as stage:
        source = Path(stage) / "src"
        source.mkdir()
        for item in SOURCE_ITEMS:  # a copy: pip prepares a local project in its own folder
            path = ROOT / item
            if path.is_dir():
                shutil.copytree(path, source / item, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(path, source / item)
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--disable-pip-version-check",
            "--quiet",
            "--dest",
            str(dest),
            TORCH_SPEC,
            f"{source}[app]",
            *build_requirements(),
        ]
        print("+ " + " ".join(command), flush=True)
        code = subprocess.call(command)
    if code == 0:
        print(f"wheelhouse: {dest} ({sum(1 for _ in dest.glob('*.whl'))} wheels)")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
