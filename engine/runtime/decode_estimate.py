"""A plan's expected decode speed, before the user commits to it (issue 24): a token's GPU step plus its expected
missed experts' copies over the host-to-GPU link, as the offload backend runs them (step_model.decode_step_seconds).

The hit rate is the expert cache's under the benchmark's `locality` routing (engine/experts/routing.py): that
routing's model (its expert stacks and its draw-to-depth mapping) run for WARM_TOKENS + COUNTED_TOKENS decode
tokens through a least-recently-used cache of the plan's slots under the slot table's rule
(engine/kernels/slot_table.py), once per slot count and model shape. On the real layout it reproduces the H200's
measured decode hit rates (tests/engine/runtime/test_decode_estimate.py). The routing is modelled, not a real
model's: a real model's locality may differ.

The GPU's own step (every expert a hit) is MEASURED_STEP_SECONDS, measured for one model on one GPU; on the plan's
card its bytes are read at that card's VRAM bandwidth instead (step_model.card_gpu_step), and another model takes
the measured fixed cost a decoder layer times its own layers. The card is the preset's (step_model.CARDS), which
also gives the link's rate.

Misses computed on the CPU (the cpu and hybrid backends) are not modelled: where auto's trial finds one of them
faster on the user's machine it runs that, so the estimate is offload's and says so.
"""

from __future__ import annotations

import bisect
import functools
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from engine.experts.policy import HybridBalance
from engine.experts.routing import ForcedRouting
from engine.runtime.footprint import ModelFootprint, footprint_from_synthetic
from engine.runtime.planner import MemoryPlan, preset_budget_bytes
from engine.runtime.step_model import (
    CARDS,
    RUN_GPU_VRAM_BYTES_PER_S,
    Card,
    card_gpu_step,
    decode_step_seconds,
    gpu_bytes_per_token,
)

# The GPU's own decode step: qwen3.6-35b-a3b-nvfp4 at 12gb on an H200 with every expert a cache hit, offload backend
# (tools/gpu/decode_profile.py, docs/results/2026-12-04-s2/profile_12gb.txt, 2026-12-04).
MEASURED_STEP_SECONDS = 3.83e-3
MEASURED_STEP_MODEL = "qwen3.6-35b-a3b-nvfp4"
MEASURED_STEP_GPU = "H200"
STEP_CONTEXT_TOKENS = 4096  # the KV rows a token reads: the benchmark decodes after a 4,096-token prompt
BACKEND = "offload"  # every miss copied over the link: the backend the estimate models
# Decode tokens simulated: the first WARM_TOKENS settle the cache, the next COUNTED_TOKENS (the benchmark's decode
# length) are counted; seeds apart, the real layout's rates vary by under 0.005 at these lengths.
WARM_TOKENS = 32
COUNTED_TOKENS = 128
SEED = 0
DRAWS = 10**6  # ForcedRouting.depth maps a uniform draw in [0, DRAWS) to a stack depth


@dataclass(frozen=True)
class DecodeEstimate:
    """A plan's expected decode speed and what it rests on."""

    tokens_per_s: float
    hit_rate: float  # expected share of a token's routed experts found in the GPU's expert cache
    gpu_step_seconds: float  # the GPU's own step, every expert a hit
    transfer_seconds: float  # a token's missed experts over the link
    link_bytes_per_s: float
    card: str  # the card the figures are for
    assumes: str  # what the estimate assumes, in words


def card_for(plan: MemoryPlan) -> Card:
    """Pick the card whose figures the estimate takes: the preset's, else (auto and custom budgets) the card of the
    largest preset whose memory the budget reaches, or the smallest card below them all."""
    by_budget = sorted(CARDS, key=lambda card: preset_budget_bytes(card.preset))
    for card in by_budget:
        if card.preset == plan.preset:
            return card
    reached = [card for card in by_budget if preset_budget_bytes(card.preset) <= plan.budget_bytes]
    return reached[-1] if reached else by_budget[0]


@functools.cache
def _measured_footprint() -> ModelFootprint:
    """Read the footprint of the model whose GPU step was measured."""
    return footprint_from_synthetic(MEASURED_STEP_MODEL)


def card_step_seconds(footprint: ModelFootprint, card: Card, context_tokens: int = STEP_CONTEXT_TOKENS) -> float:
    """Model the GPU's own decode step (every expert a hit) of `footprint` on `card`: the measured step's fixed cost
    (launches, synchronisation) scaled by decoder layers, and the model's bytes read at the card's VRAM bandwidth."""
    measured = _measured_footprint()
    vram = RUN_GPU_VRAM_BYTES_PER_S[MEASURED_STEP_GPU]
    fixed = MEASURED_STEP_SECONDS - gpu_bytes_per_token(measured, 1.0, context_tokens) / vram
    own_bytes = gpu_bytes_per_token(footprint, 1.0, context_tokens)  # offload computes every expert from VRAM
    layers = footprint.config.num_hidden_layers / measured.config.num_hidden_layers
    return card_gpu_step(fixed * layers + own_bytes / vram, own_bytes, vram, own_bytes, card)


def estimate_decode(
    plan: MemoryPlan,
    footprint: ModelFootprint,
    gpu_step_seconds: float | None = None,
    link_bytes_per_s: float | None = None,
) -> DecodeEstimate:
    """Estimate `plan`'s decode tokens/s for `footprint`: the GPU's step (given, else card_step_seconds on the
    plan's card) plus (1 - expected hit rate) x MoE layers x top-k records over the link (given, else the card's)."""
    card = card_for(plan)
    top_k = footprint.config.num_experts_per_tok
    hit_rate = expected_hit_rate(plan.expert_slots, footprint.moe_layers, footprint.experts_per_layer, top_k)
    step = card_step_seconds(footprint, card) if gpu_step_seconds is None else gpu_step_seconds
    link = card.pcie_bytes_per_s if link_bytes_per_s is None else link_bytes_per_s
    record = footprint.expert_layer_bytes / max(footprint.experts_per_layer, 1)  # a dense model misses nothing
    miss_bytes = (1.0 - hit_rate) * footprint.moe_layers * top_k * record
    seconds = decode_step_seconds(step, miss_bytes, link, None, BACKEND)
    where = (
        "as given"
        if gpu_step_seconds is not None
        else f"{MEASURED_STEP_SECONDS * 1e3:.2f} ms measured for {MEASURED_STEP_MODEL} on an {MEASURED_STEP_GPU}, "
        f"its bytes read at this card's {card.vram_bytes_per_s / 1e9:,.0f} GB/s"
    )
    assumes = (
        f"the offload backend (every missed expert copied to the GPU; auto runs hybrid or cpu where its trial "
        f"finds them faster) on a card like the {card.name}, a link of {link / 1e9:,.1f} GB/s; expert-cache hits "
        f"{hit_rate:.0%} under the benchmark's modelled routing locality (not a real model's routing); the GPU's "
        f"own step {step * 1e3:.1f} ms ({where}), the misses' copies {(seconds - step) * 1e3:.1f} ms a token"
    )
    return DecodeEstimate(1.0 / seconds, hit_rate, step, seconds - step, link, card.name, assumes)


@functools.lru_cache(maxsize=512)
def expected_hit_rate(slots: int, layers: int, experts: int, top_k: int, cpu_fraction: float = 0.0) -> float:
    """Compute the decode hit rate of an expert cache of `slots` slots over `layers` MoE layers of `experts`, top-k
    routing, under the `locality` routing, as the benchmark counts it: hits / (hits + misses copied in). With a
    `cpu_fraction`, hybrid's share of each layer's misses (HybridBalance.counts) goes to the CPU, takes no slot and
    is not counted."""
    if slots >= layers * experts:
        return 1.0  # every expert resident: nothing misses once warm
    if slots <= 0:
        return 0.0
    stacks, ids = _locality_routing(layers, experts, top_k)
    keys = (ids + (np.arange(layers) * experts)[None, :, None]).ravel().tolist()
    calls = (keys[start : start + top_k] for start in range(0, len(keys), top_k))  # one flat list: few objects
    # the cache starts as it settles: each layer's most recently used experts, the deepest oldest
    per_layer, extra = divmod(slots, layers)
    held = [
        layer * experts + int(stacks[layer, depth])
        for depth in range(per_layer, -1, -1)
        for layer in range(layers)
        if depth < per_layer or layer < extra
    ]
    hits, copied, _ = lru_counts(calls, slots, HybridBalance(cpu_fraction).counts(top_k), held, WARM_TOKENS * layers)
    return hits / (hits + copied) if hits + copied else 0.0


def lru_counts(
    calls: Iterable[list[int]], slots: int, cpu_counts: list[int], held: Iterable[int] = (), counted_from: int = 0
) -> tuple[int, int, int]:
    """Apply the slot table's rule (kernels/slot_table.py, SlotTable.lookup) to each call's distinct keys, in an
    ordered dict for speed: hits are touched first, then each of m misses but the last cpu_counts[m] takes the least
    recently used slot. `held` fills the cache first, oldest first. (hits, misses copied in, misses left to the
    CPU) over the calls from `counted_from` on."""
    cache = OrderedDict.fromkeys(held)
    while len(cache) > slots:
        cache.popitem(last=False)
    hits = copied = on_cpu = 0
    for index, call in enumerate(calls):
        missed = []
        for key in call:
            if key in cache:
                cache.move_to_end(key)
            else:
                missed.append(key)
        placed = len(missed) - cpu_counts[len(missed)]
        for key in missed[:placed]:
            if len(cache) >= slots:
                cache.popitem(last=False)
            cache[key] = None
        if index >= counted_from:
            hits += len(call) - len(missed)
            copied += placed
            on_cpu += len(missed) - placed
    return hits, copied, on_cpu


@functools.lru_cache(maxsize=8)
def _locality_routing(layers: int, experts: int, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Run the `locality` routing for WARM_TOKENS + COUNTED_TOKENS decode tokens: (its expert stacks at the start
    [layers, experts], most recent first; each token's experts [tokens, layers, top_k]). Each layer draws k distinct
    stack depths through ForcedRouting.depth and moves their experts, in depth order, to the stack's front, as
    ForcedRouting's own steps do; the draws are numpy's, so that every layer moves at once."""
    routing = ForcedRouting("locality", list(range(layers)), experts, top_k, "cpu", SEED)
    starts = depth_starts(routing)
    stacks = np.array(routing.stacks, dtype=np.int64)
    count = WARM_TOKENS + COUNTED_TOKENS
    drawn = _distinct_depths(np.random.default_rng(SEED), starts, count * layers, top_k).reshape(count, layers, top_k)
    rows = np.arange(layers)[:, None]
    tokens = np.empty_like(drawn)
    start = stacks.copy()
    for token, depths in zip(tokens, drawn):
        token[:] = np.take_along_axis(stacks, depths, axis=1)
        moved = np.zeros(stacks.shape, dtype=bool)
        moved[rows, depths] = True
        stacks = np.concatenate([token, stacks[~moved].reshape(layers, experts - top_k)], axis=1)
    return start, tokens


def depth_starts(routing: ForcedRouting) -> np.ndarray:
    """Find each stack depth's first draw under `routing.depth`, which rises with the draw [experts]."""
    return np.array([bisect.bisect_left(range(DRAWS), d, key=routing.depth) for d in range(routing.num_experts)])


def depths_of(draws: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Map uniform draws in [0, DRAWS) to the stack depths ForcedRouting.depth gives them, from each depth's first
    draw (`starts`, depth_starts)."""
    return np.searchsorted(starts, draws, side="right") - 1


def _distinct_depths(rng: np.random.Generator, starts: np.ndarray, rows: int, top_k: int) -> np.ndarray:
    """Draw, for each of `rows` (a layer at a token), the first top_k distinct depths of a stream of draws, ascending
    [rows, top_k]."""
    candidates = 2 * top_k + 8  # enough that a row seldom lacks k distinct ones; those go on drawing
    drawn = depths_of(rng.integers(0, DRAWS, (rows, candidates)), starts)
    first = ~((drawn[:, :, None] == drawn[:, None, :]) & np.tril(np.ones((candidates,) * 2, dtype=bool), -1)).any(2)
    keep = first & (np.cumsum(first, axis=1) <= top_k)
    chosen = np.zeros((rows, top_k), dtype=np.int64)
    done = keep.sum(axis=1) == top_k
    chosen[done] = drawn[done][keep[done]].reshape(-1, top_k)
    for row in np.flatnonzero(~done):
        found = dict.fromkeys(drawn[row].tolist())
        while len(found) < top_k:
            found.setdefault(int(depths_of(rng.integers(0, DRAWS), starts)))
        chosen[row] = list(found)
    return np.sort(chosen, axis=1)
