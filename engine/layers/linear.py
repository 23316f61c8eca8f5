"""One Linear over every weight format: the format decodes in the kernel, the layer does not care."""

from __future__ import annotations

import torch

from engine import kernels
from engine.checkpoint.source import WeightSource


class Linear:
    def __init__(self, source: WeightSource, module: str, in_features: int, out_features: int):
        self.weight = source.linear(module, in_features, out_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight)


class JoinedLinear:
    """Linears that read the same input, computed as one matmul when their formats allow (decode pays per
    kernel launch); calling it gives each linear's output, in order."""

    def __init__(self, source: WeightSource, modules: list[str], in_features: int, out_features: list[int]):
        self.weights = source.joined_linear(modules, in_features, out_features)
        self.out_features = out_features

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(self.weights) == 1:
            return kernels.linear(x, self.weights[0]).split(self.out_features, dim=-1)
        return tuple(kernels.linear(x, w) for w in self.weights)
