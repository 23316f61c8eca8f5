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

import math
from dataclasses import asdict, dataclass, replace

from engine.runtime.footprint import ModelFootprint
from engine.runtime.workspace import prefill_workspace

KIB, MIB, GIB = 2**10, 2**20, 2**30

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
# What a preset's memory is for once the 32K-token prompt is secured: chat gives the rest to expert-cache layers
# (fewer misses a decoded token), long-context to the KV cache and the largest prefill chunks.
USES = ("chat", "long-context")
DEFAULT_USE = "chat"
CHAT_MAX_CHUNK = 2048  # a chat's prompts are short: memory a bigger chunk would take buys cache layers
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
    use: str = DEFAULT_USE  # what the memory beyond the target prompt went to (USES); "custom" for a custom plan

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
            f"{self.model} {self.preset} for {self.use}: {_layers(self.expert_cache_layers)} of experts "
            f"({self.expert_slots:,} slots), overlap {'on' if self.prefill_overlap else 'off'}, "
            f"chunk {self.prefill_chunk_tokens}, "
            f"KV {self.kv_tokens:,} tokens ({self.kv_cache}), prompts up to {self.max_prompt_tokens:,} tokens; "
            f"{_gib(self.breakdown['total'])} of {_gib(self.budget_bytes)}; runtime reserve {self.reserve_source}"
        )

    def format_table(self) -> str:
        policy = f" (rules of {self.policy})" if self.policy != self.preset else ""
        experts_per_layer = self.expert_slots // self.expert_cache_layers
        lines = [
            f"{self.model}, preset {self.preset}{policy} for {self.use}, budget {_gib(self.budget_bytes)}",
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
    long_chunk: int  # the largest prefill chunk a long-context plan buys before it gives the rest to KV
    chat_layers: bool = True  # whether a chat plan buys cache layers with the rest (else it goes to KV)

    def for_use(self, use: str) -> tuple[bool, int]:
        """Whether memory left after the KV target and the largest chunk buys cache layers, and that chunk."""
        if use == "chat":
            return self.chat_layers, min(self.long_chunk, CHAT_MAX_CHUNK)
        return False, self.long_chunk


# 4gb keeps 2,048-token chunks and gives what is left to the prompt, whatever the use: less than a layer is left;
# with more memory a long context is worth bigger chunks (fewer expert bytes a prompt token), a chat cache layers,
# which prefill keeps instead of recopying (experts/cache.py) and decode hits.
RULES = {
    "4gb": _Rule(min_layers=1, long_chunk=2048, chat_layers=False),  # the field report's fix, made official
    "8gb": _Rule(min_layers=2, long_chunk=PREFILL_CHUNK_MAX),
    "12gb": _Rule(min_layers=2, long_chunk=PREFILL_CHUNK_MAX),
}


def plan_memory(
    footprint: ModelFootprint,
    budget_bytes: int,
    preset: str,
    custom: dict | None = None,
    *,
    reserve_bytes: int = DEFAULT_RUNTIME_RESERVE_BYTES,
    reserve_source: str | None = None,
    use: str = DEFAULT_USE,
) -> MemoryPlan:
    """A plan that fits budget_bytes, or PlanError saying what is needed, what is there and what to change.

    preset: "4gb" one layer of expert slots at least, "8gb" and "12gb" two; each secures the KV of a 32K-token
    prompt first, then spends the rest as `use` says: "chat" on 2,048-token chunks and cache layers,
    "long-context" on the preset's largest chunk and KV (no preset overlaps prefill: it ran slower,
    docs/PLANNER.md); "auto" chooses between 4gb's and 12gb's rules from the budget (pass the GPU's free
    memory); "custom" checks `custom`'s expert_cache_layers, prefill_overlap, prefill_chunk_tokens and
    kv_tokens against the budget, whatever `use` is.
    reserve_bytes: the actual GPU's reserve, when known (engine/runtime/reserve.py measures it);
    reserve_source: where that figure came from, for the plan to say (by default: the reference card's
    estimate for the default reserve, GIVEN_RESERVE_SOURCE for another figure).
    """
    if preset not in PRESETS:
        raise PlanError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if use not in USES:
        raise PlanError(f"unknown use {use!r}; choose one of {', '.join(USES)}")
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
        plan = replace(_custom_plan(footprint, budget_bytes, custom, reserve_bytes), use="custom")
    else:
        policy = _auto_policy(footprint, budget_bytes, reserve_bytes, use) if preset == "auto" else preset
        plan = replace(_preset_plan(footprint, budget_bytes, preset, policy, reserve_bytes, use), use=use)
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


def _auto_policy(footprint: ModelFootprint, budget: int, reserve_bytes: int, use: str) -> str:
    """The rules auto applies to a budget: 12gb's, or 4gb's below the point where they pay.

    12gb's rules (two or more cache layers) start once two layers fit beside the KV
    target and the largest chunk; below that one layer leaves the memory to a bigger chunk,
    which speeds prefill far more than a second layer of slots would.
    """
    needed = (
        _fixed_bytes(footprint, RULES["12gb"].min_layers, reserve_bytes)
        + _workspace(footprint, RULES["12gb"].for_use(use)[1])
        + _kv_target(footprint) * footprint.kv_bytes_per_token
    )
    return "12gb" if needed <= budget else "4gb"


def _preset_plan(
    footprint: ModelFootprint, budget: int, preset: str, policy: str, reserve_bytes: int, use: str
) -> MemoryPlan:
    """KV for the target prompt first, then the largest chunk, then (chat) cache layers, then more KV.

    Each step only starts once the one before is complete, so a bigger budget never gives a
    smaller prompt, chunk or cache.
    """
    rule = RULES[policy]
    fills_layers, max_chunk = rule.for_use(use)
    per_token, layer_bytes = footprint.kv_bytes_per_token, footprint.expert_layer_bytes
    layers = rule.min_layers
    free = budget - _fixed_bytes(footprint, layers, reserve_bytes)
    kv_target, min_kv = _kv_target(footprint), _min_kv(footprint)
    needed = _workspace(footprint, PREFILL_CHUNK_MIN) + min_kv * per_token
    if free < needed:
        raise PlanError(_does_not_fit(footprint, budget, preset, layers, reserve_bytes, min_kv))
    choices = [c for c in PREFILL_CHUNK_CHOICES if c <= max_chunk]
    fitting = [c for c in choices if _workspace(footprint, c) + kv_target * per_token <= free]
    chunk = fitting[-1] if fitting else PREFILL_CHUNK_MIN
    if not fitting:  # the target prompt is out of reach: all that is left goes to KV
        kv_tokens = _whole_blocks((free - _workspace(footprint, chunk)) // per_token)
    elif chunk < max_chunk:  # memory short of the next chunk size stays as headroom
        kv_tokens = kv_target
    else:
        spare = free - _workspace(footprint, chunk) - kv_target * per_token
        if fills_layers:
            added = min(footprint.moe_layers - layers, spare // layer_bytes)
            layers += added
            spare -= added * layer_bytes
            if layers < footprint.moe_layers:  # less than a layer left over: headroom, so KV stays monotonic
                spare = 0
        kv_tokens = kv_target + _whole_blocks(spare // per_token)
        beyond_context = (kv_tokens - footprint.max_context) * per_token
        if use == "long-context" and beyond_context >= layer_bytes:  # KV for every position: the rest buys layers
            layers += min(footprint.moe_layers - layers, beyond_context // layer_bytes)
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
