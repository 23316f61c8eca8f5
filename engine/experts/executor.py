"""Expert executors: given a layer's bank, the hidden states and the router's choice, the routed output.

`ReferenceExpertExecutor` computes each chosen expert from the host bank where the hidden
states live. `CachedExpertExecutor` keeps experts in cache slots on the compute device
(engine/experts/cache.py) and copies only the misses. Both count what they did: the runtime
and the app's gauges read `stats()`.
"""

from __future__ import annotations

import torch

from engine.experts.bank import ExpertBank, run_expert
from engine.experts.cache import ExpertCache


def _routed_sum(x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor, weights_of) -> torch.Tensor:
    """Sum over each token's chosen experts of weight * expert(token); `weights_of(expert)` gives its weights."""
    out = torch.zeros_like(x)
    for expert in expert_ids.unique().tolist():
        token_idx, slot = torch.where(expert_ids == expert)
        y = weights_of(expert)(x[token_idx])
        out.index_add_(0, token_idx, y * expert_weights[token_idx, slot, None].to(x.dtype))
    return out


class ReferenceExpertExecutor:
    def __init__(self):
        self.expert_calls = 0  # experts computed so far

    def __call__(self, bank: ExpertBank, layer: int, x, expert_ids, expert_weights) -> torch.Tensor:
        def compute(expert):
            self.expert_calls += 1
            weights = tuple(w.to(x.device) for w in bank.stored(expert))
            return lambda tokens: run_expert(tokens, weights, bank.intermediate)

        return _routed_sum(x, expert_ids, expert_weights, compute)

    def stats(self) -> dict:
        return {"expert_calls": self.expert_calls}


class CachedExpertExecutor:
    def __init__(self, cache: ExpertCache):
        self.cache = cache
        self.expert_calls = 0

    def __call__(self, bank: ExpertBank, layer: int, x, expert_ids, expert_weights) -> torch.Tensor:
        def compute(expert):
            self.expert_calls += 1
            weights = self.cache.get(layer, expert, bank)
            return lambda tokens: run_expert(tokens, weights, bank.intermediate)

        return _routed_sum(x, expert_ids, expert_weights, compute)

    def stats(self) -> dict:
        return {"expert_calls": self.expert_calls, **self.cache.stats()}
