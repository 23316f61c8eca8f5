"""`bench`: the speed of a full-size model with random weights, or of the CPU's expert kernels alone."""

from __future__ import annotations

import json

from engine.cli.common import CliError
from engine.cli.loading import add_kv_cache_option, add_use_option


def register(commands) -> None:
    """Add the bench command."""
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
    add_kv_cache_option(bench)
    add_use_option(bench)
    bench.add_argument("--json", action="store_true")
    bench.set_defaults(run=run_bench)


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
        plan = bench.plan_for(args.synthetic, args.preset, args.vram_limit, reserve, args.kv_cache, args.use)
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
            kv_cache=args.kv_cache,
        )
    except LinkLimitError as exc:
        raise CliError(str(exc)) from None
    except torch.OutOfMemoryError as exc:  # each prompt's row catches its own: this is the build or the warm-up
        raise CliError(
            "the GPU ran out of memory building the model or prefilling the warm-up chunk, before any measurement "
            f"({str(exc).splitlines()[0]}): the plan does not hold on this GPU. Try a smaller --preset, and "
            "report this line with the GPU's name"
        ) from None
    print(json.dumps(result, indent=2) if args.json else bench.format_result(result))
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
