"""Routed experts repacked for streaming: one record of bytes per expert, so a miss is one copy and a
whole layer of experts is one copy.

A record holds the expert's gate_up weight and its down weight at the offsets of a RecordLayout
(engine/kernels/record_layout.py, beside the kernels that read it). The same record layout
views host records and device cache slots alike: `RecordLayout.view(records)` gives stacked
StoredWeights [n, out, in] whose tensors are strided views into the bytes, which is what the grouped
expert kernels take. Host records are pinned (page-locked) up to a pin budget, for full-speed
asynchronous copies, and pageable beyond it; how many bytes went each way is reported, never silent.
"""

from __future__ import annotations

import functools
import os
import sys

import torch

from engine.checkpoint.formats import StoredWeight, fuse_rows
from engine.kernels.record_layout import RecordLayout


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
    return {
        "gate_up": fuse_rows(list(gate_up), f"{stored[0].name}+up"),
        "down": fuse_rows([stored[-1]], stored[-1].name),
    }


def pack_banks(
    banks: dict[int, object], pin_budget_bytes: int | None, pin: bool
) -> tuple[dict[int, PackedExperts], dict]:
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
    report = {
        "pinned_expert_bytes": pinned_bytes,
        "pageable_expert_bytes": pageable_bytes,
        "pin_budget_bytes": pin_budget_bytes,
    }
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
