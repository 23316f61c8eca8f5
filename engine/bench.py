"""`python -m engine bench`: prefill and decode speed of a full-size model with random weights, built in
memory in its real checkpoint layout (no download, no file), with the ceilings it is judged against.

Random weights route however their random numbers fall, so the bench forces the routing (`--routing`,
engine/experts/routing.py) and every result names the mode it ran under and what that implies.
`--link-gbps` holds the expert copies to a narrower link than the machine's (engine/experts/link.py), as on
the field report's laptop.
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

import torch

from engine.bench_hf import hf_offload_row
from engine.bench_projection import CHECK_PROMPT, add_ceilings, pcie_bounds, projection
from engine.checkpoint import Checkpoint, TensorShard
from engine.checkpoint.source import WeightSource
from engine.experts.link import LinkLimit, LinkLimitError
from engine.experts.policy import BackendTrial
from engine.experts.routing import NOTES as ROUTING_NOTES
from engine.experts.routing import ForcedRouting, force_routing
from engine.loader import build_model, expert_executor, kv_dtype
from engine.models.base import CausalLM
from engine.runtime.footprint import footprint_from_synthetic
from engine.runtime.planner import DEFAULT_USE, MemoryPlan, plan_memory, preset_budget_bytes
from engine.runtime.vram import cap_process_memory, measured_peak
from engine.synthetic import SYNTHETIC_MODELS
from engine.testing.random_weights import random_tensors

MODEL_ROUTING = "model"  # the random routers decide
ROUTING_NOTES = {
    MODEL_ROUTING: "routing by the random routers: random weights route however their numbers fall, "
    "so expert-cache hit rates say nothing of a real model; force a routing with "
    "--routing uniform|locality",
    **ROUTING_NOTES,
}
DEFAULT_PREFILL_CHUNK = 512  # without a plan (CPU runs)
BANDWIDTH_PROBE_BYTES = 256 * 2**20
HF_BASELINE_TOKENS = 128  # the baseline's prompt at most (its decode takes seconds a token)
# Of the capped allocator, what accelerate may place weights in (the rest: activations). accelerate keeps room for
# the largest layer (an MoE layer: 1.6 GB in bf16) on the GPU: below this share nothing else fit on the GPU
HF_GPU_SHARE = 0.9


def build_random_model(
    name: str,
    device: str,
    dtype: torch.dtype,
    expert_cache_slots: int | None,
    pin_budget_bytes: int | None = None,
    expert_backend: str = "offload",
    cpu_threads: int | None = None,
    seed: int = 0,
    link: LinkLimit | None = None,
    kv_cache: str = "auto",
) -> CausalLM:
    """The synthetic model `name` in its real checkpoint layout, with honest random weights, in memory; `link`:
    its expert copies held to an emulated link (engine/experts/link.py); `kv_cache`: the KV cache's format."""
    synthetic = SYNTHETIC_MODELS[name]
    config = synthetic.config
    tensors = random_tensors(synthetic.tensor_layout(), config.zero_centered_norms, seed)
    where = Path(f"<random {name}>")
    checkpoint = Checkpoint(where, synthetic.quantization_config, shards=[TensorShard(tensors, where)])
    source = WeightSource(checkpoint, config, torch.device(device), dtype, kv_dtype(kv_cache, checkpoint.quant))
    executor = expert_executor(device, expert_cache_slots, pin_budget_bytes, expert_backend, cpu_threads, link)
    return build_model(source, executor)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def host_to_device_bandwidth(pinned: bool) -> float:
    """Bytes per second of one large host-to-GPU copy, measured now."""
    source = torch.empty(BANDWIDTH_PROBE_BYTES, dtype=torch.uint8, pin_memory=pinned)
    target = torch.empty_like(source, device="cuda")
    target.copy_(source)  # first touch and warm-up
    torch.cuda.synchronize()
    started = time.perf_counter()
    target.copy_(source, non_blocking=pinned)
    torch.cuda.synchronize()
    return BANDWIDTH_PROBE_BYTES / (time.perf_counter() - started)


def link_note(link: LinkLimit, pageable: bool) -> str:
    """What `--link-gbps` emulated, and how, for the result's notes."""
    return (
        f"host->GPU expert copies held to {link.bytes_per_s / 1e9:g} GB/s ({'pageable' if pageable else 'pinned'} "
        f"records): the copies still happen at this machine's speed, then a GPU kernel on the copies' own "
        f"stream spins on the GPU's global timer until the run of copies began plus its bytes at that rate, "
        f"so whatever waits for them waits as on such a link (pageable copies keep the host waiting too); "
        f"decode steps stay captured as CUDA graphs, the hold after each in-graph gather counting the step's "
        f"misses on the device. Not held: the CPU expert path (cpu, hybrid: host RAM, no link) and the few KB "
        f"of activations and slot tables a layer, and the transformers + accelerate baseline's copies; link "
        f"latency is not emulated, only its rate. The split's calibration, the PCIe bounds and the decode "
        f"ceilings use the held rate"
    )


def _host_peak_memory() -> dict:
    try:
        import resource
    except ImportError:  # Windows: no getrusage
        return {}
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    return {"peak_process_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale}


def measure(
    model: CausalLM,
    device: str,
    prompt_tokens: int,
    decode_tokens: int,
    chunk: int,
    seed: int,
    kv_tokens: int | None = None,
    backends: list[str] | None = None,
    decode_inputs: str = "greedy",
    routing: ForcedRouting | None = None,
) -> dict:
    """Prefill a random prompt in chunks, then decode; speeds, time to first token and cache traffic.
    `kv_tokens`: the plan's KV cache, allocated whole as the app would (default: just enough). `backends`:
    decode `decode_tokens` with each expert backend in turn (engine/experts/backend.py), one after the other on
    the same sequence; the row's decode figures are the first one's, all are under "decode_by_backend".
    `decode_inputs`: "greedy" feeds each step the last one's argmax, "random" feeds random tokens. `routing`:
    the forced routing installed in the model (its next step's experts are drawn before each step). `auto` is
    timed after its trial (BackendTrial) has chosen, which the row reports."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_tokens,), generator=generator)
    executor = model.expert_executor
    untimed = 1 + (BackendTrial.STEPS if "auto" in (backends or []) else 0)
    state = model.new_state(kv_tokens or prompt_tokens + (decode_tokens + untimed) * len(backends or [None]))

    def step(token: int) -> int:
        if routing is not None:
            routing.advance()
        return int(model.forward([token], state).argmax())  # read back either way: the same wait per step

    before = executor.stats()
    _sync(device)
    started = time.perf_counter()
    for begin in range(0, prompt_tokens, chunk):
        logits = model.forward(prompt[begin : begin + chunk], state)
    token = int(logits.argmax())
    _sync(device)
    first_token = time.perf_counter()
    row = {
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "decode_inputs": decode_inputs,
        "routing": routing.mode if routing is not None else MODEL_ROUTING,
        "prefill_chunk_tokens": chunk,
        "time_to_first_token_s": first_token - started,
        "prefill_tokens_per_s": prompt_tokens / (first_token - started),
    }
    row.update(_traffic("prefill", before, executor.stats()))
    by_backend = {}
    for backend in (backends or [None]) if decode_tokens else []:
        if backend is not None:
            executor.choose_backend(backend)
        # untimed: the first step on a new state captures its decode graphs (engine/runtime/graph_runner.py),
        # and auto's trial steps time its candidates (BackendTrial.STEPS: the longest trial)
        for _ in range(1 + (BackendTrial.STEPS if executor.backend_trial else 0)):
            token = step(token)
        _sync(device)
        inputs = torch.randint(0, model.config.vocab_size, (decode_tokens,), generator=generator).tolist()
        start = executor.stats()
        began = time.perf_counter()
        for position in range(decode_tokens):
            token = step(token)
            if decode_inputs == "random":
                token = inputs[position]
        _sync(device)
        seconds = time.perf_counter() - began
        end = executor.stats()
        decode = {
            "decode_tokens_per_s": decode_tokens / seconds if decode_tokens else 0.0,
            **_traffic("decode", start, end),
        }
        if "cpu_expert_calls" in end:
            cpu = end["cpu_expert_calls"] - start["cpu_expert_calls"]
            gpu = end["expert_calls"] - start["expert_calls"]
            decode["decode_cpu_expert_share"] = cpu / (cpu + gpu) if cpu + gpu else 0.0
        if backend == "hybrid" and "hybrid_cpu_fraction" in end:  # where the balance settled
            decode["decode_hybrid_cpu_fraction"] = end["hybrid_cpu_fraction"]
        if "expert_backend_trial" in end:  # auto: the step each backend took in the trial, and the choice
            decode["decode_auto_trial"] = end["expert_backend_trial"]
        by_backend[backend] = decode
    row.update(next(iter(by_backend.values()), {}))
    if backends and by_backend:
        row["decode_by_backend"] = by_backend
    return row


def _traffic(phase: str, start: dict, end: dict) -> dict:
    """Expert-cache hit rate and bytes copied between two executor stats."""
    if "expert_cache_hits" not in end:
        return {}
    hits = end["expert_cache_hits"] - start["expert_cache_hits"]
    misses = end["expert_cache_misses"] - start["expert_cache_misses"]
    return {
        f"{phase}_expert_cache_hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        f"{phase}_expert_bytes_copied": end["expert_bytes_copied"] - start["expert_bytes_copied"],
    }


def run_bench(
    name: str,
    device: str,
    prompt_lengths: list[int],
    decode_tokens: int,
    plan: MemoryPlan | None,
    seed: int = 0,
    backends: list[str] | None = None,
    hf_baseline: bool = False,
    decode_inputs: str = "greedy",
    routings: list[str] | None = None,
    cpu_threads: int | None = None,
    pageable: bool = False,
    decode_after: list[int] | None = None,
    gpu_step_seconds: float | None = None,
    link_bytes_per_s: float | None = None,
    kv_cache: str = "auto",
) -> dict:
    """On CUDA with a plan, the process is held to the plan's budget (engine/runtime/vram.py) for the whole
    run, and each prompt length reports its measured peak against it. `routings`: forced routing modes
    (engine/experts/routing.py), each prompt length run under each; None lets the random routers decide.
    `backends` (CUDA): decode with each expert backend in turn after every prefill. `cpu_threads`: the CPU
    experts' threads; `pageable`: no expert record pinned (as where pinning is refused). `hf_baseline`: then
    the same shape through transformers + accelerate under the same cap (engine/bench_hf.py), on the shortest
    prompt, up to HF_BASELINE_TOKENS. `decode_after`: the prompt lengths whose prefill a decode follows (default
    every one); elsewhere `locality` and `fixed`, which route prompt chunks as `uniform` does, run only if it
    does not. `gpu_step_seconds`: the
    GPU's own step for the decode ceilings, where no `fixed` row can measure it (a cache smaller than a step's
    experts over all layers). `link_bytes_per_s` (CUDA): expert copies held to an emulated link of that rate
    (engine/experts/link.py), below the measured one (else LinkLimitError, before anything is built); the link
    figures, bounds, ceilings and the split's calibration are then the held rate's. `kv_cache`: the KV cache's
    format (the plan's must match)."""
    synthetic = SYNTHETIC_MODELS[name]
    slots = plan.expert_slots if plan is not None else None
    chunk = plan.prefill_chunk_tokens if plan is not None else DEFAULT_PREFILL_CHUNK
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    modes = routings or [MODEL_ROUTING]
    if link_bytes_per_s is not None and device != "cuda":
        raise LinkLimitError("a link limit needs --device cuda: on the CPU no expert crosses a link")
    link = LinkLimit(link_bytes_per_s) if link_bytes_per_s is not None else None
    result = {
        "model": name,
        "description": synthetic.description,
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "pageable_experts": pageable,
        "cpu_threads": cpu_threads,
        "link_limit_bytes_per_s": link_bytes_per_s,
        "kv_cache": kv_cache,
        "plan": plan.to_dict() if plan is not None else None,
        "notes": [ROUTING_NOTES[mode] for mode in modes],
        "runs": [],
    }
    bandwidth = None
    if device == "cuda":
        result["host_to_device_bytes_per_s"] = {
            "pinned": host_to_device_bandwidth(pinned=True),
            "pageable": host_to_device_bandwidth(pinned=False),
        }
        bandwidth = result["host_to_device_bytes_per_s"]["pageable" if pageable else "pinned"]
        if link is not None:
            link.check_below(bandwidth, "pageable" if pageable else "pinned")
            bandwidth = link.through(bandwidth)
            result["notes"].append(link_note(link, pageable))
        result["expert_link_bytes_per_s"] = bandwidth
        torch.cuda.empty_cache()
        if plan is not None:
            result["vram_cap"] = cap_process_memory(plan.budget_bytes).to_dict()
    started = time.perf_counter()
    # The CPU kernel and the calibration are made when a backend needs them; the backend then switches per run
    build_backend = "hybrid" if set(backends or []) & {"cpu", "hybrid", "auto"} else "offload"
    model = build_random_model(
        name, device, dtype, slots, 0 if pageable else None, build_backend, cpu_threads, seed, link, kv_cache
    )
    result["build_seconds"] = time.perf_counter() - started
    executor = model.expert_executor
    result["expert_placement"] = dict(executor.host_report)
    stats = executor.stats()
    result["expert_backend"] = stats.get("expert_backend")
    result["prefill_kept_layers"] = stats.get("expert_cache_kept_layers", 0)
    if executor.calibration is not None:
        result["calibration"] = executor.calibration.to_dict()
    packed = executor.packed
    expert_bytes = sum(p.nbytes for p in packed.values())
    routing = force_routing(model, modes[0], seed) if modes != [MODEL_ROUTING] else None
    if routing is not None and slots:
        result["uniform_floor_hit_rate"] = min(1.0, slots / (len(packed) * model.config.num_experts))
    # Untimed: a chunk, the shortest prompt and a few tokens compile and load the kernels the rows use (their
    # tile shapes follow the rows an expert gets), so no row pays for it, as llama-bench warms each test
    for warm in sorted({min(chunk, max(prompt_lengths)), min(chunk, min(prompt_lengths))}, reverse=True):
        measure(model, device, warm, 2, chunk, seed + 1, plan.kv_tokens if plan is not None else None, routing=routing)
    for length in prompt_lengths:
        decodes = decode_after is None or length in decode_after
        for mode in modes:
            if not decodes and mode in ("locality", "fixed") and "uniform" in modes:
                continue  # they route prompt chunks as uniform does: the same prefill again
            result["runs"].append(
                _run_one(
                    model,
                    device,
                    length,
                    decode_tokens if decodes else 0,
                    chunk,
                    seed,
                    plan,
                    backends,
                    decode_inputs,
                    routing,
                    mode,
                    bandwidth,
                    expert_bytes,
                )
            )
    if packed and "expert_link_bytes_per_s" in result:
        add_ceilings(
            result,
            next(iter(packed.values())).layout.record_bytes,
            len(packed),
            model.config.num_experts_per_tok,
            gpu_step_seconds,
        )
        projected = projection(result, footprint_from_synthetic(name)) if plan is not None else None
        if projected is not None:
            result["projection"] = projected
    if hf_baseline:
        del model, routing  # its expert records and weights make room for the other model
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        cap = result.get("vram_cap", {}).get("allocator_limit_bytes")
        prompt = min(min(prompt_lengths), HF_BASELINE_TOKENS)
        try:
            result["baseline"] = hf_offload_row(
                name, device, int(cap * HF_GPU_SHARE) if cap else None, prompt, min(decode_tokens, 3), seed
            )
        except Exception as exc:  # the other tool failing must not lose our figures (seen: inputs on the wrong device)
            result["baseline"] = {"baseline": "transformers + accelerate", "error": f"{type(exc).__name__}: {exc}"}
    if device != "cuda":
        result.update(_host_peak_memory())
    return result


def _run_one(
    model: CausalLM,
    device: str,
    length: int,
    decode_tokens: int,
    chunk: int,
    seed: int,
    plan: MemoryPlan | None,
    backends: list[str] | None,
    decode_inputs: str,
    routing: ForcedRouting | None,
    mode: str,
    bandwidth: float | None,
    expert_bytes: int,
) -> dict:
    """One prompt length under one routing mode: its row, with the measured peak against the plan on CUDA."""
    if plan is not None and length > plan.max_prompt_tokens:
        return {
            "prompt_tokens": length,
            "routing": mode,
            "skipped": f"longer than the plan's guaranteed prompt of {plan.max_prompt_tokens:,} tokens",
        }
    if routing is not None:
        routing.mode = mode  # the same object: captured decode graphs read its step ids
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        row = measure(
            model,
            device,
            length,
            decode_tokens,
            chunk,
            seed,
            plan.kv_tokens if plan is not None else None,
            backends,
            decode_inputs,
            routing,
        )
    except torch.OutOfMemoryError as exc:
        row = {"prompt_tokens": length, "routing": mode, "error": f"out of memory: {str(exc).splitlines()[0]}"}
    except Exception as exc:  # one failing length must not lose the others' figures
        row = {"prompt_tokens": length, "routing": mode, "error": f"{type(exc).__name__}: {exc}"}
    print(f"bench: {row}", file=sys.stderr, flush=True)
    if device == "cuda":
        row.update(measured_peak())
        if plan is not None:
            row["peak_within_budget"] = row["peak_process_bytes"] <= plan.budget_bytes
        if bandwidth is not None and plan is not None and "error" not in row:
            row.update(pcie_bounds(row, bandwidth, expert_bytes))
        torch.cuda.empty_cache()
    return row


def plan_for(
    name: str,
    preset: str | None,
    vram_gib: float | None,
    reserve_bytes: int | None = None,
    kv_cache: str = "auto",
    use: str = DEFAULT_USE,
) -> MemoryPlan | None:
    """The memory plan of synthetic model `name` under `preset` (None without one), its KV cache in `kv_cache`,
    the memory beyond the target prompt spent as `use` says."""
    if preset is None:
        return None
    budget = int(vram_gib * 2**30) if vram_gib else preset_budget_bytes(preset)
    extra = {} if reserve_bytes is None else {"reserve_bytes": reserve_bytes}
    return plan_memory(footprint_from_synthetic(name, kv_cache), budget, preset, use=use, **extra)


def format_result(result: dict) -> str:
    lines = [
        f"{result['model']} on {result['device_name']} ({result['dtype']}), built in {result['build_seconds']:.1f} s",
        *(f"note: {note}" for note in result["notes"]),
    ]
    if "host_to_device_bytes_per_s" in result:
        bw = result["host_to_device_bytes_per_s"]
        lines.append(
            f"host->GPU copy: pinned {bw['pinned'] / 1e9:.1f} GB/s, pageable {bw['pageable'] / 1e9:.1f} GB/s"
            + ("; expert records pageable" if result.get("pageable_experts") else "")
            + (
                f"; expert copies held to {result['link_limit_bytes_per_s'] / 1e9:g} GB/s"
                if result.get("link_limit_bytes_per_s")
                else ""
            )
        )
    if "uniform_floor_hit_rate" in result:
        lines.append(f"uniform routing's hit-rate floor: {result['uniform_floor_hit_rate']:.3f} (slots / experts)")
    lines.append(
        f"{'prompt':>8} {'routing':>9} {'chunk':>6} {'TTFT s':>8} {'prefill tok/s':>14} {'decode tok/s':>13} "
        f"{'hit rate p/d':>13}"
    )
    for row in result["runs"]:
        if "skipped" in row or "error" in row:
            lines.append(f"{row['prompt_tokens']:>8} {row['routing']:>9} {row.get('skipped') or row['error']}")
            continue
        hits = (
            "/".join(
                f"{row[k]:.2f}" for k in ("prefill_expert_cache_hit_rate", "decode_expert_cache_hit_rate") if k in row
            )
            or "-"
        )
        lines.append(
            f"{row['prompt_tokens']:>8} {row['routing']:>9} {row['prefill_chunk_tokens']:>6} "
            f"{row['time_to_first_token_s']:>8.2f} {row['prefill_tokens_per_s']:>14.1f} "
            f"{format(row['decode_tokens_per_s'], '.1f') if 'decode_tokens_per_s' in row else '-':>13} "
            f"{hits:>13}"
        )
        if "decode_by_backend" in row:
            lines.append(
                "         decode by expert backend: "
                + ", ".join(
                    f"{backend} {d['decode_tokens_per_s']:.1f} tok/s (CPU {d.get('decode_cpu_expert_share', 0):.0%}, "
                    f"hits {d.get('decode_expert_cache_hit_rate', 0):.2f})"
                    for backend, d in row["decode_by_backend"].items()
                )
            )
    baseline = result.get("baseline")
    if baseline is not None:
        lines.append(
            f"baseline, {baseline['baseline']}: "
            + (
                baseline.get("skipped")
                or baseline.get("error")
                or (
                    f"{baseline['prompt_tokens']}-token prompt, prefill {baseline['prefill_tokens_per_s']:.1f} tok/s, "
                    f"decode {baseline['decode_tokens_per_s']:.2f} tok/s"
                )
            )
        )
    for card in (result.get("projection") or {}).get("cards", []):
        uniform = card["decode_tokens_per_s"].get("uniform", {})
        decode = ", ".join(
            f"{backend} {d['scaled_by_measured']:.1f}" for backend, d in uniform.items() if backend != "auto"
        )
        prefill = card["prefill_tokens_per_s"][CHECK_PROMPT]
        lines.append(
            f"modelled for {card['card']['name']} (not measured): decode tok/s under uniform routing "
            f"{decode or '-'}; prefill {prefill['modelled']:.0f} tok/s at {CHECK_PROMPT:,} tokens"
        )
    peaks = [row["peak_process_bytes"] for row in result["runs"] if "peak_process_bytes" in row]
    if peaks:
        lines.append(f"peak GPU memory of the process: {max(peaks) / 2**30:.2f} GiB")
    elif result.get("peak_process_rss_bytes"):
        lines.append(f"peak host memory: {result['peak_process_rss_bytes'] / 2**30:.2f} GiB")
    return "\n".join(lines)


def parse_lengths(text: str, flag: str = "--prompt-tokens") -> list[int]:
    """Parses comma-separated token counts, saying which flag was wrong."""
    try:
        lengths = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise ValueError(f"{flag} takes positive whole numbers separated by commas, e.g. 512,4096; got {text!r}")
    return lengths
