"""One Linear over every weight format: the format decodes in the kernel, the layer does not care."""

from __future__ import annotations

import torch

from engine import kernels
from engine.layers.source import WeightSource


class Linear:
    def __init__(self, source: WeightSource, module: str, in_features: int, out_features: int):
        self.weight = source.linear(module, in_features, out_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight)
