"""Where a prefill's time goes: a preset's plan under its cap, full-size random weights in the real layout,
uniform routing, the plan's chunks. From the repository root on a CUDA machine:

    python3 tools/gpu/prefill_profile.py [4gb|8gb|12gb] [--tokens 16384] [--backend hybrid]

Prints the prefill's wall time and expert bytes copied (twice, after an untimed warm-up of two chunks), with the
cache's kept layers and without them where the cache holds fewer blocks than the model has layers, then a
torch.profiler view of one prefill: the GPU's busy time by kind of kernel, the host-to-device copies, the
kernels that took longest, and the wall time the GPU was idle; then cProfile's view of one more prefill: the
host's functions by their own time, where the host spends what the GPU waits for.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engine import bench
from engine.experts.routing import force_routing
from engine.runtime.vram import cap_process_memory, gpu_runtime_reserve_bytes, measured_peak

MODEL = "qwen3.6-35b-a3b-nvfp4"
KINDS = {  # substrings of kernel names -> the kind they are counted under, first match wins
    "Memcpy HtoD": "expert copies (host to device)",
    "Memcpy": "other copies",
    "linear_kernel": "NVFP4 linear (Triton)",
    "delta": "GDN delta rule",
    "gdn": "GDN other",
    "conv": "GDN conv",
    "attn": "attention",
    "flash": "attention",
    "gemm": "cuBLAS GEMM",
    "sm90": "cuBLAS GEMM",
    "index": "gather / scatter / index_add",
    "sort": "sort (routing order)",
}


def prefill(model, tokens: int, chunk: int, seed: int) -> tuple[float, int]:
    """Prefill `tokens` random tokens in chunks of `chunk` on a new sequence: wall seconds and expert bytes copied."""
    ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed))
    state = model.new_state(tokens + 8)
    before = model.expert_executor.stats()["expert_bytes_copied"]
    torch.cuda.synchronize()
    started = time.perf_counter()
    for begin in range(0, tokens, chunk):
        logits = model.forward(ids[begin : begin + chunk], state)
    int(logits.argmax())
    torch.cuda.synchronize()
    return time.perf_counter() - started, model.expert_executor.stats()["expert_bytes_copied"] - before


def kind_of(name: str) -> str:
    """The kind a kernel's name counts under (KINDS), or "other"."""
    lowered = name.lower()
    return next((kind for key, kind in KINDS.items() if key.lower() in lowered), "other")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("preset", nargs="?", default="8gb")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--backend", default="hybrid")
    args = parser.parse_args()
    plan = bench.plan_for(MODEL, args.preset, None, gpu_runtime_reserve_bytes())
    cap_process_memory(plan.budget_bytes)
    model = bench.build_random_model(MODEL, "cuda", torch.bfloat16, plan.expert_slots, expert_backend=args.backend)
    force_routing(model, "uniform")
    cache, chunk = model.expert_executor.cache, plan.prefill_chunk_tokens
    kept = cache.kept_layers
    print(f"{args.preset}: chunk {chunk}, {cache.blocks} blocks, kept layers {len(kept)}, backend {args.backend}")
    prefill(model, 2 * chunk, chunk, 1)  # compiles the chunk's kernels
    settings = [("kept", kept), ("none kept", ())] if kept else [("plan", ())]
    for name, layers in settings:
        cache.keep_when_streaming(list(layers))
        for seed in (2, 3):
            wall, copied = prefill(model, args.tokens, chunk, seed)
            print(
                f"  {name:>9}: {args.tokens:,} tokens {wall:.3f} s ({args.tokens / wall:,.0f} tok/s), "
                f"{copied / 1e9:.1f} GB of experts copied ({copied / 1e9 / wall:.1f} GB/s over the wall time)"
            )
    cache.keep_when_streaming(list(kept))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiled:
        wall, copied = prefill(model, args.tokens, chunk, 4)
    events = [e for e in profiled.key_averages() if e.device_type.name == "CUDA"]
    by_kind: dict[str, float] = {}
    for event in events:
        kind = kind_of(event.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + event.self_device_time_total / 1e6
    copies = by_kind.get("expert copies (host to device)", 0.0)
    compute = sum(seconds for kind, seconds in by_kind.items() if "copies" not in kind)
    print(f"profiled prefill: wall {wall:.3f} s; GPU compute busy {compute:.3f} s, expert copies {copies:.3f} s")
    for kind, seconds in sorted(by_kind.items(), key=lambda item: -item[1]):
        print(f"  {seconds:8.3f} s  {kind}")
    print("longest kernels (self CUDA time, s; calls):")
    for event in sorted(events, key=lambda e: -e.self_device_time_total)[:14]:
        print(f"  {event.self_device_time_total / 1e6:8.3f}  {event.count:6d}  {event.key[:96]}")
    host = cProfile.Profile()
    host.enable()
    wall, _ = prefill(model, args.tokens, chunk, 5)
    host.disable()
    print(f"host profile of one prefill (wall {wall:.3f} s under cProfile), by own time:")
    pstats.Stats(host).sort_stats("tottime").print_stats(18)
    print(measured_peak())


if __name__ == "__main__":
    main()
