"""A live `engine serve` on a free loopback port, in a thread of the test process, for the server tests."""

from contextlib import contextmanager

from engine.server import serve

API_KEY = "test-key-not-secret"


@contextmanager
def live_server(
    model, tokenizer, *, context_tokens=2048, max_queue=8, prefix_cache_mib=64, max_body_mib=1.0, **session_options
):
    """A RunningServer for `model` on 127.0.0.1 (port chosen by the system) with API_KEY; stopped after."""
    settings = serve.check_settings(
        host="127.0.0.1",
        port=0,
        api_key=API_KEY,
        max_queue=max_queue,
        prefix_cache_mib=prefix_cache_mib,
        max_body_mib=max_body_mib,
    )
    running = serve.start(
        settings,
        model,
        tokenizer,
        context_tokens=context_tokens,
        model_name="demo",
        log_level="warning",
        **session_options,
    )
    try:
        yield running
    finally:
        running.stop()
