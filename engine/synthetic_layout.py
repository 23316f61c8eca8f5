"""The tensor layout of a checkpoint, generated from its config.json and the stored form of each part.

`walk_layout(config_json, build)` lists every tensor the exporter writes (checkpoint key -> safetensors dtype,
shape), in its order, with each linear module's stored form (`Build`: bf16, FP8 block or per-tensor, NVFP4
ModelOpt or compressed-tensors). engine/synthetic.py describes the published checkpoints with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.config import ModelConfig, config_from_dict

Layout = dict[str, tuple[str, tuple[int, ...]]]  # checkpoint key -> (safetensors dtype, shape)

# How one linear weight [out, in] is stored (the checkpoint's tensors of that module).
BF16 = "bf16"
FP8_BLOCK = "fp8_block"  # Qwen's -FP8: float8 weight, one bf16 weight_scale_inv per 128x128 block
FP8_TENSOR = "fp8_tensor"  # ModelOpt FP8: float8 weight, scalar float32 weight_scale and input_scale
NVFP4 = "nvfp4"  # ModelOpt NVFP4: packed E2M1, fp8 scale per 16 inputs, scalar weight_scale_2 and input_scale
NVFP4_CT = "nvfp4_ct"  # compressed-tensors NVFP4: weight_packed, weight_scale, weight_global_scale, input_global_scale
NVFP4_GROUP = 16


def stored_tensors(form: str, out_features: int, in_features: int, block: tuple[int, int] = (128, 128)) -> Layout:
    """The tensors (role -> dtype, shape) of an [out, in] linear stored in `form`."""
    if form == BF16:
        return {"weight": ("BF16", (out_features, in_features))}
    if form == FP8_BLOCK:
        scales = (-(-out_features // block[0]), -(-in_features // block[1]))
        return {"weight": ("F8_E4M3", (out_features, in_features)), "weight_scale_inv": ("BF16", scales)}
    if form == FP8_TENSOR:
        return {
            "weight": ("F8_E4M3", (out_features, in_features)),
            "weight_scale": ("F32", ()),
            "input_scale": ("F32", ()),
        }
    packed, scales = (out_features, in_features // 2), (out_features, in_features // NVFP4_GROUP)
    if form == NVFP4:
        return {
            "weight": ("U8", packed),
            "weight_scale": ("F8_E4M3", scales),
            "weight_scale_2": ("F32", ()),
            "input_scale": ("F32", ()),
        }
    if form == NVFP4_CT:
        return {
            "weight_packed": ("U8", packed),
            "weight_scale": ("F8_E4M3", scales),
            "weight_global_scale": ("F32", (1,)),
            "input_global_scale": ("F32", (1,)),
        }
    raise ValueError(f"no stored form {form!r}")


@dataclass(frozen=True)
class Build:
    """Which stored form each part of a model takes in one published checkpoint."""

    experts: str
    shared_expert: str
    attention: str  # q/k/v/o of full-attention layers
    gdn: str  # in_proj_qkv, in_proj_z and out_proj of Gated DeltaNet layers (in_proj_a/b stay bf16)
    lm_head: str = BF16
    fused_experts: bool = False  # one [E, 2I, H] gate_up_proj and one [E, H, I] down_proj per layer
    mtp: Build | None = None  # the multi-token-prediction head's own build; None: the checkpoint has none


BF16_FUSED = Build(BF16, BF16, BF16, BF16, fused_experts=True)
NVIDIA_NVFP4 = Build(NVFP4, NVFP4, FP8_TENSOR, FP8_TENSOR, lm_head=NVFP4, mtp=BF16_FUSED)
QWEN_BF16 = Build(BF16, BF16, BF16, BF16, fused_experts=True, mtp=BF16_FUSED)
QWEN_FP8 = Build(FP8_BLOCK, FP8_BLOCK, FP8_BLOCK, FP8_BLOCK, mtp=Build(FP8_BLOCK, FP8_BLOCK, FP8_BLOCK, BF16))
LLM_COMPRESSOR_NVFP4 = Build(NVFP4_CT, NVFP4_CT, NVFP4_CT, BF16)
QWEN3_BF16 = Build(BF16, BF16, BF16, BF16)


class _LayoutWalk:
    """Collects a checkpoint's tensors in the exporter's order, and each linear module's stored form."""

    def __init__(self, block: tuple[int, int]):
        self.layout: Layout = {}
        self.forms: dict[str, str] = {}  # quantisation group (a module, or a layer's experts) -> form
        self.linears: dict[str, str] = {}  # nn.Linear module (not a router) -> form, in order
        self.block = block

    def plain(self, name: str, *shape: int) -> None:
        self.layout[name] = ("BF16", shape)

    def linear(
        self,
        module: str,
        out_features: int,
        in_features: int,
        form: str,
        group: str | None = None,
        is_linear: bool = True,
    ) -> None:
        for role, entry in stored_tensors(form, out_features, in_features, self.block).items():
            self.layout[f"{module}.{role}"] = entry
        self.forms.setdefault(group or module, form)
        if is_linear:
            self.linears[module] = form


def _attention(w: _LayoutWalk, c: ModelConfig, prefix: str, form: str) -> None:
    hidden, heads_dim = c.hidden_size, c.num_attention_heads * c.head_dim
    kv_width = c.num_key_value_heads * c.head_dim
    w.linear(f"{prefix}.q_proj", heads_dim * (2 if c.attention_output_gate else 1), hidden, form)
    w.linear(f"{prefix}.k_proj", kv_width, hidden, form)
    w.linear(f"{prefix}.v_proj", kv_width, hidden, form)
    w.linear(f"{prefix}.o_proj", hidden, heads_dim, form)
    w.plain(f"{prefix}.q_norm.weight", c.head_dim)
    w.plain(f"{prefix}.k_norm.weight", c.head_dim)


def _gated_deltanet(w: _LayoutWalk, c: ModelConfig, prefix: str, form: str) -> None:
    hidden, value_heads = c.hidden_size, c.linear_num_value_heads
    values = value_heads * c.linear_value_head_dim
    conv = 2 * c.linear_num_key_heads * c.linear_key_head_dim + values
    w.linear(f"{prefix}.in_proj_qkv", conv, hidden, form)
    w.linear(f"{prefix}.in_proj_z", values, hidden, form)
    w.linear(f"{prefix}.in_proj_b", value_heads, hidden, BF16)
    w.linear(f"{prefix}.in_proj_a", value_heads, hidden, BF16)
    w.plain(f"{prefix}.conv1d.weight", conv, 1, c.linear_conv_kernel_dim)
    w.plain(f"{prefix}.A_log", value_heads)
    w.plain(f"{prefix}.dt_bias", value_heads)
    w.plain(f"{prefix}.norm.weight", c.linear_value_head_dim)
    w.linear(f"{prefix}.out_proj", hidden, values, form)


def _swiglu(w: _LayoutWalk, prefix: str, hidden: int, intermediate: int, form: str, group: str | None = None) -> None:
    w.linear(f"{prefix}.gate_proj", intermediate, hidden, form, group)
    w.linear(f"{prefix}.up_proj", intermediate, hidden, form, group)
    w.linear(f"{prefix}.down_proj", hidden, intermediate, form, group)


def _moe(w: _LayoutWalk, c: ModelConfig, prefix: str, build: Build) -> None:
    hidden, inter, experts = c.hidden_size, c.moe_intermediate_size, c.num_experts
    # Qwen3.5/3.6's router is its own module, not an nn.Linear (quantisers that target Linear pass it by)
    w.linear(f"{prefix}.gate", experts, hidden, BF16, is_linear=c.model_type == "qwen3_moe")
    if build.fused_experts:
        w.layout[f"{prefix}.experts.gate_up_proj"] = ("BF16", (experts, 2 * inter, hidden))
        w.layout[f"{prefix}.experts.down_proj"] = ("BF16", (experts, hidden, inter))
    else:
        for e in range(experts):
            _swiglu(w, f"{prefix}.experts.{e}", hidden, inter, build.experts, group=f"{prefix}.experts")
    if c.shared_expert_intermediate_size:
        _swiglu(w, f"{prefix}.shared_expert", hidden, c.shared_expert_intermediate_size, build.shared_expert)
        w.linear(f"{prefix}.shared_expert_gate", 1, hidden, BF16)


def _decoder_layer(w: _LayoutWalk, c: ModelConfig, prefix: str, kind: str, moe: bool, build: Build) -> None:
    w.plain(f"{prefix}.input_layernorm.weight", c.hidden_size)
    w.plain(f"{prefix}.post_attention_layernorm.weight", c.hidden_size)
    if kind == "full_attention":
        _attention(w, c, f"{prefix}.self_attn", build.attention)
    else:
        _gated_deltanet(w, c, f"{prefix}.linear_attn", build.gdn)
    if moe:
        _moe(w, c, f"{prefix}.mlp", build)
    else:
        _swiglu(w, f"{prefix}.mlp", c.hidden_size, c.intermediate_size, build.shared_expert)


def _mtp(w: _LayoutWalk, c: ModelConfig, layers: int, build: Build) -> None:
    """Qwen3.5/3.6's multi-token-prediction head: joins an embedding and a hidden state, then full layers."""
    hidden = c.hidden_size
    w.plain("mtp.fc.weight", hidden, 2 * hidden)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        w.plain(f"mtp.{norm}.weight", hidden)
    for i in range(layers):
        _decoder_layer(w, c, f"mtp.layers.{i}", "full_attention", True, build)


def vision_tensors(vision: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """Lists the Qwen3.5/3.6 vision tower's tensors (ViT blocks and the patch merger) in checkpoint order, as
    (name, shape, kind), kind one of "linear" (a weight), "bias", "norm" (a norm's weight) and "embed"."""
    hidden, inter, out = vision["hidden_size"], vision["intermediate_size"], vision["out_hidden_size"]
    merged = hidden * vision["spatial_merge_size"] ** 2
    patch = vision["patch_size"]
    tensors = [
        (
            "model.visual.patch_embed.proj.weight",
            (hidden, vision["in_channels"], vision["temporal_patch_size"], patch, patch),
            "embed",
        ),
        ("model.visual.patch_embed.proj.bias", (hidden,), "bias"),
        ("model.visual.pos_embed.weight", (vision["num_position_embeddings"], hidden), "embed"),
    ]

    def linear_with_bias(module: str, out_features: int, in_features: int) -> None:
        tensors.extend(
            [(f"{module}.weight", (out_features, in_features), "linear"), (f"{module}.bias", (out_features,), "bias")]
        )

    for b in range(vision["depth"]):
        block = f"model.visual.blocks.{b}"
        linear_with_bias(f"{block}.attn.qkv", 3 * hidden, hidden)
        linear_with_bias(f"{block}.attn.proj", hidden, hidden)
        linear_with_bias(f"{block}.mlp.linear_fc1", inter, hidden)
        linear_with_bias(f"{block}.mlp.linear_fc2", hidden, inter)
        for norm in ("norm1", "norm2"):
            tensors.extend([(f"{block}.{norm}.weight", (hidden,), "norm"), (f"{block}.{norm}.bias", (hidden,), "bias")])
    linear_with_bias("model.visual.merger.linear_fc1", merged, merged)
    linear_with_bias("model.visual.merger.linear_fc2", out, merged)
    tensors.extend(
        [("model.visual.merger.norm.weight", (hidden,), "norm"), ("model.visual.merger.norm.bias", (hidden,), "bias")]
    )
    return tensors


def _vision(w: _LayoutWalk, vision: dict) -> None:
    """The vision tower's tensors in the layout; a text-only engine skips them."""
    for name, shape, kind in vision_tensors(vision):
        if kind == "linear":
            w.linear(name.removesuffix(".weight"), *shape, BF16)
        else:
            w.plain(name, *shape)


def walk_layout(config_json: dict, build: Build, block: tuple[int, int] = (128, 128)) -> _LayoutWalk:
    """Every tensor of a checkpoint with this config.json stored as `build` says, in the exporter's order."""
    c = config_from_dict(config_json, Path("config.json"))
    wrapper = config_json.get("model_type") == "qwen3_5_moe"
    prefix = "model.language_model." if wrapper else "model."
    text = config_json.get("text_config", config_json)
    w = _LayoutWalk(block)
    w.plain(f"{prefix}embed_tokens.weight", c.vocab_size, c.hidden_size)
    for i, kind in enumerate(c.layer_types):
        _decoder_layer(w, c, f"{prefix}layers.{i}", kind, c.is_moe_layer(i), build)
    w.plain(f"{prefix}norm.weight", c.hidden_size)
    if not c.tie_word_embeddings:
        w.linear("lm_head", c.vocab_size, c.hidden_size, build.lm_head)
    if build.mtp is not None and text.get("mtp_num_hidden_layers"):
        _mtp(w, c, int(text["mtp_num_hidden_layers"]), build.mtp)
    if wrapper and "vision_config" in config_json:
        _vision(w, config_json["vision_config"])
    return w
