"""What the session benches (bench-agent, bench-resume) share: the model options, their checks, the plan, the
model's build and the report."""

from __future__ import annotations

import json
import time
from pathlib import Path

from engine.cli.common import CliError
from engine.resources import resolve_model


def add_model_options(parser) -> None:
    """Add the options that say which model runs where, and how the result is reported."""
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", type=resolve_model, help="checkpoint folder or 'demo' (runs on the CPU)")
    model.add_argument(
        "--synthetic",
        help="a built-in model description with random weights, e.g. qwen3.6-35b-a3b-nvfp4 (needs --tokenizer)",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help="with --synthetic: a folder with the model's tokenizer.json, tokenizer_config.json and chat template",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--preset",
        choices=["4gb", "8gb", "12gb"],
        help="with --synthetic: the VRAM plan (expert cache, prefill chunk, KV cache) to run under",
    )
    parser.add_argument("--vram-limit", type=float, help="VRAM budget in GiB (default: the preset's size)")
    parser.add_argument(
        "--past-trained-context",
        action="store_true",
        help="let the session run past the model's max_position_embeddings (its replies there mean "
        "nothing; the scripted session does not read them)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of the table")
    parser.add_argument("--output", type=Path, help="also write the result as JSON to this file")


def model_source(args):
    """(config, tokenizer) of the model the options name, after checking they go together."""
    import torch

    from engine.runtime.tokenizer import ChatTokenizer
    from engine.synthetic import SYNTHETIC_MODELS

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
    return config, tokenizer


def check_length(args, config, needed: int, notes: list[str], lower: str) -> None:
    """Refuse a session of `needed` tokens past the model's trained context unless the options allow it, and
    say so in `notes` when they do; `lower`: the option that makes the session shorter."""
    if needed <= config.max_position_embeddings:
        return
    if not args.past_trained_context:
        raise CliError(
            f"the session reaches {needed:,} tokens, past this model's "
            f"{config.max_position_embeddings:,} (max_position_embeddings): lower {lower}, or "
            f"give --past-trained-context to measure the cache's work there anyway"
        )
    notes.append(
        f"the session runs past the model's trained {config.max_position_embeddings:,} positions "
        f"(--past-trained-context): its replies there mean nothing, the cost per token is the same"
    )


def plan_session(args, longest: int, needed: int, lower: str):
    """(plan or None, prefill chunk, context tokens) for a session whose longest prompt is `longest`."""
    from engine import bench
    from engine.runtime.planner import PlanError
    from engine.runtime.session import DEFAULT_PREFILL_CHUNK_TOKENS

    try:
        if args.preset is None:
            if args.vram_limit is not None:
                raise ValueError("--vram-limit needs --preset")
            return None, DEFAULT_PREFILL_CHUNK_TOKENS, needed
        reserve = None
        if args.device == "cuda":
            from engine.runtime.reserve import runtime_reserve

            reserve = runtime_reserve().reserve_bytes
        plan = bench.plan_for(args.synthetic, args.preset, args.vram_limit, reserve)
        if longest > plan.max_prompt_tokens:
            raise ValueError(
                f"the session's longest prompt ({longest:,} tokens) is longer than the plan's "
                f"guaranteed {plan.max_prompt_tokens:,}: lower {lower}"
            )
        return plan, plan.prefill_chunk_tokens, plan.kv_tokens
    except (ValueError, PlanError) as exc:
        raise CliError(str(exc)) from None


def start_result(args, plan, notes: list[str]) -> dict:
    """The report's head; caps the process's VRAM at the plan's budget and checks --output's folder first."""
    import torch

    result = {
        "model": args.synthetic or str(args.model),
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "plan": plan.to_dict() if plan is not None else None,
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
    return result


def build_model(args, plan, result: dict):
    """The model the options name, its build time in `result`."""
    import torch

    from engine import bench

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
    return model


def report(args, result: dict, table: str) -> int:
    """Add the GPU's peak, print the result (table or JSON) and write --output."""
    if args.device == "cuda":
        from engine.runtime.vram import measured_peak

        result.update(measured_peak())
    print(json.dumps(result, indent=2) if args.json else table(result))
    if args.output is not None:
        try:
            args.output.write_text(json.dumps(result, indent=2), encoding="utf-8")
        except OSError as exc:
            raise CliError(f"could not write --output {args.output}: {exc.strerror or exc}") from None
    return 0
