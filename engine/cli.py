"""`python -m engine`: chat, generate, plan, bench and pull from the command line.

Every error a user can make ends in one line on stderr and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import codecs
import io
import json
import signal
import sys
import time
from pathlib import Path

from engine.checkpoint.quant_config import KV_CACHE_CHOICES
from engine.errors import CheckpointError
from engine.experts.backend import BACKENDS
from engine.resources import DEMO_MODEL, DEMO_NAME, resolve_model
from engine.runtime.events import AnswerDelta, ReasoningDelta, TurnFinished
from engine.runtime.sampling import SamplingParams

DEFAULT_CONTEXT_TOKENS = 8192
EXIT_USAGE, EXIT_FAILED, EXIT_INTERRUPTED = 2, 1, 130


class CliError(Exception):
    """A problem to report in one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's default prints the whole usage block first
        raise CliError(f"{message} (see {self.prog} --help)")

    def parse_args(self, args=None, namespace=None):
        """Parse, pointing an unknown argument after a command at that command's help."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            command = getattr(parsed, "command", None)
            where = f"{self.prog} {command}" if command else self.prog
            raise CliError(f"unrecognized arguments: {' '.join(extra)} (see {where} --help)")
        return parsed


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m engine", description="MoE Desk engine: chat, generate, plan")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    chat = commands.add_parser("chat", help="interactive chat in the terminal")
    _model_and_sampling(chat)

    generate = commands.add_parser("generate", help="answer one prompt or a file of prompts")
    _model_and_sampling(generate)
    source = generate.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the user message")
    source.add_argument("--prompts-file", type=Path, help="a text file with one user message per line")
    generate.add_argument("--json", action="store_true", help="one JSON object per prompt: reply and stats")

    plan = commands.add_parser("plan", help="the VRAM plan of a model for a preset")
    target = plan.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--model", type=resolve_model, help="checkpoint folder or 'demo' (only tensor headers are read)"
    )
    target.add_argument("--synthetic", help="a built-in model description, e.g. qwen3.6-35b-a3b-nvfp4")
    plan.add_argument("--preset", required=True, choices=["4gb", "8gb", "12gb", "auto"])
    plan.add_argument(
        "--vram", type=float, help="VRAM budget in GiB (default: the preset's size, or the GPU's free memory for auto)"
    )
    plan.add_argument("--json", action="store_true")
    _kv_cache_option(plan)

    bench = commands.add_parser("bench", help="speed of a full-size model with random weights (built in memory)")
    bench.add_argument("--synthetic", help="a built-in model description, e.g. qwen3.6-35b-a3b-nvfp4")
    bench.add_argument(
        "--cpu-experts",
        action="store_true",
        help="instead: NVFP4 expert throughput of the CPU kernels against DRAM read bandwidth",
    )
    bench.add_argument(
        "--threads",
        help="with --cpu-experts: thread counts, comma-separated (default: 1 and "
        "powers of two up to the physical cores)",
    )
    bench.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    bench.add_argument(
        "--preset", choices=["4gb", "8gb", "12gb"], help="plan the expert cache and prefill chunk for this card size"
    )
    bench.add_argument(
        "--vram-limit",
        type=float,
        help="VRAM budget in GiB (default: the preset's size); on a bigger GPU the process is held to it",
    )
    bench.add_argument("--prompt-tokens", default="512", help="prompt lengths, comma-separated (e.g. 512,4096)")
    bench.add_argument("--decode-tokens", type=int, default=128)
    bench.add_argument(
        "--decode-inputs",
        choices=["greedy", "random"],
        default="greedy",
        help="decode from each step's argmax, or from random tokens (routing spread over the experts)",
    )
    bench.add_argument(
        "--hf-baseline",
        action="store_true",
        help="also run the same shape through transformers + accelerate (needs accelerate)",
    )
    bench.add_argument(
        "--expert-backends",
        help="CUDA: decode with each of these expert backends in turn, comma-separated (offload, cpu, hybrid, auto)",
    )
    bench.add_argument(
        "--routing",
        default="model",
        help="forced routing modes, comma-separated, each prompt length run under each: uniform "
        "(the hit-rate floor), locality (modelled reuse), fixed (the GPU's own step), same, "
        "distinct (worst cases of a chunk); model (default): the random routers decide",
    )
    bench.add_argument(
        "--decode-after",
        help="prompt lengths, comma-separated, whose prefill a decode follows "
        "(default: every one; the others measure prefill alone)",
    )
    bench.add_argument(
        "--gpu-step-ms",
        type=float,
        help="the GPU's own decode step (ms) for the decode ceilings, "
        "measured by another run's fixed routing where this "
        "preset's cache cannot hold one",
    )
    bench.add_argument("--cpu-threads", type=int, help="threads for the CPU's expert work (default: the cores)")
    bench.add_argument(
        "--pageable", action="store_true", help="pin no expert record (as where pinning is refused, e.g. under WSL2)"
    )
    bench.add_argument(
        "--link-gbps",
        type=float,
        help="CUDA: hold host->GPU expert copies to this many GB/s, below the measured rate, to "
        "emulate a narrower link (e.g. 6.5 for a laptop's PCIe 4.0 x4)",
    )
    bench.add_argument("--json", action="store_true")

    agent = commands.add_parser(
        "bench-agent",
        help="an agent session's requests through the prefix cache: what "
        "each one prefills, and its time to first token",
    )
    agent_model = agent.add_mutually_exclusive_group(required=True)
    agent_model.add_argument("--model", type=resolve_model, help="checkpoint folder or 'demo' (runs on the CPU)")
    agent_model.add_argument(
        "--synthetic",
        help="a built-in model description with random weights, e.g. qwen3.6-35b-a3b-nvfp4 (needs --tokenizer)",
    )
    agent.add_argument(
        "--tokenizer",
        type=Path,
        help="with --synthetic: a folder with the model's tokenizer.json, tokenizer_config.json and chat template",
    )
    agent.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    agent.add_argument(
        "--preset",
        choices=["4gb", "8gb", "12gb"],
        help="with --synthetic: the VRAM plan (expert cache, prefill chunk, KV cache) to run under",
    )
    agent.add_argument("--vram-limit", type=float, help="VRAM budget in GiB (default: the preset's size)")
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
    agent.add_argument(
        "--past-trained-context",
        action="store_true",
        help="let the session run past the model's max_position_embeddings (its replies there mean "
        "nothing; the scripted session does not read them)",
    )
    agent.add_argument("--seed", type=int, default=0, help="the script's seed (tool-result sizes and contents)")
    agent.add_argument("--json", action="store_true", help="print the result as JSON instead of the table")
    agent.add_argument("--output", type=Path, help="also write the result as JSON to this file")

    serve = commands.add_parser("serve", help="serve the model over HTTP: OpenAI- and Anthropic-compatible API")
    _model_options(serve)
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

    pull = commands.add_parser("pull", help="download a model from the Hugging Face Hub (resumes an unfinished one)")
    pull.add_argument("repo_id", help="the model's repo, e.g. nvidia/Qwen3.6-35B-A3B-NVFP4")
    pull.add_argument("--revision", default="main", help="branch, tag or commit (default: main)")
    pull.add_argument(
        "--local-dir",
        type=Path,
        help="the model folder to fill (default: ORG--NAME in MoE Desk's "
        "models folder, which the app lists; $MOEDESK_MODELS_DIR "
        "sets it)",
    )
    pull.add_argument("--endpoint", help="a Hub mirror's address (default: $HF_ENDPOINT or huggingface.co)")
    pull.add_argument("--offline", action="store_true", help="refuse to contact the Hub (as HF_HUB_OFFLINE=1 does)")
    return parser


def _model_and_sampling(p: argparse.ArgumentParser) -> None:
    _model_options(p)
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


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        type=resolve_model,
        default=DEMO_MODEL,
        help="checkpoint folder, or 'demo' for the built-in demo model (the default)",
    )
    p.add_argument(
        "--context",
        type=int,
        help=f"context size in tokens (default: {DEFAULT_CONTEXT_TOKENS}, or the model's maximum when that is less)",
    )
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: the GPU under --preset's memory plan when one is usable, else the CPU",
    )
    p.add_argument(
        "--preset",
        choices=["4gb", "8gb", "12gb", "auto"],
        default="auto",
        help="VRAM preset for the GPU (auto: the card's free memory)",
    )
    p.add_argument(
        "--expert-backend",
        choices=BACKENDS,
        default="auto",
        help="where a GPU run computes expert-cache misses: auto (timed over the first tokens), gpu "
        "(every expert in VRAM), offload (copied over PCIe), cpu (from host RAM) or hybrid (both)",
    )
    p.add_argument(
        "--cpu-threads",
        type=int,
        help="threads for the CPU's work: the whole model on the CPU, the "
        "experts it computes on a GPU run (default: physical cores)",
    )
    _kv_cache_option(p)


def _kv_cache_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache", choices=KV_CACHE_CHOICES, default="auto", help="auto: fp8 where the model declares it")


def _open_session(args):
    from engine.runtime.session import ChatSession

    _check_text(args.system, "--system")
    for stop in args.stop or ():
        _check_text(stop, "--stop")
    model, tokenizer, context, chunk = _load(args)
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


def _load(args):
    """(model, tokenizer, context tokens, prefill chunk setting) for --model under --device and --preset."""
    # imported here so `plan` and `--help` stay fast
    import torch

    from engine.loader import read_config
    from engine.runtime.placement import gpu_status, load_placed, plan_placement
    from engine.runtime.planner import PlanError
    from engine.runtime.tokenizer import ChatTokenizer

    if args.context is not None and args.context < 16:
        raise CliError(f"--context must be at least 16 tokens, got {args.context}")
    if args.cpu_threads is not None:
        from engine.kernels import cpu_experts

        try:  # checked before the long load, against the CPU expert kernels' own limit
            cpu_experts.set_threads(args.cpu_threads)
        except ValueError as exc:
            raise CliError(f"--cpu-threads: {exc}") from None
        torch.set_num_threads(args.cpu_threads)  # torch's threads run the whole model in CPU mode, as in the app
    config = read_config(args.model)  # first: it explains a wrong folder best
    longest = config.max_position_embeddings
    if args.context is not None and args.context > longest:
        raise CliError(
            f"--context {args.context} is more than this model's maximum of {longest} tokens "
            f"(max_position_embeddings in config.json); use --context {longest} or less"
        )
    if args.device == "cuda" and not gpu_status()[0]:
        raise CliError(f"--device cuda: {gpu_status()[1]}")
    try:
        placement = plan_placement(args.model, args.preset, device=args.device, kv_cache_dtype=args.kv_cache)
    except PlanError as exc:
        raise CliError(f"no VRAM plan fits: {exc}; try a bigger --preset or --device cpu") from None
    if placement.device == "cuda":  # the GPU's plan is worth a line; CPU mode is what a CPU build always does
        print(placement.note, file=sys.stderr)
    elif args.expert_backend != "auto":
        why = "--device cpu asks for it" if args.device == "cpu" else gpu_status()[1]
        raise CliError(
            f"--expert-backend {args.expert_backend} only applies on the GPU; leave it out, since this "
            f"run is on the CPU: {why}"
        )
    try:
        model = load_placed(args.model, placement, expert_backend=args.expert_backend, cpu_threads=args.cpu_threads)
    except ValueError as exc:  # the executor refuses a gpu backend whose cache cannot hold every layer
        raise CliError(f"{exc} (--expert-backend), or a bigger --preset") from None
    tokenizer = ChatTokenizer.from_folder(args.model)
    plan = placement.plan
    chunk = {"prefill_chunk_tokens": plan.prefill_chunk_tokens} if plan is not None else {}
    context = args.context or min(DEFAULT_CONTEXT_TOKENS, longest)
    context = min(context, plan.kv_tokens) if plan is not None else context
    return model, tokenizer, context, chunk


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
    model, tokenizer, context, chunk = _load(args)
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


def run_plan(args) -> int:
    from engine.runtime.planner import (
        REFERENCE_CARD,
        PlanError,
        footprint_from_checkpoint,
        footprint_from_synthetic,
        plan_memory,
        preset_budget_bytes,
    )

    try:
        footprint = (
            footprint_from_synthetic(args.synthetic, args.kv_cache)
            if args.synthetic
            else footprint_from_checkpoint(args.model, args.kv_cache)
        )
    except KeyError as exc:
        raise CliError(str(exc.args[0])) from None
    if args.vram is not None:
        if args.vram <= 0:
            raise CliError(f"--vram must be a positive number of GiB, got {args.vram}")
        budget = int(args.vram * 2**30)
    else:
        budget = preset_budget_bytes(args.preset)
        if budget is None:
            raise CliError("--preset auto needs --vram GiB here (no GPU is visible to read free memory from)")
    reserve, where = _plan_reserve()
    try:
        plan = plan_memory(
            footprint, budget, args.preset, reserve_bytes=reserve.reserve_bytes, reserve_source=reserve.source
        )
    except PlanError as exc:
        raise CliError(str(exc)) from None
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
        return 0
    print(plan.format_table())
    if reserve.measured:
        print(f"The guarantee uses the runtime reserve measured on this GPU, {reserve.gpu} (cached in {where}).")
    elif reserve.gpu is None:
        print(
            f"The guarantee is an estimate, for the reference card ({REFERENCE_CARD}): no GPU measured the runtime "
            f"reserve here ({where}). On a usable NVIDIA GPU `plan` measures it, and plans with that."
        )
    else:
        print(f"The guarantee is an estimate: the runtime reserve is the {reserve.source}.")
    return 0


def _plan_reserve():
    """(the runtime reserve `plan` uses, the file a measurement is cached in or why there is no GPU): measured on a
    usable GPU, else the reference card's estimate."""
    from engine.runtime.placement import gpu_status
    from engine.runtime.reserve import reference_estimate, reserve_file, runtime_reserve

    usable, status = gpu_status()
    if not usable:
        return reference_estimate(), status
    return runtime_reserve(), reserve_file()


def run_bench(args) -> int:
    if args.cpu_experts:
        return run_cpu_experts_bench(args)
    import torch

    from engine import bench
    from engine.experts.link import LinkLimitError
    from engine.experts.routing import MODES as ROUTING_MODES
    from engine.runtime.planner import PlanError
    from engine.synthetic import SYNTHETIC_MODELS

    if args.threads is not None:
        raise CliError("--threads goes with --cpu-experts")
    if args.synthetic is None:
        raise CliError("bench needs --synthetic MODEL (or --cpu-experts)")
    if args.synthetic not in SYNTHETIC_MODELS:
        raise CliError(f"no synthetic model {args.synthetic!r}; choose one of {', '.join(SYNTHETIC_MODELS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda needs an NVIDIA GPU and a CUDA build of PyTorch; use --device cpu here")
    if args.decode_tokens < 0:
        raise CliError(f"--decode-tokens must be 0 or more, got {args.decode_tokens}")
    try:
        lengths = bench.parse_lengths(args.prompt_tokens)
        if args.vram_limit is not None and args.vram_limit <= 0:
            raise ValueError(f"--vram-limit must be a positive number of GiB, got {args.vram_limit}")
        if args.vram_limit is not None and args.preset is None:
            raise ValueError("--vram-limit needs --preset (the rules the plan follows within that budget)")
        reserve = None
        if args.device == "cuda":  # the reserve the VRAM cap leaves out: measured on this GPU, or its formula
            from engine.runtime.reserve import runtime_reserve

            reserve = runtime_reserve().reserve_bytes
        plan = bench.plan_for(args.synthetic, args.preset, args.vram_limit, reserve)
    except (ValueError, PlanError) as exc:
        raise CliError(str(exc)) from None
    backends = None
    if args.expert_backends:
        backends = [b.strip() for b in args.expert_backends.split(",") if b.strip()]
        unknown = [b for b in backends if b not in ("offload", "cpu", "hybrid", "auto")]
        if unknown or not backends:
            raise CliError(
                f"--expert-backends takes offload, cpu, hybrid or auto, comma-separated; got {args.expert_backends!r}"
            )
        if args.device != "cuda" or plan is None:
            raise CliError("--expert-backends needs --device cuda and a --preset (an expert cache to miss)")
    routings = [m.strip() for m in args.routing.split(",") if m.strip()]
    if (
        not routings
        or any(m not in (bench.MODEL_ROUTING, *ROUTING_MODES) for m in routings)
        or (bench.MODEL_ROUTING in routings and len(routings) > 1)
    ):
        raise CliError(
            f"--routing takes model alone, or forced modes comma-separated ({', '.join(ROUTING_MODES)}); "
            f"got {args.routing!r}"
        )
    if args.cpu_threads is not None and args.cpu_threads < 1:
        raise CliError(f"--cpu-threads must be 1 or more, got {args.cpu_threads}")
    decode_after = None
    if args.decode_after is not None:
        try:
            decode_after = bench.parse_lengths(args.decode_after, "--decode-after")
        except ValueError as exc:
            raise CliError(str(exc)) from None
        if not set(decode_after) <= set(lengths):
            raise CliError(
                f"--decode-after takes lengths from --prompt-tokens ({args.prompt_tokens}); got {args.decode_after!r}"
            )
    if args.gpu_step_ms is not None and not 0 < args.gpu_step_ms < 10_000:
        raise CliError(f"--gpu-step-ms must be a positive number of milliseconds, got {args.gpu_step_ms}")
    if args.link_gbps is not None and not 0 < args.link_gbps < float("inf"):
        raise CliError(f"--link-gbps must be a positive number of GB/s (e.g. 6.5), got {args.link_gbps}")
    if args.link_gbps is not None and args.device != "cuda":
        raise CliError("--link-gbps needs --device cuda: on the CPU no expert crosses a link")
    try:
        result = bench.run_bench(
            args.synthetic,
            args.device,
            lengths,
            args.decode_tokens,
            plan,
            backends=backends,
            decode_inputs=args.decode_inputs,
            hf_baseline=args.hf_baseline,
            routings=None if routings == [bench.MODEL_ROUTING] else routings,
            cpu_threads=args.cpu_threads,
            pageable=args.pageable,
            decode_after=decode_after,
            gpu_step_seconds=args.gpu_step_ms / 1e3 if args.gpu_step_ms else None,
            link_bytes_per_s=args.link_gbps * 1e9 if args.link_gbps is not None else None,
        )
    except LinkLimitError as exc:
        raise CliError(str(exc)) from None
    print(json.dumps(result, indent=2) if args.json else bench.format_result(result))
    return 0


def run_bench_agent(args) -> int:
    import torch

    from engine import bench, bench_agent
    from engine.runtime.planner import PlanError
    from engine.runtime.session import DEFAULT_PREFILL_CHUNK_TOKENS, ChatSession
    from engine.runtime.tokenizer import ChatTokenizer
    from engine.synthetic import SYNTHETIC_MODELS

    for flag, value, least in (
        ("--requests", args.requests, 2),
        ("--target-tokens", args.target_tokens, 1),
        ("--decode-tokens", args.decode_tokens, 1),
        ("--prefix-cache-mib", args.prefix_cache_mib, 0),
    ):
        if value < least:
            raise CliError(f"{flag} must be {least} or more, got {value}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda needs an NVIDIA GPU and a CUDA build of PyTorch; use --device cpu here")
    if args.model is not None and (args.device != "cpu" or args.preset or args.tokenizer):
        raise CliError(
            "--model runs on the CPU with its own tokenizer: leave out --device cuda, --preset and "
            "--tokenizer, or use --synthetic"
        )
    if args.synthetic is not None:
        if args.synthetic not in SYNTHETIC_MODELS:
            raise CliError(f"no synthetic model {args.synthetic!r}; choose one of {', '.join(SYNTHETIC_MODELS)}")
        if args.tokenizer is None:
            raise CliError("--synthetic needs --tokenizer FOLDER (the real model's tokenizer and chat template)")
        config = SYNTHETIC_MODELS[args.synthetic].config
    else:
        from engine.loader import read_config

        config = read_config(args.model)
    tokenizer = ChatTokenizer.from_folder(args.tokenizer or args.model)
    if tokenizer.vocab_size > config.vocab_size:
        raise CliError(
            f"the tokenizer has {tokenizer.vocab_size:,} tokens, more than the model's "
            f"{config.vocab_size:,}: give --tokenizer the folder of this model's own tokenizer"
        )
    script = bench_agent.agent_script(tokenizer, args.requests, args.target_tokens, args.seed)
    longest = script.last_prompt_tokens
    needed = longest + args.decode_tokens + 1
    notes = [
        f"the session is scripted (seed {args.seed}): the model's replies are not read, so random weights "
        f"replay the same conversation"
    ]
    if needed > config.max_position_embeddings:
        if not args.past_trained_context:
            raise CliError(
                f"the session reaches {needed:,} tokens, past this model's "
                f"{config.max_position_embeddings:,} (max_position_embeddings): lower --target-tokens, or "
                f"give --past-trained-context to measure the cache's work there anyway"
            )
        notes.append(
            f"the session runs past the model's trained {config.max_position_embeddings:,} positions "
            f"(--past-trained-context): its replies there mean nothing, the cost per token is the same"
        )
    plan, chunk, context = None, DEFAULT_PREFILL_CHUNK_TOKENS, needed
    try:
        if args.preset is not None:
            reserve = None
            if args.device == "cuda":
                from engine.runtime.reserve import runtime_reserve

                reserve = runtime_reserve().reserve_bytes
            plan = bench.plan_for(args.synthetic, args.preset, args.vram_limit, reserve)
            if longest > plan.max_prompt_tokens:
                raise ValueError(
                    f"the session's last prompt ({longest:,} tokens) is longer than the plan's "
                    f"guaranteed {plan.max_prompt_tokens:,}: lower --target-tokens"
                )
            chunk, context = plan.prefill_chunk_tokens, plan.kv_tokens
        elif args.vram_limit is not None:
            raise ValueError("--vram-limit needs --preset")
    except (ValueError, PlanError) as exc:
        raise CliError(str(exc)) from None
    result = {
        "model": args.synthetic or str(args.model),
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "plan": plan.to_dict() if plan is not None else None,
        "target_tokens": args.target_tokens,
        "notes": notes,
    }
    if args.device == "cuda" and plan is not None:
        from engine.runtime.vram import cap_process_memory

        result["vram_cap"] = cap_process_memory(plan.budget_bytes).to_dict()
    if args.output is not None:  # before the long run: a folder that cannot be made fails now
        try:
            args.output.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CliError(f"could not make the folder of --output {args.output}: {exc.strerror or exc}") from None
    started = time.perf_counter()
    if args.synthetic is not None:
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        model = bench.build_random_model(
            args.synthetic, args.device, dtype, plan.expert_slots if plan is not None else None
        )
    else:
        from engine.loader import load_model

        model = load_model(args.model)
    result["build_seconds"] = time.perf_counter() - started
    session = ChatSession(model, tokenizer, context_tokens=context, prefill_chunk_tokens=chunk)
    result.update(bench_agent.run_agent_bench(session, script, args.prefix_cache_mib * 2**20, args.decode_tokens))
    if args.device == "cuda":
        from engine.runtime.vram import measured_peak

        result.update(measured_peak())
    print(json.dumps(result, indent=2) if args.json else bench_agent.format_table(result))
    if args.output is not None:
        try:
            args.output.write_text(json.dumps(result, indent=2), encoding="utf-8")
        except OSError as exc:
            raise CliError(f"could not write --output {args.output}: {exc.strerror or exc}") from None
    return 0


def run_cpu_experts_bench(args) -> int:
    from engine import bench_cpu
    from engine.kernels import cpu_experts

    if args.synthetic is not None:
        raise CliError("--cpu-experts measures the CPU kernels alone: leave out --synthetic")
    if cpu_experts.numba is None:
        raise CliError("--cpu-experts needs numba (pip install numba)")
    limit = cpu_experts.numba.config.NUMBA_NUM_THREADS
    if args.threads is None:
        cores = cpu_experts.default_threads()
        counts = sorted({cores, *(2**i for i in range(cores.bit_length()))})
    else:
        try:
            counts = [int(part) for part in args.threads.split(",")]
        except ValueError:
            counts = []
        if not counts or any(not 1 <= n <= limit for n in counts):
            raise CliError(f"--threads must be whole numbers from 1 to {limit}, comma-separated, got {args.threads!r}")
    result = bench_cpu.run_cpu_bench(counts)
    print(json.dumps(result, indent=2) if args.json else bench_cpu.format_table(result))
    return 0


def run_pull(args) -> int:
    """Download with one status line (rewritten in place on a terminal, a line per file otherwise).

    The token is huggingface_hub's own (`hf auth login` or HF_TOKEN); Ctrl-C stops and keeps what arrived
    (a second Ctrl-C stops without waiting for a stalled read), and running the same command again resumes."""
    from engine import hub

    out = sys.stdout
    tty = out.isatty()
    state = {"file": None, "last": 0.0, "width": 0}

    def show_plan(plan) -> None:
        have = f", {hub.format_size(plan.have_bytes)} already here" if plan.have_bytes else ""
        print(
            f"{plan.repo_id} @ {plan.revision} (commit {plan.commit[:12]}): {len(plan.files)} files, "
            f"{hub.format_size(plan.total_bytes)}{have} -> {plan.folder}",
            file=out,
        )
        if plan.fit is not None:
            presets = "  ".join(f"{p.removesuffix('gb')} GB {'yes' if ok else 'no'}" for p, ok in plan.fit.fits.items())
            print(
                f"needs about {hub.format_size(plan.fit.ram_bytes)} of RAM; VRAM presets that fit: {presets}", file=out
            )
        elif plan.fit_note:
            print(plan.fit_note, file=out)
        out.flush()

    def show(p) -> None:
        now = time.monotonic()
        line = (
            f"[{100 * p.done / max(p.total, 1):5.1f}%] {p.files_done}/{p.files_total} {p.file} "
            f"{hub.format_size(p.file_done)}/{hub.format_size(p.file_size)}"
        )
        if p.state == "downloading" and p.speed > 0:
            line += f"  {hub.format_size(p.speed)}/s  ETA {hub.format_duration(p.eta_s)}"
        elif p.state != "downloading":
            line += f"  ({p.state})"
        if tty:
            if now - state["last"] >= 0.2 or p.state in ("verifying", "done"):
                out.write("\r" + line.ljust(state["width"]))
                state["width"] = len(line)
                state["last"] = now
        elif (
            p.state in ("retrying", "done")
            or (p.file != state["file"] and p.file_done == 0)
            or now - state["last"] >= 10
        ):
            out.write(line + "\n")
            state["last"] = now
        state["file"] = p.file
        out.flush()

    control = hub.DownloadControl()

    def on_interrupt(*_) -> None:
        if control.stopping:  # the second Ctrl-C: do not wait for the download to reach its next piece
            raise KeyboardInterrupt
        control.interrupt()

    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        folder = hub.pull(
            args.repo_id,
            args.revision,
            args.local_dir,
            endpoint=args.endpoint,
            offline=args.offline,
            progress=show,
            control=control,
            on_plan=show_plan,
        )
    except hub.HubError as exc:
        if tty:
            out.write("\n")
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except (hub.DownloadCancelled, KeyboardInterrupt) as exc:
        if tty:
            out.write("\n")
        folder = getattr(exc, "folder", "")
        kept = (
            "nothing was downloaded"
            if folder is None
            else f"what arrived is kept{f' in {folder}' if folder else ''}: run the same command again to resume"
        )
        print(f"error: interrupted; {kept}", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGINT, previous)
    if tty:
        out.write("\n")
    print(f"done: {folder} (try it: python -m engine chat --model {folder})", file=out)
    return 0


def _printable_output() -> None:
    """Let a terminal or pipe that is not UTF-8 show what it cannot encode as escapes instead of failing."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and codecs.lookup(stream.encoding).name != "utf-8":
            stream.reconfigure(errors="backslashreplace")


def main(argv: list[str] | None = None) -> int:
    _printable_output()
    try:
        args = build_parser().parse_args(argv)
        commands = {
            "chat": run_chat,
            "generate": run_generate,
            "plan": run_plan,
            "bench": run_bench,
            "bench-agent": run_bench_agent,
            "pull": run_pull,
            "serve": run_serve,
        }
        return commands[args.command](args)
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
