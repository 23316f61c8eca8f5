"""The routed experts of one MoE layer, in host memory, in their checkpoint format.

Checkpoints store them fused per layer (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`
[E, H, I]) or per expert (`experts.E.{gate,up,down}_proj`); the bank hides which.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import kernels
from engine.checkpoint.formats import StoredWeight
from engine.checkpoint.source import WeightSource


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
                (
                    source.host_weight(f"{prefix}.{e}.gate_proj", (intermediate, hidden)),
                    source.host_weight(f"{prefix}.{e}.up_proj", (intermediate, hidden)),
                    source.host_weight(f"{prefix}.{e}.down_proj", (hidden, intermediate)),
                )
                for e in range(num_experts)
            ]

    @property
    def nbytes(self) -> int:
        stored = self._fused if self._fused is not None else [w for ws in self._per_expert for w in ws]
        return sum(w.nbytes for w in stored)

    def stored(self, expert: int) -> tuple[StoredWeight, ...]:
        """One expert's weights in their stored format: (gate_up [2I, H], down [H, I]) from a fused
        checkpoint, (gate [I, H], up [I, H], down [H, I]) from a per-expert one."""
        if self._fused is not None:
            return tuple(w.select(expert) for w in self._fused)
        return self._per_expert[expert]


def run_expert(x: torch.Tensor, weights: tuple[StoredWeight, ...], intermediate: int) -> torch.Tensor:
    """SwiGLU of one expert over the tokens x, whichever way its weights are stored."""
    if len(weights) == 2:
        gate_up, down = weights
        gate, up = kernels.linear(x, gate_up).split(intermediate, dim=-1)
    else:
        gate_proj, up_proj, down = weights
        gate, up = kernels.linear(x, gate_proj), kernels.linear(x, up_proj)
    return kernels.linear(F.silu(gate) * up, down)
