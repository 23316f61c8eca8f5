"""The tree passes the linter and the formatter configured in pyproject.toml ([tool.ruff])."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)


def test_ruff_finds_nothing_to_report():
    result = ruff("check", "--output-format", "concise", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_file_is_formatted():
    result = ruff("format", "--check", ".")
    assert result.returncode == 0, "run `ruff format .`:\n" + result.stdout + result.stderr
