"""`python -m engine bench`: prefill and decode speed of a full-size model with random weights, built in
memory from its real shapes and formats (no download, no file), with the ceilings it is judged against.

Random router weights spread tokens evenly over the experts, so expert-cache hit rates measured here
are a pessimistic floor for real models; every result says so.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from engine.checkpoint import Checkpoint, TensorShard
from engine.experts.cache import ExpertCache
from engine.experts.executor import CachedExpertExecutor, ReferenceExpertExecutor
from engine.layers.source import WeightSource
from engine.models import BUILDERS
from engine.models.base import CausalLM
from engine.runtime.planner import MemoryPlan, footprint_from_synthetic, plan_memory, preset_budget_bytes
from engine.synthetic import SYNTHETIC_MODELS, checkpoint_format, text_config
from engine.testing.tiny_checkpoints import checkpoint_tensors

ROUTING_NOTE = ("random weights: the router spreads tokens evenly over the experts, so expert-cache hit rates "
                "are a pessimistic floor for a real model")
DEFAULT_PREFILL_CHUNK = 512  # without a plan (CPU runs)
BANDWIDTH_PROBE_BYTES = 256 * 2**20


def build_random_model(name: str, device: str, dtype: torch.dtype, expert_cache_slots: int | None) -> CausalLM:
    """The synthetic model `name` with random weights of its real shapes and formats, in memory."""
    synthetic = SYNTHETIC_MODELS[name]
    config = synthetic.config
    tensors, quant = checkpoint_tensors(config.model_type, checkpoint_format(synthetic), text_config(config),
                                        tiled=True)
    where = Path(f"<random {name}>")
    checkpoint = Checkpoint(where, quant, shards=[TensorShard(tensors, where)])
    source = WeightSource(checkpoint, config, torch.device(device), dtype)
    executor = (CachedExpertExecutor(ExpertCache(device, expert_cache_slots)) if expert_cache_slots
                else ReferenceExpertExecutor())
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


def _peak_memory(device: str) -> dict:
    if device == "cuda":
        return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved()}
    try:
        import resource
    except ImportError:  # Windows: no getrusage
        return {}
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    return {"peak_process_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale}


def measure(model: CausalLM, device: str, prompt_tokens: int, decode_tokens: int, chunk: int, seed: int) -> dict:
    """Prefill a random prompt in chunks, then greedy-decode; speeds, time to first token and cache traffic."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_tokens,), generator=generator)
    state = model.new_state(prompt_tokens + decode_tokens)
    before = model.expert_executor.stats()
    _sync(device)
    started = time.perf_counter()
    for begin in range(0, prompt_tokens, chunk):
        logits = model.forward(prompt[begin:begin + chunk], state)
    token = int(logits.argmax())
    _sync(device)
    first_token = time.perf_counter()
    after_prefill = model.expert_executor.stats()
    for _ in range(decode_tokens):
        token = int(model.forward([token], state).argmax())
    _sync(device)
    finished = time.perf_counter()
    after_decode = model.expert_executor.stats()
    row = {"prompt_tokens": prompt_tokens, "decode_tokens": decode_tokens, "prefill_chunk_tokens": chunk,
           "time_to_first_token_s": first_token - started,
           "prefill_tokens_per_s": prompt_tokens / (first_token - started),
           "decode_tokens_per_s": decode_tokens / (finished - first_token) if decode_tokens else 0.0}
    for phase, (start, end) in {"prefill": (before, after_prefill), "decode": (after_prefill, after_decode)}.items():
        if "expert_cache_hits" in end:
            hits = end["expert_cache_hits"] - start["expert_cache_hits"]
            misses = end["expert_cache_misses"] - start["expert_cache_misses"]
            row[f"{phase}_expert_cache_hit_rate"] = hits / (hits + misses) if hits + misses else 0.0
            row[f"{phase}_expert_bytes_copied"] = end["expert_bytes_copied"] - start["expert_bytes_copied"]
    return row


def _bounds(row: dict, bandwidth: float, layer_bytes: int, moe_layers: int) -> dict:
    """Ratios of measured speed to the PCIe-streaming bounds: a prefill chunk streams every MoE layer's
    experts once; a decode token streams what it missed."""
    chunk_seconds = moe_layers * layer_bytes / bandwidth
    prefill_bound = row["prefill_chunk_tokens"] / chunk_seconds
    bounds = {"prefill_pcie_bound_tokens_per_s": prefill_bound,
              "prefill_vs_bound": row["prefill_tokens_per_s"] / prefill_bound}
    copied = row.get("decode_expert_bytes_copied", 0)
    if row["decode_tokens"] and copied:
        decode_bound = row["decode_tokens"] / (copied / bandwidth)
        bounds.update(decode_pcie_bound_tokens_per_s=decode_bound,
                      decode_vs_bound=row["decode_tokens_per_s"] / decode_bound)
    return bounds


def run_bench(name: str, device: str, prompt_lengths: list[int], decode_tokens: int, plan: MemoryPlan | None,
              seed: int = 0) -> dict:
    synthetic = SYNTHETIC_MODELS[name]
    config = synthetic.config
    slots = plan.expert_slots if plan is not None else None
    chunk = plan.prefill_chunk_tokens if plan is not None else DEFAULT_PREFILL_CHUNK
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    model = build_random_model(name, device, dtype, slots)
    result = {"model": name, "description": synthetic.description, "device": device,
              "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "dtype": str(dtype).removeprefix("torch."), "build_seconds": time.perf_counter() - started,
              "plan": plan.to_dict() if plan is not None else None, "notes": [ROUTING_NOTE], "runs": []}
    bandwidth = None
    if device == "cuda":
        bandwidth = host_to_device_bandwidth(pinned=True)
        result["host_to_device_bytes_per_s"] = {"pinned": bandwidth,
                                                "pageable": host_to_device_bandwidth(pinned=False)}
    footprint = footprint_from_synthetic(name)
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    for length in prompt_lengths:
        row = measure(model, device, length, decode_tokens, chunk, seed)
        if bandwidth is not None and plan is not None:
            row.update(_bounds(row, bandwidth, footprint.expert_layer_bytes, moe_layers))
        result["runs"].append(row)
    result.update(_peak_memory(device))
    return result


def plan_for(name: str, preset: str | None, vram_gib: float | None) -> MemoryPlan | None:
    if preset is None:
        return None
    budget = int(vram_gib * 2**30) if vram_gib else preset_budget_bytes(preset)
    return plan_memory(footprint_from_synthetic(name), budget, preset)


def format_result(result: dict) -> str:
    lines = [f"{result['model']} on {result['device_name']} ({result['dtype']}), built in "
             f"{result['build_seconds']:.1f} s; {result['notes'][0]}"]
    if "host_to_device_bytes_per_s" in result:
        bw = result["host_to_device_bytes_per_s"]
        lines.append(f"host->GPU copy: pinned {bw['pinned'] / 1e9:.1f} GB/s, pageable {bw['pageable'] / 1e9:.1f} GB/s")
    lines.append(f"{'prompt':>8} {'chunk':>6} {'TTFT s':>8} {'prefill tok/s':>14} {'decode tok/s':>13} "
                 f"{'hit rate p/d':>13}")
    for row in result["runs"]:
        hits = "/".join(f"{row[k]:.2f}" for k in ("prefill_expert_cache_hit_rate", "decode_expert_cache_hit_rate")
                        if k in row) or "-"
        lines.append(f"{row['prompt_tokens']:>8} {row['prefill_chunk_tokens']:>6} {row['time_to_first_token_s']:>8.2f} "
                     f"{row['prefill_tokens_per_s']:>14.1f} {row['decode_tokens_per_s']:>13.1f} {hits:>13}")
    peak = result.get("peak_allocated_bytes") or result.get("peak_process_rss_bytes")
    if peak:
        lines.append(f"peak memory: {peak / 2**30:.2f} GiB")
    return "\n".join(lines)


def parse_lengths(text: str) -> list[int]:
    lengths = [int(part) for part in text.split(",") if part.strip()]
    if not lengths or min(lengths) < 1:
        raise ValueError("--prompt-tokens takes positive whole numbers separated by commas, e.g. 512,4096")
    return lengths
