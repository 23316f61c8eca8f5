"""`chat` and `generate`: a conversation in the terminal, or replies to prompts given up front."""

from __future__ import annotations

import argparse
import io
import json
import signal
import sys
from pathlib import Path

from engine.cli.common import EXIT_FAILED, EXIT_USAGE, CliError
from engine.cli.loading import add_model_options, open_model
from engine.runtime.events import AnswerDelta, ReasoningDelta, TurnFinished
from engine.runtime.sampling import SamplingParams


def register(commands) -> None:
    """Add the chat and generate commands."""
    chat = commands.add_parser("chat", help="interactive chat in the terminal")
    _model_and_sampling(chat)

    generate = commands.add_parser("generate", help="answer one prompt or a file of prompts")
    _model_and_sampling(generate)
    source = generate.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the user message")
    source.add_argument("--prompts-file", type=Path, help="a text file with one user message per line")
    generate.add_argument("--json", action="store_true", help="one JSON object per prompt: reply and stats")
    chat.set_defaults(run=run_chat)
    generate.set_defaults(run=run_generate)


def _model_and_sampling(p: argparse.ArgumentParser) -> None:
    add_model_options(p)
    p.add_argument("--system", help="system prompt")
    p.add_argument("--no-think", action="store_true", help="turn the thinking mode off")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--presence-penalty", type=float)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--seed", type=int)


def _open_session(args):
    from engine.runtime.session import ChatSession

    _check_text(args.system, "--system")
    for stop in args.stop or ():
        _check_text(stop, "--stop")
    model, tokenizer, context, chunk = open_model(args)
    sampling = SamplingParams.from_generation_config(
        tokenizer.generation_defaults,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        stop=tuple(args.stop) if args.stop else None,
    )
    try:
        sampling.validate()
    except ValueError as exc:
        raise CliError(str(exc)) from None
    return ChatSession(
        model,
        tokenizer,
        context_tokens=context,
        sampling=sampling,
        system_prompt=args.system,
        enable_thinking=not args.no_think,
        **chunk,
    )


def _check_text(text: str | None, what: str) -> None:
    """CliError when text holds bytes that were not UTF-8 (Python keeps them as lone surrogates)."""
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise CliError(
            f"{what} is not valid UTF-8 text (undecodable bytes at character {exc.start}); pass UTF-8 "
            f"text, e.g. under a UTF-8 locale"
        ) from None


def _read_line(prompt: str) -> str:
    """One line typed at the chat prompt; CliError when it is not UTF-8 text, EOFError at the end of input."""
    try:
        line = input(prompt)
    except UnicodeDecodeError as exc:  # a stdin that could not be told to keep undecodable bytes
        raise CliError(
            f"that line is not valid UTF-8 text ({exc.reason} at byte {exc.start}); "
            f"type UTF-8 text, e.g. set a UTF-8 locale"
        ) from None
    _check_text(line, "that line")
    return line.strip()


def _keep_undecodable_input() -> None:
    """Read stdin so that bytes that are not UTF-8 stay in their line (as surrogates) instead of failing a read,
    which loses the rest of the buffered input too."""
    if isinstance(sys.stdin, io.TextIOWrapper):
        try:
            sys.stdin.reconfigure(errors="surrogateescape")
        except io.UnsupportedOperation:  # read from already: a line that fails to decode is then refused whole
            pass


def _stream(events, out) -> TurnFinished:
    """Print deltas as they come (reasoning dimmed on a terminal); return the final event."""
    dim, reset = ("\x1b[2m", "\x1b[0m") if out.isatty() else ("", "")
    in_reasoning = False
    for event in events:
        if isinstance(event, TurnFinished):
            if in_reasoning:
                out.write(reset)
            return event
        if isinstance(event, ReasoningDelta) and not in_reasoning:
            out.write(dim + "[thinking] ")
            in_reasoning = True
        elif isinstance(event, AnswerDelta) and in_reasoning:
            out.write(reset + "\n")
            in_reasoning = False
        out.write(event.text)
        out.flush()
    raise RuntimeError("the reply stream ended without a final event")


def _stats_line(stats) -> str:
    return (
        f"[{stats.new_tokens} tokens, {stats.decode_tokens_per_s:.1f} tok/s, prefill {stats.prefill_tokens} "
        f"tokens at {stats.prefill_tokens_per_s:.1f} tok/s, first token {stats.time_to_first_token_s:.2f} s, "
        f"stop: {stats.stop_reason}]"
    )


def run_chat(args) -> int:
    _keep_undecodable_input()
    session = _open_session(args)
    print("Chat started. /reset clears the conversation, /think on|off switches thinking, /exit quits.")
    # Ctrl-C while a reply streams cancels the reply; at the prompt it quits
    previous = signal.signal(signal.SIGINT, lambda *_: session.cancel())
    refused_input = False  # a line that was not UTF-8 is refused and the chat goes on; the exit code says so
    try:
        while True:
            try:
                signal.signal(signal.SIGINT, previous)
                line = _read_line("\n> ")
            except (EOFError, KeyboardInterrupt):
                print()
                return EXIT_USAGE if refused_input else 0
            except CliError as exc:
                print(f"error: {exc}", file=sys.stderr)
                refused_input = True
                continue
            finally:
                signal.signal(signal.SIGINT, lambda *_: session.cancel())
            if not line:
                continue
            if line in ("/exit", "/quit"):
                return EXIT_USAGE if refused_input else 0
            if line == "/reset":
                session.reset()
                print("(conversation cleared)")
                continue
            if line.startswith("/think"):
                choice = line.split()[1:] or [""]
                if choice[0] not in ("on", "off"):
                    print("usage: /think on|off")
                    continue
                session.enable_thinking = choice[0] == "on"
                print(f"(thinking {choice[0]})")
                continue
            final = _stream(session.send(line), sys.stdout)
            if final.stats.error:
                print(f"error: {final.stats.error}", file=sys.stderr)
            else:
                print("\n" + _stats_line(final.stats))
    finally:
        signal.signal(signal.SIGINT, previous)


def run_generate(args) -> int:
    if args.prompt is not None:
        _check_text(args.prompt, "--prompt")
        prompts = [args.prompt]
    else:
        try:
            prompts = [line for line in args.prompts_file.read_text(encoding="utf-8").splitlines() if line.strip()]
        except OSError as exc:
            raise CliError(f"cannot read {args.prompts_file}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise CliError(
                f"{args.prompts_file} is not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8"
            ) from None
        if not prompts:
            raise CliError(f"{args.prompts_file} holds no prompts (one per line)")
    session = _open_session(args)
    failed = False
    for prompt in prompts:
        session.reset()
        if args.json:
            final = next(e for e in session.send(prompt) if isinstance(e, TurnFinished))
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "reply": final.answer,
                        "reasoning": final.reasoning,
                        "stats": final.stats.to_dict(),
                    },
                    ensure_ascii=False,
                ),
                flush=True,
            )
        else:
            final = _stream(session.send(prompt), sys.stdout)
            if not final.stats.error:
                print("\n" + _stats_line(final.stats))
        if final.stats.error:
            failed = True
            print(f"error: {final.stats.error}", file=sys.stderr)
    return EXIT_FAILED if failed else 0
