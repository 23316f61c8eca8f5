"""`python -m engine`: generate and chat on a tiny checkpoint; every error is one line and a non-zero exit."""

import io
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from engine.cli import main
from engine.loader import load_model
from engine.runtime import placement


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return str(tiny_checkpoint("qwen3_5_moe", "nvfp4"))


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_one_object_per_prompt(model_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello\n\nWhat is 2+2?\n", encoding="utf-8")
    code, out, err = run(
        [
            "generate",
            "--model",
            model_dir,
            "--prompts-file",
            str(prompts),
            "--json",
            "--max-new-tokens",
            "5",
            "--seed",
            "3",
        ],
        capsys,
    )
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in rows] == ["Hello", "What is 2+2?"]
    for row in rows:
        assert row["stats"]["new_tokens"] == 5 and row["stats"]["stop_reason"] == "length"
        assert row["stats"]["seed"] == 3 and row["stats"]["prefill_tokens"] > 0
    # same seed, same text
    _, again, _ = run(
        ["generate", "--model", model_dir, "--prompt", "Hello", "--json", "--max-new-tokens", "5", "--seed", "3"],
        capsys,
    )
    assert json.loads(again)["reply"] == rows[0]["reply"] and json.loads(again)["reasoning"] == rows[0]["reasoning"]


def test_generate_streams_text_and_stats(model_dir, capsys):
    code, out, err = run(
        ["generate", "--model", model_dir, "--prompt", "Hi", "--max-new-tokens", "4", "--no-think"], capsys
    )
    assert code == 0 and "[4 tokens" in out and "stop: length" in out


def test_chat_commands(model_dir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n/think off\n/think maybe\nAgain\n/reset\n/exit\n"))
    code, out, err = run(["chat", "--model", model_dir, "--max-new-tokens", "3"], capsys)
    assert code == 0
    assert "(thinking off)" in out and "usage: /think on|off" in out and "(conversation cleared)" in out
    assert out.count("[3 tokens") == 2


@pytest.mark.parametrize(
    "argv, message, exit_code",
    [
        (["generate", "--model", "/no/such/folder", "--prompt", "x"], "/no/such/folder: does not exist", 1),
        (["generate"], "one of the arguments --prompt --prompts-file is required", 2),
        (["generate", "--model", "M", "--prompt", "x", "--bogus"], "unrecognized arguments: --bogus", 2),
        (["generate", "--model", "M", "--prompt", "x", "--top-p", "1.5"], "top_p must be in (0, 1], got 1.5", 2),
        (["generate", "--model", "M", "--prompts-file", "/no/such/file.txt"], "cannot read /no/such/file.txt", 2),
        (["generate", "--model", "M", "--prompt", "x" * 5000, "--context", "64"], "at most 64", 1),
        (["plan", "--synthetic", "no-such-model", "--preset", "4gb"], "no-such-model", 2),
        (["plan", "--synthetic", "qwen3.6-35b-a3b-nvfp4", "--preset", "4gb", "--vram", "-1"], "--vram must be", 2),
    ],
)
def test_errors_are_one_line(argv, message, exit_code, model_dir, capsys):
    argv = [model_dir if a == "M" else a for a in argv]
    code, out, err = run(argv, capsys)
    assert code == exit_code
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]


def test_demo_model_is_the_default(capsys):
    code, out, err = run(["generate", "--prompt", "What is 12 + 30?", "--temperature", "0", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["reply"].endswith("42.")


def test_module_entry_point(model_dir):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine",
            "generate",
            "--model",
            model_dir,
            "--prompt",
            "Hi",
            "--max-new-tokens",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["stats"]["new_tokens"] == 2


def test_asking_for_the_gpu_on_a_cpu_build_says_why(model_dir, capsys):
    code = main(["generate", "--model", str(model_dir), "--prompt", "hi", "--device", "cuda"])
    err = capsys.readouterr().err
    assert code == 2 and "--device cuda: this PyTorch build has no CUDA support" in err and len(err.splitlines()) == 1


@pytest.fixture
def restored_threads(monkeypatch):
    """--cpu-threads sets process-wide thread counts: each test leaves them as it found them."""
    from engine.kernels.cpu_experts import pool

    monkeypatch.setattr(pool, "_threads", pool._threads)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def fake_gpu_run(monkeypatch, expert_slots: int) -> list[dict]:
    """A GPU placement whose model loads on the CPU with `expert_slots` cache slots, so the real cached executor
    runs; returns load_placed's expert keywords, one dict per call."""
    calls = []
    plan = SimpleNamespace(expert_slots=expert_slots, prefill_chunk_tokens=64, kv_tokens=4096)
    gpu = placement.Placement("cuda", torch.float32, plan, "GPU mode on a test card")
    monkeypatch.setattr(placement, "plan_placement", lambda *args, **kwargs: gpu)

    def load_cached(folder, where, pin_budget_bytes=None, **backend):
        calls.append(backend)
        return load_model(folder, "cpu", torch.float32, expert_cache_slots=where.plan.expert_slots, **backend)

    monkeypatch.setattr(placement, "load_placed", load_cached)
    return calls


@pytest.mark.parametrize(
    "options, expected",
    [
        ([], {"expert_backend": "auto", "cpu_threads": None}),
        (["--expert-backend", "offload", "--cpu-threads", "1"], {"expert_backend": "offload", "cpu_threads": 1}),
    ],
)
def test_expert_backend_and_cpu_threads_reach_load_placed(
    options, expected, model_dir, capsys, monkeypatch, restored_threads
):
    calls = fake_gpu_run(monkeypatch, expert_slots=32)  # every layer fits: any backend runs
    code, out, err = run(
        ["generate", "--model", model_dir, "--prompt", "Hi", "--max-new-tokens", "2", "--json", *options], capsys
    )
    assert code == 0, err
    assert calls == [expected] and json.loads(out)["stats"]["new_tokens"] == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--expert-backend", "warp"], "argument --expert-backend: invalid choice: 'warp'"),
        (["--cpu-threads", "many"], "argument --cpu-threads: invalid int value: 'many'"),
        (["--cpu-threads", "0"], "--cpu-threads: threads must be between 1 and"),
        (
            ["--device", "cpu", "--expert-backend", "hybrid"],
            "--expert-backend hybrid only applies on the GPU; leave it out, since this run is on the CPU: --device cpu",
        ),
    ],
)
def test_bad_expert_options_are_one_line(argv, message, model_dir, capsys, restored_threads):
    code, out, err = run(["generate", "--model", model_dir, "--prompt", "x", *argv], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]


def test_a_gpu_backend_the_cache_cannot_hold_is_one_line(model_dir, capsys, monkeypatch):
    fake_gpu_run(monkeypatch, expert_slots=8)  # one of the tiny model's four MoE layers
    code, out, err = run(["chat", "--model", model_dir, "--expert-backend", "gpu"], capsys)
    assert code == 2 and err.splitlines()[-1] == (
        "error: the gpu expert backend keeps every expert in VRAM: 4 layers of slots, but the cache holds 1; "
        "choose offload, cpu, hybrid or auto (--expert-backend), or a bigger --preset"
    )


def test_plan_without_a_gpu_says_its_guarantee_is_an_estimate_for_the_reference_card(capsys):
    code, out, _ = run(["plan", "--synthetic", "qwen3.6-35b-a3b-nvfp4", "--preset", "4gb"], capsys)
    assert code == 0
    assert "The guarantee is an estimate, for the reference card (RTX 2050)" in out and "CPU-only build" in out
    assert "runtime reserve     688.2 MiB   (estimate for the reference card, an RTX 2050" in out
    code, out, _ = run(["plan", "--synthetic", "qwen3.6-35b-a3b-nvfp4", "--preset", "4gb", "--json"], capsys)
    plan = json.loads(out)
    assert code == 0 and plan["reserve_measured"] is False
    assert "estimate for the reference card" in plan["reserve_source"]


def test_plan_on_a_usable_gpu_uses_the_reserve_measured_there(capsys, monkeypatch):
    from engine.runtime import reserve
    from engine.runtime.footprint import footprint_from_synthetic
    from engine.runtime.planner import GIB, plan_memory

    measured = reserve.measured_reserve(900 * 2**20, "NVIDIA H200", others_included=False)
    monkeypatch.setattr(placement, "gpu_status", lambda: (True, "NVIDIA H200"))
    monkeypatch.setattr(reserve, "runtime_reserve", lambda device="cuda": measured)
    code, out, _ = run(["plan", "--synthetic", "qwen3.6-35b-a3b-nvfp4", "--preset", "4gb"], capsys)
    footprint = footprint_from_synthetic("qwen3.6-35b-a3b-nvfp4")
    expected = plan_memory(footprint, 4 * GIB, "4gb", reserve_bytes=measured.reserve_bytes)
    assert code == 0 and "measured on this GPU, NVIDIA H200 (cached in " in out and "estimate" not in out
    assert f"largest prompt guaranteed {expected.max_prompt_tokens:,} tokens" in out
    code, out, _ = run(["plan", "--synthetic", "qwen3.6-35b-a3b-nvfp4", "--preset", "4gb", "--json"], capsys)
    plan = json.loads(out)
    assert plan["reserve_source"] == "measured on NVIDIA H200" and plan["reserve_measured"] is True
    assert plan["breakdown"]["runtime_reserve"] == measured.reserve_bytes
    reference = plan_memory(footprint, 4 * GIB, "4gb")
    assert plan["max_prompt_tokens"] == expected.max_prompt_tokens < reference.max_prompt_tokens


# hostile inputs: each is one line on stderr and a non-zero exit, never a traceback


def _one_error_line(err: str, message: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", "x", "--seed", "-1"], "seed must be a whole number from 0 to 18446744073709551615, got -1"),
        (["--prompt", "x", "--seed", str(2**64)], f"seed must be a whole number from 0 to {2**64 - 1}, got {2**64}"),
        (
            ["--prompt", "x", "--context", "1000000000"],
            "--context 1000000000 is more than this model's maximum of 4096 tokens (max_position_embeddings in "
            "config.json); use --context 4096 or less",
        ),
        (["--prompt", "x", "--cpu-threads", "10000"], "--cpu-threads: threads must be between 1 and"),
        (["--prompt", "caf\udce9"], "--prompt is not valid UTF-8 text (undecodable bytes at character 3)"),
        (["--prompt", "x", "--system", "\udcff"], "--system is not valid UTF-8 text"),
        (["--prompt", "x", "--stop", "\udcff"], "--stop is not valid UTF-8 text"),
    ],
)
def test_hostile_generate_arguments_are_one_line(argv, message, model_dir, capsys, restored_threads):
    code, out, err = run(["generate", "--model", model_dir, *argv], capsys)
    assert code == 2
    _one_error_line(err, message)


def test_a_prompts_file_that_is_not_utf8_is_one_line(model_dir, tmp_path, capsys):
    prompts = tmp_path / "latin1.txt"
    prompts.write_bytes("café\n".encode("latin-1"))
    code, out, err = run(["generate", "--model", model_dir, "--prompts-file", str(prompts)], capsys)
    assert code == 2
    _one_error_line(err, f"{prompts} is not UTF-8 text (invalid continuation byte at byte 3); save it as UTF-8")


def test_a_prompt_past_the_models_own_context_gets_the_apps_message(model_dir, capsys):
    """Without --context the session holds at most max_position_embeddings (4096 here), as in the app."""
    code, out, err = run(["generate", "--model", model_dir, "--prompt", "x " * 5000, "--max-new-tokens", "1"], capsys)
    assert code == 1
    # the model's own maximum: raising the context cannot help, so the message does not say to
    _one_error_line(err, "but this session holds at most 4096; start a new chat or shorten the prompt")


def test_a_chat_line_that_is_not_utf8_is_refused_and_the_chat_goes_on(model_dir, capsys, monkeypatch):
    typed = b"\xff\xfe\nHi\n/exit\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(typed), encoding="utf-8"))
    code, out, err = run(["chat", "--model", model_dir, "--max-new-tokens", "2"], capsys)
    assert code == 2 and out.count("[2 tokens") == 1
    _one_error_line(err, "that line is not valid UTF-8 text (undecodable bytes at character 0)")


class _StrictStdin(io.StringIO):
    """A stdin whose first line fails to decode, as a strict reader that cannot be reconfigured does."""

    def readline(self, *args):
        if self.tell() == 0:
            self.seek(1)
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return super().readline(*args)


def test_a_strict_stdin_that_fails_to_decode_a_line_is_one_line(model_dir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", _StrictStdin("\nHi\n/exit\n"))
    code, out, err = run(["chat", "--model", model_dir, "--max-new-tokens", "2"], capsys)
    assert code == 2 and out.count("[2 tokens") == 1
    _one_error_line(err, "that line is not valid UTF-8 text (invalid start byte at byte 0)")


def test_a_chat_line_with_undecodable_bytes_is_refused(model_dir, capsys, monkeypatch):
    """Under a C locale Python reads stdin with surrogateescape: the bytes arrive as lone surrogates."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("caf\udce9\n/exit\n"))
    code, out, err = run(["chat", "--model", model_dir, "--max-new-tokens", "2"], capsys)
    assert code == 2 and "[2 tokens" not in out
    _one_error_line(err, "that line is not valid UTF-8 text (undecodable bytes at character 3)")


def test_a_reply_prints_on_an_ascii_terminal(model_dir):
    result = subprocess.run(
        [
            sys.executable,
            "-X",
            "utf8=0",
            "-m",
            "engine",
            "generate",
            "--model",
            model_dir,
            "--prompt",
            "Hi",
            "--max-new-tokens",
            "3",
            "--seed",
            "1",
        ],
        capture_output=True,
        env={**os.environ, "LC_ALL": "C", "PYTHONIOENCODING": "ascii"},
    )
    assert result.returncode == 0, result.stderr.decode()
    assert b"Traceback" not in result.stderr and b"[3 tokens" in result.stdout


@pytest.fixture(scope="module")
def nan_model_dir(tiny_checkpoint, tmp_path_factory):
    """The tiny model with its output projection full of NaN, as a damaged download or a misread format gives."""
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(tiny_checkpoint("qwen3_5_moe", "bf16"), tmp_path_factory.mktemp("nan") / "model")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["lm_head.weight"] = torch.full_like(tensors["lm_head.weight"], float("nan"))
    save_file(tensors, str(folder / "model.safetensors"))
    return str(folder)


@pytest.mark.parametrize(
    "sampling", [["--temperature", "0"], ["--temperature", "0.7", "--seed", "1"]], ids=["greedy", "sampled"]
)
def test_nan_logits_stop_the_reply_with_a_clear_error(nan_model_dir, sampling, capsys):
    code, out, err = run(["generate", "--model", nan_model_dir, "--prompt", "Hi", "--json", *sampling], capsys)
    assert code == 1 and json.loads(out)["reply"] == ""
    _one_error_line(
        err, "the model produced NaN/inf logits: its weights are damaged or the format is misread; re-download it"
    )
