"""bench-resume: the next turn of a chat resumed from RAM and from disk prefills only the new message and
answers as a re-prefill does; its options are checked in words."""

import json

from engine.cli import main
from engine.cli.common import EXIT_USAGE


def test_a_resumed_chat_prefills_only_its_new_message(capsys, tmp_path):
    output = tmp_path / "resume.json"
    args = ["bench-resume", "--model", "demo", "--history-tokens", "600", "--turns", "3", "--json"]
    assert main([*args, "--output", str(output)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert json.loads(output.read_text(encoding="utf-8")) == result
    rows = result["rows"]
    assert set(rows) == {"resume from RAM", "resume from disk"}
    for row in rows.values():
        assert row["prompt_tokens"] > 500 and row["prefilled_tokens"] < 64
        assert row["same_reply_as_re_prefill"]


def test_a_history_too_short_is_refused_in_words(capsys):
    assert main(["bench-resume", "--model", "demo", "--history-tokens", "10"]) == EXIT_USAGE
    assert "--history-tokens must be 64 or more, got 10" in capsys.readouterr().err
