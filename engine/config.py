"""One ModelConfig from any supported config.json (qwen3_5_moe wrapper, qwen3_5_moe_text, qwen3_moe)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import CheckpointError

SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_moe")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # the text model's type: "qwen3_5_moe_text" or "qwen3_moe"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int  # how many leading dims of each head RoPE rotates
    layer_types: tuple[str, ...]  # "full_attention" | "linear_attention" per layer
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    # Qwen3.5/3.6 only
    attention_output_gate: bool = False
    zero_centered_norms: bool = False  # RMSNorm scales by (1 + weight)
    shared_expert_intermediate_size: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # Qwen3-MoE only: layers with a dense MLP instead of experts
    dense_mlp_layers: tuple[int, ...] = ()
    intermediate_size: int = 0
    eos_token_id: tuple[int, ...] = field(default=())
    quantization_config: dict | None = None

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_mlp_layers

    @property
    def num_attention_layers(self) -> int:
        return sum(t == "full_attention" for t in self.layer_types)

    @property
    def num_linear_attention_layers(self) -> int:
        return sum(t == "linear_attention" for t in self.layer_types)


def read_config(folder: Path) -> ModelConfig:
    config_path = folder / "config.json"
    if not folder.is_dir():
        raise CheckpointError(folder, "is not a folder" if folder.exists() else "does not exist",
                              "choose the folder that holds config.json and the .safetensors files")
    if not config_path.is_file():
        raise CheckpointError(folder, "has no config.json, so it is not a Hugging Face model folder",
                              "choose the folder that holds config.json and the .safetensors files")
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(config_path, f"is not valid JSON ({exc})", "the download may be incomplete; fetch it again")
    if not isinstance(raw, dict):
        raise CheckpointError(config_path, "does not hold a JSON object")
    return config_from_dict(raw, config_path)


def config_from_dict(raw: dict, source: Path) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(source, f"model_type {model_type!r} is not supported",
                              f"MoE Desk runs {', '.join(SUPPORTED_MODEL_TYPES)}")
    quantization_config = raw.get("quantization_config")
    text = raw
    if model_type == "qwen3_5_moe":
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(source, "model_type qwen3_5_moe needs a text_config section")
        quantization_config = quantization_config or text.get("quantization_config")
    try:
        if model_type == "qwen3_moe":
            return _qwen3_moe(text, quantization_config)
        return _qwen3_5_moe(text, quantization_config)
    except KeyError as exc:
        raise CheckpointError(source, f"is missing the setting {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise CheckpointError(source, f"has a setting of the wrong kind ({exc})") from None


def _rope(text: dict, default_partial: float) -> tuple[float, float]:
    """(theta, partial_rotary_factor) from either rope_parameters (transformers 5) or rope_theta/rope_scaling."""
    params = text.get("rope_parameters") or {}
    scaling = text.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ValueError(f"rope type {rope_type!r} is not supported yet, only 'default'")
    theta = params.get("rope_theta", text.get("rope_theta"))
    if theta is None:
        raise KeyError("rope_theta")
    partial = params.get("partial_rotary_factor", text.get("partial_rotary_factor", default_partial))
    return float(theta), float(partial)


def _eos(text: dict) -> tuple[int, ...]:
    eos = text.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _common(text: dict, default_partial: float) -> dict:
    theta, partial = _rope(text, default_partial)
    hidden = int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or hidden // heads)
    return dict(
        vocab_size=int(text["vocab_size"]),
        hidden_size=hidden,
        num_hidden_layers=int(text["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(text.get("num_key_value_heads", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rotary_dim=int(head_dim * partial),
        num_experts=int(text.get("num_experts", text.get("num_local_experts", 0))),
        num_experts_per_tok=int(text["num_experts_per_tok"]),
        moe_intermediate_size=int(text["moe_intermediate_size"]),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        eos_token_id=_eos(text),
    )


def _qwen3_moe(text: dict, quantization_config: dict | None) -> ModelConfig:
    if text.get("use_sliding_window"):
        raise ValueError("sliding-window attention is not supported")
    common = _common(text, default_partial=1.0)
    layers = common["num_hidden_layers"]
    step = int(text.get("decoder_sparse_step", 1))
    mlp_only = set(text.get("mlp_only_layers") or [])
    dense = tuple(i for i in range(layers)
                  if i in mlp_only or common["num_experts"] == 0 or (i + 1) % step != 0)
    return ModelConfig(
        model_type="qwen3_moe",
        layer_types=("full_attention",) * layers,
        norm_topk_prob=bool(text.get("norm_topk_prob", False)),
        dense_mlp_layers=dense,
        intermediate_size=int(text.get("intermediate_size", 0)),
        quantization_config=quantization_config,
        **common,
    )


def _qwen3_5_moe(text: dict, quantization_config: dict | None) -> ModelConfig:
    common = _common(text, default_partial=0.25)
    layers = common["num_hidden_layers"]
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = int(text.get("full_attention_interval", 4))
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if len(layer_types) != layers or set(layer_types) - {"linear_attention", "full_attention"}:
        raise ValueError(f"layer_types must list 'linear_attention'/'full_attention' for all {layers} layers")
    return ModelConfig(
        model_type="qwen3_5_moe_text",
        layer_types=tuple(layer_types),
        norm_topk_prob=True,
        attention_output_gate=True,
        zero_centered_norms=True,
        shared_expert_intermediate_size=int(text["shared_expert_intermediate_size"]),
        linear_num_key_heads=int(text["linear_num_key_heads"]),
        linear_num_value_heads=int(text["linear_num_value_heads"]),
        linear_key_head_dim=int(text["linear_key_head_dim"]),
        linear_value_head_dim=int(text["linear_value_head_dim"]),
        linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
        quantization_config=quantization_config,
        **common,
    )
