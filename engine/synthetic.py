"""Full-size models described without any file: each one exactly as its real checkpoint lays it out.

`SYNTHETIC_MODELS[name]` gives a `SyntheticModel`: the config.json the real checkpoint has
(`config_json`, its `hf_quant_config` where it ships one), the `ModelConfig` the engine reads from it,
and `tensor_layout()`, every tensor of the real safetensors files (checkpoint key -> safetensors dtype,
shape), generated from the config by the same rules the exporter follows (engine/synthetic_layout.py).
The memory planner sizes plans from the layout through the code that reads real headers; benchmarks build
random weights of it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from engine.checkpoint.declared import compressed_tensors_nvfp4, fp8_block, modelopt_mixed_precision
from engine.config import ModelConfig, config_from_dict
from engine.synthetic_layout import (
    BF16,
    FP8_TENSOR,
    LLM_COMPRESSOR_NVFP4,
    NVFP4,
    NVIDIA_NVFP4,
    QWEN3_BF16,
    QWEN_BF16,
    QWEN_FP8,
    Build,
    Layout,
    walk_layout,
)
from engine.testing import tiny_checkpoints


@dataclass(frozen=True)
class SyntheticModel:
    name: str
    description: str
    config: ModelConfig  # what engine.config.read_config gives for config_json
    config_json: dict  # the checkpoint's config.json, quantization_config included where it has one
    build: Build
    hf_quant_config: dict | None = None  # hf_quant_config.json, for ModelOpt exports
    fp8_block_size: tuple[int, int] = (128, 128)
    generation_config: dict = field(default_factory=dict)

    def tensor_layout(self) -> Layout:
        """Every tensor of the real checkpoint: key -> (safetensors dtype, shape)."""
        return walk_layout(self.config_json, self.build, self.fp8_block_size).layout

    @property
    def quantization_config(self) -> dict | None:
        """What engine.checkpoint.Checkpoint takes as its quantisation argument (config.json's section)."""
        return self.config.quantization_config


# ---- the published configs ------------------------------------------------------------------

QWEN3_6_LAYERS = 40
QWEN3_6_FULL_ATTENTION_INTERVAL = 4  # three Gated DeltaNet layers, then one full-attention layer

QWEN3_6_TEXT_CONFIG = {  # Qwen/Qwen3.6-35B-A3B's text_config, shared by every build of it
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_output_gate": True,
    "bos_token_id": 248044,
    "dtype": "bfloat16",
    "eos_token_id": 248044,
    "full_attention_interval": QWEN3_6_FULL_ATTENTION_INTERVAL,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "layer_types": [
        "full_attention" if (i + 1) % QWEN3_6_FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
        for i in range(QWEN3_6_LAYERS)
    ],
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "mamba_ssm_dtype": "float32",
    "max_position_embeddings": 262144,
    "model_type": "qwen3_5_moe_text",
    "moe_intermediate_size": 512,
    "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False,
    "num_attention_heads": 16,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "num_hidden_layers": QWEN3_6_LAYERS,
    "num_key_value_heads": 2,
    "output_router_logits": False,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "rope_type": "default",
    },
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 248320,
}
QWEN3_6_VISION_CONFIG = {
    "deepstack_visual_indexes": [],
    "depth": 27,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "in_channels": 3,
    "initializer_range": 0.02,
    "intermediate_size": 4304,
    "model_type": "qwen3_5_moe",
    "num_heads": 16,
    "num_position_embeddings": 2304,
    "out_hidden_size": 2048,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
QWEN3_6_CONFIG = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "image_token_id": 248056,
    "language_model_only": False,
    "model_type": "qwen3_5_moe",
    "text_config": QWEN3_6_TEXT_CONFIG,
    "tie_word_embeddings": False,
    "transformers_version": "4.57.1",
    "video_token_id": 248057,
    "vision_config": QWEN3_6_VISION_CONFIG,
    "vision_end_token_id": 248054,
    "vision_start_token_id": 248053,
}
QWEN3_6_GENERATION_CONFIG = {
    "bos_token_id": 248044,
    "do_sample": True,
    "eos_token_id": [248046, 248044],
    "pad_token_id": 248044,
    "temperature": 1.0,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.57.1",
}

QWEN3_30B_A3B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_30B_A3B_GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}

MODELOPT_VERSION = "0.44.0"  # the exporter of nvidia/Qwen3.6-35B-A3B-NVFP4
LLM_COMPRESSOR_VERSION = "0.20.1"  # compressed-tensors version of the llm-compressor build
# Qwen's FP8 list names three deepstack mergers although this vision tower has none (deepstack_visual_indexes
# is empty): the count is not in the config
QWEN3_6_FP8_DEEPSTACK_MERGERS = 3


def _modelopt_quantization(config_json: dict, build: Build) -> tuple[dict, dict]:
    """(config.json quantization_config, hf_quant_config.json) a ModelOpt MIXED_PRECISION export declares."""
    walk = walk_layout(config_json, build)
    algos = {NVFP4: "W4A16_NVFP4", FP8_TENSOR: "FP8"}
    layers = {
        group: algos[form] for group, form in walk.forms.items() if form in algos and not group.startswith("mtp.")
    }
    mtp_layers = int(config_json.get("text_config", config_json).get("mtp_num_hidden_layers") or 0)
    exclude = ["mtp*", *(f"mtp.layers.{i}*" for i in range(mtp_layers))]
    return modelopt_mixed_precision(layers, exclude, MODELOPT_VERSION)


def _qwen_fp8_modules_to_not_convert(config_json: dict) -> list[str]:
    """Qwen's FP8 export's list of modules left in bf16: vision tower (under both prefixes), embedding,
    head, norms, routers, GDN gates and the MTP head's norms, in the order the published config has them."""
    text, vision = config_json["text_config"], config_json["vision_config"]
    names = []
    for b in range(vision["depth"]):
        names += [f"model.visual.blocks.{b}.{m}" for m in ("attn.proj", "attn.qkv", "mlp.linear_fc1", "mlp.linear_fc2")]
        names += [f"visual.blocks.{b}.{m}" for m in ("attn.proj", "attn.qkv_proj", "mlp.linear_fc1", "mlp.linear_fc2")]
    for d in range(QWEN3_6_FP8_DEEPSTACK_MERGERS):
        for root in ("model.visual", "visual"):
            names += [f"{root}.deepstack_merger_list.{d}.{m}" for m in ("linear_fc1", "linear_fc2", "norm")]
    for root in ("model.visual", "visual"):
        names += [
            f"{root}.{m}"
            for m in ("merger.linear_fc1", "merger.linear_fc2", "merger.norm", "patch_embed.proj", "pos_embed")
        ]
    names += ["visual", "model.visual", "lm_head", "model.embed_tokens"]
    for i, kind in enumerate(text["layer_types"]):
        layer = f"model.language_model.layers.{i}"
        names += [
            f"{layer}.{m}"
            for m in ("input_layernorm", "mlp.shared_expert_gate", "post_attention_layernorm", "mlp.gate")
        ]
        mixer = (
            (
                "linear_attn.A_log",
                "linear_attn.conv1d",
                "linear_attn.dt_bias",
                "linear_attn.in_proj_ba",
                "linear_attn.in_proj_b",
                "linear_attn.in_proj_a",
                "linear_attn.norm",
            )
            if kind == "linear_attention"
            else ("self_attn.k_norm", "self_attn.q_norm")
        )
        names += [f"{layer}.{m}" for m in mixer]
    for i in range(text["mtp_num_hidden_layers"]):
        names += [
            f"mtp.layers.{i}.{m}"
            for m in (
                "input_layernorm",
                "mlp.gate",
                "mlp.shared_expert_gate",
                "post_attention_layernorm",
                "self_attn.k_norm",
                "self_attn.q_norm",
            )
        ]
    return names + ["mtp.fc", "mtp.norm", "mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden"]


def _llm_compressor_ignore(config_json: dict, build: Build) -> list[str]:
    """The compressed-tensors ignore list: every nn.Linear the recipe left in bf16, the vision tower's first."""
    walk = walk_layout(config_json, build)
    bf16 = [m for m, form in walk.linears.items() if form == BF16]
    return sorted(bf16, key=lambda m: not m.startswith("model.visual."))


def _with_quantization(config: dict, quantization: dict) -> dict:
    return dict(copy.deepcopy(config), quantization_config=quantization)


def _synthetic(name: str, description: str, config_json: dict, build: Build, **extra) -> SyntheticModel:
    return SyntheticModel(
        name,
        description,
        config_from_dict(config_json, Path(f"<synthetic {name}>/config.json")),
        config_json,
        build,
        **extra,
    )


def _nvidia_nvfp4(name: str, description: str, config: dict, **extra) -> SyntheticModel:
    quantization, hf_quant = _modelopt_quantization(config, NVIDIA_NVFP4)
    return _synthetic(
        name, description, _with_quantization(config, quantization), NVIDIA_NVFP4, hf_quant_config=hf_quant, **extra
    )


# The shapes of the tiny test checkpoints, as write_tiny_checkpoint(..., "qwen3_5_moe", "nvfp4") lays them out.
TINY_CONFIG = tiny_checkpoints.config_json("qwen3_5_moe", tiny_checkpoints.TEXT_QWEN3_5)

SYNTHETIC_MODELS: Mapping[str, SyntheticModel] = MappingProxyType(
    {
        model.name: model
        for model in (
            _nvidia_nvfp4(
                "qwen3.6-35b-a3b-nvfp4",
                "Qwen3.6-35B-A3B as nvidia/Qwen3.6-35B-A3B-NVFP4 stores it (NVFP4 "
                "experts and LM head, FP8 attention and GDN projections)",
                QWEN3_6_CONFIG,
                generation_config=QWEN3_6_GENERATION_CONFIG,
            ),
            _synthetic(
                "qwen3.6-35b-a3b",
                "Qwen3.6-35B-A3B as Qwen/Qwen3.6-35B-A3B stores it (bf16, fused experts)",
                copy.deepcopy(QWEN3_6_CONFIG),
                QWEN_BF16,
                generation_config=QWEN3_6_GENERATION_CONFIG,
            ),
            _synthetic(
                "qwen3.6-35b-a3b-fp8",
                "Qwen3.6-35B-A3B as Qwen/Qwen3.6-35B-A3B-FP8 stores it (FP8 projections, "
                "bf16 scales per 128x128 block)",
                _with_quantization(
                    QWEN3_6_CONFIG, fp8_block((128, 128), _qwen_fp8_modules_to_not_convert(QWEN3_6_CONFIG))
                ),
                QWEN_FP8,
                generation_config=QWEN3_6_GENERATION_CONFIG,
            ),
            _synthetic(
                "qwen3.6-35b-a3b-nvfp4-ct",
                "Qwen3.6-35B-A3B as an llm-compressor nvfp4-pack-quantized build "
                "stores it (NVFP4 experts and attention, bf16 GDN)",
                _with_quantization(
                    QWEN3_6_CONFIG,
                    compressed_tensors_nvfp4(
                        _llm_compressor_ignore(QWEN3_6_CONFIG, LLM_COMPRESSOR_NVFP4), LLM_COMPRESSOR_VERSION
                    ),
                ),
                LLM_COMPRESSOR_NVFP4,
                generation_config=QWEN3_6_GENERATION_CONFIG,
            ),
            _synthetic(
                "qwen3-30b-a3b",
                "Qwen3-30B-A3B as Qwen/Qwen3-30B-A3B stores it (bf16, one tensor per expert)",
                copy.deepcopy(QWEN3_30B_A3B_CONFIG),
                QWEN3_BF16,
                generation_config=QWEN3_30B_A3B_GENERATION_CONFIG,
            ),
            _nvidia_nvfp4(
                "tiny",
                "the tiny Qwen3.5-MoE test model, as write_tiny_checkpoint(..., 'nvfp4') lays it out",
                TINY_CONFIG,
            ),
        )
    }
)


def text_config(config: ModelConfig) -> dict:
    """The config.json text settings that give `config`: what engine.testing.tiny_checkpoints lays out."""
    text = {
        key: getattr(config, key)
        for key in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "intermediate_size",
            "shared_expert_intermediate_size",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
        )
    }
    text["layer_types"] = list(config.layer_types)
    text["mlp_only_layers"] = list(config.dense_mlp_layers)
    return text
