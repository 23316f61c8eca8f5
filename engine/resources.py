"""Files shipped beside the code: the built-in demo model (resources/demo-model, see its README)."""

from __future__ import annotations

from pathlib import Path

RESOURCES = Path(__file__).resolve().parent.parent / "resources"
DEMO_MODEL = RESOURCES / "demo-model"
DEMO_NAME = "demo"  # what --model takes for the built-in model


def resolve_model(name_or_path: str | Path) -> Path:
    """`demo` means the built-in demo model; anything else is a folder path."""
    return DEMO_MODEL if str(name_or_path) == DEMO_NAME else Path(name_or_path).expanduser()
