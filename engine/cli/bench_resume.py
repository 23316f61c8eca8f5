"""`bench-resume`: time to first token of the next turn of a long chat, prefilled again or resumed from the
prefix cache (RAM) and its disk tier (after a restart)."""

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

REPLY_TOKENS = 8  # the bench times the first token; a few more show the replies agree


def register(commands) -> None:
    """Add the bench-resume command."""
    resume = commands.add_parser(
        "bench-resume",
        help="the next turn of a long chat: re-prefilled, resumed from RAM, resumed from disk",
    )
    add_model_options(resume)
    resume.add_argument("--history-tokens", type=int, default=16_384, help="the chat's history, about (default: 16384)")
    resume.add_argument("--turns", type=int, default=8, help="exchanges the history is made of (default: 8)")
    resume.add_argument("--ram-mib", type=int, default=4096, help="the prefix cache's host RAM (default: 4096 MiB)")
    resume.add_argument("--seed", type=int, default=0, help="the filler text's seed")
    resume.set_defaults(run=run_bench_resume)


def run_bench_resume(args) -> int:
    from engine import bench_resume
    from engine.runtime.sampling import SamplingParams
    from engine.runtime.session import ChatSession

    for flag, value, least in (("--history-tokens", args.history_tokens, 64), ("--turns", args.turns, 1)):
        if value < least:
            raise CliError(f"{flag} must be {least} or more, got {value}")
    config, tokenizer = model_source(args)
    history = bench_resume.chat_history(tokenizer, args.history_tokens, args.turns, args.seed)
    longest = len(tokenizer.encode_chat(history, add_generation_prompt=True)[0]) + 160  # three more short turns
    needed = longest + 2 * REPLY_TOKENS + 1
    notes = [f"the chat is scripted (seed {args.seed}); replies are greedy, {REPLY_TOKENS} tokens"]
    check_length(args, config, needed, notes, "--history-tokens")
    plan, chunk, context = plan_session(args, longest, needed, "--history-tokens")
    result = start_result(args, plan, notes)
    model = build_model(args, plan, result)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=REPLY_TOKENS)

    session = ChatSession(model, tokenizer, context_tokens=context, prefill_chunk_tokens=chunk, sampling=sampling)
    result.update(bench_resume.run_resume_bench(session, history, args.ram_mib * 2**20))
    return report(args, result, bench_resume.format_table)
