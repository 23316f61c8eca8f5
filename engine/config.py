"""One ModelConfig from any supported config.json (qwen3_5_moe wrapper, qwen3_5_moe_text, qwen3_moe)."""

from __future__ import annotations

import json
import math
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
        cause = (
            "is not a folder"
            if folder.exists()
            else "does not exist"
            if not folder.is_symlink()
            else "is a link that leads nowhere (broken, or a loop of links)"
        )
        raise CheckpointError(folder, cause, "choose the folder that holds config.json and the .safetensors files")
    if not config_path.is_file():
        raise CheckpointError(
            folder,
            "has no config.json, so it is not a Hugging Face model folder",
            "choose the folder that holds config.json and the .safetensors files",
        )
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            config_path, f"is not valid JSON ({exc})", "the download may be incomplete; fetch it again"
        )
    if not isinstance(raw, dict):
        raise CheckpointError(config_path, "does not hold a JSON object", FIX_CONFIG)
    return config_from_dict(raw, config_path)


FIX_CONFIG = "config.json is damaged or was edited by hand; download it again from the model's repository"


def config_from_dict(raw: dict, source: Path) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            source, f"model_type {model_type!r} is not supported", f"MoE Desk runs {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    quantization_config = raw.get("quantization_config")
    text = raw
    if model_type == "qwen3_5_moe":
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(source, "model_type qwen3_5_moe needs a text_config section", FIX_CONFIG)
        quantization_config = quantization_config or text.get("quantization_config")
    try:
        config = (
            _qwen3_moe(text, quantization_config)
            if model_type == "qwen3_moe"
            else _qwen3_5_moe(text, quantization_config)
        )
        _check_consistent(config)
    except KeyError as exc:
        raise CheckpointError(source, f"is missing the setting {exc.args[0]!r}", FIX_CONFIG) from None
    except (TypeError, ValueError) as exc:
        raise CheckpointError(source, f"has an unusable setting: {exc}", FIX_CONFIG) from None
    return config


def _whole(text: dict, key: str, default=None, minimum: int = 1) -> int:
    """text[key] (or default when it is absent or null) as an int of at least `minimum`; ValueError naming the key
    for text, fractions, booleans and smaller numbers, KeyError when it is absent without a default."""
    value = text.get(key)
    if value is None:
        if default is None:
            raise KeyError(key)
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
        raise ValueError(f"{key} must be a whole number, got {value!r}")
    if value < minimum:
        raise ValueError(f"{key} must be at least {minimum}, got {value!r}")
    return int(value)


def _positive(value, key: str, maximum: float = math.inf) -> float:
    """value as a finite float above 0 and at most `maximum`; ValueError naming the key otherwise."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value <= maximum
        or not math.isfinite(value)
    ):
        bound = f"at most {maximum:g}" if math.isfinite(maximum) else "finite"
        raise ValueError(f"{key} must be a number above 0 and {bound}, got {value!r}")
    return float(value)


def _section(text: dict, key: str) -> dict:
    """text[key] as a dict ({} when absent or null); ValueError when it is something else."""
    value = text.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{key} must be a JSON object, got {value!r:.60}")
    return value


def _rope(text: dict, default_partial: float) -> tuple[float, float]:
    """(theta, partial_rotary_factor) from either rope_parameters (transformers 5) or rope_theta/rope_scaling."""
    params = _section(text, "rope_parameters")
    scaling = _section(text, "rope_scaling")
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ValueError(f"rope type {rope_type!r} is not supported yet, only 'default'")
    theta = params.get("rope_theta", text.get("rope_theta"))
    if theta is None:
        raise KeyError("rope_theta")
    partial = params.get("partial_rotary_factor", text.get("partial_rotary_factor", default_partial))
    return _positive(theta, "rope_theta"), _positive(partial, "partial_rotary_factor", maximum=1.0)


def _eos(text: dict) -> tuple[int, ...]:
    eos = text.get("eos_token_id")
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"eos_token_id must be a token id or a list of them, got {eos!r}")
    return tuple(ids)


def _common(text: dict, default_partial: float) -> dict:
    theta, partial = _rope(text, default_partial)
    hidden = _whole(text, "hidden_size")
    heads = _whole(text, "num_attention_heads")
    head_dim = _whole(text, "head_dim", default=hidden // heads)
    return dict(
        vocab_size=_whole(text, "vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=_whole(text, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=_whole(text, "num_key_value_heads", default=heads),
        head_dim=head_dim,
        rms_norm_eps=_positive(text.get("rms_norm_eps", 1e-6), "rms_norm_eps", maximum=1.0),
        rope_theta=theta,
        rotary_dim=int(head_dim * partial),
        num_experts=_whole(
            text, "num_experts", default=_whole(text, "num_local_experts", default=0, minimum=0), minimum=0
        ),
        num_experts_per_tok=_whole(text, "num_experts_per_tok"),
        moe_intermediate_size=_whole(text, "moe_intermediate_size"),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        max_position_embeddings=_whole(text, "max_position_embeddings", default=32768),
        eos_token_id=_eos(text),
    )


def _check_consistent(config: ModelConfig) -> None:
    """ValueError when settings that are each in range contradict one another."""
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads {config.num_attention_heads} is not a multiple of "
            f"num_key_value_heads {config.num_key_value_heads}"
        )
    if config.rotary_dim < 2 or config.rotary_dim % 2:
        raise ValueError(
            f"head_dim {config.head_dim} x partial_rotary_factor gives {config.rotary_dim} rotated "
            f"dimensions, which must be an even number of at least 2"
        )
    moe_layers = config.num_hidden_layers - len(config.dense_mlp_layers)
    if moe_layers and not 1 <= config.num_experts_per_tok <= config.num_experts:
        raise ValueError(
            f"num_experts_per_tok {config.num_experts_per_tok} must be from 1 to num_experts {config.num_experts}"
        )
    if config.dense_mlp_layers and config.intermediate_size < 1:
        raise ValueError(
            f"intermediate_size must be at least 1 for the dense MLP layers "
            f"{list(config.dense_mlp_layers)}, got {config.intermediate_size}"
        )
    if config.num_linear_attention_layers and config.linear_num_value_heads % config.linear_num_key_heads:
        raise ValueError(
            f"linear_num_value_heads {config.linear_num_value_heads} is not a multiple of "
            f"linear_num_key_heads {config.linear_num_key_heads}"
        )


def _qwen3_moe(text: dict, quantization_config: dict | None) -> ModelConfig:
    if text.get("use_sliding_window"):
        raise ValueError("sliding-window attention is not supported")
    common = _common(text, default_partial=1.0)
    layers = common["num_hidden_layers"]
    step = _whole(text, "decoder_sparse_step", default=1)
    mlp_only = text.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in mlp_only):
        raise ValueError(f"mlp_only_layers must be a list of layer numbers, got {mlp_only!r:.60}")
    dense = tuple(i for i in range(layers) if i in mlp_only or common["num_experts"] == 0 or (i + 1) % step != 0)
    return ModelConfig(
        model_type="qwen3_moe",
        layer_types=("full_attention",) * layers,
        norm_topk_prob=bool(text.get("norm_topk_prob", False)),
        dense_mlp_layers=dense,
        intermediate_size=_whole(text, "intermediate_size", default=0, minimum=0),
        quantization_config=quantization_config,
        **common,
    )


def _qwen3_5_moe(text: dict, quantization_config: dict | None) -> ModelConfig:
    common = _common(text, default_partial=0.25)
    layers = common["num_hidden_layers"]
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = _whole(text, "full_attention_interval", default=4)
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if (
        not isinstance(layer_types, list)
        or len(layer_types) != layers
        or not all(t in ("linear_attention", "full_attention") for t in layer_types)
    ):
        raise ValueError(f"layer_types must list 'linear_attention'/'full_attention' for all {layers} layers")
    return ModelConfig(
        model_type="qwen3_5_moe_text",
        layer_types=tuple(layer_types),
        norm_topk_prob=True,
        attention_output_gate=True,
        zero_centered_norms=True,
        shared_expert_intermediate_size=_whole(text, "shared_expert_intermediate_size"),
        linear_num_key_heads=_whole(text, "linear_num_key_heads"),
        linear_num_value_heads=_whole(text, "linear_num_value_heads"),
        linear_key_head_dim=_whole(text, "linear_key_head_dim"),
        linear_value_head_dim=_whole(text, "linear_value_head_dim"),
        linear_conv_kernel_dim=_whole(text, "linear_conv_kernel_dim", default=4),
        quantization_config=quantization_config,
        **common,
    )
