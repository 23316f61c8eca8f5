"""Write tiny random checkpoints in the real layouts of the models MoE Desk runs.

    python -m engine.testing.tiny_checkpoints OUT_DIR --arch qwen3_5_moe --format nvfp4

Each comes with a tiny byte-level BPE tokenizer and a Qwen-style chat template
(engine/testing/tiny_tokenizer.py). Architectures: qwen3_5_moe (vision-language wrapper, keys under model.language_model.,
with a tiny vision tower and MTP head under their real names), qwen3_5_moe_text (text-only, keys under model.),
qwen3_moe. Formats: bf16, fp32, fp8_block (Qwen's -FP8 repos: bf16 block scales), nvfp4 (ModelOpt MIXED_PRECISION as
nvidia exports it: W4A16_NVFP4 experts, shared experts and LM head, FP8 per-tensor attention and GDN projections
with their input scales, bf16 rest), nvfp4_ct (compressed-tensors NVFP4 experts). Experts are stored fused per
layer or per expert.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.checkpoint import quantize
from engine.checkpoint.declared import MODELOPT_FP8, MODELOPT_NVFP4_WEIGHT_ONLY, fp8_block, modelopt_mixed_precision
from engine.synthetic_layout import vision_tensors
from engine.testing.tiny_tokenizer import write_tiny_tokenizer

FORMATS = ("bf16", "fp32", "fp8_block", "nvfp4", "nvfp4_ct")
ARCHS = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_moe")
FP8_BLOCK = (32, 32)  # smaller than the real 128 so tiny weights span several (and partial) blocks

TEXT_QWEN3_5 = dict(
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    hidden_act="silu",
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 2],
        "mrope_interleaved": True,
    },
    eos_token_id=1,
    mtp_num_hidden_layers=1,
)
TEXT_QWEN3 = dict(
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[1],
    hidden_act="silu",
    rope_theta=1000000.0,
    rope_scaling=None,
    use_sliding_window=False,
    eos_token_id=1,
)
VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=64,
    num_position_embeddings=16,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    in_channels=3,
)
MODELOPT_VERSION = "0.44.0"
MODELOPT_ALGOS = {"nvfp4": MODELOPT_NVFP4_WEIGHT_ONLY, "fp8_tensor": MODELOPT_FP8}
EXPERT_MODULE = re.compile(r"\.experts\.\d+\.\w+$")  # ModelOpt names one quantisation group per layer's experts


def _expert_formats(fmt: str) -> tuple[str, str]:
    """(format of expert MLP weights, format of attention/GDN projections)."""
    return {
        "bf16": ("bf16", "bf16"),
        "fp32": ("fp32", "fp32"),
        "fp8_block": ("fp8_block", "fp8_block"),
        "nvfp4": ("nvfp4", "fp8_tensor"),
        "nvfp4_ct": ("nvfp4_ct", "bf16"),
    }[fmt]


def _encode(w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    if fmt == "bf16":
        return {"weight": w.to(torch.bfloat16)}
    if fmt == "fp32":
        return {"weight": w.float()}
    if fmt == "fp8_block":
        return quantize.fp8_block(w, FP8_BLOCK)
    if fmt == "fp8_tensor":
        return quantize.fp8_per_tensor(w)
    if fmt == "nvfp4":
        return quantize.nvfp4_modelopt(w)
    if fmt == "nvfp4_ct":
        return quantize.nvfp4_compressed_tensors(w)
    raise ValueError(fmt)


class _Writer:
    def __init__(self, seed: int, plain_dtype: torch.dtype):
        self.generator = torch.Generator().manual_seed(seed)
        self.tensors: dict[str, torch.Tensor] = {}
        self.plain_dtype = plain_dtype
        self.quantized: dict[str, str] = {}  # module -> format, for the quantisation config

    def randn(self, *shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator) * std

    def plain(self, name: str, value: torch.Tensor) -> None:
        self.tensors[name] = value.to(self.plain_dtype).contiguous()

    def linear(self, module: str, out_features: int, in_features: int, fmt: str, std: float | None = None) -> None:
        w = self.randn(out_features, in_features, std=std or in_features**-0.5)
        for role, t in _encode(w, fmt).items():
            self.tensors[f"{module}.{role}"] = t.contiguous()
        if fmt not in ("bf16", "fp32"):
            self.quantized[module] = fmt


def checkpoint_tensors(
    arch: str, fmt: str, text: dict, fused_experts: bool = False, seed: int = 0
) -> tuple[dict[str, torch.Tensor], dict | None]:
    """(tensors under their checkpoint names, quantization_config) of a random model with the shapes of
    `text` (a text config dict)."""
    tensors, quant, _ = _checkpoint(arch, fmt, text, fused_experts, seed)
    return tensors, quant


def _checkpoint(
    arch: str, fmt: str, text: dict, fused_experts: bool, seed: int
) -> tuple[dict[str, torch.Tensor], dict | None, dict | None]:
    """(tensors, config.json's quantization_config, hf_quant_config.json or None)."""
    if arch not in ARCHS or fmt not in FORMATS:
        raise ValueError(f"arch must be one of {ARCHS} and format one of {FORMATS}")
    if fused_experts and fmt not in ("bf16", "fp32"):
        raise ValueError("fused expert stacks exist in bf16/fp32 checkpoints only")
    writer = _Writer(seed, torch.float32 if fmt == "fp32" else torch.bfloat16)
    expert_fmt, mixer_fmt = _expert_formats(fmt)
    prefix = "model.language_model." if arch == "qwen3_5_moe" else "model."
    _write_text_model(writer, text, arch, prefix, expert_fmt, mixer_fmt, fused_experts)
    if arch == "qwen3_5_moe":
        _write_mtp_and_vision(writer, text)
    return (writer.tensors, *_quantization_config(fmt, writer.quantized, text))


def write_tiny_checkpoint(
    folder: str | Path,
    arch: str = "qwen3_5_moe",
    fmt: str = "bf16",
    fused_experts: bool = False,
    shards: int = 1,
    seed: int = 0,
    text_overrides: dict | None = None,
) -> Path:
    """Write the checkpoint into `folder`; `text_overrides` changes the text model's shapes (e.g. to make
    a larger model for memory tests)."""
    text = dict(TEXT_QWEN3 if arch == "qwen3_moe" else TEXT_QWEN3_5, **(text_overrides or {}))
    tensors, quant, hf_quant = _checkpoint(arch, fmt, text, fused_experts, seed)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = config_json(arch, text)
    if quant is not None:
        config["quantization_config"] = quant
    if hf_quant is not None:
        (folder / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    special = write_tiny_tokenizer(folder, vocab_size=text["vocab_size"])
    (folder / "generation_config.json").write_text(
        json.dumps(
            {
                "eos_token_id": [special["eos"], special["endoftext"]],
                "do_sample": True,
                "temperature": 0.6,
                "top_k": 20,
                "top_p": 0.95,
            }
        )
    )
    _save(tensors, folder, shards)
    return folder


def _write_text_model(
    w: _Writer, text: dict, arch: str, prefix: str, expert_fmt: str, mixer_fmt: str, fused_experts: bool
) -> None:
    hidden, vocab = text["hidden_size"], text["vocab_size"]
    qwen3_5 = arch != "qwen3_moe"
    w.plain(f"{prefix}embed_tokens.weight", w.randn(vocab, hidden, std=1.0))
    w.plain(f"{prefix}norm.weight", w.randn(hidden, std=0.1) if qwen3_5 else 1.0 + w.randn(hidden, std=0.1))
    # nvidia's NVFP4 export quantises the LM head like the experts; the other builds keep it unquantised
    head_fmt = "nvfp4" if expert_fmt == "nvfp4" else "bf16" if expert_fmt != "fp32" else "fp32"
    w.linear("lm_head", vocab, hidden, head_fmt, std=2.0 * hidden**-0.5)
    layer_types = text.get("layer_types") or ["full_attention"] * text["num_hidden_layers"]
    for i, kind in enumerate(layer_types):
        dense = arch == "qwen3_moe" and i in text["mlp_only_layers"]
        _write_layer(w, text, f"{prefix}layers.{i}", kind, qwen3_5, expert_fmt, mixer_fmt, fused_experts, dense)


def _write_layer(
    w: _Writer,
    text: dict,
    layer: str,
    kind: str,
    qwen3_5: bool,
    expert_fmt: str,
    mixer_fmt: str,
    fused_experts: bool,
    dense: bool = False,
) -> None:
    hidden = text["hidden_size"]
    heads, kv_heads, head_dim = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    norm = (lambda n: w.randn(n, std=0.1)) if qwen3_5 else (lambda n: 1.0 + w.randn(n, std=0.1))
    w.plain(f"{layer}.input_layernorm.weight", norm(hidden))
    w.plain(f"{layer}.post_attention_layernorm.weight", norm(hidden))
    if kind == "full_attention":
        attn = f"{layer}.self_attn"
        w.linear(f"{attn}.q_proj", heads * head_dim * (2 if qwen3_5 else 1), hidden, mixer_fmt)
        w.linear(f"{attn}.k_proj", kv_heads * head_dim, hidden, mixer_fmt)
        w.linear(f"{attn}.v_proj", kv_heads * head_dim, hidden, mixer_fmt)
        w.linear(f"{attn}.o_proj", hidden, heads * head_dim, mixer_fmt)
        w.plain(f"{attn}.q_norm.weight", norm(head_dim))
        w.plain(f"{attn}.k_norm.weight", norm(head_dim))
    else:
        _write_gated_deltanet(w, text, f"{layer}.linear_attn", mixer_fmt)
    if dense:
        _write_swiglu(w, f"{layer}.mlp", hidden, text["intermediate_size"], mixer_fmt)
    else:
        _write_moe(w, text, f"{layer}.mlp", expert_fmt, fused_experts, shared=qwen3_5)


def _write_mtp_and_vision(w: _Writer, text: dict) -> None:
    """The tensors a text-only engine must skip, under the names Qwen3.5/3.6 checkpoints give them: the
    multi-token-prediction head (bf16, fused experts, as nvidia and Qwen store it) and the vision tower."""
    hidden = text["hidden_size"]
    plain_fmt = "fp32" if w.plain_dtype == torch.float32 else "bf16"
    w.plain("mtp.fc.weight", w.randn(hidden, 2 * hidden, std=0.02))
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        w.plain(f"mtp.{norm}.weight", w.randn(hidden, std=0.1))
    for i in range(text.get("mtp_num_hidden_layers", 0)):
        _write_layer(w, text, f"mtp.layers.{i}", "full_attention", True, plain_fmt, plain_fmt, True)
    laws = {
        "linear": lambda shape: w.randn(*shape, std=shape[1] ** -0.5),
        "bias": lambda shape: w.randn(*shape, std=0.02),
        "norm": lambda shape: 1.0 + w.randn(*shape, std=0.1),
        "embed": lambda shape: w.randn(*shape, std=0.02),
    }
    for name, shape, kind in vision_tensors(VISION):
        w.plain(name, laws[kind](shape))


def _write_gated_deltanet(w: _Writer, text: dict, prefix: str, fmt: str) -> None:
    hidden = text["hidden_size"]
    keys = text["linear_num_key_heads"] * text["linear_key_head_dim"]
    values = text["linear_num_value_heads"] * text["linear_value_head_dim"]
    value_heads, kernel = text["linear_num_value_heads"], text["linear_conv_kernel_dim"]
    w.linear(f"{prefix}.in_proj_qkv", 2 * keys + values, hidden, fmt)
    w.linear(f"{prefix}.in_proj_z", values, hidden, fmt)
    w.linear(f"{prefix}.in_proj_b", value_heads, hidden, "bf16" if fmt != "fp32" else "fp32")
    w.linear(f"{prefix}.in_proj_a", value_heads, hidden, "bf16" if fmt != "fp32" else "fp32")
    w.linear(f"{prefix}.out_proj", hidden, values, fmt)
    w.plain(f"{prefix}.conv1d.weight", w.randn(2 * keys + values, 1, kernel, std=0.5))
    w.plain(f"{prefix}.A_log", torch.empty(value_heads).uniform_(1.0, 16.0, generator=w.generator).log())
    w.plain(f"{prefix}.dt_bias", 1.0 + w.randn(value_heads, std=0.5))
    w.plain(f"{prefix}.norm.weight", 1.0 + w.randn(text["linear_value_head_dim"], std=0.1))


def _write_swiglu(w: _Writer, prefix: str, hidden: int, intermediate: int, fmt: str) -> None:
    w.linear(f"{prefix}.gate_proj", intermediate, hidden, fmt)
    w.linear(f"{prefix}.up_proj", intermediate, hidden, fmt)
    w.linear(f"{prefix}.down_proj", hidden, intermediate, fmt)


def _write_moe(w: _Writer, text: dict, prefix: str, fmt: str, fused: bool, shared: bool) -> None:
    hidden, inter, experts = text["hidden_size"], text["moe_intermediate_size"], text["num_experts"]
    w.linear(f"{prefix}.gate", experts, hidden, "bf16" if fmt != "fp32" else "fp32", std=1.0)
    if fused:
        w.plain(f"{prefix}.experts.gate_up_proj", w.randn(experts, 2 * inter, hidden, std=hidden**-0.5))
        w.plain(f"{prefix}.experts.down_proj", w.randn(experts, hidden, inter, std=inter**-0.5))
    else:
        for e in range(experts):
            _write_swiglu(w, f"{prefix}.experts.{e}", hidden, inter, fmt)
    if shared:
        _write_swiglu(w, f"{prefix}.shared_expert", hidden, text["shared_expert_intermediate_size"], fmt)
        w.linear(f"{prefix}.shared_expert_gate", 1, hidden, "bf16" if fmt != "fp32" else "fp32")


def config_json(arch: str, text: dict) -> dict:
    """The config.json (without quantisation settings) of a tiny checkpoint with text settings `text`."""
    if arch == "qwen3_moe":
        return dict(text, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"])
    text_config = dict(text, model_type="qwen3_5_moe_text")
    if arch == "qwen3_5_moe_text":
        return dict(text_config, architectures=["Qwen3_5MoeForCausalLM"])
    return {
        "model_type": "qwen3_5_moe",
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "text_config": text_config,
        "vision_config": dict(VISION, model_type="qwen3_5_moe_vision"),
        "tie_word_embeddings": False,
    }


def _quantization_config(fmt: str, quantized: dict[str, str], text: dict) -> tuple[dict | None, dict | None]:
    """(config.json's quantization_config, hf_quant_config.json) the way each exporter declares them."""
    if fmt == "fp8_block":
        return fp8_block(FP8_BLOCK), None
    if fmt == "nvfp4":
        groups = {}
        for module, f in quantized.items():
            groups.setdefault(EXPERT_MODULE.sub(".experts", module), MODELOPT_ALGOS[f])
        exclude = ["mtp*", *(f"mtp.layers.{i}*" for i in range(text.get("mtp_num_hidden_layers", 0)))]
        return modelopt_mixed_precision(groups, exclude, MODELOPT_VERSION)
    if fmt == "nvfp4_ct":
        return {
            "quant_method": "compressed-tensors",
            "format": "nvfp4-pack-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
                }
            },
            "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*self_attn.*", "re:.*linear_attn.*"],
        }, None
    return None, None


def _save(tensors: dict[str, torch.Tensor], folder: Path, shards: int) -> None:
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(tensors)
    weight_map, total = {}, 0
    for s in range(shards):
        file_name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, str(folder / file_name), metadata={"format": "pt"})
        weight_map.update({n: file_name for n in part})
        total += sum(t.numel() * t.element_size() for t in part.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--arch", choices=ARCHS, default="qwen3_5_moe")
    parser.add_argument("--format", dest="fmt", choices=FORMATS, default="bf16")
    parser.add_argument("--fused-experts", action="store_true")
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = write_tiny_checkpoint(args.out_dir, args.arch, args.fmt, args.fused_experts, args.shards, args.seed)
    print(path)


if __name__ == "__main__":
    main()
