"""The routed experts of one MoE layer, in host memory, in their checkpoint format.

Checkpoints store them fused per layer (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`
[E, H, I]) or per expert (`experts.E.{gate,up,down}_proj`); the bank hides which.
"""

from __future__ import annotations

import torch

from engine.checkpoint.formats import StoredWeight
from engine.layers.source import WeightSource


class ExpertBank:
    def __init__(self, source: WeightSource, prefix: str, num_experts: int, hidden: int, intermediate: int):
        self.num_experts, self.intermediate = num_experts, intermediate
        fused_name = f"{prefix}.gate_up_proj"
        if source.checkpoint.has(fused_name):
            gate_up = source.host_weight(fused_name, (num_experts, 2 * intermediate, hidden))
            down = source.host_weight(f"{prefix}.down_proj", (num_experts, hidden, intermediate))
            self._fused: tuple[StoredWeight, StoredWeight] | None = (gate_up, down)
            self._per_expert: list[tuple[StoredWeight, ...]] = []
        else:
            self._fused = None
            self._per_expert = [
                (source.host_weight(f"{prefix}.{e}.gate_proj", (intermediate, hidden)),
                 source.host_weight(f"{prefix}.{e}.up_proj", (intermediate, hidden)),
                 source.host_weight(f"{prefix}.{e}.down_proj", (hidden, intermediate)))
                for e in range(num_experts)
            ]

    @property
    def nbytes(self) -> int:
        stored = self._fused if self._fused is not None else [w for ws in self._per_expert for w in ws]
        return sum(w.nbytes for w in stored)

    def weights(self, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [I, H], up [I, H], down [H, I]) of one expert, decoded to `dtype` on the host."""
        if self._fused is not None:
            gate_up, down = self._fused
            gate, up = gate_up.select(expert).dequantize(dtype).split(self.intermediate, dim=0)
            return gate, up, down.select(expert).dequantize(dtype)
        gate, up, down = self._per_expert[expert]
        return gate.dequantize(dtype), up.dequantize(dtype), down.dequantize(dtype)
