"""`bench-agent`: a scripted agent session through the prefix cache, with what each request prefills."""

from __future__ import annotations

from engine.cli.common import CliError
from engine.cli.session_bench import (
    add_model_options,
    build_model,
    check_length,
    model_source,
    plan_session,
    report,
    start_result,
)


def register(commands) -> None:
    """Add the bench-agent command."""
    agent = commands.add_parser(
        "bench-agent",
        help="an agent session's requests through the prefix cache: what "
        "each one prefills, and its time to first token",
    )
    add_model_options(agent)
    agent.add_argument("--requests", type=int, default=20, help="requests in the session (default: 20)")
    agent.add_argument(
        "--target-tokens", type=int, default=30_000, help="the last request's prompt, about (default: 30000)"
    )
    agent.add_argument("--decode-tokens", type=int, default=4, help="tokens generated per request (default: 4)")
    agent.add_argument(
        "--prefix-cache-mib",
        type=int,
        default=4096,
        help="the prefix cache's host RAM, as serve's option (default: 4096 MiB; 0: no cache)",
    )
    agent.add_argument("--seed", type=int, default=0, help="the script's seed (tool-result sizes and contents)")
    agent.set_defaults(run=run_bench_agent)


def run_bench_agent(args) -> int:
    from engine import bench_agent
    from engine.runtime.session import ChatSession

    for flag, value, least in (
        ("--requests", args.requests, 2),
        ("--target-tokens", args.target_tokens, 1),
        ("--decode-tokens", args.decode_tokens, 1),
        ("--prefix-cache-mib", args.prefix_cache_mib, 0),
    ):
        if value < least:
            raise CliError(f"{flag} must be {least} or more, got {value}")
    config, tokenizer = model_source(args)
    script = bench_agent.agent_script(tokenizer, args.requests, args.target_tokens, args.seed)
    longest = script.last_prompt_tokens
    needed = longest + args.decode_tokens + 1
    notes = [
        f"the session is scripted (seed {args.seed}): the model's replies are not read, so random weights "
        f"replay the same conversation"
    ]
    check_length(args, config, needed, notes, "--target-tokens")
    plan, chunk, context = plan_session(args, longest, needed, "--target-tokens")
    result = start_result(args, plan, notes)
    result["target_tokens"] = args.target_tokens
    model = build_model(args, plan, result)
    session = ChatSession(model, tokenizer, context_tokens=context, prefill_chunk_tokens=chunk)
    result.update(bench_agent.run_agent_bench(session, script, args.prefix_cache_mib * 2**20, args.decode_tokens))
    return report(args, result, bench_agent.format_table)
