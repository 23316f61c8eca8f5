"""The CPU experts in plain PyTorch, for where numba is not installed: the same numbers, slower."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.record_layout import RecordLayout


def run_torch(
    layout: RecordLayout,
    records: torch.Tensor,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    chosen: torch.Tensor,
) -> torch.Tensor:
    """Compute CpuExpertKernel.run's sum with PyTorch: each chosen expert dequantised, then F.linear."""
    views = layout.view(records)
    hidden, intermediate = layout.matrices["down"].shape[0], layout.matrices["gate_up"].shape[0] // 2
    out = torch.zeros(x.shape[0], hidden)
    for expert in ids[chosen].unique().tolist():
        tokens, slot = torch.where((ids == expert) & chosen)
        gate, up = F.linear(x[tokens], views["gate_up"].select(expert).dequantize()).split(intermediate, -1)
        y = F.linear(F.silu(gate) * up, views["down"].select(expert).dequantize())
        out.index_add_(0, tokens, y * weights[tokens, slot, None])
    return out
