"""Fixtures shared by the remote-engine tests: a fake OpenAI-compatible server and a RemoteWorker on its thread.

tests/conftest.py registers them for every test module.
"""

from __future__ import annotations

import pytest
from fake_openai_server import FakeOpenAI, FakeServer


@pytest.fixture(scope="module")
def server():
    """A fake OpenAI-compatible server on a loopback port, one per test module."""
    running = FakeServer(FakeOpenAI())
    yield running
    running.stop()


@pytest.fixture
def fake_api(server):
    """The module's server, answering as a fresh FakeOpenAI for this test."""
    server.fake.__init__()
    return server.fake


@pytest.fixture
def remote(qtbot):
    """A RemoteWorker on its own QThread, ended after the test."""
    from app.remote_worker import start_remote_worker

    worker, thread = start_remote_worker()
    yield worker
    worker.stop()
    thread.quit()
    thread.wait(10_000)
