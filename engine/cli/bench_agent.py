"""`bench-agent`: a scripted agent session through the prefix cache, with what each request prefills."""

from __future__ import annotations

import json
import time
from pathlib import Path

from engine.cli.common import CliError
from engine.resources import resolve_model


def register(commands) -> None:
    """Add the bench-agent command."""
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
    agent.set_defaults(run=run_bench_agent)


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
