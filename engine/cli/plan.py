"""`plan`: the VRAM plan of a checkpoint or a built-in model description for a preset."""

from __future__ import annotations

import json

from engine.cli.common import CliError
from engine.cli.loading import add_kv_cache_option, add_use_option
from engine.resources import resolve_model


def register(commands) -> None:
    """Add the plan command."""
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
    add_kv_cache_option(plan)
    add_use_option(plan)
    plan.set_defaults(run=run_plan)


def run_plan(args) -> int:
    from engine.runtime.footprint import footprint_from_checkpoint, footprint_from_synthetic
    from engine.runtime.planner import REFERENCE_CARD, PlanError, plan_memory, preset_budget_bytes

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
            footprint,
            budget,
            args.preset,
            reserve_bytes=reserve.reserve_bytes,
            reserve_source=reserve.source,
            use=args.use,
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
