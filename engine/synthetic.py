"""Full-size models described without any file: real shapes plus the format of each weight.

`SYNTHETIC_MODELS[name]` gives a `SyntheticModel`: the `ModelConfig` a real checkpoint of that
model would produce and a map from weight component to stored format. This module is data
only: the memory planner sizes plans from it, and a benchmark can build random-weight models
of the real shapes from it (no download, no file on disk).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from engine.checkpoint.formats import FP8_TENSOR, NVFP4
from engine.config import ModelConfig, config_from_dict
from engine.testing import tiny_checkpoints

BF16 = "bf16"  # plain bfloat16 weight (formats.DENSE stored as bf16)

# The weight components a format map names, and which tensors each covers.
COMPONENTS = MappingProxyType({
    "routed_experts": "gate/up/down projections of every routed expert",
    "shared_expert": "gate/up/down projections of each layer's shared expert",
    "attention_projections": "q/k/v/o projections of the full-attention layers",
    "gdn_projections": "in_proj_qkv, in_proj_z and out_proj of the Gated DeltaNet layers",
    "gdn_gate_projections": "in_proj_a and in_proj_b of the Gated DeltaNet layers",
    "router": "each MoE layer's router (mlp.gate) and shared-expert gate",
    "norms_and_small": "RMSNorm weights, GDN conv1d weights, A_log and dt_bias",
    "embedding": "embed_tokens",
    "lm_head": "the output projection (not tied to the embedding)",
})


@dataclass(frozen=True)
class SyntheticModel:
    name: str
    description: str
    config: ModelConfig
    formats: Mapping[str, str]  # component (a key of COMPONENTS) -> BF16 | FP8_TENSOR | NVFP4


# nvidia/Qwen3.6-35B-A3B-NVFP4 is a ModelOpt MIXED_PRECISION export: NVFP4 experts,
# FP8 per-tensor attention/GDN projections, bf16 for what its exclude list names.
QWEN3_5_NVFP4_FORMATS = MappingProxyType({
    "routed_experts": NVFP4,
    "shared_expert": NVFP4,
    "attention_projections": FP8_TENSOR,
    "gdn_projections": FP8_TENSOR,
    "gdn_gate_projections": BF16,
    "router": BF16,
    "norms_and_small": BF16,
    "embedding": BF16,
    "lm_head": BF16,
})

# Qwen/Qwen3-30B-A3B is published in bf16; it has no shared expert and no Gated DeltaNet.
QWEN3_BF16_FORMATS = MappingProxyType({
    "routed_experts": BF16,
    "attention_projections": BF16,
    "router": BF16,
    "norms_and_small": BF16,
    "embedding": BF16,
    "lm_head": BF16,
})

# Qwen/Qwen3.6-35B-A3B (and Qwen/Qwen3.5-35B-A3B, the same shapes) is published in bf16.
QWEN3_5_BF16_FORMATS = MappingProxyType(dict.fromkeys(QWEN3_5_NVFP4_FORMATS, BF16))

# Qwen/Qwen3.6-35B-A3B-FP8 stores its projections in FP8 with one scale per 128x128 block; sized here as
# per-tensor FP8, which differs only by those scales (4 bytes per 16,384 weights, 0.02 %).
QWEN3_5_FP8_FORMATS = MappingProxyType(dict(QWEN3_5_BF16_FORMATS, routed_experts=FP8_TENSOR,
                                            shared_expert=FP8_TENSOR, attention_projections=FP8_TENSOR,
                                            gdn_projections=FP8_TENSOR))

QWEN3_6_LAYERS = 40
QWEN3_6_FULL_ATTENTION_INTERVAL = 4  # three Gated DeltaNet layers, then one full-attention layer

QWEN3_6_35B_A3B = ModelConfig(  # the defaults of transformers' Qwen3_5MoeTextConfig
    model_type="qwen3_5_moe_text",
    vocab_size=248320,
    hidden_size=2048,
    num_hidden_layers=QWEN3_6_LAYERS,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    rms_norm_eps=1e-6,
    rope_theta=10_000_000.0,
    rotary_dim=64,  # partial_rotary_factor 0.25 of head_dim 256
    layer_types=tuple("full_attention" if (i + 1) % QWEN3_6_FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
                      for i in range(QWEN3_6_LAYERS)),
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    norm_topk_prob=True,
    tie_word_embeddings=False,
    max_position_embeddings=262144,
    attention_output_gate=True,
    zero_centered_norms=True,
    shared_expert_intermediate_size=512,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
)

QWEN3_30B_A3B_LAYERS = 48

QWEN3_30B_A3B = ModelConfig(
    model_type="qwen3_moe",
    vocab_size=151936,
    hidden_size=2048,
    num_hidden_layers=QWEN3_30B_A3B_LAYERS,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    rotary_dim=128,  # full RoPE
    layer_types=("full_attention",) * QWEN3_30B_A3B_LAYERS,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
    tie_word_embeddings=False,
    max_position_embeddings=40960,
    intermediate_size=6144,  # in config.json, unused: every layer is MoE
)

# The shapes of the tiny test checkpoints, parsed the way a real config.json is, so they cannot drift.
TINY = config_from_dict(dict(tiny_checkpoints.TEXT_QWEN3_5, model_type="qwen3_5_moe_text"),
                        Path(tiny_checkpoints.__file__))

SYNTHETIC_MODELS: Mapping[str, SyntheticModel] = MappingProxyType({
    model.name: model for model in (
        SyntheticModel("qwen3.6-35b-a3b-nvfp4", "Qwen3.6-35B-A3B as nvidia/Qwen3.6-35B-A3B-NVFP4 stores it",
                       QWEN3_6_35B_A3B, QWEN3_5_NVFP4_FORMATS),
        SyntheticModel("qwen3.6-35b-a3b", "Qwen3.6-35B-A3B as Qwen/Qwen3.6-35B-A3B stores it (bf16)",
                       QWEN3_6_35B_A3B, QWEN3_5_BF16_FORMATS),
        SyntheticModel("qwen3.6-35b-a3b-fp8", "Qwen3.6-35B-A3B as Qwen/Qwen3.6-35B-A3B-FP8 stores it (FP8 "
                       "projections, sized as per-tensor FP8)", QWEN3_6_35B_A3B, QWEN3_5_FP8_FORMATS),
        SyntheticModel("qwen3-30b-a3b", "Qwen3-30B-A3B as Qwen/Qwen3-30B-A3B stores it (bf16)",
                       QWEN3_30B_A3B, QWEN3_BF16_FORMATS),
        SyntheticModel("tiny", "the tiny Qwen3.5-MoE test model, formats as write_tiny_checkpoint(..., 'nvfp4')",
                       TINY, QWEN3_5_NVFP4_FORMATS),
    )
})


def text_config(config: ModelConfig) -> dict:
    """The config.json text settings that give `config`: what engine.testing.tiny_checkpoints lays out."""
    text = {key: getattr(config, key) for key in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
        "shared_expert_intermediate_size", "linear_num_key_heads", "linear_num_value_heads",
        "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")}
    text["layer_types"] = list(config.layer_types)
    text["mlp_only_layers"] = list(config.dense_mlp_layers)
    return text


def checkpoint_format(model: SyntheticModel) -> str:
    """The tiny_checkpoints format name whose weight formats are `model.formats`."""
    return {NVFP4: "nvfp4", FP8_TENSOR: "fp8_block"}.get(model.formats["routed_experts"], "bf16")
