"""The model options of chat, generate and serve, and the model they load: GPU under a preset's plan, or the CPU."""

from __future__ import annotations

import argparse
import sys

from engine.checkpoint.quant_config import KV_CACHE_CHOICES
from engine.cli.common import CliError
from engine.experts.backend import BACKENDS
from engine.resources import DEMO_MODEL, resolve_model

DEFAULT_CONTEXT_TOKENS = 8192


def add_model_options(p: argparse.ArgumentParser) -> None:
    """Add the options that pick a model and where it runs: --model, --context, --device, --preset and more."""
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
    add_kv_cache_option(p)
    add_use_option(p)


def add_kv_cache_option(p: argparse.ArgumentParser) -> None:
    """Add --kv-cache, the KV cache's format."""
    p.add_argument(
        "--kv-cache",
        choices=KV_CACHE_CHOICES,
        default="auto",
        help="auto: bf16 for now; fp8 halves the KV cache (e4m3 with per-head scales)",
    )


def add_use_option(p: argparse.ArgumentParser) -> None:
    """Add --use, what the GPU memory beyond a 32K-token prompt goes to."""
    from engine.runtime.planner import DEFAULT_USE, USES

    p.add_argument(
        "--use",
        choices=USES,
        default=DEFAULT_USE,
        help="what the VRAM plan gives the memory beyond a 32K-token prompt: chat (expert-cache layers, faster "
        "decode) or long-context (KV cache for longer prompts, larger prefill chunks)",
    )


def open_model(args):
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
        placement = plan_placement(
            args.model, args.preset, device=args.device, kv_cache_dtype=args.kv_cache, use=args.use
        )
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
