"""DownloadPlan: what downloading a repo involves, from the Hub's listing and what is already here."""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field
from pathlib import Path

from engine.checkpoint import INDEX_FILE
from engine.hub.client import Hub, _not_the_hub
from engine.hub.control import DownloadControl
from engine.hub.curated import Fit
from engine.hub.display import format_size
from engine.hub.errors import HubError
from engine.hub.folder import (
    CONFIG_FILE,
    NEEDED_FILES,
    WEIGHT_PATTERN,
    _existing_ancestor,
    _incomplete_path,
    _known_hashes,
    folder_name,
    free_disk_bytes,
)
from engine.hub.names import check_file_names
from engine.hub.remote_fit import _remote_fit
from engine.paths import default_models_dir

DISK_MARGIN_BYTES = 256 * 1024 * 1024  # left free after a download, for the system and the app
MAX_SMALL_FILE_BYTES = 64 * 1024 * 1024  # the most a config or index file read while planning may be


@dataclass
class PlanFile:
    path: str
    size: int
    sha256: str | None = None  # LFS files
    blob_id: str | None = None  # the git blob id of small files
    have: int = 0  # bytes already here: the whole file, or the part in .download/
    done: bool = False

    @property
    def hash_key(self) -> str:
        return self.sha256 or self.blob_id or f"size:{self.size}"


@dataclass
class DownloadPlan:
    repo_id: str
    revision: str
    commit: str
    endpoint: str
    folder: Path
    files: list[PlanFile]
    skipped: list[str] = field(default_factory=list)  # files of the repo the engine does not need
    gated: bool = False
    free_bytes: int = 0  # on the disk that holds the folder
    fit: Fit | None = None
    fit_note: str = ""  # why there is no fit, when there is none

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def have_bytes(self) -> int:
        return sum(f.have for f in self.files)

    @property
    def need_bytes(self) -> int:
        return self.total_bytes - self.have_bytes

    @property
    def complete(self) -> bool:
        return all(f.done for f in self.files)

    @property
    def disk_ok(self) -> bool:
        return self.need_bytes == 0 or self.need_bytes + DISK_MARGIN_BYTES <= self.free_bytes

    def disk_message(self) -> str:
        return (
            f"Not enough disk space in {_existing_ancestor(self.folder)}: this download needs "
            f"{format_size(self.need_bytes)} more and only {format_size(self.free_bytes)} is free "
            f"({format_size(DISK_MARGIN_BYTES)} is kept free for the system). Free up space or choose "
            f"another download folder."
        )

    def to_dict(self) -> dict:
        return {
            "repo_id": self.repo_id,
            "revision": self.revision,
            "commit": self.commit,
            "endpoint": self.endpoint,
            "folder": str(self.folder),
            "files": [{"path": f.path, "size": f.size, "have": f.have, "done": f.done} for f in self.files],
            "skipped": list(self.skipped),
            "gated": self.gated,
            "total_bytes": self.total_bytes,
            "have_bytes": self.have_bytes,
            "need_bytes": self.need_bytes,
            "free_bytes": self.free_bytes,
            "disk_ok": self.disk_ok,
            "disk_message": "" if self.disk_ok else self.disk_message(),
            "complete": self.complete,
            "fit": self.fit.to_dict() if self.fit else None,
            "fit_note": self.fit_note,
        }


def needed_files(paths: list[str]) -> tuple[list[str], list[str]]:
    """(what the engine needs, what it does not) of a repo's file paths: the configs, the tokenizer, the chat
    template and the top-level safetensors weights."""
    needed = [p for p in paths if p in NEEDED_FILES or ("/" not in p and fnmatch.fnmatch(p, WEIGHT_PATTERN))]
    return needed, [p for p in paths if p not in needed]


def _checked_listing(hub: Hub, info) -> tuple[str | None, dict]:
    """(commit, {path: sibling}) of a model info, refusing values of the wrong type (an answer not from the Hub)."""

    def count(value) -> bool:
        return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)

    wrong = HubError("server", _not_the_hub(hub, "JSON that is not a model's file list"))
    if info.sha is not None and not isinstance(info.sha, str) or not isinstance(info.siblings or [], list):
        raise wrong
    siblings = {}
    for s in info.siblings or []:
        lfs = s.lfs
        if (
            not isinstance(s.rfilename, str)
            or not count(s.size)
            or not (s.blob_id is None or isinstance(s.blob_id, str))
            or lfs is not None
            and (not count(lfs.size) or not isinstance(lfs.sha256, str))
        ):
            raise wrong
        siblings[s.rfilename] = s
    return info.sha, siblings


def plan_download(
    hub: Hub,
    repo_id: str,
    revision: str = "main",
    folder: str | Path | None = None,
    models_dir: str | Path | None = None,
    with_fit: bool = True,
    control: DownloadControl | None = None,
) -> DownloadPlan:
    """What downloading `repo_id` at `revision` involves: the files and sizes from the Hub, what is already
    here, the free disk, and (with_fit) the RAM/VRAM fit from the config and the safetensors headers.

    A stop asked through `control` ends it at once with DownloadCancelled (folder None)."""
    repo_id, revision = repo_id.strip(), (revision or "main").strip() or "main"
    if not repo_id:
        raise HubError("invalid", "Give a repo id, e.g. Qwen/Qwen3-30B-A3B.")
    info = hub.model_info(repo_id, revision, control)
    commit, siblings = _checked_listing(hub, info)
    commit = commit or revision
    wanted, skipped = needed_files(sorted(siblings))
    check_file_names(repo_id, wanted)
    weights = [p for p in wanted if fnmatch.fnmatch(p, WEIGHT_PATTERN)]
    if not weights:
        raise HubError(
            "unsupported",
            f"{repo_id} has no .safetensors weights at its top level: MoE Desk runs "
            f"Hugging Face safetensors checkpoints (GGUF, .bin and other formats are not "
            f"supported).",
        )
    if CONFIG_FILE not in wanted:
        raise HubError("unsupported", f"{repo_id} has no config.json, so it is not a model folder MoE Desk can open.")
    small = {}
    for name in (CONFIG_FILE, "hf_quant_config.json", INDEX_FILE):
        if name in siblings:
            size = _listed_size(hub, siblings[name])
            if size > MAX_SMALL_FILE_BYTES:
                raise HubError(
                    "unsupported",
                    f"{repo_id}'s {name} is listed as {format_size(size)}, far more than "
                    f"a config file takes (at most {format_size(MAX_SMALL_FILE_BYTES)} "
                    f"is read): the repo is broken. Choose another model.",
                )
            # also where a gated repo without access is found out
            small[name] = hub.read(repo_id, commit, name, 0, size - 1, control) if size else b""
    if INDEX_FILE in small:
        try:
            listed = set(json.loads(small[INDEX_FILE])["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            raise HubError("unsupported", f"{repo_id}'s {INDEX_FILE} is not a valid safetensors index.") from None
        missing = sorted(listed - set(weights))
        if missing:
            raise HubError("unsupported", f"{repo_id}'s {INDEX_FILE} names {missing[0]}, which the repo does not have.")
        skipped += [p for p in weights if p not in listed]
        wanted = [p for p in wanted if p not in weights or p in listed]
    files = []
    for path in wanted:
        sibling = siblings[path]
        lfs = sibling.lfs
        files.append(
            PlanFile(
                path,
                _listed_size(hub, sibling),
                sha256=lfs.sha256 if lfs is not None else None,
                blob_id=None if lfs is not None else sibling.blob_id,
            )
        )
    target = (
        Path(folder).expanduser()
        if folder
        else Path(models_dir or default_models_dir()) / folder_name(repo_id, revision)
    )
    plan = DownloadPlan(
        repo_id,
        revision,
        commit,
        hub.endpoint,
        target,
        files,
        sorted(skipped),
        gated=bool(getattr(info, "gated", False)),
    )
    plan.files = _order(plan.files)
    _mark_local(plan)
    plan.free_bytes = free_disk_bytes(target)
    if with_fit:
        plan.fit, plan.fit_note = _remote_fit(hub, plan, small, control)
    return plan


def _listed_size(hub: Hub, sibling) -> int:
    size = sibling.lfs.size if sibling.lfs is not None else sibling.size
    if size is None:
        raise HubError("server", f"{hub.host} did not give the size of {sibling.rfilename}; try again later.")
    return int(size)


def _order(files: list[PlanFile]) -> list[PlanFile]:
    """Small files first, then the weights, and config.json last: a folder without config.json is not a model,
    so an unfinished download is never taken for one."""
    return sorted(files, key=lambda f: (f.path == CONFIG_FILE, fnmatch.fnmatch(f.path, WEIGHT_PATTERN), f.path))


def _mark_local(plan: DownloadPlan) -> None:
    """Set `have`/`done` from what is in the folder: a file counts as done only if one of our downloads
    verified it (same hash) and its size is right; partial bytes count if they belong to the same file version."""
    placed, partial = _known_hashes(plan.folder)
    for f in plan.files:
        target = plan.folder / f.path
        if placed.get(f.path) == f.hash_key and target.is_file() and target.stat().st_size == f.size:
            f.have, f.done = f.size, True
            continue
        incomplete = _incomplete_path(plan.folder, f.path)
        if partial.get(f.path) == f.hash_key and incomplete.is_file():
            f.have = min(incomplete.stat().st_size, f.size)
