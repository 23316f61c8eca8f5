"""The fit of a model before downloading it, from its config and safetensors headers on the Hub."""

from __future__ import annotations

import fnmatch
import json
import struct
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from engine.checkpoint import Checkpoint, LayoutShard
from engine.checkpoint.safetensors_file import MAX_HEADER_BYTES
from engine.config import read_config
from engine.errors import CheckpointError
from engine.hub.client import Hub
from engine.hub.control import DownloadControl
from engine.hub.curated import Fit, fit_of
from engine.hub.display import format_size
from engine.hub.errors import HubError
from engine.hub.folder import CONFIG_FILE, WEIGHT_PATTERN

if TYPE_CHECKING:  # plan.py imports this module
    from engine.hub.plan import DownloadPlan, PlanFile


HEADER_PROBE_BYTES = 512 * 1024  # first request for a safetensors header; most headers fit


def _header_shard(header: dict, path: Path) -> LayoutShard:
    """A safetensors file known only by its header (fetched with a range request)."""
    entries = {k: v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}
    return LayoutShard({k: (v["dtype"], tuple(int(d) for d in v["shape"])) for k, v in entries.items()}, path)


def _safetensors_header(hub: Hub, plan: DownloadPlan, f: PlanFile, control: DownloadControl | None) -> dict:
    probe = (
        hub.read(plan.repo_id, plan.commit, f.path, 0, min(f.size, HEADER_PROBE_BYTES) - 1, control)
        if f.size >= 8
        else b""
    )
    if len(probe) < 8:
        raise CheckpointError(Path(f.path), "is too short to be a safetensors file")
    (length,) = struct.unpack("<Q", probe[:8])
    if length > MAX_HEADER_BYTES:
        # the engine refuses such a file when it opens it, so downloading it would be in vain
        raise HubError(
            "unsupported",
            f"{plan.repo_id}'s {f.path} claims a safetensors header of "
            f"{format_size(length)}, more than the {format_size(MAX_HEADER_BYTES)} a "
            f"safetensors file may have: the file is damaged or not a real checkpoint, "
            f"and MoE Desk could not open it. Nothing was downloaded; choose another "
            f"model.",
        )
    if length > f.size - 8:
        raise CheckpointError(Path(f.path), "has a corrupt safetensors header")
    if 8 + length > len(probe):
        probe += hub.read(plan.repo_id, plan.commit, f.path, len(probe), 8 + length - 1, control)
    try:
        header = json.loads(probe[8 : 8 + length].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(Path(f.path), f"has a corrupt safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(Path(f.path), "has a corrupt safetensors header")
    return header


def _remote_fit(
    hub: Hub, plan: DownloadPlan, small: dict[str, bytes], control: DownloadControl | None
) -> tuple[Fit | None, str]:
    """The fit from config.json and the safetensors headers (a few range requests, no weight data)."""
    with tempfile.TemporaryDirectory(prefix="moedesk-fit-") as tmp:
        folder = Path(tmp)
        for name in (CONFIG_FILE, "hf_quant_config.json"):
            if name in small:
                (folder / name).write_bytes(small[name])
        try:
            config = read_config(folder)
        except CheckpointError as exc:
            raise HubError(
                "unsupported",
                f"{plan.repo_id} is not a model MoE Desk runs: {exc.cause}{f' ({exc.hint})' if exc.hint else ''}.",
            ) from None
        try:
            shards = [
                _header_shard(_safetensors_header(hub, plan, f, control), Path(f.path))
                for f in plan.files
                if fnmatch.fnmatch(f.path, WEIGHT_PATTERN)
            ]
            footprint = footprint_from_headers(folder, config, shards)
        except CheckpointError as exc:
            return None, f"the fit cannot be worked out before downloading: {exc}"
        except KeyError as exc:
            return None, f"the fit cannot be worked out before downloading: unknown tensor dtype {exc.args[0]!r}"
    return fit_of(footprint, "the config and safetensors headers on the Hub"), ""


def footprint_from_headers(folder: Path, config, shards: list):
    """The planner's ModelFootprint from tensor headers alone, classified by the planner's own rules."""
    from engine.runtime.footprint import footprint_of

    return footprint_of(Checkpoint(folder, config.quantization_config, shards=shards), config, folder)
