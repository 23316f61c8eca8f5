"""SwiGLU MLP: the shared expert of Qwen3.5/3.6 and the dense layers of Qwen3-MoE."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.linear import Linear
from engine.layers.source import WeightSource


class SwiGLU:
    def __init__(self, source: WeightSource, prefix: str, hidden: int, intermediate: int):
        self.gate_proj = Linear(source, f"{prefix}.gate_proj", hidden, intermediate)
        self.up_proj = Linear(source, f"{prefix}.up_proj", hidden, intermediate)
        self.down_proj = Linear(source, f"{prefix}.down_proj", intermediate, hidden)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
