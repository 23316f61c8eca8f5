"""`python -m engine bench` on the CPU with the tiny synthetic model: the CI run of the benchmark."""

import json

import pytest
import torch

from engine.bench import build_random_model
from engine.cli import main
from engine.synthetic import SYNTHETIC_MODELS


def bench(argv, capsys):
    code = main(["bench", "--synthetic", "tiny", "--device", "cpu", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_report(capsys):
    code, out, err = bench(["--prompt-tokens", "40,130", "--decode-tokens", "3", "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["model"] == "tiny" and "say nothing of a real model" in result["notes"][0]
    assert result["link_limit_bytes_per_s"] is None and len(result["notes"]) == 1  # the machine's own link
    assert [r["prompt_tokens"] for r in result["runs"]] == [40, 130]
    for row in result["runs"]:
        assert row["prefill_tokens_per_s"] > 0 and row["decode_tokens_per_s"] > 0 and row["time_to_first_token_s"] > 0
    assert result["peak_process_rss_bytes"] > 0


def test_a_preset_plans_the_expert_cache_and_chunk(capsys):
    code, out, err = bench(["--preset", "4gb", "--prompt-tokens", "130", "--decode-tokens", "3", "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    (row,) = result["runs"]
    assert (
        result["plan"]["expert_cache_layers"] == 1
        and row["prefill_chunk_tokens"] == result["plan"]["prefill_chunk_tokens"]
    )
    # one layer of slots: every layer's experts stream in during prefill and evict the previous layer's
    assert row["prefill_expert_cache_hit_rate"] == 0.0 and row["prefill_expert_bytes_copied"] > 0
    assert 0.0 <= row["decode_expert_cache_hit_rate"] <= 1.0


def test_the_transformers_accelerate_baseline_row(capsys):
    """The side-by-side row: the same shape through transformers (+ accelerate on a GPU), measured after ours."""
    code, out, err = bench(["--prompt-tokens", "40", "--decode-tokens", "2", "--hf-baseline", "--json"], capsys)
    assert code == 0, err
    baseline = json.loads(out)["baseline"]
    assert baseline["baseline"].startswith("transformers + accelerate, float32")
    assert baseline["prompt_tokens"] == 40 and baseline["decode_tokens"] == 2
    assert baseline["prefill_tokens_per_s"] > 0 and baseline["decode_tokens_per_s"] > 0
    code, out, _ = bench(["--prompt-tokens", "20", "--decode-tokens", "1", "--hf-baseline"], capsys)
    assert code == 0 and "baseline, transformers + accelerate" in out and "decode" in out


def test_a_failing_baseline_keeps_the_benchmarks_own_figures(capsys, monkeypatch):
    import engine.bench as bench_module

    def failing(*args):
        raise RuntimeError("Expected all tensors to be on the same device")

    monkeypatch.setattr(bench_module, "hf_offload_row", failing)
    code, out, err = bench(["--prompt-tokens", "20", "--decode-tokens", "1", "--hf-baseline", "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["runs"][0]["decode_tokens_per_s"] > 0
    assert result["baseline"]["error"] == "RuntimeError: Expected all tensors to be on the same device"
    code, out, _ = bench(["--prompt-tokens", "20", "--decode-tokens", "1", "--hf-baseline"], capsys)
    assert code == 0 and "RuntimeError: Expected all tensors" in out


def test_table_output(capsys):
    code, out, _ = bench(["--prompt-tokens", "20", "--decode-tokens", "2"], capsys)
    assert code == 0 and "prefill tok/s" in out and "note: routing by the random routers" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt-tokens", "0"], "positive whole numbers"),
        (["--expert-backends", "pcie"], "--expert-backends takes offload, cpu, hybrid or auto"),
        (["--expert-backends", "hybrid", "--preset", "4gb"], "needs --device cuda"),
        (["--decode-tokens", "-1"], "--decode-tokens must be 0 or more"),
        (["--routing", "skewed"], "--routing takes model alone, or forced modes"),
        (["--routing", "model,uniform"], "--routing takes model alone, or forced modes"),
        (["--cpu-threads", "0"], "--cpu-threads must be 1 or more"),
        (["--link-gbps", "0"], "--link-gbps must be a positive number of GB/s (e.g. 6.5), got 0.0"),
        (["--link-gbps", "-6.5"], "--link-gbps must be a positive number of GB/s"),
        (["--link-gbps", "nan"], "--link-gbps must be a positive number of GB/s"),
        (["--link-gbps", "6.5"], "--link-gbps needs --device cuda: on the CPU no expert crosses a link"),
    ],
)
def test_bad_arguments(argv, message, capsys):
    code, _, err = bench(argv, capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "pageable, message",
    [
        (False, "--link-gbps 6.5 is not below this machine's measured pinned host->GPU rate of 6.0 GB/s"),
        (True, "--link-gbps 6.5 is not below this machine's measured pageable host->GPU rate of 4.0 GB/s"),
    ],
)
def test_a_link_limit_at_or_above_the_measured_link_is_refused_before_anything_is_built(
    pageable, message, capsys, monkeypatch
):
    import engine.bench as bench_module
    from engine.runtime import reserve

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *device: "NVIDIA H200")
    monkeypatch.setattr(
        reserve,
        "runtime_reserve",
        lambda device="cuda": reserve.measured_reserve(900 * 2**20, "NVIDIA H200", others_included=False),
    )
    monkeypatch.setattr(bench_module, "host_to_device_bandwidth", lambda pinned: 6e9 if pinned else 4e9)
    monkeypatch.setattr(bench_module, "build_random_model", lambda *args, **kwargs: pytest.fail("built"))
    code = main(["bench", "--synthetic", "tiny", "--link-gbps", "6.5", *(["--pageable"] if pageable else [])])
    _, err = capsys.readouterr()
    assert code == 2 and message in err and "give a lower rate or leave --link-gbps out" in err
    assert len(err.strip().splitlines()) == 1


def test_the_held_link_sets_the_bounds_and_ceilings():
    """The expert link the bench reports, and what its ceilings divide by, is the held rate, not the machine's."""
    from engine.bench import link_note
    from engine.bench_projection import add_ceilings
    from engine.experts.link import LinkLimit

    link = LinkLimit(6.5e9)
    assert link.through(50e9) == 6.5e9
    decode = {"decode_tokens_per_s": 20.0, "decode_expert_cache_hit_rate": 0.5}
    result = {
        "expert_link_bytes_per_s": link.through(50e9),
        "expert_backend": "offload",
        "calibration": {"cpu_bytes_per_s": 1e9},
        "runs": [{"routing": "uniform", "decode_by_backend": {"offload": decode}}],
    }
    add_ceilings(result, record_bytes=1_000_000, moe_layers=13, top_k=4, gpu_step=0.001)
    assert decode["decode_ceiling_tokens_per_s"] == pytest.approx(250.0)  # 26 MB a token at 6.5 GB/s: 4 ms
    note = link_note(link, pageable=True)
    assert "6.5 GB/s (pageable records)" in note and "CUDA graphs" in note and "not held" in note.lower()


def test_random_model_has_the_real_shapes_and_formats():
    synthetic = SYNTHETIC_MODELS["tiny"]
    model = build_random_model("tiny", "cpu", torch.float32, expert_cache_slots=None)
    assert model.layers[0].mlp.experts.stored(0)[0].format == "nvfp4"
    assert model.layers[3].mixer.qkv_proj.weights[0].format == "fp8_tensor"
    assert model.score(torch.arange(2, 30)).shape == (28, synthetic.config.vocab_size)


def test_forced_routings_run_side_by_side_and_uniform_hits_its_floor(capsys):
    """Each prompt length runs under each forced mode; under uniform routing the decode hit rate comes out at
    slots / (layers x experts), which is what makes it a floor."""
    code, out, err = bench(
        [
            "--preset",
            "4gb",
            "--prompt-tokens",
            "40",
            "--decode-tokens",
            "400",
            "--json",
            "--routing",
            "uniform,locality,fixed",
        ],
        capsys,
    )
    assert code == 0, err
    result = json.loads(out)
    assert [row["routing"] for row in result["runs"]] == ["uniform", "locality", "fixed"]
    assert any("floor" in note for note in result["notes"]) and any("modelled" in note for note in result["notes"])
    floor = result["uniform_floor_hit_rate"]
    assert floor == result["plan"]["expert_slots"] / (4 * 8)
    uniform, locality, fixed = result["runs"]
    assert abs(uniform["decode_expert_cache_hit_rate"] - floor) <= 0.05
    assert locality["decode_expert_cache_hit_rate"] > uniform["decode_expert_cache_hit_rate"] + 0.1
    assert fixed["decode_expert_cache_hit_rate"] > 0.99


def test_decode_after_measures_prefill_alone_elsewhere_without_repeating_uniform_chunks(capsys):
    code, out, err = bench(
        [
            "--preset",
            "4gb",
            "--prompt-tokens",
            "40,70",
            "--decode-after",
            "70",
            "--decode-tokens",
            "4",
            "--routing",
            "uniform,fixed,same",
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    runs = json.loads(out)["runs"]
    assert [(row["prompt_tokens"], row["routing"]) for row in runs] == [
        (40, "uniform"),
        (40, "same"),
        (70, "uniform"),
        (70, "fixed"),
        (70, "same"),
    ]
    runs = [row for row in runs if row["routing"] != "same"]
    assert "decode_tokens_per_s" not in runs[0] and runs[0]["prefill_tokens_per_s"] > 0
    assert all(row["decode_tokens_per_s"] > 0 for row in runs[1:])
    assert (
        "-"
        in main_text(
            ["--preset", "4gb", "--prompt-tokens", "40,70", "--decode-after", "70", "--decode-tokens", "2"], capsys
        ).splitlines()[-3]
    )


def main_text(argv, capsys):
    code, out, err = bench(argv, capsys)
    assert code == 0, err
    return out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt-tokens", "40", "--decode-after", "70"], "lengths from --prompt-tokens"),
        (["--prompt-tokens", "40", "--decode-after", "x"], "--decode-after takes positive whole numbers"),
        (["--prompt-tokens", "forty"], "--prompt-tokens takes positive whole numbers"),
        (["--prompt-tokens", "40", "--gpu-step-ms", "-1"], "--gpu-step-ms must be a positive"),
    ],
)
def test_bad_bench_lengths_and_steps_are_named(argv, message, capsys):
    code, out, err = bench(argv, capsys)
    assert code != 0 and message in err


def test_a_given_gpu_step_sets_the_ceilings_where_no_fixed_row_could():
    """The 4gb cache holds fewer experts than one fixed step uses over all layers, so its ceilings take the
    GPU step another run measured: the slower of the step and the missed bytes over the link."""
    from engine.bench_projection import add_ceilings

    decode = {"decode_tokens_per_s": 20.0, "decode_expert_cache_hit_rate": 0.5}
    result = {
        "expert_link_bytes_per_s": 1e9,
        "expert_backend": "offload",
        "calibration": {"cpu_bytes_per_s": 1e9},
        "runs": [{"routing": "uniform", "decode_by_backend": {"offload": decode}}],
    }
    add_ceilings(result, record_bytes=1_000_000, moe_layers=10, top_k=4)
    assert "decode_ceiling_tokens_per_s" not in decode  # no fixed row, no step given: no ceiling claimed
    add_ceilings(result, record_bytes=1_000_000, moe_layers=10, top_k=4, gpu_step=0.01)
    # 20 missed records = 20 MB a token over 1 GB/s: 20 ms, slower than the 10 ms step
    assert decode["decode_ceiling_tokens_per_s"] == pytest.approx(50.0)
    assert decode["decode_vs_ceiling"] == pytest.approx(0.4) and result["gpu_step_source"].startswith("given")


def test_experts_the_cpu_computes_count_as_read_bytes_in_the_cpu_ceiling():
    """The cpu backend reports a GPU-cache hit rate of 1 (it computes the misses itself), yet it reads those
    experts from host memory: its ceiling counts them."""
    from engine.bench_projection import add_ceilings

    decode = {"decode_tokens_per_s": 20.0, "decode_expert_cache_hit_rate": 1.0, "decode_cpu_expert_share": 0.5}
    result = {
        "expert_link_bytes_per_s": 1e9,
        "expert_backend": "cpu",
        "calibration": {"cpu_bytes_per_s": 1e9},
        "runs": [{"routing": "uniform", "decode_by_backend": {"cpu": decode}}],
    }
    add_ceilings(result, record_bytes=1_000_000, moe_layers=10, top_k=4, gpu_step=0.001)
    assert decode["decode_ceiling_tokens_per_s"] == pytest.approx(50.0)  # 20 MB at 1 GB/s: 20 ms


def test_auto_is_held_to_the_ceiling_of_the_backend_it_chose():
    from engine.bench_projection import add_ceilings

    decode = {
        "decode_tokens_per_s": 20.0,
        "decode_expert_cache_hit_rate": 1.0,
        "decode_cpu_expert_share": 0.5,
        "decode_auto_trial": {"chosen": "cpu"},
    }
    result = {
        "expert_link_bytes_per_s": 4e9,
        "expert_backend": "auto",
        "calibration": {"cpu_bytes_per_s": 1e9},
        "runs": [{"routing": "uniform", "decode_by_backend": {"auto": decode}}],
    }
    add_ceilings(result, record_bytes=1_000_000, moe_layers=10, top_k=4, gpu_step=0.001)
    assert decode["decode_ceiling_tokens_per_s"] == pytest.approx(50.0)  # the CPU's 1 GB/s, not the link's 4


def test_running_out_of_memory_before_any_row_is_said_in_one_line(capsys, monkeypatch):
    """Each prompt's row reports its own out-of-memory error; one in the build or the warm-up chunk ends the run
    with what happened and what to do, not a traceback."""
    from engine import bench as bench_module

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB.\nmore detail")

    monkeypatch.setattr(bench_module, "run_bench", no_memory)
    code, out, err = bench(["--prompt-tokens", "40", "--decode-tokens", "2"], capsys)
    assert code != 0 and out == ""
    assert "warm-up chunk" in err and "Tried to allocate 64.00 MiB" in err and "smaller --preset" in err
    assert "more detail" not in err and "Traceback" not in err
