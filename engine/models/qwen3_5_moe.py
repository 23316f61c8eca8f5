"""Qwen3.5/3.6-MoE: Gated DeltaNet and gated full attention layers, each followed by a MoE block
with a shared expert; zero-centred RMSNorms."""

from __future__ import annotations

from engine.checkpoint.source import WeightSource
from engine.layers.attention import Attention
from engine.layers.gated_deltanet import GatedDeltaNet
from engine.layers.moe import SparseMoe
from engine.layers.rotary import Rotary
from engine.models.base import CausalLM, DecoderLayer


def build(source: WeightSource, executor) -> CausalLM:
    c = source.config
    rotary = Rotary(c.rotary_dim, c.rope_theta, source.device)
    layers = []
    for i, kind in enumerate(c.layer_types):
        if kind == "full_attention":
            mixer = Attention(source, f"layers.{i}.self_attn", rotary)
        else:
            mixer = GatedDeltaNet(source, f"layers.{i}.linear_attn")
        layers.append(DecoderLayer(source, i, mixer, SparseMoe(source, i, executor)))
    return CausalLM(source, layers, executor)
