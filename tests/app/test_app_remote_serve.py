"""The app chatting with MoE Desk's own server as a remote engine: `python -m engine serve` with the demo model
in a subprocess, found through the connection test, answering in the chat page, which says who answered."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import pytest
from app_fakes import FakeWorker
from fake_openai_server import free_port
from locations import ROOT
from PySide6.QtCore import Qt
from test_app_remote import choose

from app.pages.chat import ChatPage
from app.remote_engine import probe
from app.remote_store import RemoteEndpoint
from app.storage import ConversationStore

KEY = "sk-serve-test-5e1a"
START_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def served():
    """`engine serve` on a free loopback port with the demo model on the CPU; its base URL."""
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine",
            "serve",
            "--model",
            "demo",
            "--device",
            "cpu",
            "--port",
            str(port),
            "--api-key",
            KEY,
            "--cpu-threads",
            "1",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert process.poll() is None, process.stderr.read()[-2000:]
        try:
            if httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "engine serve did not answer /health"
        time.sleep(0.2)
    yield url
    process.terminate()
    try:
        process.wait(20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


def test_the_connection_test_lists_the_served_model_and_refuses_a_wrong_key(served):
    models = asyncio.run(probe(served, KEY))
    assert [m["id"] for m in models] == ["demo"]
    with pytest.raises(Exception, match="key was refused"):
        asyncio.run(probe(served, "sk-wrong"))


def test_the_chat_page_answers_through_the_served_engine_and_names_it(qtbot, served, settings, remote, tmp_path):
    endpoint = RemoteEndpoint("moedesk", served, "demo", KEY)
    keep = choose(remote, endpoint)
    store = ConversationStore(tmp_path / "c.sqlite3")
    page = ChatPage(store, FakeWorker(), settings)
    qtbot.addWidget(page)
    page.show()
    page.set_engine(remote, f"remote: {endpoint.label()}")
    assert page.engine_text() == f"Answering: remote: moedesk @ {endpoint.host}, model demo"
    qtbot.keyClicks(page.input, "What is 123 + 456?")
    qtbot.keyClick(page.input, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: page.send_button.isEnabled() and bool(page.transcript.bubbles[-1].answer), timeout=60_000)
    bubble = page.transcript.bubbles[-1]
    assert "579" in bubble.answer  # the demo model's sum, from the server's engine
    assert bubble.reasoning_section.text_label.text()  # its thinking arrived apart, as reasoning_content
    assert bubble.stats_label.text().endswith(f"remote: moedesk @ {endpoint.host}, model demo")
    assert keep
