"""Issue 22's side-by-side table and llama.cpp's VRAM fit: small fixtures in the JSON that engine/bench.py and
llama-bench write (llama-bench's field names as its json_printer prints them, tools/llama-bench/llama-bench.cpp
of the vendored llama.cpp)."""

import json

import pytest

from tools.gpu import llama_vram, side_by_side

GIB = 2**30


def llama_test(n_prompt, n_gen, threads, avg_ts, n_depth=0, n_cpu_moe=38):
    """One llama-bench JSON test object, with the fields the summariser reads among the others it prints."""
    avg_ns = int(1e9 * (n_prompt + n_gen) / avg_ts)
    return {
        "build_commit": "0c1e57098",
        "build_number": 0,
        "backends": "CUDA",
        "model_type": "qwen35moe 35B.A3B Q4_K",
        "model_size": 20937965568,
        "n_batch": 2048,
        "n_ubatch": 2048,
        "n_threads": threads,
        "n_gpu_layers": 99,
        "n_cpu_moe": n_cpu_moe,
        "flash_attn": 1,
        "n_prompt": n_prompt,
        "n_gen": n_gen,
        "n_depth": n_depth,
        "test_time": "2026-12-02T05:00:00Z",
        "avg_ns": avg_ns,
        "stddev_ns": 0,
        "avg_ts": avg_ts,
        "stddev_ts": 0.0,
        "samples_ns": [avg_ns],
        "samples_ts": [avg_ts],
    }


def bench_result(decode_by_backend, budget=4 * GIB, peak=int(3.7 * GIB)):
    """An `engine bench --json` result with uniform rows at the three prompts, decode after 4,096."""

    def run(prompt, prefill, decodes=None):
        row = {
            "prompt_tokens": prompt,
            "routing": "uniform",
            "time_to_first_token_s": prompt / prefill,
            "prefill_tokens_per_s": prefill,
            "peak_process_bytes": peak,
        }
        if decodes:
            row["decode_by_backend"] = decodes
        return row

    return {
        "plan": {"budget_bytes": budget},
        "runs": [
            run(4096, 2000.0, decode_by_backend),
            run(512, 1000.0),
            run(16384, 1500.0),
            {
                "prompt_tokens": 4096,
                "routing": "fixed",
                "time_to_first_token_s": 9.0,
                "prefill_tokens_per_s": 9.0,
                "peak_process_bytes": peak,
                "decode_by_backend": {"offload": {"decode_tokens_per_s": 999.0}},
            },
        ],
    }


@pytest.fixture
def results(tmp_path):
    """A results folder as issue22_runs.sh and issue19_runs.sh leave it, for the 4gb preset."""
    decodes = {
        "offload": {"decode_tokens_per_s": 60.0},
        "hybrid": {"decode_tokens_per_s": 80.0},
        "auto": {"decode_tokens_per_s": 79.0, "decode_auto_trial": {"chosen": "hybrid"}},
    }
    (tmp_path / "bench_4gb.json").write_text(json.dumps(bench_result(decodes)))
    prefill = [llama_test(p, 0, 16, rate) for p, rate in ((512, 400.0), (4096, 500.0), (16384, 450.0))]
    (tmp_path / "llama_4gb_prefill.json").write_text(json.dumps(prefill, indent=2))
    decode = [llama_test(0, 128, 16, 40.0, n_depth=4096)]
    (tmp_path / "llama_4gb_decode.json").write_text(json.dumps(decode, indent=2))
    (tmp_path / "llama_laptop_prefill.json").write_text(json.dumps([llama_test(4096, 0, 8, 300.0)]))
    (tmp_path / "llama_laptop_decode.json").write_text(json.dumps([llama_test(0, 128, 8, 30.0, n_depth=4096)]))
    (tmp_path / "llama_4gb_prefill.vram").write_text(f"{int(3.9 * GIB)}\n")
    (tmp_path / "llama_4gb_decode.vram").write_text(f"{int(3.5 * GIB)}\n")
    (tmp_path / "llama_4gb_fit.json").write_text(
        json.dumps({"preset": "4gb", "budget_bytes": 4 * GIB, "n_cpu_moe": 38})
    )
    return tmp_path


def test_ours_rows_are_the_fastest_fixed_backend_and_auto_under_the_routing():
    decodes = {
        "offload": {"decode_tokens_per_s": 60.0},
        "cpu": {"decode_tokens_per_s": 70.0},
        "auto": {"decode_tokens_per_s": 65.0, "decode_auto_trial": {"chosen": "cpu"}},
    }
    best, auto = side_by_side.ours_rows(bench_result(decodes), "uniform")
    assert (best.engine, best.decode) == ("MoE Desk, best backend (cpu)", 70.0)
    assert (auto.engine, auto.decode) == ("MoE Desk, auto (chose cpu)", 65.0)
    assert best.prefill == {4096: 2000.0, 512: 1000.0, 16384: 1500.0}  # not the fixed row's
    assert best.ttft[16384] == pytest.approx(16384 / 1500.0)


def test_llama_row_takes_its_thread_count_its_peak_and_ttft_from_avg_ns(results):
    row = side_by_side.llama_row(results, "4gb", 16)
    assert row.decode == 40.0
    assert row.prefill == {512: 400.0, 4096: 500.0, 16384: 450.0}
    assert row.ttft[4096] == pytest.approx(4096 / 500.0, rel=1e-6)
    assert row.peak_bytes == int(3.9 * GIB)  # the larger of the two runs
    assert "--n-cpu-moe 38" in row.engine and "16 threads" in row.engine
    assert side_by_side.llama_row(results, "4gb", 8) is None  # the 8-thread runs are the laptop's
    assert side_by_side.llama_row(results, "laptop", 8).decode == 30.0
    assert side_by_side.llama_row(results, "8gb", 16) is None


def test_a_cut_short_llama_bench_keeps_its_finished_tests(tmp_path):
    finished = json.dumps([llama_test(512, 0, 16, 400.0), llama_test(4096, 0, 16, 500.0)], indent=2)
    path = tmp_path / "cut.json"
    path.write_text(finished[: finished.rfind("]")].rstrip() + ',\n  {\n    "build_commit": "0c1e')
    assert [r["n_prompt"] for r in side_by_side.load_llama_bench(path)] == [512, 4096]
    path.write_text("")
    assert side_by_side.load_llama_bench(path) == []


def test_table_states_each_ratio_against_the_goal(results):
    text = side_by_side.table(side_by_side.sections(results, "uniform"))
    best = next(line for line in text.splitlines() if "best backend (hybrid)" in line)
    assert "| 2.00x meets 1.5x |" in best  # 80 / 40
    assert "2.50x short of 3x / 4.00x meets 3x / 3.33x meets 3x" in best  # 1000/400, 2000/500, 1500/450
    llama = next(line for line in text.splitlines() if line.startswith("| 4gb | llama.cpp"))
    assert "| 3.90 |" in llama and "over budget" not in llama


def test_table_flags_a_peak_over_the_budget(results):
    (results / "llama_4gb_prefill.vram").write_text(f"{int(4.2 * GIB)}")
    text = side_by_side.table(side_by_side.sections(results, "uniform"))
    assert "4.20 (over budget)" in text


def test_main_says_what_is_missing(tmp_path, capsys):
    assert side_by_side.main([str(tmp_path)]) == 1
    assert "issue22_runs.sh" in capsys.readouterr().err


def test_the_fit_moves_as_many_expert_layers_as_the_room_holds():
    layer = llama_vram.LAYER_EXPERT_BYTES
    assert layer == 1_769_472 * 256
    probe = 2 * GIB
    room = 4 * GIB - llama_vram.MARGIN_BYTES - probe
    assert llama_vram.choose_n_cpu_moe(4 * GIB, probe, 40) == 40 - room // layer
    # a peak over the budget gives back the layers it takes to fit again
    assert llama_vram.choose_n_cpu_moe(4 * GIB, 4 * GIB + layer // 2, 30) == 31
    assert llama_vram.choose_n_cpu_moe(4 * GIB, 4 * GIB + layer, 30) == 32  # and the margin
    assert llama_vram.choose_n_cpu_moe(64 * GIB, probe, 40) == 0
    assert llama_vram.choose_n_cpu_moe(GIB, probe, 40) == 40


def test_peak_is_above_the_idle_gpu_and_needs_samples():
    assert llama_vram.peak_bytes("1000\n3500\n\n2000\n", 500.0) == 3000 * 2**20
    with pytest.raises(ValueError, match="no memory.used samples"):
        llama_vram.peak_bytes("", 500.0)


def test_buffers_sums_the_gpu_buffers_only():
    log = (
        "load_tensors:        CUDA0 model buffer size =  1500.00 MiB\n"
        "load_tensors:          CPU model buffer size = 17000.00 MiB\n"
        "llama_kv_cache:      CUDA0 KV buffer size =   330.00 MiB\n"
        "sched_reserve:      CUDA0 compute buffer size =   700.50 MiB\n"
        "sched_reserve:  CUDA_Host compute buffer size =    70.50 MiB\n"
    )
    assert llama_vram.buffers(log) == {"model": 1500.0, "KV": 330.0, "compute": 700.5}


def test_the_laptop_rows_compare_the_held_link_with_llama_cpp_at_8_threads(results):
    decodes = {
        "cpu": {"decode_tokens_per_s": 36.0},
        "auto": {"decode_tokens_per_s": 37.0, "decode_auto_trial": {"chosen": "cpu"}},
    }
    (results / "bench_laptop_pageable.json").write_text(json.dumps(bench_result(decodes)))
    labels = [label for label, _, _ in side_by_side.sections(results, "uniform")]
    assert labels == ["4gb", "4gb laptop, 6.5 GB/s, 8 threads, pageable"]
    laptop = side_by_side.sections(results, "uniform")[1]
    assert "link not held" in laptop[2].engine and laptop[2].prefill == {4096: 300.0}
    auto = next(line for line in side_by_side.table([laptop]).splitlines() if "auto (chose cpu)" in line)
    assert "| 1.23x short of 1.5x |" in auto  # 37 / 30


def test_the_batch_sweep_lists_each_size_in_order_with_its_peak(tmp_path, capsys):
    for ub, rate in ((2048, 900.0), (512, 600.0)):
        test = dict(llama_test(4096, 0, 16, rate, n_cpu_moe=40), n_ubatch=ub, n_batch=ub)
        (tmp_path / f"llama_ub{ub}.json").write_text(json.dumps([test]))
    (tmp_path / "llama_ub2048.vram").write_text(str(3 * GIB))
    assert side_by_side.main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("llama.cpp -ub/-b 512: prefill 600 tok/s") and lines[0].endswith("peak unmeasured")
    assert lines[1].startswith("llama.cpp -ub/-b 2048: prefill 900 tok/s") and lines[1].endswith("peak 3.00 GiB")
