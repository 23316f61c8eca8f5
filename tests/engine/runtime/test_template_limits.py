"""A chat template is foreign code: one that never ends, builds huge text or renders nothing is refused with a
clear message, and Stop interrupts a render (issue 20)."""

import threading
import time

import pytest
from scripted_model import ScriptedModel

from engine.errors import CheckpointError
from engine.models.base import Interrupted
from engine.runtime import tokenizer as tokenizer_module
from engine.runtime.session import ChatSession
from engine.runtime.tokenizer import ChatTokenizer
from engine.testing.tiny_tokenizer import write_tiny_tokenizer

FOREVER = "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}"
MESSAGES = [{"role": "user", "content": "Hi"}]


def with_template(tmp_path, template: str) -> ChatTokenizer:
    write_tiny_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(template)
    return ChatTokenizer.from_folder(tmp_path)


@pytest.mark.parametrize(
    "template, message",
    [
        (FOREVER, "does not finish: it ran for more than 0.3 s"),
        ("{{ 'x' * 1000000000 }}", "does not finish: a repetition of more than"),
        ("{{ 2 ** 1000000000 }}", "does not finish: a power of more than"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "fails to render (RecursionError"),
    ],
)
def test_a_runaway_template_is_refused_in_time(tmp_path, monkeypatch, template, message):
    monkeypatch.setattr(tokenizer_module, "RENDER_SECONDS", 0.3)
    tokenizer = with_template(tmp_path, template)
    started = time.monotonic()
    with pytest.raises(CheckpointError, match="chat template") as caught:
        tokenizer.render(MESSAGES)
    assert message in str(caught.value) and time.monotonic() - started < 3.0
    assert "chat_template.jinja" in str(caught.value)


def test_an_interrupt_stops_a_render(tmp_path):
    tokenizer = with_template(tmp_path, FOREVER)
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    with pytest.raises(Interrupted):
        tokenizer.render(MESSAGES, interrupt=stop.is_set)
    assert time.monotonic() - started < 2.0


def test_stop_ends_a_turn_whose_template_is_still_rendering(tmp_path):
    tokenizer = with_template(tmp_path, FOREVER)
    session = ChatSession(ScriptedModel(320, [5, 1]), tokenizer, context_tokens=512)
    turn = session.send("Hi")
    threading.Timer(0.2, session.cancel).start()
    final = list(turn)[-1]
    assert final.stats.stop_reason == "cancelled" and session.messages == []


def test_a_template_that_renders_nothing_is_a_clear_error(tmp_path):
    session = ChatSession(ScriptedModel(320, [5, 1]), with_template(tmp_path, "{# nothing #}"), context_tokens=512)
    final = list(session.send("Hi"))[-1]
    assert final.stats.stop_reason == "error" and "renders nothing" in final.stats.error
    assert session.messages == []
