"""The bench's step model and its projection onto other cards (engine/bench_projection.py): the formulas on
numbers worked by hand, the check against a run, and what a projection claims."""

import pytest

from engine import bench_projection as bp
from engine.runtime.footprint import footprint_from_synthetic

MODEL = "qwen3.6-35b-a3b-nvfp4"


@pytest.fixture(scope="module")
def footprint():
    return footprint_from_synthetic(MODEL)


def test_transfer_takes_the_backends_rate():
    assert bp.transfer_seconds(10e9, 5e9, 20e9, "offload") == pytest.approx(2.0)
    assert bp.transfer_seconds(10e9, 5e9, 20e9, "cpu") == pytest.approx(0.5)
    assert bp.transfer_seconds(10e9, 5e9, 20e9, "hybrid") == pytest.approx(0.4)  # both at once: 25 GB/s
    assert bp.transfer_seconds(10e9, 5e9, None, "cpu") == float("inf")  # no CPU path measured


def test_a_decode_step_adds_the_transfer_to_the_gpu_step():
    # 570 MB of misses at 6.5 GB/s (87.7 ms) after a 6 ms GPU step
    assert bp.decode_step_seconds(0.006, 570e6, 6.5e9, None, "offload") == pytest.approx(0.006 + 570 / 6500)


def test_missed_share_counts_what_the_cpu_computed():
    assert bp.missed_share({"decode_expert_cache_hit_rate": 0.25}) == 0.75
    assert bp.missed_share({"decode_expert_cache_hit_rate": 1.0, "decode_cpu_expert_share": 0.9}) == 0.9
    auto = {"decode_auto_trial": {"chosen": "cpu"}}
    assert bp.backend_used(auto, "auto", "hybrid") == "cpu"
    assert bp.backend_used({}, None, "hybrid") == "hybrid"


def test_prefill_sums_or_overlaps_each_chunk_including_the_last_short_one():
    # 2,500 tokens in chunks of 1,000: two full chunks and one of 500, 2 s of transfer each
    serial = bp.prefill_seconds(2500, 1000, 10e9, 5e9, 0.001, overlap=False)
    assert serial == pytest.approx(3 * 2.0 + 2.5)
    overlapped = bp.prefill_seconds(2500, 1000, 10e9, 5e9, 0.003, overlap=True)
    assert overlapped == pytest.approx(3.0 + 3.0 + 2.0)  # compute-bound, compute-bound, the link's


def test_the_gpu_step_keeps_the_fixed_cost_and_reads_at_the_cards_bandwidth():
    card = bp.Card("test", "4gb", 100e9, 1e9, 8, 50e9, 1e12, "")
    run_bytes = 2.4e9  # 0.5 ms at 4.8 TB/s
    assert bp.card_gpu_step(0.006, run_bytes, 4.8e12, 1e9, card) == pytest.approx(0.0055 + 0.010)
    assert bp.run_vram_bytes_per_s({"device_name": "NVIDIA H200"}) == 4.8e12
    # an unknown GPU: its whole step counts as fixed cost
    assert bp.card_gpu_step(
        0.006, run_bytes, bp.run_vram_bytes_per_s({"device_name": "?"}), 1e9, card
    ) == pytest.approx(0.006 + 0.010)


def test_cpu_rate_is_the_threads_until_the_dram_runs_out():
    card = bp.Card("test", "4gb", 100e9, 1e9, 8, 50e9, 1e12, "")
    assert bp.card_cpu_rate(card, 4e9) == pytest.approx(32e9)
    assert bp.card_cpu_rate(card, 5e9) == pytest.approx(bp.DRAM_EFFICIENCY * 50e9)  # 40 > 35 GB/s


def test_gpu_bytes_a_token_are_the_resident_weights_the_hits_and_the_kv(footprint):
    record = footprint.expert_layer_bytes / footprint.experts_per_layer
    none = bp.gpu_bytes_per_token(footprint, 0.0, 0)
    assert none == footprint.resident_bytes
    all_hits = bp.gpu_bytes_per_token(footprint, 1.0, 1000)
    assert all_hits - none == pytest.approx(40 * 8 * record + 1000 * footprint.kv_bytes_per_token)


def test_a_prompt_token_multiplies_about_the_three_billion_weights_the_name_says(footprint):
    weights = bp.matmul_weights_per_token(footprint)
    with_head = weights + footprint.config.vocab_size * footprint.config.hidden_size  # A3B counts the LM head
    assert 2.7e9 < with_head < 3.3e9
    c = footprint.config
    routed = 40 * 3 * c.hidden_size * 8 * c.moe_intermediate_size
    assert weights > routed  # projections and the shared expert come on top


def run_result(preset="4gb", slow=1.0, pageable=False):
    """A bench result at `preset` whose decodes are `slow` times the formula's own time (1.0: exactly it)."""
    footprint = footprint_from_synthetic(MODEL)
    record = footprint.expert_layer_bytes / footprint.experts_per_layer
    gpu_step, pcie, cpu = 0.006, 50e9, 60e9
    decodes = {}
    for backend, hit, share in (("offload", 0.1, 0.0), ("cpu", 1.0, 0.95)):
        miss = max(1 - hit, share) * 40 * 8 * record
        modelled = 1 / bp.decode_step_seconds(gpu_step, miss, pcie, cpu, backend)
        decodes[backend] = {
            "decode_tokens_per_s": modelled / slow,
            "decode_expert_cache_hit_rate": hit,
            "decode_cpu_expert_share": share,
        }
    chunk_bytes = 40 * footprint.expert_layer_bytes
    prefill_4096 = 4096 / (4 * chunk_bytes / pcie + 4096 * 0.0002)  # 0.2 ms a token beside the link
    return {
        "model": MODEL,
        "device_name": "NVIDIA H200",
        "expert_backend": "hybrid",
        "pageable_experts": pageable,
        "gpu_step_seconds": gpu_step,
        "expert_link_bytes_per_s": pcie,
        "calibration": {"cpu_bytes_per_s": cpu, "cpu_threads": 16, "pageable_bytes_per_s": 5e9},
        "plan": {"preset": preset, "prefill_chunk_tokens": 1024, "prefill_overlap": False},
        "runs": [
            {
                "prompt_tokens": 4096,
                "routing": "uniform",
                "decode_tokens": 128,
                "prefill_tokens_per_s": prefill_4096,
                "decode_by_backend": decodes,
            },
            {
                "prompt_tokens": 2048,
                "routing": "uniform",
                "prefill_tokens_per_s": 2048 / (2 * chunk_bytes / pcie + 2048 * 0.0002 * slow),
            },
            {
                "prompt_tokens": 4096,
                "routing": "fixed",
                "decode_tokens": 128,
                "decode_by_backend": {
                    "offload": {"decode_tokens_per_s": 1 / gpu_step, "decode_expert_cache_hit_rate": 1.0}
                },
            },
        ],
    }


def test_the_check_finds_no_error_where_the_run_is_the_formula(footprint):
    checked = bp.check(run_result(), footprint)
    assert [(d["routing"], d["backend"]) for d in checked["decode"]] == [("uniform", "offload"), ("uniform", "cpu")]
    assert checked["decode_error"]["max_abs_error"] == pytest.approx(0.0, abs=1e-9)
    assert checked["prefill_compute_seconds_per_token"] == pytest.approx(0.0002)
    assert checked["prefill_error"]["max_abs_error"] == pytest.approx(0.0, abs=1e-9)


def test_the_check_states_how_far_off_a_slower_run_is(footprint):
    checked = bp.check(run_result(slow=1.25), footprint)
    assert checked["decode_error"]["median_abs_error"] == pytest.approx(0.25)
    assert checked["decode_error"]["mean_signed_error"] == pytest.approx(0.25)  # the model is optimistic
    assert checked["prefill_error"]["rows"] == 1  # the 4,096 row is the one the compute time came from
    assert checked["prefill_error"]["mean_signed_error"] > 0


def test_pageable_runs_are_checked_at_the_staged_copy_rate(footprint):
    assert bp.link_rate(run_result(pageable=True)) == 5e9
    assert bp.link_rate(run_result()) == 50e9


def test_the_projection_covers_the_cards_of_the_runs_preset_and_says_it_is_modelled(footprint):
    projected = bp.projection(run_result(preset="4gb", slow=1.25), footprint)
    assert "modelled, not measured" in projected["note"]
    (card,) = projected["cards"]
    assert card["card"]["name"].startswith("RTX 2050")
    offload = card["decode_tokens_per_s"]["uniform"]["offload"]
    assert offload["scaled_by_measured"] == pytest.approx(offload["modelled"] / 1.25)
    # the narrow link sets the offload decode: 90 % of 40 x 8 experts over 6.5 GB/s, beside the GPU step
    record = footprint.expert_layer_bytes / footprint.experts_per_layer
    assert 1 / offload["modelled"] > 0.9 * 40 * 8 * record / 6.5e9
    prefill = card["prefill_tokens_per_s"]
    assert prefill[4096]["time_to_first_token_s"] == pytest.approx(4096 / prefill[4096]["modelled"])
    assert prefill[4096]["time_to_first_token_s"] > 4 * 40 * footprint.expert_layer_bytes / 6.5e9
    assert [c["card"]["preset"] for c in bp.projection(run_result(preset="12gb"), footprint)["cards"]] == ["12gb"]


def test_no_projection_without_a_gpu_step(footprint):
    result = run_result()
    del result["gpu_step_seconds"]
    assert bp.projection(result, footprint) is None


def test_layers_the_cache_keeps_are_not_streamed_again(footprint):
    """At 12gb prefill keeps 17 of 40 layers between chunks, so the card's modelled chunk copies 23 layers."""
    result = run_result(preset="12gb")
    assert bp.streamed_chunk_bytes(result, footprint) == 40 * footprint.expert_layer_bytes
    kept = dict(result, prefill_kept_layers=17)
    assert bp.streamed_chunk_bytes(kept, footprint) == 23 * footprint.expert_layer_bytes
    plain = bp.projection(result, footprint)["cards"][0]["prefill_tokens_per_s"][16384]["modelled"]
    keeping = bp.projection(kept, footprint)["cards"][0]["prefill_tokens_per_s"][16384]["modelled"]
    assert keeping > plain
