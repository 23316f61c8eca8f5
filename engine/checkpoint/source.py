"""Where layers get their weights: the checkpoint, plus the device and compute dtype of this load."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.checkpoint import Checkpoint
from engine.checkpoint.formats import StoredWeight, fuse_rows
from engine.config import ModelConfig


@dataclass
class WeightSource:
    checkpoint: Checkpoint
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype | None = None  # the KV cache's (torch.float8_e4m3fn: FP8 with scales); None: dtype's

    def linear(self, module: str, in_features: int, out_features: int) -> StoredWeight:
        """A resident linear weight, kept in its stored format on the compute device."""
        return self.checkpoint.weight(module, (out_features, in_features)).to(self.device)

    def joined_linear(self, modules: list[str], in_features: int, out_features: list[int]) -> list[StoredWeight]:
        """Linears of one input as one weight joined by rows (one kernel launch), on the compute device;
        weights of different formats cannot be joined and come back apart."""
        weights = [self.checkpoint.weight(m, (n, in_features)) for m, n in zip(modules, out_features)]
        try:
            weights = [fuse_rows(weights, "+".join(modules))]
        except ValueError:
            pass
        return [w.to(self.device) for w in weights]

    def host_weight(self, module: str, shape: tuple[int, ...]) -> StoredWeight:
        """A routed-expert weight: stays in host memory, in its stored format."""
        return self.checkpoint.weight(module, shape)

    def param(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A small plain parameter (norm weight, A_log, conv kernel) in float32 on the device."""
        return self.checkpoint.tensor(name, shape).to(self.device, torch.float32)
