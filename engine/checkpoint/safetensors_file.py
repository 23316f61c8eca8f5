"""A memory-mapped safetensors file: the header is checked up front, tensors are read lazily.

We parse the header ourselves so that a truncated or corrupt file gets a plain error naming
the file, and tensors are views of the mapping, so an unused tensor costs no RAM.
"""

from __future__ import annotations

import json
import mmap
import stat
import struct
from pathlib import Path

import torch

from engine.errors import CheckpointError

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
REDOWNLOAD = "the file is damaged or incomplete; download the model again"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the most header a safetensors file may claim (local and remote)


class SafetensorsFile:
    def __init__(self, path: Path):
        self.path = path
        try:
            status = path.stat()
            if not stat.S_ISREG(status.st_mode):  # a named pipe or device would block or stream forever
                raise CheckpointError(
                    path,
                    "is not a regular file: a folder, named pipe or device has the name of a weights file",
                    "remove it and download the model again",
                )
            size = status.st_size
            with open(path, "rb") as handle:
                prefix = handle.read(8)
                if len(prefix) < 8:
                    raise CheckpointError(path, f"is {size} bytes long, too short to be a safetensors file", REDOWNLOAD)
                (header_len,) = struct.unpack("<Q", prefix)
                if header_len > min(MAX_HEADER_BYTES, size - 8):
                    raise CheckpointError(
                        path,
                        f"has a corrupt or truncated safetensors header "
                        f"(header says {header_len} bytes, file has {size})",
                        REDOWNLOAD,
                    )
                header_bytes = handle.read(header_len)
        except OSError as exc:
            raise CheckpointError(
                path,
                f"cannot be read ({exc.strerror or exc})",
                "check that the file exists, is readable and is no broken link",
            ) from None
        try:
            header = json.loads(header_bytes.decode("utf-8"))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
        except (UnicodeDecodeError, ValueError) as exc:
            raise CheckpointError(path, f"has a corrupt safetensors header ({exc})", REDOWNLOAD) from None
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + header_len
        self._entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, entry in header.items():
            self._entries[name] = self._check_entry(name, entry, size)
        self._map: mmap.mmap | None = None

    def _check_entry(self, name: str, entry: dict, size: int):
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(entry["shape"])
            start, end = entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                self.path,
                f"has an unreadable entry for tensor {name!r} "
                f"(dtype {entry.get('dtype') if isinstance(entry, dict) else entry!r})",
                REDOWNLOAD,
            ) from None
        if not all(_is_count(n) for n in (*shape, start, end)):
            raise CheckpointError(
                self.path,
                f"tensor {name!r} has shape {list(shape)} and data offsets "
                f"{[start, end]}, which must all be whole numbers of 0 or more",
                REDOWNLOAD,
            )
        numel = 1
        for d in shape:
            numel *= d
        if end - start != numel * dtype.itemsize:
            raise CheckpointError(
                self.path,
                f"tensor {name!r} has {end - start} bytes of data "
                f"but shape {list(shape)} needs {numel * dtype.itemsize}",
                REDOWNLOAD,
            )
        if self._data_start + end > size:
            raise CheckpointError(
                self.path,
                f"is truncated: tensor {name!r} ends at byte {self._data_start + end} but the file has {size}",
                REDOWNLOAD,
            )
        return dtype, shape, start, end

    def keys(self):
        return self._entries.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def dtype(self, name: str) -> torch.dtype:
        return self._entries[name][0]

    def tensor(self, name: str) -> torch.Tensor:
        """A CPU tensor that views the file's pages; nothing is read until it is used."""
        dtype, shape, start, end = self._entries[name]
        if end == start:
            return torch.empty(shape, dtype=dtype)
        if self._map is None:
            with open(self.path, "rb") as handle:
                # ACCESS_COPY: writable view for torch.frombuffer without ever touching the file (also on Windows)
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        flat = torch.frombuffer(self._map, dtype=torch.uint8, count=end - start, offset=self._data_start + start)
        return flat.view(dtype).reshape(shape)


def _is_count(value) -> bool:
    """Whether a header value is a whole number of 0 or more (JSON true is no number here)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
