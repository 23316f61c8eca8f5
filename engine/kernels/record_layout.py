"""The record layout: where each tensor of one routed expert lies in its record of bytes.

A record holds the expert's gate_up weight (gate and up joined by rows, engine/checkpoint/formats.py
`fuse_rows`) and its down weight, every tensor at a 64-byte aligned offset. The same layout views host
records and device cache slots alike, and is the data the CPU and GPU expert kernels read the records by,
so it lives here at the bottom beside them; engine/experts/packed.py packs a model's experts with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.checkpoint.formats import StoredWeight

RECORD_ALIGNMENT = 64  # bytes: every tensor of a record starts aligned for vector loads
MATRICES = ("gate_up", "down")


@dataclass(frozen=True)
class TensorSlot:
    role: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the record

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _itemsize(self.dtype)


@dataclass(frozen=True)
class MatrixLayout:
    format: str
    shape: tuple[int, int]  # (out_features, in_features)
    block_size: tuple[int, int]
    tensors: tuple[TensorSlot, ...]


@dataclass(frozen=True)
class RecordLayout:
    """Where each tensor of one expert lies in its record; the same for every routed expert of a model."""

    matrices: dict[str, MatrixLayout]
    record_bytes: int

    @staticmethod
    def of(expert: dict[str, StoredWeight]) -> RecordLayout:
        offset, matrices = 0, {}
        for name in MATRICES:
            weight, slots = expert[name], []
            for role, tensor in weight.tensors.items():
                offset = _aligned(offset)
                slots.append(TensorSlot(role, tensor.dtype, tuple(tensor.shape), offset))
                offset += slots[-1].nbytes
            matrices[name] = MatrixLayout(weight.format, tuple(weight.shape), weight.block_size, tuple(slots))
        return RecordLayout(matrices, _aligned(offset))

    def write(self, record: torch.Tensor, expert: dict[str, StoredWeight]) -> None:
        """Copy one expert's tensors into `record` (uint8 [record_bytes])."""
        for name, matrix in self.matrices.items():
            weight = expert[name]
            if tuple(weight.shape) != matrix.shape or weight.format != matrix.format:
                raise ValueError(
                    f"{weight.name} is {weight.format} {list(weight.shape)}, but the model's other "
                    f"experts are {matrix.format} {list(matrix.shape)}: every routed expert of a "
                    f"model must share one shape and format"
                )
            for slot in matrix.tensors:
                tensor = weight.tensors[slot.role].contiguous()
                record[slot.offset : slot.offset + slot.nbytes].copy_(tensor.reshape(-1).view(torch.uint8))

    def view(self, records: torch.Tensor) -> dict[str, StoredWeight]:
        """Stacked weights [n, out, in] over records (uint8 [n, record_bytes], host or device), no copy."""
        count = records.shape[0]
        views = {}
        for name, matrix in self.matrices.items():
            tensors = {}
            for slot in matrix.tensors:
                raw = records[:, slot.offset : slot.offset + slot.nbytes].view(slot.dtype)
                tensors[slot.role] = raw.unflatten(1, slot.shape) if slot.shape else raw.reshape(count)
            views[name] = StoredWeight(
                matrix.format, tensors, (count, *matrix.shape), f"experts.{name}", matrix.block_size
            )
        return views


def _aligned(offset: int) -> int:
    return -(-offset // RECORD_ALIGNMENT) * RECORD_ALIGNMENT


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
