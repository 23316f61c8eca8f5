"""SwiGLU MLP: the shared expert of Qwen3.5/3.6 and the dense layers of Qwen3-MoE."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import kernels
from engine.checkpoint.source import WeightSource
from engine.layers.linear import JoinedLinear, Linear


class SwiGLU:
    def __init__(self, source: WeightSource, prefix: str, hidden: int, intermediate: int):
        self.gate_up_proj = JoinedLinear(
            source, [f"{prefix}.gate_proj", f"{prefix}.up_proj"], hidden, [intermediate, intermediate]
        )
        self.down_proj = Linear(source, f"{prefix}.down_proj", intermediate, hidden)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.gate_up_proj.weights) == 1:  # [gate | up] rows: the down projection applies the activation
            return kernels.linear(kernels.linear(x, self.gate_up_proj.weights[0]), self.down_proj.weight, swiglu=True)
        gate, up = self.gate_up_proj(x)
        return self.down_proj(F.silu(gate) * up)

    def decode_step(self, x: torch.Tensor, residual: torch.Tensor, step) -> torch.Tensor:
        """`residual` plus one token through the MLP, as a dense decoder layer ends."""
        return residual + self(x)
