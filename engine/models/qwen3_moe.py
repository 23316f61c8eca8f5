"""Qwen3-MoE: full attention with q/k norms and RoPE on every layer; MoE blocks (or dense MLPs on
`mlp_only_layers`), no shared expert."""

from __future__ import annotations

from engine.checkpoint.source import WeightSource
from engine.layers.attention import Attention
from engine.layers.mlp import SwiGLU
from engine.layers.moe import SparseMoe
from engine.layers.rotary import Rotary
from engine.models.base import CausalLM, DecoderLayer


def build(source: WeightSource, executor) -> CausalLM:
    c = source.config
    rotary = Rotary(c.rotary_dim, c.rope_theta, source.device)
    layers = []
    for i in range(c.num_hidden_layers):
        if c.is_moe_layer(i):
            mlp = SparseMoe(source, i, executor)
        else:
            mlp = SwiGLU(source, f"layers.{i}.mlp", c.hidden_size, c.intermediate_size)
        layers.append(DecoderLayer(source, i, Attention(source, f"layers.{i}.self_attn", rotary), mlp))
    return CausalLM(source, layers, executor)
