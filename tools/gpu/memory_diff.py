"""Where a preset's full-size model holds GPU memory: builds it under the preset's plan with the allocator's history
on, prefills one prompt, and prints the live bytes grouped by the engine source line that allocated them (JSON
with --output). Run it on two trees (PYTHONPATH) and compare, to find what a change added.

    python tools/gpu/memory_diff.py --preset 4gb --prompt-tokens 4096 --output OUT.json
With --bench, runs `engine bench` with the arguments that follow instead and prints the live bytes at its first
out-of-memory error (or nothing, if it has none):
    python tools/gpu/memory_diff.py --bench --preset 4gb --prompt-tokens 4096 --decode-tokens 0
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import torch

from engine import bench
from engine.runtime.reserve import runtime_reserve
from engine.runtime.vram import cap_process_memory

MODEL = "qwen3.6-35b-a3b-nvfp4"


def engine_frame(frames: list[dict]) -> str:
    """The innermost engine/ frame of an allocation's stack, as path:line function."""
    for frame in frames:
        name = frame["filename"].replace("\\", "/")
        if "/engine/" in name:
            return f"engine/{name.split('/engine/', 1)[1]}:{frame['line']} {frame['name']}"
    return "(outside engine/)"


def live_by_source() -> dict[str, int]:
    """Live allocated bytes, by the engine line that allocated them."""
    totals: dict[str, int] = defaultdict(int)
    for segment in torch.cuda.memory._snapshot()["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                totals[engine_frame(block.get("frames", []))] += block["size"]
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def free_blocks() -> list[int]:
    """Sizes of the allocator's free blocks inside its segments, largest first: the holes fragmentation leaves."""
    holes = [
        block["size"]
        for segment in torch.cuda.memory._snapshot()["segments"]
        for block in segment["blocks"]
        if block["state"] == "inactive"
    ]
    return sorted(holes, reverse=True)


def print_table(live: dict[str, int], rows: int = 25) -> None:
    """Print the largest entries of a live_by_source() table, in MiB."""
    for where, size in list(live.items())[:rows]:
        print(f"  {size / 2**20:9.2f} MiB  {where}")


def bench_at_oom(bench_args: list[str]) -> int:
    """Run `engine bench` with the allocator's history on; print the live bytes at its first out-of-memory error."""
    from engine.cli import main as engine_main

    at_oom: list[tuple[int, dict[str, int]]] = []

    def observe(device, size, allocated, free):
        del device, allocated, free
        if not at_oom:
            at_oom.append((size, live_by_source(), free_blocks()))

    torch.cuda.memory._record_memory_history(max_entries=200_000)
    torch._C._cuda_attach_out_of_memory_observer(observe)
    try:
        code = engine_main(["bench", "--synthetic", MODEL, *bench_args])
    except torch.OutOfMemoryError:
        code = 1
    for size, live, holes in at_oom:
        print(f"first out of memory: {size / 2**20:.1f} MiB asked, {sum(live.values()) / 2**20:.1f} MiB live:")
        print_table(live, 40)
        print(f"free blocks inside segments (MiB, largest first): {[round(h / 2**20, 1) for h in holes[:20]]}")
    if not at_oom:
        print(f"no out-of-memory error; peak {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")
    return code


def main() -> int:
    """Build, snapshot, prefill, snapshot; print both tables."""
    if sys.argv[1:2] == ["--bench"]:
        return bench_at_oom(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="4gb")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--output")
    args = parser.parse_args()
    plan = bench.plan_for(MODEL, args.preset, None, runtime_reserve().reserve_bytes)
    cap_process_memory(plan.budget_bytes)
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    model = bench.build_random_model(MODEL, "cuda", torch.bfloat16, plan.expert_slots)
    report = {"plan": plan.to_dict(), "after_build": live_by_source()}
    report["after_build_bytes"] = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        bench.measure(model, "cuda", args.prompt_tokens, 0, plan.prefill_chunk_tokens, 1, plan.kv_tokens)
        report["prefill"] = "ok"
    except torch.OutOfMemoryError as exc:
        report["prefill"] = f"out of memory: {str(exc).splitlines()[0]}"
    report["prefill_peak_bytes"] = torch.cuda.max_memory_allocated()
    report["after_prefill"] = live_by_source()
    mib = 2**20
    print(
        f"after build {report['after_build_bytes'] / mib:.1f} MiB; prefill {report['prefill']}, "
        f"peak {report['prefill_peak_bytes'] / mib:.1f} MiB"
    )
    print_table(report["after_build"])
    if args.output:
        with open(args.output, "w") as out:
            json.dump(report, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
