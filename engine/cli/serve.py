"""`serve`: the model over HTTP, with OpenAI- and Anthropic-compatible APIs."""

from __future__ import annotations

import signal
import sys

from engine.cli.common import CliError
from engine.cli.loading import add_model_options, open_model
from engine.resources import DEMO_MODEL, DEMO_NAME


def register(commands) -> None:
    """Add the serve command."""
    serve = commands.add_parser("serve", help="serve the model over HTTP: OpenAI- and Anthropic-compatible API")
    add_model_options(serve)
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: 127.0.0.1, this machine only; any other needs --api-key)",
    )
    serve.add_argument("--port", type=int, default=1919, help="port to listen on (default: 1919)")
    serve.add_argument(
        "--api-key",
        help="key every request must carry (Authorization: Bearer KEY or x-api-key); "
        "default: $MOEDESK_API_KEY, else none on 127.0.0.1",
    )
    serve.add_argument(
        "--max-queue",
        type=int,
        default=16,
        help="requests that may wait while one runs; past it the server answers 429 (default: 16)",
    )
    serve.add_argument(
        "--prefix-cache-mib",
        type=int,
        default=4096,
        help="host RAM for the states of recent prompts, so a resent conversation prefills only "
        "what is new (default: 4096 MiB; 0 turns it off)",
    )
    serve.add_argument("--max-body-mib", type=float, default=16, help="largest request body (default: 16 MiB)")
    serve.set_defaults(run=run_serve)


def run_serve(args) -> int:
    """Load the model and serve it until Ctrl-C."""
    import os

    from engine.server import serve

    api_key = args.api_key or os.environ.get("MOEDESK_API_KEY") or None
    try:
        server = serve.check_settings(
            host=args.host,
            port=args.port,
            api_key=api_key,
            max_queue=args.max_queue,
            prefix_cache_mib=args.prefix_cache_mib,
            max_body_mib=args.max_body_mib,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None
    model, tokenizer, context, chunk = open_model(args)
    name = DEMO_NAME if args.model == DEMO_MODEL else args.model.name
    try:
        running = serve.start(server, model, tokenizer, context_tokens=context, model_name=name, **chunk)
    except RuntimeError as exc:
        raise CliError(str(exc)) from None
    print(
        f"serving {name} at {running.base_url} (OpenAI: {running.base_url}/v1, Anthropic: {running.base_url}); "
        f"Ctrl-C stops",
        file=sys.stderr,
        flush=True,
    )
    try:
        running.wait()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not break the bounded shutdown
        running.stop()
    return 0
