"""`python -m engine bench-agent`: the scripted agent session, its replay through the prefix cache (each request
prefills only what is new), and the command's plumbing on the tiny synthetic model in its real layout."""

import json

import pytest

import engine
from engine import bench_agent
from engine.cli import main
from engine.resources import DEMO_MODEL
from engine.runtime.prefix_cache import PrefixCache
from engine.runtime.session import ChatSession
from engine.runtime.prompt import chat_prompt
from engine.runtime.tokenizer import ChatTokenizer
from engine.testing.tiny_tokenizer import write_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return ChatTokenizer.from_folder(DEMO_MODEL)


def test_the_script_is_an_agent_session_that_reaches_its_target(tokenizer):
    script = bench_agent.agent_script(tokenizer, requests=11, target_tokens=6000)
    assert len(script.request_messages) == 11 and script.request_messages == sorted(set(script.request_messages))
    roles = [m["role"] for m in script.messages]
    assert roles[:2] == ["system", "user"] and roles.count("user") == 3  # a new question every fifth request
    assert all(m.get("tool_calls") for m in script.messages if m["role"] == "assistant")
    results = [len(tokenizer.encode(m["content"])) for m in script.messages if m["role"] == "tool"]
    assert len(results) == 10 and min(results) >= bench_agent.MIN_RESULT_TOKENS and max(results) > 2 * min(results)
    last = chat_prompt(tokenizer, script.request(10), tools=script.tools)
    assert script.last_prompt_tokens == len(last.ids) and 6000 <= len(last.ids) < 6600
    assert bench_agent.agent_script(tokenizer, requests=11, target_tokens=6000) == script  # the same every run


def test_the_replayed_session_prefills_only_its_new_tokens(tokenizer):
    """Each request restores the longest save point of the requests before it that it shares and prefills the
    rest: the previous prompt whole when no new question came; after one (this template then drops the
    reasoning of the replies since the last question) from the last message boundary before the re-render."""
    script = bench_agent.agent_script(tokenizer, requests=9, target_tokens=3500)
    session = ChatSession(engine.load_model(DEMO_MODEL), tokenizer, context_tokens=4096)
    result = bench_agent.replay(session, script, PrefixCache(256 * 2**20), decode_tokens=2)
    rows, saved = result["requests"], {}  # every save point so far: its length -> the ids before it
    assert result["errors"] == 0 and len(rows) == 9 and rows[-1]["prompt_tokens"] >= 3500
    for index, row in enumerate(rows):
        prompt = chat_prompt(tokenizer, script.request(index), tools=script.tools)
        assert row["prompt_tokens"] == len(prompt.ids)
        assert row["prefilled_tokens"] == row["prompt_tokens"] - row["cached_tokens"]
        assert row["cached_tokens"] >= max((n for n, ids in saved.items() if prompt.ids[:n] == ids), default=0)
        # what is prefilled is what changed, and the tokens from the last message boundary up to it
        assert row["new_tokens"] <= row["prefilled_tokens"] <= row["new_tokens"] + 8
        if index % 5 != 0:
            assert row["cached_tokens"] == rows[index - 1]["prompt_tokens"]
        saved.update({n: prompt.ids[:n] for n in (*prompt.save_at, len(prompt.ids))})
    totals = result["totals"]
    assert totals["prefilled_tokens"] == sum(r["prefilled_tokens"] for r in rows) < totals["prompt_tokens"] / 2
    assert "prefilled" in bench_agent.format_table(result)


def test_the_command_runs_a_synthetic_real_layout_model_under_a_plan(tmp_path, capsys):
    """The GPU run's path on the CPU: the tiny model in its real checkpoint layout, random weights, the 4gb
    plan's chunk and KV cache, a tokenizer folder of its own; the table on stdout, the JSON in --output."""
    write_tiny_tokenizer(tmp_path / "tokenizer")
    out = tmp_path / "out" / "agent.json"
    code = main(
        [
            "bench-agent",
            "--synthetic",
            "tiny",
            "--preset",
            "4gb",
            "--tokenizer",
            str(tmp_path / "tokenizer"),
            "--requests",
            "3",
            "--target-tokens",
            "1500",
            "--decode-tokens",
            "2",
            "--output",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads(out.read_text(encoding="utf-8"))
    assert result["model"] == "tiny" and result["plan"]["preset"] == "4gb"
    assert result["prefill_chunk_tokens"] == result["plan"]["prefill_chunk_tokens"]
    rows = result["requests"]
    assert len(rows) == 3 and result["errors"] == 0 and rows[-1]["prompt_tokens"] >= 1500
    assert all(r["prefilled_tokens"] == r["prompt_tokens"] - r["cached_tokens"] for r in rows)
    assert all(r["cached_tokens"] == p["prompt_tokens"] for p, r in zip(rows, rows[1:]))
    assert "prefilled" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--synthetic", "tiny"], "needs --tokenizer"),
        (["--model", "demo", "--target-tokens", "30000"], "past this model's 4,096"),
        (["--model", "demo", "--requests", "1"], "--requests must be 2 or more"),
        (["--model", "demo", "--preset", "4gb"], "--model runs on the CPU"),
    ],
)
def test_the_command_explains_what_it_refuses(argv, message, capsys):
    assert main(["bench-agent", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
