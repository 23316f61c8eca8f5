"""`python -m engine bench`: prefill and decode speed of a full-size model with random weights, built in
memory from its real shapes and formats (no download, no file), with the ceilings it is judged against.

Random router weights spread tokens evenly over the experts, so expert-cache hit rates measured here
are a pessimistic floor for real models; every result says so.
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

import torch

from engine.bench_hf import hf_offload_row
from engine.checkpoint import Checkpoint, TensorShard
from engine.experts.split import BackendTrial
from engine.layers.source import WeightSource
from engine.loader import expert_executor
from engine.models import BUILDERS
from engine.models.base import CausalLM
from engine.runtime.planner import MemoryPlan, footprint_from_synthetic, plan_memory, preset_budget_bytes
from engine.runtime.vram import cap_process_memory, measured_peak
from engine.synthetic import SYNTHETIC_MODELS, checkpoint_format, text_config
from engine.testing.tiny_checkpoints import checkpoint_tensors

ROUTING_NOTE = ("random weights: the router spreads tokens evenly over the experts, so with random decode inputs "
                "the expert-cache hit rates are a pessimistic floor for a real model; greedy decoding can repeat a "
                "token, and its experts, more than a real model would")
DEFAULT_PREFILL_CHUNK = 512  # without a plan (CPU runs)
BANDWIDTH_PROBE_BYTES = 256 * 2**20
HF_BASELINE_TOKENS = 128  # the baseline's prompt at most (its decode takes seconds a token)
# Of the capped allocator, what accelerate may place weights in (the rest: activations). accelerate keeps room for
# the largest layer (an MoE layer: 1.6 GB in bf16) on the GPU: at 0.75 of the 4gb cap nothing else fit, not even
# the embedding, and the whole model ran in host RAM on the CPU (H200, 2026-11-30)
HF_GPU_SHARE = 0.9


def build_random_model(name: str, device: str, dtype: torch.dtype, expert_cache_slots: int | None,
                       pin_budget_bytes: int | None = None, expert_backend: str = "offload") -> CausalLM:
    """The synthetic model `name` with random weights of its real shapes and formats, in memory."""
    synthetic = SYNTHETIC_MODELS[name]
    config = synthetic.config
    tensors, quant = checkpoint_tensors(config.model_type, checkpoint_format(synthetic), text_config(config),
                                        tiled=True)
    where = Path(f"<random {name}>")
    checkpoint = Checkpoint(where, quant, shards=[TensorShard(tensors, where)])
    source = WeightSource(checkpoint, config, torch.device(device), dtype)
    executor = expert_executor(device, expert_cache_slots, pin_budget_bytes, expert_backend)
    return BUILDERS[config.model_type](source, executor)


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


def _host_peak_memory() -> dict:
    try:
        import resource
    except ImportError:  # Windows: no getrusage
        return {}
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    return {"peak_process_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale}


def measure(model: CausalLM, device: str, prompt_tokens: int, decode_tokens: int, chunk: int, seed: int,
            kv_tokens: int | None = None, backends: list[str] | None = None, decode_inputs: str = "greedy") -> dict:
    """Prefill a random prompt in chunks, then decode; speeds, time to first token and cache traffic.
    `kv_tokens`: the plan's KV cache, allocated whole as the app would (default: just enough). `backends`:
    decode `decode_tokens` with each expert backend in turn (engine/experts/split.py), one after the other on
    the same sequence; the row's decode figures are the first one's, all are under "decode_by_backend".
    `decode_inputs`: "greedy" feeds each step the last one's argmax (random weights tend to repeat a token, and
    so its experts, which the expert cache can then hit); "random" feeds random tokens, which spread the routing
    (the cache's floor). `auto` is timed after its trial (BackendTrial) has chosen, which the row reports."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_tokens,), generator=generator)
    executor = model.expert_executor
    untimed = 1 + (BackendTrial.STEPS if "auto" in (backends or []) else 0)
    state = model.new_state(kv_tokens or prompt_tokens + (decode_tokens + untimed) * len(backends or [None]))
    before = executor.stats()
    _sync(device)
    started = time.perf_counter()
    for begin in range(0, prompt_tokens, chunk):
        logits = model.forward(prompt[begin:begin + chunk], state)
    token = int(logits.argmax())
    _sync(device)
    first_token = time.perf_counter()
    row = {"prompt_tokens": prompt_tokens, "decode_tokens": decode_tokens, "decode_inputs": decode_inputs,
           "prefill_chunk_tokens": chunk,
           "time_to_first_token_s": first_token - started,
           "prefill_tokens_per_s": prompt_tokens / (first_token - started)}
    row.update(_traffic("prefill", before, executor.stats()))
    by_backend = {}
    for backend in backends or [None]:
        if backend is not None:
            executor.choose_backend(backend)
        # untimed: the first step on a new state captures its decode graphs (engine/runtime/decode_graphs.py),
        # and auto's trial steps time its candidates (BackendTrial.STEPS: the longest trial)
        for _ in range(1 + (BackendTrial.STEPS if getattr(executor, "backend_trial", None) else 0)):
            token = int(model.forward([token], state).argmax())
        _sync(device)
        inputs = torch.randint(0, model.config.vocab_size, (decode_tokens,), generator=generator).tolist()
        start = executor.stats()
        began = time.perf_counter()
        for step in range(decode_tokens):
            token = int(model.forward([token], state).argmax())  # read back either way: the same wait per step
            if decode_inputs == "random":
                token = inputs[step]
        _sync(device)
        seconds = time.perf_counter() - began
        end = executor.stats()
        decode = {"decode_tokens_per_s": decode_tokens / seconds if decode_tokens else 0.0,
                  **_traffic("decode", start, end)}
        if "cpu_expert_calls" in end:
            cpu = end["cpu_expert_calls"] - start["cpu_expert_calls"]
            gpu = end["expert_calls"] - start["expert_calls"]
            decode["decode_cpu_expert_share"] = cpu / (cpu + gpu) if cpu + gpu else 0.0
        if backend == "hybrid" and "hybrid_cpu_fraction" in end:  # where the balance settled
            decode["decode_hybrid_cpu_fraction"] = end["hybrid_cpu_fraction"]
        if "expert_backend_trial" in end:  # auto: the step each backend took in the trial, and the choice
            decode["decode_auto_trial"] = end["expert_backend_trial"]
        by_backend[backend] = decode
    row.update(next(iter(by_backend.values())))
    if backends:
        row["decode_by_backend"] = by_backend
    return row


def _traffic(phase: str, start: dict, end: dict) -> dict:
    """Expert-cache hit rate and bytes copied between two executor stats."""
    if "expert_cache_hits" not in end:
        return {}
    hits = end["expert_cache_hits"] - start["expert_cache_hits"]
    misses = end["expert_cache_misses"] - start["expert_cache_misses"]
    return {f"{phase}_expert_cache_hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            f"{phase}_expert_bytes_copied": end["expert_bytes_copied"] - start["expert_bytes_copied"]}


def _bounds(row: dict, bandwidth: float, expert_bytes: int) -> dict:
    """Ratios of measured speed to the PCIe-streaming bounds at the measured pinned bandwidth: each prefill
    chunk streams every MoE layer's experts once; a decode token streams what it missed."""
    chunks = -(-row["prompt_tokens"] // row["prefill_chunk_tokens"])
    prefill_bound = row["prompt_tokens"] / (chunks * expert_bytes / bandwidth)
    bounds = {"prefill_pcie_bound_tokens_per_s": prefill_bound,
              "prefill_vs_bound": row["prefill_tokens_per_s"] / prefill_bound}
    bounds.update(_decode_bound(row, bandwidth))
    for decode in row.get("decode_by_backend", {}).values():
        decode.update(_decode_bound({**decode, "decode_tokens": row["decode_tokens"]}, bandwidth))
    return bounds


def _decode_bound(decode: dict, bandwidth: float) -> dict:
    """A decode token streams what it missed and the GPU computes (the CPU's share is not bounded by PCIe)."""
    copied = decode.get("decode_expert_bytes_copied", 0)
    if not decode["decode_tokens"] or not copied:
        return {}
    bound = decode["decode_tokens"] / (copied / bandwidth)
    return {"decode_pcie_bound_tokens_per_s": bound, "decode_vs_bound": decode["decode_tokens_per_s"] / bound}


def run_bench(name: str, device: str, prompt_lengths: list[int], decode_tokens: int, plan: MemoryPlan | None,
              seed: int = 0, backends: list[str] | None = None, hf_baseline: bool = False,
              decode_inputs: str = "greedy") -> dict:
    """On CUDA with a plan, the process is held to the plan's budget (engine/runtime/vram.py) for the whole
    run, and each prompt length reports its measured peak against it. `backends` (CUDA): decode with each
    expert backend in turn after every prefill. `hf_baseline`: then the same shape through transformers +
    accelerate under the same cap (engine/bench_hf.py), on the shortest prompt, up to HF_BASELINE_TOKENS."""
    synthetic = SYNTHETIC_MODELS[name]
    slots = plan.expert_slots if plan is not None else None
    chunk = plan.prefill_chunk_tokens if plan is not None else DEFAULT_PREFILL_CHUNK
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    result = {"model": name, "description": synthetic.description, "device": device,
              "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "dtype": str(dtype).removeprefix("torch."),
              "plan": plan.to_dict() if plan is not None else None, "notes": [ROUTING_NOTE], "runs": []}
    bandwidth = None
    if device == "cuda":
        bandwidth = host_to_device_bandwidth(pinned=True)
        result["host_to_device_bytes_per_s"] = {"pinned": bandwidth,
                                                "pageable": host_to_device_bandwidth(pinned=False)}
        torch.cuda.empty_cache()
        if plan is not None:
            result["vram_cap"] = cap_process_memory(plan.budget_bytes).to_dict()
    started = time.perf_counter()
    # The CPU kernel and the calibration are made when a backend needs them; the backend then switches per run
    build_backend = "hybrid" if set(backends or []) & {"cpu", "hybrid", "auto"} else "offload"
    model = build_random_model(name, device, dtype, slots, expert_backend=build_backend)
    result["build_seconds"] = time.perf_counter() - started
    result["expert_placement"] = dict(model.expert_executor.host_report)
    if getattr(model.expert_executor, "calibration", None) is not None:
        result["calibration"] = model.expert_executor.calibration.to_dict()
    expert_bytes = sum(packed.nbytes for packed in getattr(model.expert_executor, "packed", {}).values())
    # Untimed: a chunk and a few tokens compile and load every kernel, so no row pays for it
    measure(model, device, min(chunk, max(prompt_lengths)), 2, chunk, seed + 1,
            plan.kv_tokens if plan is not None else None)
    for length in prompt_lengths:
        if plan is not None and length > plan.max_prompt_tokens:
            result["runs"].append({"prompt_tokens": length, "skipped": f"longer than the plan's guaranteed prompt "
                                                                      f"of {plan.max_prompt_tokens:,} tokens"})
            continue
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            row = measure(model, device, length, decode_tokens, chunk, seed,
                          plan.kv_tokens if plan is not None else None, backends, decode_inputs)
        except torch.OutOfMemoryError as exc:
            row = {"prompt_tokens": length, "error": f"out of memory: {str(exc).splitlines()[0]}"}
        except Exception as exc:  # one failing length must not lose the others' figures
            row = {"prompt_tokens": length, "error": f"{type(exc).__name__}: {exc}"}
        print(f"bench: {row}", file=sys.stderr, flush=True)
        if device == "cuda":
            row.update(measured_peak())
            if plan is not None:
                row["peak_within_budget"] = row["peak_process_bytes"] <= plan.budget_bytes
            if bandwidth is not None and plan is not None and "error" not in row:
                row.update(_bounds(row, bandwidth, expert_bytes))
            torch.cuda.empty_cache()
        result["runs"].append(row)
    if hf_baseline:
        del model  # its expert records and weights make room for the other model
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        cap = result.get("vram_cap", {}).get("allocator_limit_bytes")
        prompt = min(min(prompt_lengths), HF_BASELINE_TOKENS)
        try:
            result["baseline"] = hf_offload_row(name, device, int(cap * HF_GPU_SHARE) if cap else None, prompt,
                                                min(decode_tokens, 3), seed)
        except Exception as exc:  # the other tool failing must not lose our figures (seen: inputs on the wrong device)
            result["baseline"] = {"baseline": "transformers + accelerate", "error": f"{type(exc).__name__}: {exc}"}
    if device != "cuda":
        result.update(_host_peak_memory())
    return result


def plan_for(name: str, preset: str | None, vram_gib: float | None, reserve_bytes: int | None = None) -> MemoryPlan | None:
    if preset is None:
        return None
    budget = int(vram_gib * 2**30) if vram_gib else preset_budget_bytes(preset)
    extra = {} if reserve_bytes is None else {"reserve_bytes": reserve_bytes}
    return plan_memory(footprint_from_synthetic(name), budget, preset, **extra)


def format_result(result: dict) -> str:
    lines = [f"{result['model']} on {result['device_name']} ({result['dtype']}), built in "
             f"{result['build_seconds']:.1f} s; {result['notes'][0]}"]
    if "host_to_device_bytes_per_s" in result:
        bw = result["host_to_device_bytes_per_s"]
        lines.append(f"host->GPU copy: pinned {bw['pinned'] / 1e9:.1f} GB/s, pageable {bw['pageable'] / 1e9:.1f} GB/s")
    lines.append(f"{'prompt':>8} {'chunk':>6} {'TTFT s':>8} {'prefill tok/s':>14} {'decode tok/s':>13} "
                 f"{'hit rate p/d':>13}")
    for row in result["runs"]:
        if "skipped" in row or "error" in row:
            lines.append(f"{row['prompt_tokens']:>8} {row.get('skipped') or row['error']}")
            continue
        hits = "/".join(f"{row[k]:.2f}" for k in ("prefill_expert_cache_hit_rate", "decode_expert_cache_hit_rate")
                        if k in row) or "-"
        lines.append(f"{row['prompt_tokens']:>8} {row['prefill_chunk_tokens']:>6} {row['time_to_first_token_s']:>8.2f} "
                     f"{row['prefill_tokens_per_s']:>14.1f} {row['decode_tokens_per_s']:>13.1f} {hits:>13}")
        if "decode_by_backend" in row:
            lines.append("         decode by expert backend: " + ", ".join(
                f"{backend} {d['decode_tokens_per_s']:.1f} tok/s (CPU {d.get('decode_cpu_expert_share', 0):.0%})"
                for backend, d in row["decode_by_backend"].items()))
    baseline = result.get("baseline")
    if baseline is not None:
        lines.append(f"baseline, {baseline['baseline']}: " + (baseline.get("skipped") or baseline.get("error") or (
            f"{baseline['prompt_tokens']}-token prompt, prefill {baseline['prefill_tokens_per_s']:.1f} tok/s, "
            f"decode {baseline['decode_tokens_per_s']:.2f} tok/s")))
    peaks = [row["peak_process_bytes"] for row in result["runs"] if "peak_process_bytes" in row]
    if peaks:
        lines.append(f"peak GPU memory of the process: {max(peaks) / 2**30:.2f} GiB")
    elif result.get("peak_process_rss_bytes"):
        lines.append(f"peak host memory: {result['peak_process_rss_bytes'] / 2**30:.2f} GiB")
    return "\n".join(lines)


def parse_lengths(text: str) -> list[int]:
    lengths = [int(part) for part in text.split(",") if part.strip()]
    if not lengths or min(lengths) < 1:
        raise ValueError("--prompt-tokens takes positive whole numbers separated by commas, e.g. 512,4096")
    return lengths
