"""A model folder on disk: its name, what it holds, and the state a download keeps in it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from engine.checkpoint import INDEX_FILE

STAGING_DIR = ".download"
STATE_FILE = "state.json"
RECORD_FILE = ".moedesk-download.json"
INCOMPLETE_SUFFIX = ".incomplete"
CONFIG_FILE = "config.json"
# What the engine reads from a checkpoint folder besides the weights; everything else in a repo is skipped.
NEEDED_FILES = (
    CONFIG_FILE,
    "generation_config.json",
    "hf_quant_config.json",
    INDEX_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
)
WEIGHT_PATTERN = "*.safetensors"


def folder_name(repo_id: str, revision: str = "main") -> str:
    """ORG--NAME, plus --REVISION for anything but main (a folder per revision)."""
    name = repo_id.replace("/", "--")
    if revision and revision != "main":
        name += "--" + "".join(c if c.isalnum() or c in "-_." else "-" for c in revision)
    return name


def free_disk_bytes(folder: Path) -> int:
    return shutil.disk_usage(_existing_ancestor(folder)).free


def _existing_ancestor(folder: Path) -> Path:
    folder = Path(folder).expanduser().absolute()
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    return folder


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _known_hashes(folder: Path) -> tuple[dict, dict]:
    """({path: hash_key} of files that a download verified and placed here, {path: hash_key} of partial files)."""
    record = _read_json(folder / RECORD_FILE)
    state = _read_json(folder / STAGING_DIR / STATE_FILE)
    placed = {p: v.get("hash") for p, v in (record.get("files") or {}).items() if isinstance(v, dict)}
    placed.update({p: h for p, h in (state.get("placed") or {}).items()})
    partial = {p: h for p, h in (state.get("partial") or {}).items()}
    return placed, partial


def _incomplete_path(folder: Path, path: str) -> Path:
    return folder / STAGING_DIR / (path + INCOMPLETE_SUFFIX)


def download_record(folder: str | Path) -> dict:
    """The record a finished download left in a model folder ({} when there is none)."""
    return _read_json(Path(folder) / RECORD_FILE)


def partial_download(folder: str | Path) -> bool:
    """Whether a download into `folder` was started and not finished (so it can resume)."""
    return (Path(folder) / STAGING_DIR / STATE_FILE).is_file()
