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

The interface is two-phase: `start(...)` routes the work and sets whatever is slow in motion (copies on
the copy stream; CPU compute, later), `wait()` on what it returns gives the routed output. The MoE
layer runs its shared expert in between, so that work hides the transfers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import kernels
from engine.experts.bank import ExpertBank, run_expert
from engine.experts.cache import ExpertCache
from engine.experts.packed import PackedExperts, pack_banks
from engine.kernels.groups import ExpertGroups


class ReferenceExpertExecutor:
    host_report: dict = {}  # nothing is repacked or pinned: experts are read where the checkpoint keeps them

    def __init__(self):
        self.expert_calls = 0  # experts computed so far

    def prepare(self, banks: dict[int, ExpertBank]) -> None:
        """Nothing to set up: experts are computed from the banks as they are."""

    def start(self, bank: ExpertBank, layer: int, x, expert_ids, expert_weights) -> Ready:
        out = torch.zeros_like(x)
        for expert in expert_ids.unique().tolist():
            self.expert_calls += 1
            token_idx, slot = torch.where(expert_ids == expert)
            weights = tuple(w.to(x.device) for w in bank.stored(expert))
            y = run_expert(x[token_idx], weights, bank.intermediate)
            out.index_add_(0, token_idx, y * expert_weights[token_idx, slot, None].to(x.dtype))
        return Ready(out)

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

    def start(self, bank: ExpertBank, layer: int, x, expert_ids, expert_weights) -> _CachedWork:
        tokens, top_k = expert_ids.shape
        flat = expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments sorted by expert
        counts = torch.bincount(flat, minlength=bank.num_experts).tolist()  # the one host sync of a layer
        experts = [e for e, n in enumerate(counts) if n]
        self.expert_calls += len(experts)
        token_of_row = order // top_k
        rows = x[token_of_row]
        starts = [0]
        for e in experts:
            starts.append(starts[-1] + counts[e])
        streaming = self.cache.blocks > 0 and tokens * top_k >= bank.num_experts
        # Experts in rounds the cache can hold at once (one round unless the cache is under a layer).
        rounds = []
        for first in range(0, len(experts), self.slots):
            chosen = experts[first:first + self.slots]
            rounds.append((first, chosen, None if first else self._slots(layer, chosen, streaming)))
        return _CachedWork(self, layer, x, rows, order, token_of_row, expert_weights, starts, rounds, streaming,
                           bank.intermediate)

    def _slots(self, layer: int, experts: list[int], streaming: bool) -> list[int]:
        """Cache slots holding `experts`, their copies issued on the copy stream."""
        if streaming:
            base = self.cache.stream_layer(layer, self.packed[layer])
            return [base + e for e in experts]
        return self.cache.fetch(layer, experts, self.packed[layer])

    def _swiglu(self, rows: torch.Tensor, groups: ExpertGroups, intermediate: int) -> torch.Tensor:
        weights = self.cache.weights
        gate, up = kernels.grouped_linear(rows, weights["gate_up"], groups).split(intermediate, dim=-1)
        return kernels.grouped_linear(F.silu(gate) * up, weights["down"], groups)

    def stats(self) -> dict:
        return {"expert_calls": self.expert_calls, **self.host_report, **self.cache.stats()}


class Ready:
    """Work that was done at once."""

    def __init__(self, out: torch.Tensor):
        self.out = out

    def wait(self) -> torch.Tensor:
        return self.out


@dataclass
class _CachedWork:
    """A layer's routed experts whose first round of copies is in flight."""

    executor: CachedExpertExecutor
    layer: int
    x: torch.Tensor
    rows: torch.Tensor  # x's rows, one per (token, chosen expert), sorted by expert
    order: torch.Tensor  # flat (token * top_k + k) index of each row
    token_of_row: torch.Tensor
    expert_weights: torch.Tensor
    starts: list[int]  # first row of each present expert, and the end
    rounds: list[tuple]  # (index of its first expert, experts, slots or None until fetched)
    streaming: bool
    intermediate: int

    def wait(self) -> torch.Tensor:
        executor, cache = self.executor, self.executor.cache
        out_rows = torch.empty_like(self.rows)
        for first, chosen, slots in self.rounds:
            if slots is None:
                slots = executor._slots(self.layer, chosen, self.streaming)
            begin, end = self.starts[first], self.starts[first + len(chosen)]
            groups = ExpertGroups(slots, [s - begin for s in self.starts[first:first + len(chosen) + 1]])
            cache.wait_ready()
            out_rows[begin:end] = executor._swiglu(self.rows[begin:end], groups, self.intermediate)
            cache.release(slots)
        following = executor._next_layer.get(self.layer)
        if self.streaming and following is not None:  # next layer's experts stream while this one finishes
            cache.stream_layer(following, executor.packed[following], count_as_lookups=False)
        weighted = out_rows * self.expert_weights.reshape(-1)[self.order, None].to(out_rows.dtype)
        return torch.zeros_like(self.x).index_add_(0, self.token_of_row, weighted)
