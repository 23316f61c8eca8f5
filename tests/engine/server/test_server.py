"""`engine serve` with the demo model on the CPU, used through the official openai and anthropic packages as
any user would: chat with reasoning apart, streaming, usage with cached tokens, stop strings, completions,
keys, 400s that name the field, the body limit, the loopback rule, and a load of concurrent clients."""

import json
import threading
import time

import anthropic
import httpx
import openai
import psutil
import pytest
from server_fixtures import API_KEY, live_server

import engine
from engine.cli import main
from engine.resources import DEMO_MODEL
from engine.runtime.prompt import chat_prompt
from engine.runtime.tokenizer import ChatTokenizer
from engine.server.serve import check_settings

QUESTION = [{"role": "user", "content": "What is 12 + 30?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return ChatTokenizer.from_folder(DEMO_MODEL)


@pytest.fixture(scope="module")
def server(tokenizer):
    with live_server(engine.load_model(DEMO_MODEL), tokenizer, max_queue=4) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0)


def test_chat_answers_with_reasoning_apart_and_usage(client, tokenizer):
    reply = client.chat.completions.create(model="demo", messages=QUESTION, temperature=0, max_tokens=120)
    message = reply.choices[0].message
    assert "42" in message.content and "<think>" not in message.content
    assert "digit by digit" in message.reasoning_content  # the demo model works the sum out in its thinking
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens == len(chat_prompt(tokenizer, QUESTION).ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_streaming_chat_and_cached_tokens_on_a_resend(client):
    def stream():
        chunks = list(
            client.chat.completions.create(
                model="demo",
                messages=QUESTION,
                temperature=0,
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        return reasoning, chunks[-1].usage, [c.choices[0].finish_reason for c in chunks if c.choices][-1]

    reasoning, usage, finish = stream()
    assert reasoning.startswith("12 + 30") and finish == "length" and usage.completion_tokens == 6
    again_reasoning, again, _ = stream()
    assert again_reasoning == reasoning  # greedy, from the restored state
    assert again.prompt_tokens_details.cached_tokens == again.prompt_tokens  # the whole prompt was cached


def test_stop_string_ends_the_answer(client):
    reply = client.chat.completions.create(
        model="demo",
        messages=QUESTION,
        temperature=0,
        max_tokens=30,
        stop=[" ="],
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    choice = reply.choices[0]
    assert choice.message.content == "12 + 30" and choice.finish_reason == "stop"
    assert choice.message.reasoning_content is None


def test_reasoning_effort_none_turns_thinking_off(client):
    reply = client.chat.completions.create(
        model="demo", messages=QUESTION, temperature=0, max_tokens=4, reasoning_effort="none"
    )
    assert reply.choices[0].message.reasoning_content is None and reply.choices[0].message.content


def test_completions_continue_raw_text(client):
    reply = client.completions.create(model="demo", prompt="What is", max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"
    assert reply.choices[0].text


def test_models_health_and_stats(server, client):
    assert [m.id for m in client.models.list()] == ["demo"]
    headers = {"x-api-key": API_KEY}
    assert httpx.get(f"{server.base_url}/health", headers=headers).json()["status"] == "ok"
    stats = httpx.get(f"{server.base_url}/v1/stats", headers=headers).json()
    assert stats["requests_served"] >= 1 and set(stats["last_request"]) >= {
        "prompt_tokens",
        "cached_tokens",
        "generated_tokens",
        "tokens_per_s",
    }


def test_every_request_needs_the_key(server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0).messages.count_tokens(
            model="demo", messages=QUESTION
        )
    for path in ("/health", "/v1/stats", "/v1/models"):
        refused = httpx.get(server.base_url + path)
        assert refused.status_code == 401 and API_KEY not in refused.text
        assert httpx.get(server.base_url + path, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": QUESTION, "temperature": "hot"}, "temperature"),
        ({"messages": QUESTION, "top_p": 0}, "top_p"),
        ({"messages": QUESTION, "max_tokens": 0}, "max_tokens"),
        ({"messages": QUESTION, "stop": [""]}, "stop"),
        ({"messages": []}, "messages"),
        ({}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0]",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}
                        ],
                    },
                    {"role": "user", "content": "hi"},
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        ({"messages": QUESTION, "reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"messages": QUESTION, "n": 2}, "n"),
        (
            {"messages": QUESTION, "chat_template_kwargs": {"enable_thinking": "yes"}},
            "chat_template_kwargs.enable_thinking",
        ),
    ],
)
def test_bad_fields_are_400s_that_name_them(server, body, param):
    answer = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers={"x-api-key": API_KEY})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_bad_json_and_big_bodies_are_refused(server, claude):
    headers = {"x-api-key": API_KEY, "content-type": "application/json"}
    bad = httpx.post(f"{server.base_url}/v1/chat/completions", content=b"{nope", headers=headers)
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    big = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        headers=headers,
        content=json.dumps({"messages": [{"role": "user", "content": "x" * (2 * 2**20)}]}),
    )
    assert big.status_code == 413
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        claude.messages.create(model="demo", messages=QUESTION, max_tokens=0)
    no_limit = httpx.post(f"{server.base_url}/v1/messages", json={"messages": QUESTION}, headers=headers)
    assert no_limit.status_code == 400 and no_limit.json()["error"] == {
        "type": "invalid_request_error",
        "message": "'max_tokens' is required",
    }  # Anthropic's error shape


def test_anthropic_messages_have_thinking_and_text_blocks(claude):
    message = claude.messages.create(
        model="demo", max_tokens=120, messages=QUESTION, extra_body={"temperature": 0}, system="You add numbers."
    )
    kinds = [block.type for block in message.content]
    assert kinds == ["thinking", "text"] and "42" in message.content[1].text
    assert message.stop_reason == "end_turn" and message.usage.output_tokens > 0
    assert (
        claude.messages.count_tokens(model="demo", messages=QUESTION, system="You add numbers.").input_tokens
        == message.usage.input_tokens + message.usage.cache_read_input_tokens
    )


def test_anthropic_stream_events(claude):
    with claude.messages.stream(model="demo", max_tokens=8, messages=QUESTION, extra_body={"temperature": 0}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "thinking" in kinds
    assert final.content[0].type == "thinking" and final.content[0].thinking.startswith("12 + 30")
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8


def test_no_cross_origin_access_is_granted(server):
    """CORS is off: a web page on another origin gets no permission to read the API's answers."""
    headers = {"Origin": "https://example.com", "Access-Control-Request-Method": "POST", "x-api-key": API_KEY}
    preflight = httpx.options(f"{server.base_url}/v1/chat/completions", headers=headers)
    answer = httpx.get(f"{server.base_url}/v1/models", headers=headers)
    assert "access-control-allow-origin" not in preflight.headers
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


def test_a_lan_address_needs_a_key(capsys):
    with pytest.raises(ValueError, match="--api-key"):
        check_settings(host="0.0.0.0", port=1919, api_key=None, max_queue=4, prefix_cache_mib=0, max_body_mib=1)
    assert check_settings(host="::1", port=1919, api_key=None, max_queue=4, prefix_cache_mib=0, max_body_mib=1)
    assert main(["serve", "--host", "192.168.1.20"]) == 2  # refused before the model loads
    assert "--api-key" in capsys.readouterr().err


def test_concurrent_clients_are_answered_or_refused_with_429(server):
    """8 clients x 50 requests at once against a queue of 4: every request is answered or refused with 429,
    the process's memory stays flat from the first round to the last, and the server serves on afterwards."""
    outcomes, lock, rounds = [], threading.Lock(), 50
    memory = {}
    process = psutil.Process()

    def client_run(client: int):
        with httpx.Client(base_url=server.base_url, headers={"x-api-key": API_KEY}, timeout=300) as http:
            for request in range(rounds):
                answer = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 2})
                with lock:
                    outcomes.append((answer.status_code, answer.json()))
                    if client == 0 and request in (5, rounds - 1):  # after warm-up, and at the end
                        memory[request] = process.memory_info().rss

    threads = [threading.Thread(target=client_run, args=(client,)) for client in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(outcomes) == 8 * rounds
    codes = {code for code, _ in outcomes}
    assert codes <= {200, 429} and 200 in codes
    assert all(body["choices"][0]["message"]["reasoning_content"] for code, body in outcomes if code == 200)
    assert all("--max-queue" in body["error"]["message"] for code, body in outcomes if code == 429)
    answered = sum(code == 200 for code, _ in outcomes)
    print(
        f"\n{answered} answered, {len(outcomes) - answered} refused with 429; "
        f"RSS {(memory[rounds - 1] - memory[5]) / 2**20:+.1f} MiB from round 5 to {rounds}"
    )
    assert memory[rounds - 1] - memory[5] < 64 * 2**20, memory  # no growth with the requests served
    # the last reply reaches its client before the worker marks itself idle: give it a moment
    deadline = time.monotonic() + 5
    while (server.worker.queued or server.worker.busy) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.worker.queued == 0 and not server.worker.busy
    assert httpx.get(f"{server.base_url}/health", headers={"x-api-key": API_KEY}).status_code == 200


MULTIPLY = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two whole numbers and return their product.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
PRODUCT = [{"role": "user", "content": "What is 23 times 47?"}]


def test_openai_tool_round_trip_streams_the_call_then_answers_from_the_result(client):
    """The demo model calls the multiply tool (streamed arguments), then answers from the tool's result."""
    chunks = list(
        client.chat.completions.create(
            model="demo", messages=PRODUCT, tools=[MULTIPLY], temperature=0, max_tokens=200, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [call for d in deltas for call in (d.tool_calls or [])]
    assert calls[0].function.name == "multiply" and calls[0].id
    arguments = json.loads("".join(call.function.arguments or "" for call in calls))
    assert arguments == {"a": 23, "b": 47}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert "multiply tool" in "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    history = PRODUCT + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": calls[0].id,
                    "type": "function",
                    "function": {"name": "multiply", "arguments": json.dumps(arguments)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": calls[0].id, "content": str(23 * 47)},
    ]
    answer = client.chat.completions.create(
        model="demo", messages=history, tools=[MULTIPLY], temperature=0, max_tokens=120
    )
    assert answer.choices[0].finish_reason == "stop" and not answer.choices[0].message.tool_calls
    assert "1081" in answer.choices[0].message.content


def test_anthropic_tool_round_trip_uses_tool_use_and_tool_result_blocks(claude):
    tool = {
        "name": "multiply",
        "description": MULTIPLY["function"]["description"],
        "input_schema": MULTIPLY["function"]["parameters"],
    }
    with claude.messages.stream(
        model="demo", max_tokens=200, messages=PRODUCT, tools=[tool], extra_body={"temperature": 0}
    ) as stream:
        kinds = [event.type for event in stream]
        call = stream.get_final_message()
    assert "input_json" in kinds  # the arguments arrive as input_json_delta events
    assert call.stop_reason == "tool_use"
    use = [block for block in call.content if block.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "multiply" and use[0].input == {"a": 23, "b": 47}
    answer = claude.messages.create(
        model="demo",
        max_tokens=120,
        tools=[tool],
        extra_body={"temperature": 0},
        messages=PRODUCT
        + [
            {"role": "assistant", "content": call.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": "1081"}]},
        ],
    )
    assert answer.stop_reason == "end_turn" and "1081" in answer.content[-1].text


def test_the_fifth_turn_of_a_chat_is_answered_as_in_a_fresh_one(client):
    """The field report's chat: four sums answered, then 345 + 678 in the fifth turn, the model's own replies
    as history."""
    messages = []
    for question in [
        "What is 12 + 30?",
        "What is 250 - 75?",
        "What is 99 + 1?",
        "What is 500 - 499?",
        "What is 345 + 678?",
    ]:
        messages.append({"role": "user", "content": question})
        reply = client.chat.completions.create(model="demo", messages=messages, temperature=0, max_tokens=200)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    assert [m["content"] for m in messages[1::2]] == [
        "12 + 30 = 42.",
        "250 - 75 = 175.",
        "99 + 1 = 100.",
        "500 - 499 = 1.",
        "345 + 678 = 1023.",
    ]


def test_tool_choice_required_makes_the_model_call_a_tool(client, claude):
    """A sum needs no tool, so the demo model answers it; tool_choice required (OpenAI) and any (Anthropic)
    open the answer with <tool_call>, and the model writes the call from there."""
    sum_question = [{"role": "user", "content": "What is 12 + 30?"}]
    free = client.chat.completions.create(
        model="demo", messages=sum_question, tools=[MULTIPLY], temperature=0, max_tokens=120
    )
    assert free.choices[0].finish_reason == "stop" and free.choices[0].message.content == "12 + 30 = 42."
    forced = client.chat.completions.create(
        model="demo", messages=sum_question, tools=[MULTIPLY], temperature=0, max_tokens=120, tool_choice="required"
    )
    assert forced.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in forced.choices[0].message.tool_calls] == [
        ("multiply", {"a": 12, "b": 30})
    ]
    tool = {"name": "multiply", "input_schema": MULTIPLY["function"]["parameters"]}
    reply = claude.messages.create(
        model="demo",
        max_tokens=120,
        messages=sum_question,
        tools=[tool],
        tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    )
    assert reply.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in reply.content if b.type == "tool_use"] == [("multiply", {"a": 12, "b": 30})]


def test_a_named_tool_choice_calls_that_tool(client, claude):
    """Asked for a product, the demo model calls multiply by itself; naming the tool with thinking off (the
    call forced from the answer's first token) gives the same call."""
    for thinking in (True, False):
        reply = client.chat.completions.create(
            model="demo",
            messages=PRODUCT,
            tools=[MULTIPLY],
            temperature=0,
            max_tokens=160,
            tool_choice={"type": "function", "function": {"name": "multiply"}},
            extra_body={"chat_template_kwargs": {"enable_thinking": thinking}},
        )
        calls = reply.choices[0].message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("multiply", {"a": 23, "b": 47})
        ]
    tool = {"name": "multiply", "input_schema": MULTIPLY["function"]["parameters"]}
    message = claude.messages.create(
        model="demo",
        max_tokens=160,
        messages=PRODUCT,
        tools=[tool],
        tool_choice={"type": "tool", "name": "multiply"},
        extra_body={"temperature": 0},
    )
    assert [(b.name, b.input) for b in message.content if b.type == "tool_use"] == [("multiply", {"a": 23, "b": 47})]


@pytest.mark.parametrize(
    "choice, tools, param",
    [
        ({"type": "function", "function": {"name": "add"}}, [MULTIPLY], "tool_choice.function.name"),
        ("required", [], "tool_choice"),
        ({"type": "function"}, [MULTIPLY], "tool_choice.function"),
    ],
)
def test_a_tool_choice_that_cannot_be_met_is_a_400_naming_it(server, choice, tools, param):
    body = {"model": "demo", "messages": PRODUCT, "tools": tools, "tool_choice": choice, "max_tokens": 4}
    answer = httpx.post(
        f"{server.base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
