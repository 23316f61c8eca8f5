"""The memory planner: a model's footprint, a VRAM budget and a preset in, a checked MemoryPlan out.

A plan fixes everything the GPU runtime allocates: expert-cache layers (slots = layers x
experts per layer), prefill overlap, prefill chunk size, KV-cache tokens, and so the largest
prompt guaranteed to run. Its byte breakdown is the contract the runtime honours and checks
its measured peak against. docs/PLANNER.md explains the model at length.

Assumptions (each a named constant below, with its reason):
1. Resident on the GPU in their stored format: attention/GDN projections, shared experts,
   routers, norms and small tensors, lm_head. The embedding table stays in host RAM (one row
   per token is copied up) and so do the routed experts, which visit the GPU through the
   expert-cache slots.
2. KV cache is bf16, or FP8 (e4m3, one byte a value) where the checkpoint declares it or the
   caller asks (ModelFootprint.kv_cache), preallocated for kv_tokens over the full-attention layers
   only; an FP8 cache's scales (2 x KV heads float32 a layer) are within the allocator slack.
   Gated DeltaNet state (fp32 recurrent matrix plus bf16 conv window) is fixed per sequence.
   One sequence at a time.
3. Prefill runs in chunks of prefill_chunk_tokens, so its temporary memory depends on the
   chunk, never on the prompt: hidden states, the largest phase of a layer (GDN scan,
   attention over the KV cache in query x key blocks, or MoE dispatch), and the last
   position's logits. Everything a phase holds is counted as live at once (an upper bound).
   Decode is a chunk of one token, so the prefill workspace bounds it too.
4. With prefill overlap, layer i+1's experts stream into a second layer of slots while
   layer i computes; without it one layer of slots is refilled serially.
5. The runtime reserve covers what lives outside the budgeted tensors: the CUDA context and
   kernel images, CUDA's per-thread local memory (which scales with the GPU's size), and
   caching-allocator rounding and fragmentation. On a GPU engine/runtime/reserve.py measures it;
   without one a plan carries the reference card's estimate and says so (MemoryPlan.reserve_source).
6. A prompt is guaranteed when it plus a reply reserve fits the KV cache and the model's
   context; presets aim for a 32,768-token prompt before spending memory elsewhere.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from engine.checkpoint import Checkpoint, LayoutShard
from engine.checkpoint.formats import IGNORED_ROLES
from engine.checkpoint.source import WeightSource
from engine.checkpoint.quant_config import kv_cache_choice
from engine.config import ModelConfig, read_config
from engine.errors import CheckpointError
from engine.experts.bank import ExpertBank
from engine.experts.packed import expert_matrices
from engine.kernels.record_layout import RecordLayout
from engine.kernels import reference
from engine.kernels.reference import GDN_CHUNK, GDN_GROUP_TOKENS
from engine.synthetic import SYNTHETIC_MODELS

KIB, MIB, GIB = 2**10, 2**20, 2**30

# ---- element sizes -------------------------------------------------------------------------
BF16_BYTES = 2
FP32_BYTES = 4
INT64_BYTES = 8
ACTIVATION_BYTES = BF16_BYTES  # activations between kernels are bf16 on the GPU
KV_BYTES = {"bf16": BF16_BYTES, "fp8": 1}  # a KV cache value by the cache's dtype (quant_config.kv_cache_choice)
CONV_STATE_BYTES = BF16_BYTES  # the GDN conv window holds activations
ACCUMULATOR_BYTES = FP32_BYTES  # residual stream, GDN scan and recurrent state, softmax, logits

# ---- prefill workspace ---------------------------------------------------------------------
GDN_SCAN_CHUNK = GDN_CHUNK  # tokens per block of the chunked gated delta rule (FLA uses the same 64)
# queries per attention block (big enough to keep the GPU busy) and keys per block of the online softmax (scores
# never span the whole context): the blocks the FP8 cache's attention runs in
ATTENTION_QUERY_BLOCK = reference.ATTENTION_QUERY_BLOCK
ATTENTION_KEY_BLOCK = reference.ATTENTION_KEY_BLOCK
# Sampling the last position: fp32 logits, fp32 probabilities, and a sorted copy (fp32 values,
# int64 indices) for top-k/top-p.
SAMPLING_BYTES_PER_VOCAB_ENTRY = 3 * FP32_BYTES + INT64_BYTES

# ---- runtime reserve -----------------------------------------------------------------------
# CUDA context, cuBLAS, SDPA and the Triton kernel images of a whole forward, outside PyTorch's
# allocator: measured 533 MiB on the H200 (torch 2.11, CUDA 13, lazy loading) at the end of a
# full-size 4gb benchmark, once the per-thread local memory below is taken out; rounded up.
CUDA_CONTEXT_BYTES = 544 * MIB
# CUDA reserves local memory (stack) for every thread the GPU can hold: SMs x threads/SM x the
# stack limit, 1 KiB by default. Measured: each KiB of stack costs 264 MiB on the H200 (132 x 2048).
CUDA_STACK_BYTES_PER_THREAD = 1 * KIB
# The card the default reserve is for: the field report's RTX 2050 (16 SMs x 1536 threads).
REFERENCE_CARD = "RTX 2050"
REFERENCE_MULTIPROCESSORS = 16
REFERENCE_THREADS_PER_MULTIPROCESSOR = 1536
# Caching-allocator rounding of the long-lived tensors and fragmentation of the per-chunk
# workspace, whose tensors change size from phase to phase.
ALLOCATOR_SLACK_BYTES = 64 * MIB
# Decode steps replay as CUDA graphs (engine/runtime/graph_runner.py): their private memory pool (a step's
# one-token intermediates, inside the allocator, never lent to prefill) and the instantiated graphs (outside
# it). Measured for the 40-layer Qwen3.6 (91 graphs, H200): pool 6 MiB, graphs 18 MiB; rounded up.
DECODE_GRAPH_POOL_BYTES = 16 * MIB
DECODE_GRAPH_EXEC_BYTES = 24 * MIB
# The part of the reserve that lies inside PyTorch's allocator, so under the VRAM cap (engine/runtime/vram.py),
# besides the cuBLAS workspaces below.
RESERVE_INSIDE_ALLOCATOR_BYTES = ALLOCATOR_SLACK_BYTES + DECODE_GRAPH_POOL_BYTES
# PyTorch keeps a cuBLAS workspace in its allocator for every stream that has run a GEMM, for the process's life
# (CUBLAS_WORKSPACE_CONFIG: 32 MiB from Hopper on, else ":4096:2:16:8"); a chat runs GEMMs on the compute
# stream and on the stream that captures the decode graphs.
CUBLAS_WORKSPACE_STREAMS = 2
REFERENCE_COMPUTE_MAJOR = 8  # the RTX 2050 is an Ampere card (sm_86)

# ---- plan policy ---------------------------------------------------------------------------
TARGET_PROMPT_TOKENS = 32768  # the prompt the issue asks a 4 GB card to take (the report crashed at ~600)
REPLY_RESERVE_TOKENS = 1024  # KV kept free after the longest guaranteed prompt for the reply
MIN_KV_TOKENS = 4096  # the field report's largest working context; a plan with less is refused
KV_TOKEN_GRANULE = 256  # KV is sized in whole blocks of this many tokens
PREFILL_CHUNK_MIN = 128  # two GDN scan blocks; smaller chunks re-stream every expert for too few tokens
# A chunk streams every layer's experts it does not hold once, and waits for the copies: more tokens a chunk
# are fewer bytes a token, up to where the chunk's temporaries cost more than they save.
PREFILL_CHUNK_MAX = 8192
PREFILL_CHUNK_CHOICES = tuple(
    PREFILL_CHUNK_MIN * 2**i for i in range(int(math.log2(PREFILL_CHUNK_MAX // PREFILL_CHUNK_MIN)) + 1)
)
PRESETS = ("4gb", "8gb", "12gb", "auto", "custom")
# The card each size preset is named for; the caller passes less when the card's memory is not all free.
PRESET_BUDGET_BYTES = {"4gb": 4 * GIB, "8gb": 8 * GIB, "12gb": 12 * GIB}
CUSTOM_KEYS = ("expert_cache_layers", "prefill_overlap", "prefill_chunk_tokens", "kv_tokens")
OVERLAP_MIN_LAYERS = 2  # layer i computes in one layer of slots while layer i+1 streams into another

BREAKDOWN_LABELS = {
    "resident_weights": "resident weights",
    "expert_cache": "expert cache",
    "kv_cache": "KV cache",
    "gdn_state": "GDN state",
    "prefill_workspace": "prefill workspace",
    "runtime_reserve": "runtime reserve",
}


class PlanError(ValueError):
    """A plan that cannot be made, with the numbers: what is needed, what is there, what to change."""


def preset_budget_bytes(preset: str) -> int | None:
    """The budget a size preset is named for; None for auto and custom, which need the GPU's free memory."""
    return PRESET_BUDGET_BYTES.get(preset)


def cublas_workspaces_bytes(compute_major: int) -> int:
    """Estimate the cuBLAS workspaces a chatting process keeps in PyTorch's allocator on a GPU of this generation."""
    each = 32 * MIB if compute_major >= 9 else 2 * 4096 * KIB + 8 * 16 * KIB
    return CUBLAS_WORKSPACE_STREAMS * each


def runtime_reserve_bytes(
    multiprocessors: int, threads_per_multiprocessor: int, compute_major: int = REFERENCE_COMPUTE_MAJOR
) -> int:
    """The reserve for a given GPU (torch.cuda.get_device_properties gives the numbers)."""
    local_memory = multiprocessors * threads_per_multiprocessor * CUDA_STACK_BYTES_PER_THREAD
    return CUDA_CONTEXT_BYTES + DECODE_GRAPH_EXEC_BYTES + local_memory + reserve_inside_allocator_bytes(compute_major)


def reserve_inside_allocator_bytes(compute_major: int = REFERENCE_COMPUTE_MAJOR) -> int:
    """The part of the formula's reserve that lies inside PyTorch's allocator on a GPU of this generation."""
    return RESERVE_INSIDE_ALLOCATOR_BYTES + cublas_workspaces_bytes(compute_major)


DEFAULT_RUNTIME_RESERVE_BYTES = runtime_reserve_bytes(REFERENCE_MULTIPROCESSORS, REFERENCE_THREADS_PER_MULTIPROCESSOR)
# Where a plan's reserve came from (MemoryPlan.reserve_source): engine/runtime/reserve.py measures it on a GPU.
DEFAULT_RESERVE_SOURCE = (
    f"estimate for the reference card, an {REFERENCE_CARD} with {REFERENCE_MULTIPROCESSORS} SMs "
    f"x {REFERENCE_THREADS_PER_MULTIPROCESSOR:,} threads"
)
GIVEN_RESERVE_SOURCE = "given by the caller"


# ---- what a model needs --------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFootprint:
    """The bytes of each component a plan places, for one model in its stored formats."""

    name: str
    config: ModelConfig
    projection_bytes: int  # attention and Gated DeltaNet projections
    shared_mlp_bytes: int  # shared experts, and dense MLP layers where a model has them
    small_bytes: int  # routers, shared-expert gates, norms, conv weights, A_log, dt_bias
    lm_head_bytes: int
    embedding_bytes: int  # kept in host RAM
    expert_layer_bytes: int  # one layer of cache slots: experts per layer x the runtime's record of one expert
    routed_expert_bytes: int  # all routed experts, in host RAM
    moe_layers: int
    kv_cache: str = "bf16"  # the KV cache's dtype: "bf16" or "fp8" (quant_config.kv_cache_choice)

    @property
    def resident_bytes(self) -> int:
        """Weights that live on the GPU for the whole session."""
        return self.projection_bytes + self.shared_mlp_bytes + self.small_bytes + self.lm_head_bytes

    @property
    def experts_per_layer(self) -> int:
        return self.config.num_experts

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every full-attention layer, in the KV cache's dtype; GDN layers keep no per-token state."""
        c = self.config
        return c.num_attention_layers * 2 * c.num_key_value_heads * c.head_dim * KV_BYTES[self.kv_cache]

    @property
    def gdn_state_bytes(self) -> int:
        """Recurrent matrices and conv windows of all GDN layers: one sequence, any length."""
        c = self.config
        recurrent = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * ACCUMULATOR_BYTES
        conv = _gdn_conv_channels(c) * (c.linear_conv_kernel_dim - 1) * CONV_STATE_BYTES
        return c.num_linear_attention_layers * (recurrent + conv)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings

    def to_dict(self) -> dict:
        fields = {k: v for k, v in asdict(self).items() if k != "config"}
        return dict(
            fields,
            resident_bytes=self.resident_bytes,
            experts_per_layer=self.experts_per_layer,
            kv_bytes_per_token=self.kv_bytes_per_token,
            gdn_state_bytes=self.gdn_state_bytes,
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
            max_context=self.max_context,
        )


def _gdn_conv_channels(c: ModelConfig) -> int:
    return 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim


@functools.lru_cache(maxsize=None)
def footprint_from_synthetic(name: str, kv_cache_dtype: str = "auto") -> ModelFootprint:
    """The footprint of a model described in engine.synthetic: its real checkpoint's tensor layout, sized by the
    code that sizes a checkpoint folder, so the two cannot disagree."""
    if name not in SYNTHETIC_MODELS:
        raise KeyError(f"no synthetic model {name!r}; known: {', '.join(SYNTHETIC_MODELS)}")
    model = SYNTHETIC_MODELS[name]
    where = Path(name)
    checkpoint = Checkpoint(where, model.quantization_config, shards=[LayoutShard(model.tensor_layout(), where)])
    return footprint_of(checkpoint, model.config, where, kv_cache_dtype)


# Normalised tensor names (engine.checkpoint.normalise_key) by the component they belong to.
ROUTED_EXPERTS = re.compile(r"^layers\.(\d+)\.mlp\.experts\.")
PROJECTIONS = re.compile(r"^layers\.\d+\.(self_attn|linear_attn)\.\w*proj\w*\.")
ALWAYS_ON_MLP = re.compile(r"^layers\.\d+\.mlp\.(shared_expert|gate_proj|up_proj|down_proj)\.")


def footprint_from_checkpoint(folder: str | Path, kv_cache_dtype: str = "auto") -> ModelFootprint:
    """The footprint of a checkpoint folder, from its safetensors headers only (no weight data is read)."""
    folder = Path(folder).expanduser()
    config = read_config(folder)
    return footprint_of(Checkpoint(folder, config.quantization_config), config, folder, kv_cache_dtype)


def footprint_of(
    checkpoint: Checkpoint, config: ModelConfig, folder: Path, kv_cache_dtype: str = "auto"
) -> ModelFootprint:
    """The footprint of an open checkpoint (a folder's, or shard headers fetched before downloading), its KV cache
    in the dtype the kv_cache_dtype option gives it (auto: FP8 where the checkpoint declares it)."""
    sizes = dict.fromkeys(("projection", "shared", "small", "lm_head", "embedding"), 0)
    expert_layers: dict[int, int] = {}
    for name, nbytes in checkpoint.tensor_bytes():
        if name.rpartition(".")[2] in IGNORED_ROLES:  # activation scales: weight-only compute never loads them
            continue
        routed = ROUTED_EXPERTS.match(name)
        if routed:
            layer = int(routed.group(1))
            expert_layers[layer] = expert_layers.get(layer, 0) + nbytes
        elif PROJECTIONS.match(name):
            sizes["projection"] += nbytes
        elif ALWAYS_ON_MLP.match(name):
            sizes["shared"] += nbytes
        elif name.startswith("lm_head."):
            sizes["lm_head"] += nbytes
        elif name.startswith("embed_tokens."):
            sizes["embedding"] += nbytes
        else:
            sizes["small"] += nbytes
    if not expert_layers:
        raise CheckpointError(
            folder,
            "has no routed-expert weights, so it is not a mixture-of-experts checkpoint the planner can place",
            "choose a Qwen3.5/3.6-MoE or Qwen3-MoE model",
        )
    if config.tie_word_embeddings and not sizes["lm_head"]:  # the head is the embedding table, then resident too
        sizes["lm_head"] = sizes["embedding"]
    largest = max(expert_layers, key=expert_layers.get)
    record_bytes = expert_record_bytes(checkpoint, config, largest)
    return ModelFootprint(
        name=folder.name,
        config=config,
        projection_bytes=sizes["projection"],
        shared_mlp_bytes=sizes["shared"],
        small_bytes=sizes["small"],
        lm_head_bytes=sizes["lm_head"],
        embedding_bytes=sizes["embedding"],
        expert_layer_bytes=config.num_experts * record_bytes,
        routed_expert_bytes=sum(expert_layers.values()),
        moe_layers=len(expert_layers),
        kv_cache=kv_cache_choice(kv_cache_dtype, checkpoint.quant),
    )


def expert_record_bytes(checkpoint: Checkpoint, config: ModelConfig, layer: int) -> int:
    """Bytes of one cache slot: the record the runtime packs an expert of `layer` into (engine/experts/packed.py),
    which joins gate and up and keeps a global scale per row, so it is larger than the expert's stored bytes."""
    source = WeightSource(checkpoint.headers_only(), config, torch.device("meta"), torch.float32)
    bank = ExpertBank(
        source, f"layers.{layer}.mlp.experts", config.num_experts, config.hidden_size, config.moe_intermediate_size
    )
    return RecordLayout.of(expert_matrices(bank, 0)).record_bytes


# ---- prefill workspace ---------------------------------------------------------------------


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
    conv, values = _gdn_conv_channels(c), heads * value_dim
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


# ---- plans ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryPlan:
    """What the GPU runtime allocates for one model on one budget, and the byte breakdown it must stay within."""

    model: str
    preset: str  # what was asked for
    policy: str  # the rule that made it: a preset name, or "custom"; auto picks "4gb" or "12gb"
    budget_bytes: int
    expert_cache_layers: int
    expert_slots: int  # expert_cache_layers x experts per layer
    prefill_overlap: bool
    prefill_chunk_tokens: int
    kv_tokens: int
    max_prompt_tokens: int  # the largest prompt guaranteed to prefill and leave REPLY_RESERVE_TOKENS
    breakdown: dict[str, int]  # BREAKDOWN_LABELS keys and "total"
    reserve_source: str = DEFAULT_RESERVE_SOURCE  # "measured on <GPU>", or which estimate the runtime reserve is
    kv_cache: str = "bf16"  # the KV cache's dtype the plan is sized for, which the model must load with

    @property
    def reserve_measured(self) -> bool:
        """Whether the guarantee rests on a reserve measured on the GPU that runs the plan."""
        return self.reserve_source.startswith("measured on ")

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.breakdown["total"]

    def to_dict(self) -> dict:
        return dict(
            asdict(self),
            headroom_bytes=self.headroom_bytes,
            reply_reserve_tokens=REPLY_RESERVE_TOKENS,
            reserve_measured=self.reserve_measured,
        )

    def summary(self) -> str:
        return (
            f"{self.model} {self.preset}: {_layers(self.expert_cache_layers)} of experts "
            f"({self.expert_slots:,} slots), overlap {'on' if self.prefill_overlap else 'off'}, "
            f"chunk {self.prefill_chunk_tokens}, "
            f"KV {self.kv_tokens:,} tokens ({self.kv_cache}), prompts up to {self.max_prompt_tokens:,} tokens; "
            f"{_gib(self.breakdown['total'])} of {_gib(self.budget_bytes)}; runtime reserve {self.reserve_source}"
        )

    def format_table(self) -> str:
        policy = f" (rules of {self.policy})" if self.policy != self.preset else ""
        experts_per_layer = self.expert_slots // self.expert_cache_layers
        lines = [
            f"{self.model}, preset {self.preset}{policy}, budget {_gib(self.budget_bytes)}",
            f"  expert cache       {_layers(self.expert_cache_layers)} x {experts_per_layer} experts = "
            f"{self.expert_slots:,} slots, prefill overlap {'on' if self.prefill_overlap else 'off'}",
            f"  prefill chunk      {self.prefill_chunk_tokens:,} tokens",
            f"  KV cache           {self.kv_tokens:,} tokens ({self.kv_cache}); largest prompt guaranteed "
            f"{self.max_prompt_tokens:,} tokens (+{REPLY_RESERVE_TOKENS:,} for the reply)",
        ]
        for key, label in BREAKDOWN_LABELS.items():
            source = f"   ({self.reserve_source})" if key == "runtime_reserve" else ""
            lines.append(f"  {label:<18} {_size(self.breakdown[key]):>10}{source}")
        lines.append(f"  {'total':<18} {_size(self.breakdown['total']):>10}   (headroom {_size(self.headroom_bytes)})")
        return "\n".join(lines)


@dataclass(frozen=True)
class _Rule:
    """How a preset spends memory once the fixed costs are paid."""

    min_layers: int
    fills_layers: bool  # memory left after the KV target and the largest chunk buys more cache layers
    max_chunk: int  # the largest prefill chunk the rule buys before spending the rest


# 4gb keeps 2,048-token chunks so the rest of its memory stays prompt; 12gb's is worth more as cache layers, which
# prefill keeps instead of recopying (experts/cache.py); 8gb has KV to spare for bigger chunks.
RULES = {
    "4gb": _Rule(min_layers=1, fills_layers=False, max_chunk=2048),  # the field report's fix, made official
    "8gb": _Rule(min_layers=2, fills_layers=False, max_chunk=PREFILL_CHUNK_MAX),
    "12gb": _Rule(min_layers=2, fills_layers=True, max_chunk=2048),
}


def plan_memory(
    footprint: ModelFootprint,
    budget_bytes: int,
    preset: str,
    custom: dict | None = None,
    *,
    reserve_bytes: int = DEFAULT_RUNTIME_RESERVE_BYTES,
    reserve_source: str | None = None,
) -> MemoryPlan:
    """A plan that fits budget_bytes, or PlanError saying what is needed, what is there and what to change.

    preset: "4gb" one layer of expert slots; "8gb" two layers; "12gb" as many layers as fit after
    the KV target (no preset overlaps prefill: it ran slower, docs/PLANNER.md); "auto" chooses
    between those rules from the budget (pass the GPU's free memory); "custom" checks `custom`'s
    expert_cache_layers, prefill_overlap, prefill_chunk_tokens and kv_tokens against the budget.
    reserve_bytes: the actual GPU's reserve, when known (engine/runtime/reserve.py measures it);
    reserve_source: where that figure came from, for the plan to say (by default: the reference card's
    estimate for the default reserve, GIVEN_RESERVE_SOURCE for another figure).
    """
    if preset not in PRESETS:
        raise PlanError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise PlanError(f"the VRAM budget must be a positive number of bytes, not {budget_bytes!r}")
    if (custom is not None) != (preset == "custom"):
        raise PlanError(
            f"custom values go with the custom preset, and the custom preset needs them: give {', '.join(CUSTOM_KEYS)}"
        )
    if reserve_source is None:
        reserve_source = (
            DEFAULT_RESERVE_SOURCE if reserve_bytes == DEFAULT_RUNTIME_RESERVE_BYTES else GIVEN_RESERVE_SOURCE
        )
    if preset == "custom":
        plan = _custom_plan(footprint, budget_bytes, custom, reserve_bytes)
    else:
        policy = _auto_policy(footprint, budget_bytes, reserve_bytes) if preset == "auto" else preset
        plan = _preset_plan(footprint, budget_bytes, preset, policy, reserve_bytes)
    return replace(plan, reserve_source=reserve_source)


def _workspace(footprint: ModelFootprint, chunk_tokens: int) -> int:
    return prefill_workspace(footprint.config, chunk_tokens)["total"]


def _kv_target(footprint: ModelFootprint) -> int:
    return min(TARGET_PROMPT_TOKENS + REPLY_RESERVE_TOKENS, footprint.max_context)


def _min_kv(footprint: ModelFootprint) -> int:
    return min(MIN_KV_TOKENS, footprint.max_context)


def _fixed_bytes(footprint: ModelFootprint, layers: int, reserve_bytes: int) -> int:
    """What a plan spends before any KV cache or workspace."""
    return footprint.resident_bytes + footprint.gdn_state_bytes + reserve_bytes + layers * footprint.expert_layer_bytes


def _auto_policy(footprint: ModelFootprint, budget: int, reserve_bytes: int) -> str:
    """The rules auto applies to a budget: 12gb's, or 4gb's below the point where they pay.

    12gb's rules (two or more cache layers) start once two layers fit beside the KV
    target and the largest chunk; below that one layer leaves the memory to a bigger chunk,
    which speeds prefill far more than a second layer of slots would.
    """
    needed = (
        _fixed_bytes(footprint, RULES["12gb"].min_layers, reserve_bytes)
        + _workspace(footprint, RULES["12gb"].max_chunk)
        + _kv_target(footprint) * footprint.kv_bytes_per_token
    )
    return "12gb" if needed <= budget else "4gb"


def _preset_plan(footprint: ModelFootprint, budget: int, preset: str, policy: str, reserve_bytes: int) -> MemoryPlan:
    """KV for the target prompt first, then the largest chunk, then (12gb) cache layers, then more KV.

    Each step only starts once the one before is complete, so a bigger budget never gives a
    smaller prompt, chunk or cache.
    """
    rule = RULES[policy]
    per_token, layer_bytes = footprint.kv_bytes_per_token, footprint.expert_layer_bytes
    layers = rule.min_layers
    free = budget - _fixed_bytes(footprint, layers, reserve_bytes)
    kv_target, min_kv = _kv_target(footprint), _min_kv(footprint)
    needed = _workspace(footprint, PREFILL_CHUNK_MIN) + min_kv * per_token
    if free < needed:
        raise PlanError(_does_not_fit(footprint, budget, preset, layers, reserve_bytes, min_kv))
    choices = [c for c in PREFILL_CHUNK_CHOICES if c <= rule.max_chunk]
    fitting = [c for c in choices if _workspace(footprint, c) + kv_target * per_token <= free]
    chunk = fitting[-1] if fitting else PREFILL_CHUNK_MIN
    if not fitting:  # the target prompt is out of reach: all that is left goes to KV
        kv_tokens = _whole_blocks((free - _workspace(footprint, chunk)) // per_token)
    elif chunk < rule.max_chunk:  # memory short of the next chunk size stays as headroom
        kv_tokens = kv_target
    else:
        spare = free - _workspace(footprint, chunk) - kv_target * per_token
        if rule.fills_layers:
            added = min(footprint.moe_layers - layers, spare // layer_bytes)
            layers += added
            spare -= added * layer_bytes
            if layers < footprint.moe_layers:  # less than a layer left over: headroom, so KV stays monotonic
                spare = 0
        kv_tokens = kv_target + _whole_blocks(spare // per_token)
    return _plan(
        footprint,
        budget,
        preset,
        policy,
        layers,
        False,  # no preset overlaps prefill with expert streaming: measured slower (docs/PLANNER.md)
        chunk,
        min(kv_tokens, footprint.max_context),
        reserve_bytes,
    )


def _whole_blocks(tokens: int) -> int:
    return tokens // KV_TOKEN_GRANULE * KV_TOKEN_GRANULE


def _plan(
    footprint: ModelFootprint,
    budget: int,
    preset: str,
    policy: str,
    layers: int,
    overlap: bool,
    chunk: int,
    kv_tokens: int,
    reserve_bytes: int,
) -> MemoryPlan:
    breakdown = {
        "resident_weights": footprint.resident_bytes,
        "expert_cache": layers * footprint.expert_layer_bytes,
        "kv_cache": kv_tokens * footprint.kv_bytes_per_token,
        "gdn_state": footprint.gdn_state_bytes,
        "prefill_workspace": _workspace(footprint, chunk),
        "runtime_reserve": reserve_bytes,
    }
    breakdown["total"] = sum(breakdown.values())
    return MemoryPlan(
        model=footprint.name,
        preset=preset,
        policy=policy,
        budget_bytes=budget,
        expert_cache_layers=layers,
        expert_slots=layers * footprint.experts_per_layer,
        prefill_overlap=overlap,
        prefill_chunk_tokens=chunk,
        kv_tokens=kv_tokens,
        max_prompt_tokens=min(kv_tokens, footprint.max_context) - REPLY_RESERVE_TOKENS,
        breakdown=breakdown,
        kv_cache=footprint.kv_cache,
    )


def _custom_plan(footprint: ModelFootprint, budget: int, custom: dict, reserve_bytes: int) -> MemoryPlan:
    missing = [k for k in CUSTOM_KEYS if k not in custom]
    unknown = sorted(set(custom) - set(CUSTOM_KEYS))
    if missing or unknown:
        raise PlanError(
            f"a custom plan takes exactly {', '.join(CUSTOM_KEYS)}"
            + (f"; missing {', '.join(missing)}" if missing else "")
            + (f"; unknown {', '.join(unknown)}" if unknown else "")
        )
    layers = _whole_number(
        custom, "expert_cache_layers", 1, footprint.moe_layers, f"the model has {footprint.moe_layers} MoE layers"
    )
    chunk = _whole_number(custom, "prefill_chunk_tokens", 1, None, "")
    kv_tokens = _whole_number(
        custom,
        "kv_tokens",
        REPLY_RESERVE_TOKENS + 1,
        footprint.max_context,
        f"a prompt needs room beside the {REPLY_RESERVE_TOKENS}-token reply reserve, "
        f"and the model reads at most {footprint.max_context:,} positions",
    )
    overlap = custom["prefill_overlap"]
    if not isinstance(overlap, bool):
        raise PlanError(f"prefill_overlap must be true or false, not {overlap!r}")
    if overlap and layers < OVERLAP_MIN_LAYERS:
        raise PlanError(
            f"prefill overlap streams layer i+1 into a second layer of slots while layer i computes, "
            f"so it needs at least {OVERLAP_MIN_LAYERS} expert-cache layers; this plan has {layers}: "
            f"set expert_cache_layers to {OVERLAP_MIN_LAYERS} or more, or prefill_overlap to false"
        )
    plan = _plan(footprint, budget, "custom", "custom", layers, overlap, chunk, kv_tokens, reserve_bytes)
    if plan.headroom_bytes < 0:
        raise PlanError(_custom_over_budget(footprint, plan))
    return plan


def _whole_number(custom: dict, key: str, low: int, high: int | None, why: str) -> int:
    value = custom[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bounds = f"from {low:,} to {high:,}" if high is not None else f"of at least {low:,}"
        raise PlanError(f"{key} must be a whole number {bounds}, not {value!r}" + (f" ({why})" if why else ""))
    return value


# ---- messages ------------------------------------------------------------------------------


def _layers(n: int) -> str:
    return f"{n} layer" if n == 1 else f"{n} layers"


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _size(n: int) -> str:
    return _gib(n) if abs(n) >= GIB else f"{n / MIB:.1f} MiB"


def _does_not_fit(
    footprint: ModelFootprint, budget: int, preset: str, layers: int, reserve_bytes: int, min_kv: int
) -> str:
    workspace = _workspace(footprint, PREFILL_CHUNK_MIN)
    kv = min_kv * footprint.kv_bytes_per_token
    needed = _fixed_bytes(footprint, layers, reserve_bytes) + workspace + kv
    hint = (
        "try the 4gb preset (one cache layer, no overlap) or free GPU memory"
        if layers > 1
        else "free GPU memory, use a card with more, or a more compact build of this model"
    )
    parts = {
        "resident weights": footprint.resident_bytes,
        f"expert cache of {_layers(layers)}": layers * footprint.expert_layer_bytes,
        "GDN state": footprint.gdn_state_bytes,
        "runtime reserve": reserve_bytes,
        f"prefill workspace for {PREFILL_CHUNK_MIN}-token chunks": workspace,
        f"KV cache for {min_kv:,} tokens": kv,
    }
    listed = ", ".join(f"{label} {_size(n)}" for label, n in parts.items() if n)
    return (
        f"{footprint.name} does not fit {_gib(budget)} with the {preset} preset: it needs at least "
        f"{_gib(needed)} ({listed}), {_size(needed - budget)} more than the budget; {hint}"
    )


def _custom_over_budget(footprint: ModelFootprint, plan: MemoryPlan) -> str:
    over = -plan.headroom_bytes
    parts = ", ".join(f"{BREAKDOWN_LABELS[k]} {_size(plan.breakdown[k])}" for k in BREAKDOWN_LABELS)
    fixes = []
    kv_fits = _whole_blocks((plan.breakdown["kv_cache"] - over) // footprint.kv_bytes_per_token)
    if kv_fits > REPLY_RESERVE_TOKENS:
        fixes.append(f"lower kv_tokens to at most {kv_fits:,}")
    fewest_layers = OVERLAP_MIN_LAYERS if plan.prefill_overlap else 1
    layers_fit = plan.expert_cache_layers - math.ceil(over / footprint.expert_layer_bytes)
    if layers_fit >= fewest_layers:
        fixes.append(f"lower expert_cache_layers to at most {layers_fit}")
    smaller_chunks = [
        c
        for c in PREFILL_CHUNK_CHOICES
        if c < plan.prefill_chunk_tokens and plan.breakdown["prefill_workspace"] - _workspace(footprint, c) >= over
    ]
    if smaller_chunks:
        fixes.append(f"lower prefill_chunk_tokens to at most {smaller_chunks[-1]:,}")
    advice = " or ".join(fixes) if fixes else "no single setting fits this budget: change several, or free GPU memory"
    return (
        f"the custom plan for {footprint.name} needs {_gib(plan.breakdown['total'])} but the budget is "
        f"{_gib(plan.budget_bytes)} ({_size(over)} over): {parts}; {advice}"
    )
