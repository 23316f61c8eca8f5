"""`python -m engine`: generate and chat on a tiny checkpoint; every error is one line and a non-zero exit."""

import io
import json
import subprocess
import sys

import pytest

from engine.cli import main


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
    code, out, err = run(["generate", "--model", model_dir, "--prompts-file", str(prompts), "--json",
                          "--max-new-tokens", "5", "--seed", "3"], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in rows] == ["Hello", "What is 2+2?"]
    for row in rows:
        assert row["stats"]["new_tokens"] == 5 and row["stats"]["stop_reason"] == "length"
        assert row["stats"]["seed"] == 3 and row["stats"]["prefill_tokens"] > 0
    # same seed, same text
    _, again, _ = run(["generate", "--model", model_dir, "--prompt", "Hello", "--json", "--max-new-tokens", "5",
                       "--seed", "3"], capsys)
    assert json.loads(again)["reply"] == rows[0]["reply"] and json.loads(again)["reasoning"] == rows[0]["reasoning"]


def test_generate_streams_text_and_stats(model_dir, capsys):
    code, out, err = run(["generate", "--model", model_dir, "--prompt", "Hi", "--max-new-tokens", "4",
                          "--no-think"], capsys)
    assert code == 0 and "[4 tokens" in out and "stop: length" in out


def test_chat_commands(model_dir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n/think off\n/think maybe\nAgain\n/reset\n/exit\n"))
    code, out, err = run(["chat", "--model", model_dir, "--max-new-tokens", "3"], capsys)
    assert code == 0
    assert "(thinking off)" in out and "usage: /think on|off" in out and "(conversation cleared)" in out
    assert out.count("[3 tokens") == 2


@pytest.mark.parametrize("argv, message, exit_code", [
    (["generate", "--model", "/no/such/folder", "--prompt", "x"], "/no/such/folder: does not exist", 1),
    (["generate"], "one of the arguments --prompt --prompts-file is required", 2),
    (["generate", "--model", "M", "--prompt", "x", "--bogus"], "unrecognized arguments: --bogus", 2),
    (["generate", "--model", "M", "--prompt", "x", "--top-p", "1.5"], "top_p must be in (0, 1], got 1.5", 2),
    (["generate", "--model", "M", "--prompts-file", "/no/such/file.txt"], "cannot read /no/such/file.txt", 2),
    (["generate", "--model", "M", "--prompt", "x" * 5000, "--context", "64"], "at most 64", 1),
    (["plan", "--synthetic", "no-such-model", "--preset", "4gb"], "no-such-model", 2),
    (["plan", "--synthetic", "qwen3.6-35b-a3b-nvfp4", "--preset", "4gb", "--vram", "-1"], "--vram must be", 2),
])
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
    result = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", model_dir, "--prompt", "Hi",
                             "--max-new-tokens", "2", "--json"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["stats"]["new_tokens"] == 2


def test_asking_for_the_gpu_on_a_cpu_build_says_why(model_dir, capsys):
    code = main(["generate", "--model", str(model_dir), "--prompt", "hi", "--device", "cuda"])
    err = capsys.readouterr().err
    assert code == 2 and "--device cuda: this PyTorch build has no CUDA support" in err and len(err.splitlines()) == 1
