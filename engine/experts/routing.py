"""Routings a benchmark or a test forces on a model's MoE layers, instead of what the routers choose.

Random weights route however their random numbers fall (identical experts make hidden states converge and
routing concentrate), so a figure measured under them says little. A forced routing makes the routing a
stated input:
- `uniform`: each token's top-k drawn uniformly per layer, the floor of any expert cache (an LRU of s slots
  over L layers of E experts hits s / (L * E));
- `locality`: modelled temporal reuse (`LOCALITY_ANCHORS`); prompt chunks stay uniform;
- `fixed`: the same k experts per layer at every decode step: once they are cached, a step is the GPU's own
  work (what decode costs without any expert traffic); prompt chunks stay uniform;
- `same`: every token of a chunk sends its k picks to the same k experts (the most skewed a chunk can be);
- `distinct`: a chunk's tokens use as many different experts as there are.
The routers still run (their cost is real); only the expert ids they give are replaced. A one-token step
reads its ids from a device tensor that `advance()` refills before each step, so captured decode graphs
replay with new routing every time.
"""

from __future__ import annotations

import bisect

import torch

MODES = ("uniform", "locality", "fixed", "same", "distinct")
# (fraction of a layer's experts, share of picks within that LRU stack depth): a per-layer LRU holding 1/8 of
# the experts hits 67 % and one holding 1/4 hits 81 % (512 experts, 10 active, a 54k-record mixed workload;
# llama.cpp PR #27861). Linear in between; depth 0 is the most recently used expert.
LOCALITY_ANCHORS = ((0.0, 0.0), (0.125, 0.67), (0.25, 0.81), (1.0, 1.0))
NOTES = {
    "uniform": "routing forced uniform: each token's experts drawn uniformly per layer, so the expert-cache hit "
    "rate is the floor, slots / (layers x experts)",
    "locality": "routing forced by a locality model (an LRU stack: 1/8 of a layer's experts cover 67 % of picks, "
    "1/4 cover 81 %, after llama.cpp PR #27861's measurement on a real 512-expert model); modelled, "
    "not measured on a real model; prompt chunks are routed uniformly",
    "fixed": "routing forced to the same experts at every decode step: with them cached, the GPU's own step",
    "same": "routing forced to the same experts for every token of a chunk (worst-case skew)",
    "distinct": "routing forced to spread each chunk's tokens over as many experts as exist",
}


class ForcedRouting:
    """Expert ids for every MoE layer of one model, in one of `MODES`."""

    def __init__(
        self, mode: str, layers: list[int], num_experts: int, top_k: int, device: torch.device | str, seed: int = 0
    ):
        if mode not in MODES:
            raise ValueError(f"unknown routing mode {mode!r}; choose one of {', '.join(MODES)}")
        if top_k > num_experts:
            raise ValueError(f"top_k {top_k} exceeds the {num_experts} experts")
        self.mode, self.num_experts, self.top_k = mode, num_experts, top_k
        self.row = {layer: i for i, layer in enumerate(layers)}
        self.generator = torch.Generator().manual_seed(seed)
        self.stacks = [list(torch.randperm(num_experts, generator=self.generator).tolist()) for _ in layers]
        self._cdf = [round(share * 1e6) for _, share in LOCALITY_ANCHORS]
        self.step_ids = torch.zeros(len(layers), top_k, dtype=torch.long, device=device)
        self._fixed = torch.stack([torch.tensor(stack[:top_k]) for stack in self.stacks])
        self.advance()

    @property
    def note(self) -> str:
        return NOTES[self.mode]

    def advance(self) -> None:
        """Draw the next one-token step's experts for every layer into `step_ids`."""
        if self.mode == "fixed":
            self.step_ids.copy_(self._fixed)
            return
        self.step_ids.copy_(torch.stack([self._token(row) for row in range(len(self.row))]))

    def ids(self, layer: int, tokens: int) -> torch.Tensor:
        """Expert ids [tokens, k] for `layer`; one token reads `step_ids` (capturable), a chunk gets new draws."""
        if tokens == 1:
            return self.step_ids[self.row[layer] : self.row[layer] + 1]
        return self.chunk(tokens).to(self.step_ids.device)

    def chunk(self, tokens: int) -> torch.Tensor:
        """Ids [tokens, k] of a prompt chunk under this mode (on the host)."""
        e, k = self.num_experts, self.top_k
        if self.mode == "same":
            return torch.randperm(e, generator=self.generator)[:k].expand(tokens, k).clone()
        if self.mode == "distinct":  # token t takes k consecutive places of one permutation, wrapping around
            places = (torch.arange(tokens).unsqueeze(1) * k + torch.arange(k)) % e
            return torch.randperm(e, generator=self.generator)[places]
        return torch.rand(tokens, e, generator=self.generator).argsort(dim=1)[:, :k]

    def _token(self, row: int) -> torch.Tensor:
        """One token's k distinct experts for the layer at `row`."""
        if self.mode != "locality":
            return self.chunk(1)[0]  # chunk(1) of `same` and `distinct` is a uniform draw too
        stack = self.stacks[row]
        depths: set[int] = set()
        while len(depths) < self.top_k:
            depths.add(self.depth(int(torch.randint(0, 10**6, (1,), generator=self.generator))))
        chosen = [stack[d] for d in sorted(depths)]
        self.stacks[row] = chosen + [e for e in stack if e not in chosen]  # most recently used first
        return torch.tensor(chosen)

    def depth(self, draw: int) -> int:
        """The LRU stack depth that a uniform draw in [0, 10**6) stands for under `LOCALITY_ANCHORS`."""
        segment = min(bisect.bisect_right(self._cdf, draw), len(self._cdf) - 1)
        (x0, _), (x1, _) = LOCALITY_ANCHORS[segment - 1], LOCALITY_ANCHORS[segment]
        y0, y1 = self._cdf[segment - 1], self._cdf[segment]
        fraction = x0 + (x1 - x0) * (draw - y0) / (y1 - y0)
        return min(int(fraction * self.num_experts), self.num_experts - 1)


def force_routing(model, mode: str, seed: int = 0) -> ForcedRouting:
    """Make every MoE layer of `model` take its expert ids from a new `ForcedRouting` in `mode`."""
    moe = [layer.mlp for layer in model.layers if hasattr(layer.mlp, "route")]
    routing = ForcedRouting(
        mode, [mlp.layer for mlp in moe], model.config.num_experts, model.config.num_experts_per_tok, model.device, seed
    )
    for mlp in moe:
        mlp.forced_routing = routing
    return routing
