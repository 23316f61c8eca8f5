"""Sparse MoE block: softmax top-k router, routed experts through an executor, optional shared expert."""

from __future__ import annotations

import torch

from engine import kernels
from engine.checkpoint.source import WeightSource
from engine.experts.bank import ExpertBank
from engine.layers.linear import JoinedLinear
from engine.layers.mlp import SwiGLU
from engine.step import DecodeStep


class SparseMoe:
    def __init__(self, source: WeightSource, layer: int, executor):
        c = source.config
        prefix = f"layers.{layer}.mlp"
        self.layer = layer
        self.top_k, self.normalise_top_k = c.num_experts_per_tok, c.norm_topk_prob
        self.experts = ExpertBank(source, f"{prefix}.experts", c.num_experts, c.hidden_size, c.moe_intermediate_size)
        self.executor = executor
        self.forced_routing = None  # an engine.experts.routing.ForcedRouting a benchmark put in the router's place
        self.shared_expert = None
        gates, widths = [f"{prefix}.gate"], [c.num_experts]
        if c.shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(
                source, f"{prefix}.shared_expert", c.hidden_size, c.shared_expert_intermediate_size
            )
            gates.append(f"{prefix}.shared_expert_gate")
            widths.append(1)
        # The shared expert's gate reads the router's input: one matmul gives both (one launch, not three)
        self.gates = JoinedLinear(source, gates, c.hidden_size, widths)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(expert ids [T, k], weights [T, k] float32, the shared expert's gate logits [T, 1] or None) of each
        token; the ids a forced routing gives, if any."""
        logits, *gate = self.gates(x)
        ids, weights = kernels.router_topk(logits, self.top_k, self.normalise_top_k)
        if self.forced_routing is not None:
            ids = self.forced_routing.ids(self.layer, x.shape[0])
        return ids, weights, gate[0] if gate else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights, gate = self.route(x)
        routed = self.executor.start(self.experts, self.layer, x, ids, weights)  # expert copies now in flight
        if self.shared_expert is None:
            return routed.wait()
        shared = torch.sigmoid(gate) * self.shared_expert(x)  # runs beside the copies
        return routed.wait() + shared

    def decode_step(self, x: torch.Tensor, residual: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        """`residual` plus one token's routed and gated shared experts; the expert backend says where the host
        acts."""
        ids, weights, gate = self.route(x)
        return self.executor.decode_layer(
            self.layer, x, ids.reshape(-1), weights, residual, self.shared_expert, gate, step
        )
