"""Sparse MoE block: softmax top-k router, routed experts through an executor, optional shared expert."""

from __future__ import annotations

import torch

from engine import kernels
from engine.checkpoint.source import WeightSource
from engine.experts.bank import ExpertBank
from engine.layers.linear import Linear
from engine.layers.mlp import SwiGLU
from engine.step import DecodeStep


class SparseMoe:
    def __init__(self, source: WeightSource, layer: int, executor):
        c = source.config
        prefix = f"layers.{layer}.mlp"
        self.layer = layer
        self.top_k, self.normalise_top_k = c.num_experts_per_tok, c.norm_topk_prob
        self.router = Linear(source, f"{prefix}.gate", c.hidden_size, c.num_experts)
        self.experts = ExpertBank(source, f"{prefix}.experts", c.num_experts, c.hidden_size, c.moe_intermediate_size)
        self.executor = executor
        self.forced_routing = None  # an engine.experts.routing.ForcedRouting a benchmark put in the router's place
        self.shared_expert = self.shared_expert_gate = None
        if c.shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(
                source, f"{prefix}.shared_expert", c.hidden_size, c.shared_expert_intermediate_size
            )
            self.shared_expert_gate = Linear(source, f"{prefix}.shared_expert_gate", c.hidden_size, 1)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], weights [T, k] float32) of each token; the ids a forced routing gives, if any."""
        ids, weights = kernels.router_topk(self.router(x), self.top_k, self.normalise_top_k)
        if self.forced_routing is not None:
            ids = self.forced_routing.ids(self.layer, x.shape[0])
        return ids, weights

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        """The gated shared expert's output, or None for a model without one."""
        if self.shared_expert is None:
            return None
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        routed = self.executor.start(self.experts, self.layer, x, ids, weights)  # expert copies now in flight
        shared = self.shared(x)  # runs beside the copies
        return routed.wait() if shared is None else routed.wait() + shared

    def decode_step(self, x: torch.Tensor, residual: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        """`residual` plus one token's routed and shared experts; the expert backend says where the host acts."""
        ids, weights = self.route(x)
        shared = self.shared if self.shared_expert is not None else None
        return self.executor.decode_layer(self.layer, x, ids.reshape(-1), weights, residual, shared, step)
