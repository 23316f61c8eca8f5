"""Expert executors: given a layer's bank, the hidden states and the router's choice, the routed output.

`ReferenceExpertExecutor` computes each chosen expert from the host bank where the hidden states
live, one expert at a time: the plain definition the others are tested against.
`CachedExpertExecutor` is the GPU runtime's: the layer's experts visit cache slots on the compute
device (engine/experts/cache.py) and run as one grouped matmul per projection over tokens sorted
by expert. Chunks big enough to touch most experts stream the whole layer, and the next layer's
experts start streaming on the copy stream as soon as this layer's compute is queued: into a second
block of slots while this layer computes (prefill overlap, two or more layers of slots), or into the
same block once this layer is done, beside the next layer's attention (one layer of slots). Both report what they did in `stats()`,
which the runtime and the app's gauges read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import kernels
from engine.experts.bank import ExpertBank, run_expert
from engine.experts.cache import ExpertCache
from engine.experts.packed import PackedExperts, pack_banks
from engine.kernels.groups import ExpertGroups


class ReferenceExpertExecutor:
    def __init__(self):
        self.expert_calls = 0  # experts computed so far

    def prepare(self, banks: dict[int, ExpertBank]) -> None:
        """Nothing to set up: experts are computed from the banks as they are."""

    def __call__(self, bank: ExpertBank, layer: int, x, expert_ids, expert_weights) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in expert_ids.unique().tolist():
            self.expert_calls += 1
            token_idx, slot = torch.where(expert_ids == expert)
            weights = tuple(w.to(x.device) for w in bank.stored(expert))
            y = run_expert(x[token_idx], weights, bank.intermediate)
            out.index_add_(0, token_idx, y * expert_weights[token_idx, slot, None].to(x.dtype))
        return out

    def stats(self) -> dict:
        return {"expert_calls": self.expert_calls}


class CachedExpertExecutor:
    def __init__(self, device: torch.device | str, slots: int, pin_budget_bytes: int | None = None):
        self.device = torch.device(device)
        self.slots, self.pin_budget_bytes = slots, pin_budget_bytes
        self.cache: ExpertCache | None = None
        self.packed: dict[int, PackedExperts] = {}
        self._next_layer: dict[int, int] = {}
        self.host_report: dict = {}
        self.expert_calls = 0

    def prepare(self, banks: dict[int, ExpertBank]) -> None:
        """Repack every layer's experts into host records (pinned within the budget) and allocate the cache."""
        self.packed, self.host_report = pack_banks(banks, self.pin_budget_bytes, pin=self.device.type == "cuda")
        layers = sorted(self.packed)
        self._next_layer = dict(zip(layers, layers[1:]))
        first = self.packed[layers[0]]
        self.cache = ExpertCache(self.device, self.slots, first.layout, first.records.shape[0])

    def __call__(self, bank: ExpertBank, layer: int, x, expert_ids, expert_weights) -> torch.Tensor:
        tokens, top_k = expert_ids.shape
        flat = expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments sorted by expert
        counts = torch.bincount(flat, minlength=bank.num_experts).tolist()  # the one host sync of a layer
        experts = [e for e, n in enumerate(counts) if n]
        self.expert_calls += len(experts)
        rows = x[order // top_k]
        starts = [0]
        for e in experts:
            starts.append(starts[-1] + counts[e])
        streaming = self.cache.blocks > 0 and tokens * top_k >= bank.num_experts
        out_rows = torch.empty_like(rows)
        # Experts in rounds the cache can hold at once (one round unless the cache is under a layer).
        for first in range(0, len(experts), self.slots):
            chosen = experts[first:first + self.slots]
            if streaming:
                base = self.cache.stream_layer(layer, self.packed[layer])
                slots = [base + e for e in chosen]
            else:
                slots = self.cache.fetch(layer, chosen, self.packed[layer])
            begin, end = starts[first], starts[first + len(chosen)]
            groups = ExpertGroups(slots, [s - begin for s in starts[first:first + len(chosen) + 1]])
            self.cache.wait_ready()
            out_rows[begin:end] = self._swiglu(rows[begin:end], groups, bank.intermediate)
            self.cache.release(slots)
        if streaming and layer in self._next_layer:
            following = self._next_layer[layer]
            self.cache.stream_layer(following, self.packed[following], count_as_lookups=False)
        weighted = out_rows * expert_weights.reshape(-1)[order, None].to(out_rows.dtype)
        return torch.zeros_like(x).index_add_(0, order // top_k, weighted)

    def _swiglu(self, rows: torch.Tensor, groups: ExpertGroups, intermediate: int) -> torch.Tensor:
        weights = self.cache.weights
        gate, up = kernels.grouped_linear(rows, weights["gate_up"], groups).split(intermediate, dim=-1)
        return kernels.grouped_linear(F.silu(gate) * up, weights["down"], groups)

    def stats(self) -> dict:
        return {"expert_calls": self.expert_calls, **self.host_report, **self.cache.stats()}
