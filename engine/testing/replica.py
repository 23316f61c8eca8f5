"""Header-only replicas of real checkpoints: the real safetensors headers over data regions left as holes.

    write_replica(folder, tensors, config)

writes shards whose headers name every tensor with its dtype, shape and byte range, as the real files do,
but writes no tensor bytes: each file is truncated to its full length, so on file systems with sparse files
(ext4, xfs, tmpfs, APFS, NTFS) it takes almost no disk space, and reading a weight gives zeros. What the
engine does with a real checkpoint's headers (plan, open, load) can be checked against it without the
download.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from engine.checkpoint import INDEX_FILE
from engine.checkpoint.safetensors_file import DTYPES

SINGLE_FILE = "model.safetensors"
HEADER_ALIGNMENT = 8  # safetensors pads its header with spaces to a multiple of 8 bytes


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * DTYPES[dtype].itemsize


def safetensors_header(tensors: dict[str, tuple[str, tuple[int, ...]]]) -> tuple[bytes, int]:
    """(the header bytes, with length prefix and padding, and the data size) of a file of `tensors`, laid out
    the way the safetensors library writes them: larger dtypes first, then by name."""
    order = sorted(tensors, key=lambda name: (-DTYPES[tensors[name][0]].itemsize, name))
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in order:
        dtype, shape = tensors[name]
        end = offset + _nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % HEADER_ALIGNMENT)
    return struct.pack("<Q", len(text)) + text, offset


def write_replica(
    folder: str | Path,
    tensors: dict[str, tuple],
    config: dict,
    hf_quant_config: dict | None = None,
    generation_config: dict | None = None,
) -> Path:
    """Write a checkpoint folder whose safetensors headers list `tensors` (name -> (dtype, shape) or
    (dtype, shape, shard file)) over sparse data, with config.json and, when given, hf_quant_config.json and
    generation_config.json. Tensors without a shard file go to model.safetensors; several shards get
    model.safetensors.index.json."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for name, entry in tensors.items():
        dtype, shape = entry[0], tuple(entry[1])
        shard = entry[2] if len(entry) > 2 else SINGLE_FILE
        shards.setdefault(shard, {})[name] = (dtype, shape)
    total = 0
    for shard, entries in shards.items():
        header, data_bytes = safetensors_header(entries)
        with open(folder / shard, "wb") as handle:
            handle.write(header)
            handle.truncate(len(header) + data_bytes)  # the data region stays a hole: nothing is written
        total += data_bytes
    if len(shards) > 1 or SINGLE_FILE not in shards:
        weight_map = {name: shard for shard, entries in shards.items() for name in entries}
        (folder / INDEX_FILE).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2)
        )
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for file_name, content in (
        ("hf_quant_config.json", hf_quant_config),
        ("generation_config.json", generation_config),
    ):
        if content is not None:
            (folder / file_name).write_text(json.dumps(content, indent=2))
    return folder
