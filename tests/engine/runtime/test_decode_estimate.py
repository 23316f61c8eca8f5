"""A plan's expected decode speed (engine/runtime/decode_estimate.py): its hit rate is the benchmark's locality
routing through the slot table's rule, checked against the H200's measured decode hit rates on the real layout,
and its speed the GPU step plus the misses' copies."""

import json
import random

import numpy as np
import pytest
from locations import ROOT

from engine.experts.policy import HybridBalance
from engine.experts.routing import ForcedRouting
from engine.kernels.slot_table import SlotTable
from engine.runtime import decode_estimate as de
from engine.runtime.footprint import footprint_from_synthetic
from engine.runtime.planner import GIB, plan_memory
from engine.runtime.step_model import CARDS, Card

MODEL = "qwen3.6-35b-a3b-nvfp4"
RESULTS = ROOT / "docs" / "results"
HIT_RATE_TOLERANCE = 0.05  # the estimate's hit rate against a measured one, either way
# (results file, decode backend) of every locality decode the H200 measured on the real layout at 128 tokens
MEASURED = (
    ("2026-12-04/bench_8gb_chat.json", "hybrid"),
    ("2026-12-04/bench_8gb_chat.json", "auto"),  # auto's trial chose offload
    ("2026-12-04/bench_8gb_long-context.json", "hybrid"),
    ("2026-12-02/bench_12gb.json", "offload"),
    ("2026-12-02/bench_12gb.json", "hybrid"),
    ("2026-12-02/bench_8gb.json", "offload"),
    ("2026-12-02/bench_8gb.json", "hybrid"),
    ("2026-12-02/bench_4gb.json", "offload"),
    ("2026-12-02/bench_4gb.json", "hybrid"),
)


@pytest.fixture(scope="module")
def footprint():
    return footprint_from_synthetic(MODEL)


def custom_plan(footprint, layers: int, budget: int = 64 * GIB):
    custom = {"expert_cache_layers": layers, "prefill_overlap": False, "prefill_chunk_tokens": 2048, "kv_tokens": 8192}
    return plan_memory(footprint, budget, "custom", custom)


def test_the_depths_are_the_locality_routings_own():
    for experts in (256, 8):
        routing = ForcedRouting("locality", [0], experts, 2, "cpu")
        starts = de.depth_starts(routing)
        draws = [*random.Random(0).sample(range(de.DRAWS), 5000), 0, de.DRAWS - 1, *starts, *(starts[1:] - 1)]
        assert de.depths_of(np.array(draws), starts).tolist() == [routing.depth(int(d)) for d in draws]


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_the_cache_follows_the_slot_tables_rule(fraction):
    """The same calls through SlotTable.lookup and through lru_counts: the same hits, copies and CPU misses."""
    rng = random.Random(1)
    calls = [rng.sample(range(40), 4) for _ in range(3000)]
    held, slots, counted_from = [3, 1, 4, 15, 9, 26], 12, 100
    cpu = HybridBalance(fraction).counts(4)
    table, expected = SlotTable.empty(slots), [0, 0, 0]
    for key in held:
        table.lookup([key])
    for index, call in enumerate(calls):
        table.reserve(len(call))
        found, misses = table.lookup(call, lambda m: m - cpu[m])
        placed = sum(found[j] is not None for j in misses)
        if index >= counted_from:
            for i, n in enumerate((len(call) - len(misses), placed, len(misses) - placed)):
                expected[i] += n
    assert list(de.lru_counts(calls, slots, cpu, held, counted_from)) == expected


def test_the_fast_routing_hits_as_the_routing_itself_does_through_the_slot_table():
    """ForcedRouting's own steps through the project's SlotTable, long enough to be exact to ~0.01, against the
    estimate's numpy run of the same model on a small shape."""
    layers, experts, top_k, tokens = 8, 64, 4, 1500
    for slots in (48, 160):
        routing = ForcedRouting("locality", list(range(layers)), experts, top_k, "cpu", seed=7)
        table, hits, lookups = SlotTable.empty(slots), 0, 0
        for token in range(tokens):
            for layer, ids in enumerate(routing.step_ids.tolist()):
                table.reserve(top_k)
                _, misses = table.lookup([layer * experts + e for e in ids])
                if token >= de.WARM_TOKENS:
                    hits, lookups = hits + top_k - len(misses), lookups + top_k
            routing.advance()
        assert de.expected_hit_rate(slots, layers, experts, top_k) == pytest.approx(hits / lookups, abs=0.03)


@pytest.mark.parametrize(("results", "backend"), MEASURED)
def test_the_hit_rate_is_the_measured_one_on_the_real_layout(footprint, results, backend):
    """The H200's decodes (a 4,096-token prompt, then 128 tokens under locality routing): offload copies every miss;
    hybrid leaves the CPU its settled fraction of each layer's misses, which take no slot and are not counted."""
    run = json.loads((RESULTS / results).read_text())
    row = next(r for r in run["runs"] if r["routing"] == "locality")
    decode = row["decode_by_backend"][backend]
    fraction = decode.get("decode_hybrid_cpu_fraction", 0.0) if backend == "hybrid" else 0.0
    if backend == "auto":
        assert decode["decode_auto_trial"]["chosen"] == "offload"
    shape = (footprint.moe_layers, footprint.experts_per_layer, footprint.config.num_experts_per_tok)
    estimated = de.expected_hit_rate(run["plan"]["expert_slots"], *shape, fraction)
    assert estimated == pytest.approx(decode["decode_expert_cache_hit_rate"], abs=HIT_RATE_TOLERANCE)


def test_the_8gb_uses_hit_as_measured(footprint):
    """The issue's two 8gb figures: chat's 10 cache layers (2,560 slots) hit 0.790 and long context's 2 (512)
    0.411, both under hybrid; offload's 2,560 slots hit 0.789 (auto chose it), 512 slots 0.167 (2026-12-02)."""
    shape = (footprint.moe_layers, footprint.experts_per_layer, footprint.config.num_experts_per_tok)
    tolerance = HIT_RATE_TOLERANCE
    assert de.expected_hit_rate(2560, *shape, 0.5) == pytest.approx(0.790, abs=tolerance)
    assert de.expected_hit_rate(512, *shape, 0.59375) == pytest.approx(0.411, abs=tolerance)
    assert de.expected_hit_rate(2560, *shape) == pytest.approx(0.789, abs=tolerance)
    assert de.expected_hit_rate(512, *shape) == pytest.approx(0.167, abs=tolerance)


def test_more_cache_slots_hit_more_and_decode_faster(footprint):
    estimates = [de.estimate_decode(custom_plan(footprint, layers), footprint) for layers in (1, 2, 5, 10, 20, 39)]
    hit_rates = [e.hit_rate for e in estimates]
    speeds = [e.tokens_per_s for e in estimates]
    assert hit_rates == sorted(hit_rates) and len(set(hit_rates)) == len(hit_rates)
    assert speeds == sorted(speeds) and len(set(speeds)) == len(speeds)
    assert len({e.gpu_step_seconds for e in estimates}) == 1  # the GPU computes every expert from its slots


def test_a_plan_caching_every_expert_decodes_at_the_gpu_step(footprint):
    plan = custom_plan(footprint, footprint.moe_layers)
    given = de.estimate_decode(plan, footprint, gpu_step_seconds=6.03e-3)
    assert given.hit_rate == 1.0 and given.transfer_seconds == 0.0
    assert given.tokens_per_s == pytest.approx(1 / 6.03e-3)
    modelled = de.estimate_decode(plan, footprint)
    assert modelled.tokens_per_s == pytest.approx(1 / de.card_step_seconds(footprint, de.card_for(plan)))


def test_the_estimate_adds_the_misses_copies_to_the_step(footprint):
    plan = plan_memory(footprint, 8 * GIB, "8gb", use="chat")
    estimate = de.estimate_decode(plan, footprint, gpu_step_seconds=0.010, link_bytes_per_s=20e9)
    record = footprint.expert_layer_bytes / footprint.experts_per_layer
    misses = (1 - estimate.hit_rate) * footprint.moe_layers * footprint.config.num_experts_per_tok * record
    assert estimate.tokens_per_s == pytest.approx(1 / (0.010 + misses / 20e9))
    assert estimate.link_bytes_per_s == 20e9 and "as given" in estimate.assumes


def test_the_card_is_the_presets_or_the_largest_the_budget_reaches(footprint):
    by_preset = {card.preset: card for card in CARDS}
    for preset in ("4gb", "8gb", "12gb"):
        plan = plan_memory(footprint, int(preset.removesuffix("gb")) * GIB, preset)
        assert de.card_for(plan) == by_preset[preset]
        estimate = de.estimate_decode(plan, footprint)
        assert estimate.link_bytes_per_s == by_preset[preset].pcie_bytes_per_s
        assert by_preset[preset].name in estimate.assumes and "offload" in estimate.assumes
    assert de.card_for(plan_memory(footprint, 24 * GIB, "auto")) == by_preset["12gb"]
    assert de.card_for(custom_plan(footprint, 2, budget=10 * GIB)) == by_preset["8gb"]
    assert de.card_for(custom_plan(footprint, 1, budget=3 * GIB + GIB // 2)) == by_preset["4gb"]


def test_the_gpu_step_is_the_measured_one_at_its_gpus_bandwidth(footprint):
    h200 = Card("H200", "12gb", 4.8e12, 55e9, 16, 0.0, 0.0, "")
    assert de.card_step_seconds(footprint, h200) == pytest.approx(de.MEASURED_STEP_SECONDS)
    laptop = next(card for card in CARDS if card.preset == "8gb")
    assert de.card_step_seconds(footprint, laptop) > de.MEASURED_STEP_SECONDS  # a quarter of a TB/s
