"""RMSNorm; Qwen3.5/3.6 scale by (1 + weight) (zero-centred), Qwen3 by weight."""

from __future__ import annotations

import torch

from engine import kernels
from engine.checkpoint.source import WeightSource


class RMSNorm:
    def __init__(self, source: WeightSource, name: str, dim: int, zero_centered: bool):
        self.weight = source.param(name, (dim,))
        self.eps = source.config.rms_norm_eps
        self.offset = 1.0 if zero_centered else 0.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps, self.offset)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + y, the norm of it), in one launch where the device has it."""
        return kernels.add_rms_norm(x, y, self.weight, self.eps, self.offset)
