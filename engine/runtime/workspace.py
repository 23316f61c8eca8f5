"""The prefill workspace: the temporary GPU bytes of one prompt chunk, by phase of a layer, as the memory plan
budgets them (an upper bound written from the shapes of the computation; docs/PLANNER.md)."""

from __future__ import annotations

import math

from engine.config import ModelConfig
from engine.kernels import reference
from engine.kernels.reference import GDN_CHUNK, GDN_GROUP_TOKENS
from engine.runtime.footprint import ACCUMULATOR_BYTES, ACTIVATION_BYTES, FP32_BYTES, INT64_BYTES, gdn_conv_channels

GDN_SCAN_CHUNK = GDN_CHUNK  # tokens per block of the chunked gated delta rule (FLA uses the same 64)
# queries per attention block (big enough to keep the GPU busy) and keys per block of the online softmax (scores
# never span the whole context): the blocks the FP8 cache's attention runs in
ATTENTION_QUERY_BLOCK = reference.ATTENTION_QUERY_BLOCK
ATTENTION_KEY_BLOCK = reference.ATTENTION_KEY_BLOCK
# Sampling the last position: fp32 logits, fp32 probabilities, and a sorted copy (fp32 values,
# int64 indices) for top-k/top-p.
SAMPLING_BYTES_PER_VOCAB_ENTRY = 3 * FP32_BYTES + INT64_BYTES


def prefill_workspace(config: ModelConfig, chunk_tokens: int) -> dict[str, int]:
    """Temporary GPU bytes of one prefill chunk, by term; "total" is what a plan budgets.

    The phases of a layer run one after another, so only the largest is live at once, beside
    the hidden states that cross the whole layer and the last position's logits.
    """
    hidden = chunk_tokens * config.hidden_size * (ACCUMULATOR_BYTES + 2 * ACTIVATION_BYTES)  # residual, input, output
    phases = {"attention": _attention_workspace(config, chunk_tokens), "moe": _moe_workspace(config, chunk_tokens)}
    if config.num_linear_attention_layers:
        phases["gated_deltanet"] = _gdn_workspace(config, chunk_tokens)
    logits = config.vocab_size * SAMPLING_BYTES_PER_VOCAB_ENTRY
    return dict(hidden_states=hidden, **phases, logits=logits, total=hidden + max(phases.values()) + logits)


def _gdn_workspace(c: ModelConfig, tokens: int) -> int:
    """Bytes a Gated DeltaNet layer holds at its peak over a chunk: what lives through the whole call, and the
    chunked rule's temporaries for one group of tokens (reference.gated_delta_rule)."""
    heads, key_dim, value_dim = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    conv, values = gdn_conv_channels(c), heads * value_dim
    per_token = (
        (conv + values + 2 * heads) * ACTIVATION_BYTES  # in_proj_qkv, in_proj_z, in_proj_b and in_proj_a outputs
        + 2 * heads * ACCUMULATOR_BYTES  # beta and decay
        + conv * ACTIVATION_BYTES  # causal conv output, of which v is a view
        + 2 * heads * key_dim * ACCUMULATOR_BYTES  # q and k per value head, normalised
        + values * ACCUMULATOR_BYTES  # the rule's output
    )
    group = min(tokens, GDN_GROUP_TOKENS)
    per_group_token = (
        heads
        * ACCUMULATOR_BYTES
        * (
            3 * key_dim  # the group's q and k laid out by chunk, and w
            + 4 * value_dim  # its v (and its float32 cast), u (turned into the values written), its output
            + 4 * GDN_SCAN_CHUNK  # intra-chunk matrices: decay, I + A, the solver's copy of it, its inverse
            + 6  # its gates laid out by chunk, their cumulative sum and its exponentials
        )
    )
    states = (math.ceil(group / GDN_SCAN_CHUNK) + 1) * heads * key_dim * value_dim * ACCUMULATOR_BYTES
    return tokens * per_token + group * per_group_token + states


def _attention_workspace(c: ModelConfig, tokens: int) -> int:
    heads = c.num_attention_heads
    q_width, kv_width = heads * c.head_dim, c.num_key_value_heads * c.head_dim
    gate_width = q_width if c.attention_output_gate else 0
    per_token = (
        (q_width + gate_width + 2 * kv_width) * ACTIVATION_BYTES  # projection outputs
        + (q_width + kv_width) * ACTIVATION_BYTES  # q and k after norm and RoPE
        + (q_width + 2 * heads) * ACCUMULATOR_BYTES  # online-softmax output, running max and sum
        + q_width * ACTIVATION_BYTES
    )  # (gated) output, input of o_proj
    query_block = min(tokens, ATTENTION_QUERY_BLOCK)
    block_pair = (
        2 * query_block * heads * ATTENTION_KEY_BLOCK * ACCUMULATOR_BYTES  # scores and probabilities
        + 2 * ATTENTION_KEY_BLOCK * heads * c.head_dim * ACTIVATION_BYTES
    )  # K, V repeated to query heads
    return tokens * per_token + block_pair


def _moe_workspace(c: ModelConfig, tokens: int) -> int:
    top_k, intermediate, hidden = c.num_experts_per_tok, c.moe_intermediate_size, c.hidden_size
    always_on = max(c.shared_expert_intermediate_size, c.intermediate_size if c.dense_mlp_layers else 0)
    per_token = (
        2 * c.num_experts * ACCUMULATOR_BYTES  # router logits and probabilities
        + top_k * (INT64_BYTES + ACCUMULATOR_BYTES)  # chosen expert ids and weights
        + top_k * hidden * ACTIVATION_BYTES  # tokens gathered per expert
        + top_k * 3 * intermediate * ACTIVATION_BYTES  # gate/up outputs and the activated product
        + (top_k + 1) * hidden * ACCUMULATOR_BYTES  # expert outputs and their weighted sum
        + (3 * always_on + hidden) * ACTIVATION_BYTES
    )  # shared expert: gate/up, product, output
    return tokens * per_token
