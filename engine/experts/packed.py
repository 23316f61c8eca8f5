"""Routed experts repacked for streaming: one record of bytes per expert, so a miss is one copy and a
whole layer of experts is one copy.

A record holds the expert's gate_up weight (gate and up joined by rows, engine/checkpoint/formats.py
`fuse_rows`) and its down weight, every tensor at a 64-byte aligned offset. The same record layout
views host records and device cache slots alike: `RecordLayout.view(records)` gives stacked
StoredWeights [n, out, in] whose tensors are strided views into the bytes, which is what the grouped
expert kernels take. Host records are pinned (page-locked) up to a pin budget, for full-speed
asynchronous copies, and pageable beyond it; how many bytes went each way is reported, never silent.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass

import torch

from engine.checkpoint.formats import StoredWeight, fuse_rows

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
                raise ValueError(f"{weight.name} is {weight.format} {list(weight.shape)}, but the model's other "
                                 f"experts are {matrix.format} {list(matrix.shape)}: every routed expert of a "
                                 f"model must share one shape and format")
            for slot in matrix.tensors:
                tensor = weight.tensors[slot.role].contiguous()
                record[slot.offset:slot.offset + slot.nbytes].copy_(tensor.reshape(-1).view(torch.uint8))

    def view(self, records: torch.Tensor) -> dict[str, StoredWeight]:
        """Stacked weights [n, out, in] over records (uint8 [n, record_bytes], host or device), no copy."""
        count = records.shape[0]
        views = {}
        for name, matrix in self.matrices.items():
            tensors = {}
            for slot in matrix.tensors:
                raw = records[:, slot.offset:slot.offset + slot.nbytes].view(slot.dtype)
                tensors[slot.role] = raw.unflatten(1, slot.shape) if slot.shape else raw.reshape(count)
            views[name] = StoredWeight(matrix.format, tensors, (count, *matrix.shape), f"experts.{name}",
                                       matrix.block_size)
        return views


class PackedExperts:
    """One MoE layer's routed experts as host records [experts, record_bytes]."""

    def __init__(self, layer: int, records: torch.Tensor, layout: RecordLayout):
        self.layer, self.records, self.layout = layer, records, layout
        self.pinned = records.is_pinned()

    @functools.cached_property
    def rows(self) -> list[torch.Tensor]:
        """One view per expert's record, made once: slicing on every decode-step miss costs host time."""
        return list(self.records.unbind(0))

    @property
    def nbytes(self) -> int:
        return self.records.numel()


def expert_matrices(bank, expert: int) -> dict[str, StoredWeight]:
    """One expert of an ExpertBank as the two matrices a record holds."""
    stored = bank.stored(expert)
    gate_up = stored[:-1]  # (gate_up,) from a fused checkpoint, (gate, up) from a per-expert one
    return {"gate_up": fuse_rows(list(gate_up), f"{stored[0].name}+up"),
            "down": fuse_rows([stored[-1]], stored[-1].name)}


def pack_banks(banks: dict[int, object], pin_budget_bytes: int | None, pin: bool) -> tuple[dict[int, PackedExperts], dict]:
    """Every layer's bank as PackedExperts; layers are pinned in order while the pin budget lasts
    (None: no limit), when `pin` (a CUDA device is there to copy to). Returns (packed by layer, report)."""
    packed, pinned_bytes, pageable_bytes = {}, 0, 0
    layout = None
    for layer, bank in banks.items():
        experts = [expert_matrices(bank, e) for e in range(bank.num_experts)]
        layout = layout or RecordLayout.of(experts[0])
        size = bank.num_experts * layout.record_bytes
        pin_this = pin and (pin_budget_bytes is None or pinned_bytes + size <= pin_budget_bytes)
        records = torch.empty((bank.num_experts, layout.record_bytes), dtype=torch.uint8, pin_memory=pin_this)
        for e, expert in enumerate(experts):
            layout.write(records[e], expert)
        packed[layer] = PackedExperts(layer, records, layout)
        if pin_this:
            pinned_bytes += size
        else:
            pageable_bytes += size
    report = {"pinned_expert_bytes": pinned_bytes, "pageable_expert_bytes": pageable_bytes,
              "pin_budget_bytes": pin_budget_bytes}
    return packed, report


def default_pin_budget_bytes() -> int:
    """Half of physical RAM: page-locked memory cannot be swapped, so the rest stays for the OS and apps."""
    return physical_memory_bytes() // 2


def physical_memory_bytes() -> int:
    try:
        import psutil
        return int(psutil.virtual_memory().total)
    except ImportError:
        pass
    if sys.platform != "win32" and hasattr(os, "sysconf"):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return 0  # unknown (Windows without psutil): pin nothing rather than risk the system


def _aligned(offset: int) -> int:
    return -(-offset // RECORD_ALIGNMENT) * RECORD_ALIGNMENT


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
