"""`engine serve` on a scripted model (the demo tokenizer and template, replies fixed token by token): tool calls
through the openai and anthropic packages with a full round trip, 429 past the queue, a client's
disconnect cancelling its request, and the desktop app's turns in the same queue."""

import json
import threading
import time

import anthropic
import httpx
import openai
import pytest
from scripted_model import ScriptedModel
from server_fixtures import API_KEY, live_server

from engine.resources import DEMO_MODEL
from engine.runtime.events import TurnFinished
from engine.runtime.session import ChatSession
from engine.runtime.prompt import text_prompt
from engine.runtime.tokenizer import ChatTokenizer
from engine.server.worker import EngineWorker, QueueFull, Stopped

TOOL_REPLY = (
    "I need to multiply.\n</think>\n\nLet me calculate.\n\n<tool_call>\n<function=multiply>\n<parameter=a>\n"
    "12\n</parameter>\n<parameter=b>\n3\n</parameter>\n</function>\n</tool_call>"
)
MULTIPLY = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two whole numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
QUESTION = [{"role": "user", "content": "What is 12 * 3?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return ChatTokenizer.from_folder(DEMO_MODEL)


def scripted(tokenizer, text, delay=0.0):
    return ScriptedModel(tokenizer.vocab_size, tokenizer.encode(text) + [min(tokenizer.eos_token_ids)], delay)


@pytest.fixture(scope="module")
def tool_server(tokenizer):
    model = scripted(tokenizer, TOOL_REPLY)
    with live_server(model, tokenizer, prefix_cache_mib=0) as running:
        running.model = model
        yield running


def _fed_text(model, tokenizer, since: int):
    """Everything the model was given after its first `since` forward passes."""
    return tokenizer.decode([i for ids in model.fed[since:] for i in ids])


def test_openai_tool_call_round_trip(tool_server, tokenizer):
    client = openai.OpenAI(base_url=f"{tool_server.base_url}/v1", api_key=API_KEY, max_retries=0)
    since = len(tool_server.model.fed)
    reply = client.chat.completions.create(model="demo", messages=QUESTION, tools=[MULTIPLY], temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me calculate." and choice.message.reasoning_content == "I need to multiply."
    (call,) = choice.message.tool_calls
    assert call.function.name == "multiply" and json.loads(call.function.arguments) == {"a": 12, "b": 3}
    assert '"name": "multiply"' in _fed_text(tool_server.model, tokenizer, since)  # the tool spec reached the template

    chunks = list(
        client.chat.completions.create(model="demo", messages=QUESTION, tools=[MULTIPLY], temperature=0, stream=True)
    )
    calls = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert calls[0].function.name == "multiply" and calls[0].id
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"a": 12, "b": 3}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    history = QUESTION + [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "36"},
    ]
    since = len(tool_server.model.fed)
    client.chat.completions.create(model="demo", messages=history, tools=[MULTIPLY], temperature=0)
    prompt = _fed_text(tool_server.model, tokenizer, since)
    assert "<tool_response>\n36\n</tool_response>" in prompt  # the result went back to the model
    assert "<function=multiply>\n<parameter=a>\n12\n</parameter>" in prompt  # and its own call, as the template has it


def test_without_tools_the_markup_is_plain_text(tool_server):
    client = openai.OpenAI(base_url=f"{tool_server.base_url}/v1", api_key=API_KEY, max_retries=0)
    message = client.chat.completions.create(model="demo", messages=QUESTION, temperature=0).choices[0].message
    assert message.tool_calls is None and "<tool_call>" in message.content


def test_anthropic_tool_use_round_trip(tool_server, tokenizer):
    claude = anthropic.Anthropic(base_url=tool_server.base_url, api_key=API_KEY, max_retries=0)
    tools = [
        {
            "name": "multiply",
            "description": "Multiply two whole numbers.",
            "input_schema": MULTIPLY["function"]["parameters"],
        }
    ]
    message = claude.messages.create(model="demo", max_tokens=200, messages=QUESTION, tools=tools)
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    use = message.content[2]
    assert use.name == "multiply" and use.input == {"a": 12, "b": 3} and message.stop_reason == "tool_use"

    with claude.messages.stream(model="demo", max_tokens=200, messages=QUESTION, tools=tools) as stream:
        final = stream.get_final_message()
    assert final.content[2].type == "tool_use" and final.content[2].input == {"a": 12, "b": 3}
    assert final.stop_reason == "tool_use"

    result = {"type": "tool_result", "tool_use_id": use.id, "content": "36"}
    history = QUESTION + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
        {"role": "user", "content": [result]},
    ]
    since = len(tool_server.model.fed)
    claude.messages.create(model="demo", max_tokens=200, messages=history, tools=tools)
    prompt = _fed_text(tool_server.model, tokenizer, since)
    assert "<tool_response>\n36\n</tool_response>" in prompt and "I need to multiply." in prompt


@pytest.fixture
def slow_server(tokenizer):
    """A model that takes 20 ms a token for 2,000 tokens: requests run long enough to queue and to cancel."""
    with live_server(
        scripted(tokenizer, "word " * 2000, delay=0.02), tokenizer, max_queue=1, prefix_cache_mib=0, context_tokens=4096
    ) as running:
        yield running


def _wait(condition, seconds=20.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the server did not get there in time"
        time.sleep(0.01)


def test_past_the_queue_limit_requests_get_429(slow_server):
    worker = slow_server.worker
    body = {"messages": QUESTION, "stream": True}
    with httpx.Client(base_url=slow_server.base_url, headers={"x-api-key": API_KEY}, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as running:
            _wait(lambda: worker.busy)
            with http.stream("POST", "/v1/chat/completions", json=body) as waiting:
                _wait(lambda: worker.queued == 1)
                refused = httpx.post(
                    f"{slow_server.base_url}/v1/chat/completions", json=body, headers={"x-api-key": API_KEY}
                )
                assert refused.status_code == 429
                assert "--max-queue" in refused.json()["error"]["message"]
                assert running.status_code == 200 and waiting is not None
    _wait(lambda: not worker.busy and worker.queued == 0)  # the clients left: their requests were cancelled


def test_a_disconnect_cancels_the_request_within_100_ms(slow_server):
    worker = slow_server.worker
    with httpx.Client(base_url=slow_server.base_url, headers={"x-api-key": API_KEY}, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json={"messages": QUESTION, "stream": True}) as reply:
            lines = reply.iter_lines()
            while "reasoning_content" not in next(lines):  # the reply is streaming
                pass
            closed_at = worker.clock()
    _wait(lambda: worker.last_cancel is not None)
    asked, stopped = worker.last_cancel
    assert asked >= closed_at and stopped - closed_at < 0.1
    assert worker.last.stop_reason == "cancelled" and worker.last.generated_tokens < 2000


def test_a_client_that_gives_up_on_a_whole_reply_cancels_it(slow_server):
    """Not streaming: the route watches the connection while the reply runs."""
    worker = slow_server.worker
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{slow_server.base_url}/v1/chat/completions",
            json={"messages": QUESTION},
            headers={"x-api-key": API_KEY},
            timeout=httpx.Timeout(60, read=1.0),
        )
    closed_at = worker.clock()  # the client has closed its connection by now
    _wait(lambda: worker.last_cancel is not None)
    assert worker.last_cancel[1] - closed_at < 0.1
    assert worker.last.stop_reason == "cancelled" and not worker.busy


def test_the_apps_turns_share_the_queue_but_not_its_limit_or_its_stats(tokenizer):
    session = ChatSession(scripted(tokenizer, "Hi."), tokenizer, context_tokens=256, enable_thinking=False)
    changes = []
    worker = EngineWorker(session, None, max_queue=0, on_change=lambda w: changes.append(w.busy_with_api))
    running, release, turn_ended, first, turn = threading.Event(), threading.Event(), threading.Event(), [], []

    def held(session):
        running.set()
        release.wait(10)
        return session.complete(text_prompt(tokenizer, "Hey"))

    def window_turn(event):
        turn.append(event)
        if event is None:
            turn_ended.set()

    try:
        worker.submit(held, first.append)  # an API request holding the engine
        assert running.wait(10)
        with pytest.raises(QueueFull):  # a second request is past the limit of 0 waiting
            worker.submit(lambda session: iter(()), lambda event: None)
        worker.submit(lambda session: session.send("Hello"), window_turn, from_api=False)  # the window's: queued
        assert worker.queued == 1 and worker.busy_with_api
        release.set()
        assert turn_ended.wait(10)
        assert isinstance(first[-2], TurnFinished) and first[-1] is None
        assert isinstance(turn[-2], TurnFinished) and turn[-1] is None
        assert turn[-2].answer == "Hi."
        assert worker.requests_served == 1 and worker.requests_refused == 1  # the held request's reply only
        assert worker.last.prompt_tokens == len(text_prompt(tokenizer, "Hey").ids)
        assert changes == [True, False, False, False]  # start and end of each: only the first was the API's
    finally:
        worker.stop()
    with pytest.raises(Stopped):  # a stopped worker refuses work rather than leave it waiting forever
        worker.submit(lambda session: iter(()), lambda event: None)


def test_a_job_can_hand_the_jobs_after_it_another_session(tokenizer):
    """The app's plan switch: a job replaces the session on the engine's thread; a job waiting behind it runs
    against the new one, and cancelling the replacing job while it holds no session stops nothing by mistake."""
    first = ChatSession(scripted(tokenizer, "One."), tokenizer, context_tokens=256, enable_thinking=False)
    second = ChatSession(scripted(tokenizer, "Two."), tokenizer, context_tokens=512, enable_thinking=False)
    worker = EngineWorker(first, None, max_queue=0)
    replacing, release, seen, ended = threading.Event(), threading.Event(), [], threading.Event()

    def replace(session):
        seen.append(session)
        worker.replace_session(None)
        replacing.set()
        release.wait(10)
        worker.replace_session(second)
        return iter(())

    def after(event):
        seen.append(event)
        if event is None:
            ended.set()

    try:
        job = worker.submit(replace, lambda event: None, from_api=False)
        worker.submit(lambda session: session.send("Hello"), after, from_api=False)
        assert replacing.wait(10)
        job.cancel()  # no session to cancel: the replacing job goes on
        release.set()
        assert ended.wait(10)
        assert seen[0] is first and worker.session is second
        assert isinstance(seen[-2], TurnFinished) and seen[-2].answer == "Two."
        assert second.messages[-1]["content"] == "Two." and first.messages == []
    finally:
        worker.stop()
