"""The remote engine client (app/remote_engine.py) against a fake OpenAI-compatible server on a loopback port, and
through httpx.MockTransport where no live socket is needed; and the remote engines' store (app/remote_store.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import stat
import sys

import httpx
import pytest
from fake_openai_server import HANG, chunk, free_port

from app.remote_engine import (
    ConnectionProbe,
    RemoteClient,
    RemoteError,
    api_base,
    chat_messages,
    host_label,
    probe,
    request_fields,
)
from app.remote_store import RemoteEndpoint, RemoteStore

KEY = "sk-secret-key-7f3a"


class FakeClock:
    """Times handed out in order: the stream's start, then one per delta."""

    def __init__(self, *times: float):
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


async def collect(client: RemoteClient, messages=None, fields=None):
    stream = client.chat("fake/model", messages or [{"role": "user", "content": "hi"}], fields)
    deltas = [delta async for delta in stream]
    return stream, deltas


def run(coroutine):
    return asyncio.run(coroutine)


def test_addresses_are_read_as_people_type_them():
    assert api_base("10.0.0.5:8000") == "http://10.0.0.5:8000/v1"
    assert api_base(" https://gpu.example.com/v1/ ") == "https://gpu.example.com/v1"
    assert api_base("http://host:1919/proxy") == "http://host:1919/proxy/v1"
    assert host_label("http://user:pw@10.0.0.5:8000/v1") == "10.0.0.5:8000"  # credentials are never shown
    assert host_label("http://[::1]:8000") == "[::1]:8000"
    for bad in ("", "ftp://host", "http://host:99999", "http://"):
        with pytest.raises(RemoteError) as caught:
            api_base(bad)
        assert caught.value.kind == "bad_url" and "server address" in str(caught.value)


def test_the_request_carries_the_chat_its_sampling_and_thinking():
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r"}]
    assert chat_messages(history, "c", "be brief") == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    fields = request_fields(
        {"enable_thinking": False, "sampling": {"temperature": 0.2, "max_new_tokens": 64, "stop": ("END",), "seed": 3}}
    )
    assert fields == {
        "chat_template_kwargs": {"enable_thinking": False},
        "temperature": 0.2,
        "max_tokens": 64,
        "stop": ["END"],
        "seed": 3,
    }


def test_the_model_list_comes_from_v1_models_with_or_without_v1(server, fake_api):
    fake_api.models = [{"id": "Qwen/Qwen3-30B-A3B", "owned_by": "sglang"}, {"id": "second"}, {"object": "junk"}]
    for url in (server.url, server.url + "/v1", server.url + "/v1/"):
        assert run(probe(url)) == [{"id": "Qwen/Qwen3-30B-A3B", "owned_by": "sglang"}, {"id": "second", "owned_by": ""}]


def test_a_key_is_sent_as_a_bearer_token_and_a_refused_one_is_said(server, fake_api):
    fake_api.api_key = KEY
    assert run(probe(server.url, KEY))[0]["id"] == "fake/model"
    assert fake_api.headers[-1]["authorization"] == f"Bearer {KEY}"
    with pytest.raises(RemoteError) as caught:
        run(probe(server.url, "wrong"))
    assert caught.value.kind == "auth"
    assert "the key was refused" in str(caught.value) and "HTTP 401" in str(caught.value)
    assert "wrong" not in str(caught.value)


@pytest.mark.parametrize(
    "url, kind, words",
    [
        ("{server}/nothing-here", "not_found", "no OpenAI-compatible API at this URL"),
        ("http://127.0.0.1:{free}", "refused", "refused the connection"),
        ("https://{host}", "tls", "secure connection"),  # TLS spoken to a plain-HTTP server
    ],
)
def test_connection_failures_say_what_happened(server, fake_api, url, kind, words):
    url = url.format(server=server.url, free=free_port(), host=server.url.removeprefix("http://"))
    with pytest.raises(RemoteError) as caught:
        run(probe(url))
    assert caught.value.kind == kind
    assert words in str(caught.value)
    assert "Traceback" not in str(caught.value)


def test_a_model_list_that_is_not_json_or_not_a_list_is_refused(server, fake_api):
    fake_api.raw_models = b"<html>welcome to nginx</html>"
    with pytest.raises(RemoteError) as caught:
        run(probe(server.url))
    assert caught.value.kind == "bad_response" and "not JSON" in str(caught.value)
    fake_api.raw_models = json.dumps({"models": []}).encode()
    with pytest.raises(RemoteError) as caught:
        run(probe(server.url))
    assert caught.value.kind == "bad_response" and "model list" in str(caught.value)


def test_an_oversized_model_list_is_cut_off(server, fake_api):
    fake_api.models = [{"id": f"model-{i}" * 20} for i in range(2000)]

    async def listing():
        async with RemoteClient(server.url, max_models_bytes=16 * 1024) as client:
            return await client.list_models()

    with pytest.raises(RemoteError) as caught:
        run(listing())
    assert caught.value.kind == "too_large"


def test_a_stream_keeps_reasoning_apart_and_measures_its_tokens(server, fake_api):
    fake_api.script = [
        chunk(reasoning="Let me "),
        chunk(reasoning="think."),
        chunk(content="The answer"),
        ": keep-alive\n\n",
        chunk(content=" is 4."),
        chunk(finish="stop"),
        chunk(usage={"prompt_tokens": 12, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 5}}),
        "data: [DONE]\n\n",
    ]

    async def talk():
        # the stream starts at 0.0; the four deltas arrive at 1.0, 1.5, 2.0 and 3.0
        async with RemoteClient(server.url, clock=FakeClock(0.0, 1.0, 1.5, 2.0, 3.0)) as client:
            return await collect(client, fields=request_fields({"enable_thinking": True}))

    stream, deltas = run(talk())
    assert [(d.kind, d.text) for d in deltas] == [
        ("reasoning", "Let me "),
        ("reasoning", "think."),
        ("answer", "The answer"),
        ("answer", " is 4."),
    ]
    assert [d.tokens for d in deltas] == [1, 2, 3, 4]
    assert deltas[-1].tokens_per_s == pytest.approx(3 / 2.0)  # counted by deltas while streaming
    assert (stream.reasoning, stream.answer) == ("Let me think.", "The answer is 4.")
    stats = stream.stats()
    assert stats["stop_reason"] == "eos" and stats["tokens_counted"] == "usage"
    assert stats["new_tokens"] == 9 and stats["prompt_tokens"] == 12 and stats["cached_tokens"] == 5
    assert stats["time_to_first_token_s"] == pytest.approx(1.0)
    assert stats["decode_tokens_per_s"] == pytest.approx(8 / 2.0)  # 8 tokens after the first, over 2 s
    sent = fake_api.requests[-1]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["chat_template_kwargs"] == {"enable_thinking": True} and sent["model"] == "fake/model"


def test_reasoning_under_its_other_name_and_tokens_counted_without_usage(server, fake_api):
    fake_api.script = [
        chunk(reasoning="hmm", reasoning_key="reasoning"),
        chunk(content="ok"),
        chunk(finish="length"),
        "data: [DONE]\n\n",
    ]

    async def talk():
        async with RemoteClient(server.url, clock=FakeClock(0.0, 0.5, 1.5)) as client:
            return await collect(client)

    stream, _ = run(talk())
    stats = stream.stats()
    assert (stream.reasoning, stream.answer) == ("hmm", "ok")
    assert stats["tokens_counted"] == "deltas" and stats["new_tokens"] == 2 and stats["stop_reason"] == "length"
    assert stats["decode_tokens_per_s"] == pytest.approx(1.0) and stats["prompt_tokens"] is None


@pytest.mark.parametrize(
    "script, kind, words",
    [
        ([chunk(content="ok"), "data: {not json\n\n"], "bad_response", "not JSON"),
        ([chunk(content="ok")], "bad_response", "ended the stream before the reply"),  # no finish, no [DONE]
        (
            [chunk(content="ok"), f"data: {json.dumps({'error': {'message': 'CUDA out of memory'}})}\n\n"],
            "http",
            "CUDA out of memory",
        ),
    ],
)
def test_a_broken_stream_keeps_what_came_and_says_why(server, fake_api, script, kind, words):
    fake_api.script = script

    async def talk():
        async with RemoteClient(server.url) as client:
            stream = client.chat("fake/model", [{"role": "user", "content": "hi"}])
            with pytest.raises(RemoteError) as caught:
                async for _ in stream:
                    pass
            return stream, caught.value

    stream, error = run(talk())
    assert error.kind == kind and words in str(error)
    assert stream.answer == "ok"


def test_an_oversized_stream_is_cut_off(server, fake_api):
    fake_api.script = [chunk(content="x" * 1000) for _ in range(100)] + [chunk(finish="stop")]

    async def talk():
        async with RemoteClient(server.url, max_stream_bytes=32 * 1024) as client:
            return await collect(client)

    with pytest.raises(RemoteError) as caught:
        run(talk())
    assert caught.value.kind == "too_large" and "cut off" in str(caught.value)


def test_an_unknown_model_is_the_server_s_own_words(server, fake_api):
    async def talk():
        transport = httpx.MockTransport(
            lambda request: httpx.Response(404, json={"error": {"message": "The model `nope` does not exist."}})
        )
        async with RemoteClient(server.url, transport=transport) as client:
            return await collect(client)

    with pytest.raises(RemoteError) as caught:
        run(talk())
    assert caught.value.kind == "not_found" and "The model `nope` does not exist." in str(caught.value)


def test_a_server_that_ignores_stream_answers_whole():
    completion = {
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "whole", "reasoning_content": "r"},
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }

    async def talk():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, json=completion))
        async with RemoteClient("http://gpu:8000", transport=transport) as client:
            return await collect(client)

    stream, deltas = run(talk())
    assert [(d.kind, d.text) for d in deltas] == [("reasoning", "r"), ("answer", "whole")]
    assert stream.stats()["new_tokens"] == 2


@pytest.mark.parametrize(
    "failure, kind",
    [
        (httpx.ReadTimeout("timed out"), "timeout"),
        (httpx.ConnectTimeout("timed out"), "timeout"),
        (httpx.ConnectError("handshake", request=None), "http"),
    ],
)
def test_network_failures_are_said_in_words(failure, kind):
    def fail(request):
        raise failure

    with pytest.raises(RemoteError) as caught:
        run(probe("http://gpu:8000", transport=httpx.MockTransport(fail)))
    assert caught.value.kind == kind and "Traceback" not in str(caught.value)


def test_a_certificate_failure_is_a_tls_error():
    def fail(request):
        raise httpx.ConnectError("[SSL: CERTIFICATE_VERIFY_FAILED]") from ssl.SSLCertVerificationError(
            "certificate verify failed: self-signed certificate"
        )

    with pytest.raises(RemoteError) as caught:
        run(probe("https://gpu:8000", transport=httpx.MockTransport(fail)))
    assert caught.value.kind == "tls" and "self-signed certificate" in str(caught.value)


def test_cancelling_a_reply_closes_its_stream_at_once(server, fake_api):
    fake_api.script = [chunk(content="first"), HANG]

    async def talk():
        async with RemoteClient(server.url) as client:
            stream = client.chat("fake/model", [{"role": "user", "content": "hi"}])
            arrived = asyncio.Event()

            async def consume():
                async for _ in stream:
                    arrived.set()

            task = asyncio.create_task(consume())
            await arrived.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return stream

    stream = run(talk())
    assert stream.answer == "first" and stream.stats("cancelled")["stop_reason"] == "cancelled"
    assert fake_api.disconnected.wait(10), "the server never saw the client close the stream"


def test_the_key_never_reaches_the_log_or_a_message(server, fake_api, caplog):
    caplog.set_level(logging.DEBUG)
    fake_api.api_key = KEY
    fake_api.script = [chunk(content="fine"), chunk(finish="stop"), "data: [DONE]\n\n"]

    async def talk():
        async with RemoteClient(server.url, KEY) as client:
            await collect(client)
        async with RemoteClient(server.url, KEY + "x") as client:
            await client.list_models()

    with pytest.raises(RemoteError) as caught:
        run(talk())
    endpoint = RemoteEndpoint("vllm", server.url, "fake/model", KEY)
    assert caplog.records  # httpx and httpcore logged the requests at debug level
    assert KEY not in caplog.text and KEY not in str(caught.value) and KEY not in repr(endpoint)


def test_a_connection_probe_answers_off_the_calling_thread(server, fake_api):
    finished = ConnectionProbe(server.url)
    refused = ConnectionProbe(f"http://127.0.0.1:{free_port()}")
    for probe_run in (finished, refused):
        probe_run._done.wait(10)
    assert finished.done() and finished.models[0]["id"] == "fake/model" and finished.error is None
    assert refused.done() and refused.error.kind == "refused"


# ---- the store ------------------------------------------------------------------------------------


def test_remote_engines_are_kept_with_their_key_readable_by_the_user_alone(tmp_path):
    path = tmp_path / "remote-engines.json"
    store = RemoteStore(path)
    vllm = RemoteEndpoint("vllm", "http://10.0.0.5:8000", "nvidia/Qwen3.6-35B-A3B-NVFP4", KEY)
    store.add(vllm)
    store.add(RemoteEndpoint("sglang", "http://10.0.0.6:30000/v1", "Qwen/Qwen3-30B-A3B"))
    again = RemoteStore(path)
    assert again.endpoints()[0] == vllm and again.get(vllm.id).api_key == KEY
    assert vllm.label() == "vllm @ 10.0.0.5:8000, model nvidia/Qwen3.6-35B-A3B-NVFP4"
    assert vllm.to_dict()["host"] == "10.0.0.5:8000"
    if sys.platform != "win32":
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again.remove(vllm.id)
    assert [e.name for e in RemoteStore(path).endpoints()] == ["sglang"]


def test_a_damaged_store_is_kept_aside_without_quoting_it(tmp_path):
    path = tmp_path / "remote-engines.json"
    path.write_text('{"engines": [{"api_key": "' + KEY + '", "name": ', encoding="utf-8")
    store = RemoteStore(path)
    assert store.endpoints() == [] and len(store.warnings) == 1
    assert "kept as" in store.warnings[0] and KEY not in store.warnings[0]
    assert not path.exists() and len(list(tmp_path.glob("remote-engines.json.damaged-*"))) == 1
    path.write_text(
        json.dumps(
            {"engines": [{"id": "a", "name": "n", "base_url": "ftp://x", "model": "m", "api_key": KEY}, "junk"]}
        ),
        encoding="utf-8",
    )
    store = RemoteStore(path)
    assert store.endpoints() == [] and "2 entries" in store.warnings[0] and KEY not in store.warnings[0]
