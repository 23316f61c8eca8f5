"""The local model library: the user's folders, downloaded models, the Hugging Face cache and the built-in demo.

Pure Python, no Qt. Each entry says what a folder holds (architecture, weight format, size on disk)
and which VRAM presets it fits, from config.json and safetensors headers alone: no weight is read.
A folder that is not a supported checkpoint stays in the list with the engine's reason, so the
user learns why a download does not show up as a usable model.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from app.machine_fit import Machine, judge
from app.paths import DEMO_MODEL
from engine.api import (
    INDEX_FILE,
    CheckpointError,
    PlanError,
    SafetensorsFile,
    footprint_from_checkpoint,
    plan_memory,
    preset_budget_bytes,
    read_hf_quant_config,
)

SIZE_PRESETS = ("4gb", "8gb", "12gb")
DEMO_SOURCE, FOLDER_SOURCE, HF_SOURCE, DOWNLOAD_SOURCE = "built-in", "your folder", "Hugging Face cache", "downloaded"
HF_REPO_PREFIX = "models--"
DTYPE_FORMATS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8"}


def default_hf_cache() -> Path:
    """The hub folder huggingface_hub itself uses: HF_HUB_CACHE, else HF_HOME/hub, else the XDG cache."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return cache / "huggingface" / "hub"


def scan_library(extra_folders: list[Path], hf_cache: Path | None = None, downloads: Path | None = None) -> list[dict]:
    """Every model folder found, each described by describe_model(); a folder found twice is listed once.

    extra_folders: folders the user added; each is a model folder itself or a folder of model folders.
    hf_cache: the hub cache (hub/models--ORG--NAME/snapshots/REV/); default_hf_cache() when None.
    downloads: the folder Download… fills (engine.hub): its model folders, named by repo; a download that has
    not finished has no config.json yet and is not listed.
    """
    entries: list[dict] = []
    seen: set[Path] = set()
    machine = Machine.read()  # once per scan, on the scanner's thread

    def add(folder: Path, source: str, name: str | None = None) -> None:
        try:
            key = folder.resolve()
        except (OSError, RuntimeError):  # a symlink loop: the folder is listed with the engine's reason
            key = folder.absolute()
        if key not in seen:
            seen.add(key)
            entries.append(describe_model(folder, source, name, machine))

    if DEMO_MODEL.is_dir():
        add(DEMO_MODEL, DEMO_SOURCE, "Demo model (built in)")
    if downloads is not None:
        for model_folder in _model_subfolders(Path(downloads).expanduser()):
            add(model_folder, DOWNLOAD_SOURCE, _downloaded_name(model_folder))
    for folder in map(Path, extra_folders):
        folder = folder.expanduser()
        children = [] if (folder / "config.json").is_file() else _model_subfolders(folder)
        for model_folder in children or [folder]:
            add(model_folder, FOLDER_SOURCE)
    for repo, snapshot in hf_snapshots(default_hf_cache() if hf_cache is None else hf_cache):
        add(snapshot, HF_SOURCE, repo)
    return entries


def _model_subfolders(folder: Path) -> list[Path]:
    try:
        return sorted(child for child in folder.iterdir() if (child / "config.json").is_file())
    except OSError:  # missing or unreadable: the folder is then listed with the engine's own reason
        return []


def _downloaded_name(folder: Path) -> str:
    """ORG/NAME (@REVISION unless main) from the record a finished download leaves; the folder name otherwise."""
    from engine.api import download_record

    record = download_record(folder)
    repo, revision = record.get("repo_id"), record.get("revision") or "main"
    if not isinstance(repo, str) or not repo:
        return folder.name
    return repo if revision == "main" else f"{repo}@{revision}"


def hf_snapshots(hub: Path) -> list[tuple[str, Path]]:
    """("ORG/NAME", snapshot folder) of each model repo in a hub cache: the revision refs/main names,
    else the newest snapshot; repos with no snapshot yet (a download that never finished a file) are skipped."""
    if (hub / "hub").is_dir():  # HF_HOME given instead of its hub folder
        hub = hub / "hub"
    found = []
    try:
        repos = sorted(p for p in hub.glob(f"{HF_REPO_PREFIX}*") if p.is_dir())
    except OSError:
        return []
    for repo in repos:
        snapshot = _current_snapshot(repo)
        if snapshot is not None:
            found.append((repo.name[len(HF_REPO_PREFIX) :].replace("--", "/"), snapshot))
    return found


def _current_snapshot(repo: Path) -> Path | None:
    main_ref = repo / "refs" / "main"
    if main_ref.is_file():
        try:
            snapshot = repo / "snapshots" / main_ref.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):  # a damaged ref: the newest snapshot stands in
            snapshot = None
        if snapshot is not None and snapshot.is_dir():
            return snapshot
    try:
        snapshots = [p for p in (repo / "snapshots").iterdir() if p.is_dir()]
    except OSError:
        return None
    return max(snapshots, key=lambda p: p.stat().st_mtime, default=None)


def describe_model(folder: Path, source: str, name: str | None = None, machine: Machine | None = None) -> dict:
    """name, path, source, architecture, format, size_bytes (None without config.json), fits
    {preset: bool}, fit_errors {preset: PlanError text}, machine_fit (how it fits `machine`: level, short, text;
    {} without a machine), error (str(CheckpointError), "" when usable)."""
    raw = _raw_config(folder)
    entry = {
        "name": name or folder.name,
        "path": str(folder),
        "source": source,
        "architecture": _architecture(raw),
        "format": weight_format(folder, raw) if raw else "",
        "size_bytes": size_on_disk(folder) if raw is not None else None,
        "fits": {},
        "fit_errors": {},
        "machine_fit": {},
        "error": "",
    }
    try:
        footprint = footprint_from_checkpoint(folder)
    except CheckpointError as exc:
        entry["error"] = str(exc)
        return entry
    except Exception as exc:  # one odd folder must not hide the rest of the library
        entry["error"] = f"{folder}: could not be read ({exc!r})"
        return entry
    for preset in SIZE_PRESETS:
        try:
            plan_memory(footprint, preset_budget_bytes(preset), preset)
            entry["fits"][preset] = True
        except PlanError as exc:
            entry["fits"][preset] = False
            entry["fit_errors"][preset] = str(exc)
        except Exception as exc:  # a planner bug on one odd checkpoint must not take the library down
            entry["fits"], entry["fit_errors"] = {}, {}
            entry["error"] = f"{folder}: could not be planned ({exc!r})"
            return entry
    if machine is not None:
        verdict = judge(footprint, machine)
        entry["machine_fit"] = {"level": verdict.level, "short": verdict.short, "text": verdict.text}
    return entry


def _raw_config(folder: Path) -> dict | None:
    """config.json as a dict; {} when it exists but cannot be parsed, None when there is none."""
    path = folder / "config.json"
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _architecture(raw: dict | None) -> str:
    return str(raw.get("model_type") or "") if raw else ""


def folder_architecture(folder: Path) -> str:
    """The architecture the library lists for a model folder (config.json's model_type), "" without one."""
    return _architecture(_raw_config(folder))


def size_on_disk(folder: Path) -> int:
    """Bytes of every file under the folder; links are followed because hub snapshots link into blobs/."""
    total = 0
    for path in folder.rglob("*"):
        try:
            if path.is_file():
                total += path.stat().st_size
        except OSError:
            continue  # a dangling link of an unfinished download counts as nothing
    return total


def weight_format(folder: Path, raw: dict) -> str:
    """bf16, fp16, fp32, fp8, nvfp4 or the quantisation method's own name; "" when it cannot be told."""
    text = raw.get("text_config")
    quant = raw.get("quantization_config") or (text.get("quantization_config") if isinstance(text, dict) else None)
    if not quant:
        try:
            quant = read_hf_quant_config(folder)  # ModelOpt's side file
        except CheckpointError:
            quant = None  # the load error, reported separately, says what is wrong with it
    if isinstance(quant, dict) and quant:
        return _format_from_quant_config(quant)
    return _format_from_headers(folder)


def _format_from_quant_config(quant: dict) -> str:
    method = str(quant.get("quant_method", "")).lower()
    if method == "modelopt":
        layers = quant.get("quantized_layers")
        specs = layers.values() if isinstance(layers, dict) else ()
        algos = {str(quant.get("quant_algo", "")).upper()}
        algos |= {str(spec.get("quant_algo", "")).upper() for spec in specs if isinstance(spec, dict)}
        return "nvfp4" if any("NVFP4" in algo for algo in algos) else "fp8"
    if method == "compressed-tensors":
        if "nvfp4" in str(quant.get("format", "")):
            return "nvfp4"
        groups = quant.get("config_groups")
        weights = [
            group.get("weights")
            for group in (groups.values() if isinstance(groups, dict) else ())
            if isinstance(group, dict)
        ]
        bits = {spec.get("num_bits") for spec in weights if isinstance(spec, dict)}
        return "nvfp4" if 4 in bits else "fp8"
    return method or ""


def _format_from_headers(folder: Path) -> str:
    """The dtype that holds most of the weight bytes, from the safetensors headers."""
    bytes_by_dtype: dict[str, int] = {}
    try:
        index = folder / INDEX_FILE
        names = (
            sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            if index.is_file()
            else sorted(p.name for p in folder.glob("*.safetensors"))
        )
        for file_name in names:
            shard = SafetensorsFile(folder / file_name)
            for key in shard.keys():
                dtype = shard.dtype(key)
                name = str(dtype).removeprefix("torch.")
                bytes_by_dtype[name] = bytes_by_dtype.get(name, 0) + math.prod(shard.shape(key)) * dtype.itemsize
    except (CheckpointError, OSError, ValueError, KeyError, TypeError):
        return ""  # the load error, reported separately, says what is wrong with the files
    if not bytes_by_dtype:
        return ""
    dominant = max(bytes_by_dtype, key=bytes_by_dtype.get)
    return DTYPE_FORMATS.get(dominant, dominant)
