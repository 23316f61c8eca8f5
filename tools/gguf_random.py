"""Write a GGUF of Qwen3.6-35B-A3B's real shape (llama.cpp's `qwen35moe` architecture) with honest random
weights, so llama.cpp and MoE Desk run the same model side by side (issue 22).

The shape is Qwen3.6-35B-A3B's text config (engine.synthetic.QWEN3_6_TEXT_CONFIG): 40 layers, every fourth
full attention (10) and the rest Gated DeltaNet (30), 256 routed experts of 512 with 8 active and one shared
expert of 512, hidden 2048, 16 query and 2 KV heads of 256, vocabulary 248,320. Tensor names, shapes and
metadata keys are those the vendored llama.cpp (0c1e57098, src/models/qwen35moe.cpp) loads; the multi-token
prediction layer is left out (llama.cpp skips it unless asked to load it).

Types: the routed experts (ffn_gate_exps, ffn_up_exps, ffn_down_exps) are Q4_K, 4.5 bits a weight like
NVFP4's 4 bits plus an E4M3 scale per 16; the other matrices F16 and the norms, the router, the Gated
DeltaNet's conv1d, A and dt bias F32, as llama.cpp's converter stores them at --outtype f16. Routed experts a
token reads: Q4_K 3 x 512 x 2048 weights x 144 / 256 bytes = 1,769,472 bytes an expert, x 8 active x 40
layers = 566,231,040 bytes a token; MoE Desk's NVFP4 record is 1,781,760 bytes an expert, 570,163,200 bytes a
token (0.7 % more, its per-tensor scales and padding).

With --like-nvidia the rest follows nvidia/Qwen3.6-35B-A3B-NVFP4's bytes instead of the converter's: its FP8
projections (attn_q/k/v/output, attn_qkv, attn_gate, ssm_out) are Q8_0 (8.5 bits), its NVFP4 shared expert
and lm_head (output.weight) Q4_K; the embedding, ssm_alpha/beta and the router stay as nvidia keeps them
(16-bit; F32 router). Use it for the side-by-side runs, so a token moves about the same bytes in both.

Honest random weights (as engine/testing/random_weights.py means it): every tensor is drawn from its own
random stream (seeded by the seed and the tensor's name), so no two rows, experts or layers repeat one
another. Float weights have about unit variance over their inputs and norms sit near one; Q4_K experts are
random 4-bit codes and 6-bit scales under valid positive fp16 block scales sized the same way. The tokenizer
is llama.cpp's "none" vocabulary (ids only): llama-bench feeds random token ids, so it needs no text.

How to run, from the repository root (the full-size file is 21.5 GiB, 19.5 GiB with --like-nvidia; minutes on one core):

    python -m tools.gguf_random --like-nvidia qwen3.6-35b-a3b-q4k.gguf
    python -m tools.gguf_random --tiny tiny.gguf        # the same architecture at tiny sizes, for tests
    .llama-build/bin/llama-bench -m tiny.gguf -p 64 -n 16
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from engine.synthetic import QWEN3_6_TEXT_CONFIG

ARCH = "qwen35moe"
Q4_K = gguf.GGMLQuantizationType.Q4_K
Q8_0 = gguf.GGMLQuantizationType.Q8_0
F16 = gguf.GGMLQuantizationType.F16
F32 = gguf.GGMLQuantizationType.F32
Q4_K_CODE_RMS = float(np.sqrt(np.mean(np.arange(16) ** 2)))  # random 4-bit codes' RMS
Q4_K_SCALE_MEAN = 31.5  # random 6-bit sub-block scales' mean
Q8_0_CODE_RMS = float(np.sqrt(np.mean(np.arange(-128, 128) ** 2.0)))  # random int8 codes' RMS


@dataclass(frozen=True)
class Shape:
    """The sizes of a qwen35moe model."""

    layers: int
    full_attention_interval: int
    hidden: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_sections: tuple[int, int, int, int]
    rope_theta: float
    experts: int
    experts_used: int
    expert_ff: int
    shared_ff: int
    linear_key_heads: int
    linear_value_heads: int
    linear_head_dim: int
    conv_kernel: int
    context: int
    rms_eps: float

    @classmethod
    def from_text_config(cls, config: dict) -> Shape:
        """Read the sizes from a Qwen3.5/3.6 MoE text_config (as config.json holds it)."""
        rope = config["rope_parameters"]
        if config["linear_key_head_dim"] != config["linear_value_head_dim"]:
            raise ValueError("qwen35moe stores one Gated DeltaNet head size (ssm.state_size) for keys and values")
        return cls(
            layers=config["num_hidden_layers"],
            full_attention_interval=config["full_attention_interval"],
            hidden=config["hidden_size"],
            vocab=config["vocab_size"],
            heads=config["num_attention_heads"],
            kv_heads=config["num_key_value_heads"],
            head_dim=config["head_dim"],
            rotary_dim=int(config["head_dim"] * rope["partial_rotary_factor"]),
            rope_sections=(*rope["mrope_section"], 0),
            rope_theta=float(rope["rope_theta"]),
            experts=config["num_experts"],
            experts_used=config["num_experts_per_tok"],
            expert_ff=config["moe_intermediate_size"],
            shared_ff=config["shared_expert_intermediate_size"],
            linear_key_heads=config["linear_num_key_heads"],
            linear_value_heads=config["linear_num_value_heads"],
            linear_head_dim=config["linear_key_head_dim"],
            conv_kernel=config["linear_conv_kernel_dim"],
            context=config["max_position_embeddings"],
            rms_eps=config["rms_norm_eps"],
        )


FULL = Shape.from_text_config(QWEN3_6_TEXT_CONFIG)
# The same architecture at sizes a test writes in well under a second; expert rows stay whole Q4_K blocks.
TINY = Shape(
    layers=4,
    full_attention_interval=4,
    hidden=256,
    vocab=512,
    heads=2,
    kv_heads=1,
    head_dim=64,
    rotary_dim=16,
    rope_sections=(3, 3, 2, 0),
    experts=8,
    experts_used=2,
    expert_ff=256,
    shared_ff=256,
    linear_key_heads=2,
    linear_value_heads=4,
    linear_head_dim=32,
    conv_kernel=4,
    context=4096,
    rope_theta=FULL.rope_theta,
    rms_eps=FULL.rms_eps,
)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor: its GGUF name, numpy shape (rows last-dimension-fastest, the reverse of ggml's ne) and type."""

    name: str
    shape: tuple[int, ...]
    kind: str  # "linear" (scaled by fan-in), "norm", "ssm_a", "ssm_dt", "conv", "embedding"
    dtype: gguf.GGMLQuantizationType


def is_full_attention(shape: Shape, layer: int) -> bool:
    """Say whether a layer is full attention (llama.cpp's rule: every full_attention_interval-th)."""
    return (layer + 1) % shape.full_attention_interval == 0


def tensor_specs(shape: Shape, like_nvidia: bool = False) -> list[TensorSpec]:
    """List every tensor the qwen35moe loader reads, in file order (like_nvidia: nvidia's NVFP4 build's bytes)."""
    h = shape.hidden
    # nvidia's build: attention projections FP8 (Q8_0 here), shared expert and lm_head NVFP4 (Q4_K here)
    projection, dense_4bit = (Q8_0, Q4_K) if like_nvidia else (F16, F16)
    specs = [
        TensorSpec("token_embd.weight", (shape.vocab, h), "embedding", F16),
        TensorSpec("output_norm.weight", (h,), "norm", F32),
        TensorSpec("output.weight", (shape.vocab, h), "linear", dense_4bit),
    ]
    key_dim = shape.linear_key_heads * shape.linear_head_dim
    value_dim = shape.linear_value_heads * shape.linear_head_dim
    for layer in range(shape.layers):
        blk = f"blk.{layer}."
        specs += [
            TensorSpec(blk + "attn_norm.weight", (h,), "norm", F32),
            TensorSpec(blk + "post_attention_norm.weight", (h,), "norm", F32),
        ]
        if is_full_attention(shape, layer):
            q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
            specs += [
                TensorSpec(blk + "attn_q.weight", (2 * q_dim, h), "linear", projection),  # queries and gate
                TensorSpec(blk + "attn_k.weight", (kv_dim, h), "linear", projection),
                TensorSpec(blk + "attn_v.weight", (kv_dim, h), "linear", projection),
                TensorSpec(blk + "attn_output.weight", (h, q_dim), "linear", projection),
                TensorSpec(blk + "attn_q_norm.weight", (shape.head_dim,), "norm", F32),
                TensorSpec(blk + "attn_k_norm.weight", (shape.head_dim,), "norm", F32),
            ]
        else:
            conv_dim = 2 * key_dim + value_dim
            specs += [
                TensorSpec(blk + "attn_qkv.weight", (conv_dim, h), "linear", projection),
                TensorSpec(blk + "attn_gate.weight", (value_dim, h), "linear", projection),
                TensorSpec(blk + "ssm_conv1d.weight", (conv_dim, shape.conv_kernel), "conv", F32),
                TensorSpec(blk + "ssm_dt.bias", (shape.linear_value_heads,), "ssm_dt", F32),
                TensorSpec(blk + "ssm_a", (shape.linear_value_heads,), "ssm_a", F32),
                TensorSpec(blk + "ssm_beta.weight", (shape.linear_value_heads, h), "linear", F16),
                TensorSpec(blk + "ssm_alpha.weight", (shape.linear_value_heads, h), "linear", F16),
                TensorSpec(blk + "ssm_norm.weight", (shape.linear_head_dim,), "norm", F32),
                TensorSpec(blk + "ssm_out.weight", (h, value_dim), "linear", projection),
            ]
        e, ff = shape.experts, shape.expert_ff
        specs += [
            TensorSpec(blk + "ffn_gate_inp.weight", (e, h), "linear", F32),
            TensorSpec(blk + "ffn_gate_exps.weight", (e, ff, h), "linear", Q4_K),
            TensorSpec(blk + "ffn_up_exps.weight", (e, ff, h), "linear", Q4_K),
            TensorSpec(blk + "ffn_down_exps.weight", (e, h, ff), "linear", Q4_K),
            TensorSpec(blk + "ffn_gate_inp_shexp.weight", (h,), "linear", F32),
            TensorSpec(blk + "ffn_gate_shexp.weight", (shape.shared_ff, h), "linear", dense_4bit),
            TensorSpec(blk + "ffn_up_shexp.weight", (shape.shared_ff, h), "linear", dense_4bit),
            TensorSpec(blk + "ffn_down_shexp.weight", (h, shape.shared_ff), "linear", dense_4bit),
        ]
    return specs


def stream(seed: int, name: str) -> np.random.Generator:
    """Return the random stream of one tensor: seeded by the seed and the tensor's name."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:16], "little"))


def float_values(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    """Draw a float tensor with its role's magnitude."""
    if spec.kind == "norm":
        values = 1.0 + 0.05 * rng.standard_normal(spec.shape, dtype=np.float32)
    elif spec.kind == "ssm_a":  # -exp(A_log), A_log uniform in log(1)..log(16) as Qwen's init
        values = -np.exp(rng.uniform(0.0, np.log(16.0), spec.shape))
    elif spec.kind == "ssm_dt":
        values = rng.uniform(-4.0, -2.0, spec.shape)
    elif spec.kind == "conv":
        values = rng.standard_normal(spec.shape, dtype=np.float32) / np.sqrt(spec.shape[-1])
    elif spec.kind == "embedding":
        values = rng.standard_normal(spec.shape, dtype=np.float32)
    else:  # float32 draws: a full-size output matrix in seconds, not half a minute
        values = rng.standard_normal(spec.shape, dtype=np.float32) / np.sqrt(spec.shape[-1])
    return values.astype(np.float32 if spec.dtype == F32 else np.float16)


def quant_bytes(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    """Draw random Q4_K or Q8_0 blocks (random codes and sub-scales) under valid positive fp16 block scales."""
    *rows, width = spec.shape
    block, nbytes = gguf.GGML_QUANT_SIZES[spec.dtype]  # Q4_K: 256 in 144 bytes, d and dmin first; Q8_0: 32 in 34, d
    blocks = rng.integers(0, 256, (*rows, width // block, nbytes), dtype=np.uint8)
    # A Q4_K weight is d * scale * code - dmin * min, a Q8_0 one d * code: d sized for unit variance over fan-in.
    if spec.dtype == Q4_K:
        d, n_scales = 1.0 / (np.sqrt(width) * Q4_K_SCALE_MEAN * Q4_K_CODE_RMS), 2
    else:
        d, n_scales = 1.0 / (np.sqrt(width) * Q8_0_CODE_RMS), 1
    scales = rng.uniform(0.5 * d, 1.5 * d, (*rows, width // block, n_scales)).astype(np.float16)
    blocks[..., : 2 * n_scales] = scales.view(np.uint8)
    return blocks.reshape(*rows, width // block * nbytes)


def stored_shape(spec: TensorSpec) -> tuple[int, ...]:
    """Return the numpy shape of a tensor's stored data (bytes per row for quantised types)."""
    if spec.dtype in (F16, F32):
        return spec.shape
    *rows, width = spec.shape
    block, nbytes = gguf.GGML_QUANT_SIZES[spec.dtype]
    return (*rows, width // block * nbytes)


def tensor_data(spec: TensorSpec, seed: int) -> np.ndarray:
    """Return one tensor's stored data: float values, or quantised blocks' bytes."""
    rng = stream(seed, spec.name)
    return float_values(spec, rng) if spec.dtype in (F16, F32) else quant_bytes(spec, rng)


def add_metadata(writer: gguf.GGUFWriter, shape: Shape) -> None:
    """Write the qwen35moe hyperparameters and an ids-only vocabulary."""
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name("Qwen3.6-35B-A3B random" if shape == FULL else "qwen35moe tiny random")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.expert_ff)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_rope_dimension_count(shape.rotary_dim)
    writer.add_rope_dimension_sections(list(shape.rope_sections))
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_expert_count(shape.experts)
    writer.add_expert_used_count(shape.experts_used)
    writer.add_expert_feed_forward_length(shape.expert_ff)
    writer.add_expert_shared_feed_forward_length(shape.shared_ff)
    writer.add_ssm_conv_kernel(shape.conv_kernel)
    writer.add_ssm_inner_size(shape.linear_value_heads * shape.linear_head_dim)
    writer.add_ssm_state_size(shape.linear_head_dim)
    writer.add_ssm_time_step_rank(shape.linear_value_heads)
    writer.add_ssm_group_count(shape.linear_key_heads)
    writer.add_full_attention_interval(shape.full_attention_interval)
    writer.add_vocab_size(shape.vocab)
    writer.add_tokenizer_model("none")


def write_gguf(path: Path, shape: Shape, seed: int = 0, like_nvidia: bool = False) -> None:
    """Write the model to path, one tensor at a time so a full-size file never sits in memory."""
    specs = tensor_specs(shape, like_nvidia)
    writer = gguf.GGUFWriter(path, ARCH)
    add_metadata(writer, shape)
    for spec in specs:
        byte_shape = stored_shape(spec)
        dtype = np.dtype({F32: np.float32, F16: np.float16}.get(spec.dtype, np.uint8))
        writer.add_tensor_info(
            spec.name, byte_shape, dtype, int(np.prod(byte_shape)) * dtype.itemsize, raw_dtype=spec.dtype
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for spec in specs:
        writer.write_tensor_data(tensor_data(spec, seed))
    writer.close()


def main(argv: list[str] | None = None) -> int:
    """Write the GGUF the command line names; exit 1 with a message if it cannot be written."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the .gguf file to write")
    parser.add_argument("--tiny", action="store_true", help="the same architecture at tiny sizes")
    parser.add_argument(
        "--like-nvidia",
        action="store_true",
        help="store what nvidia's NVFP4 build stores in FP8 as Q8_0 and its NVFP4 shared expert "
        "and lm_head as Q4_K, so both engines move about the same bytes",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        write_gguf(args.out, TINY if args.tiny else FULL, args.seed, args.like_nvidia)
    except OSError as error:
        print(f"gguf_random: could not write {args.out} ({error}); check the folder exists and has room.")
        return 1
    print(f"gguf_random: wrote {args.out} ({args.out.stat().st_size / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
