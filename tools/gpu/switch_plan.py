"""Times switching the full-size model between a preset's chat and long-context plans in place (issue 24): the
expert cache rebuilt from the host records, then a 512-token prompt and a few decoded tokens on each plan, so
the switch is checked to leave a working model. Prints one line a switch and JSON with --output.

    python3 tools/gpu/switch_plan.py --preset 8gb --output OUT.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine import bench
from engine.runtime.placement import Placement, switch_plan
from engine.runtime.reserve import runtime_reserve
from engine.runtime.vram import cap_process_memory

MODEL = "qwen3.6-35b-a3b-nvfp4"


def main() -> int:
    """Build under the first plan, switch back and forth, time each switch and the prompt after it."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="8gb")
    parser.add_argument("--switches", type=int, default=3)
    parser.add_argument("--output")
    args = parser.parse_args()
    reserve = runtime_reserve().reserve_bytes
    plans = {use: bench.plan_for(MODEL, args.preset, None, reserve, use=use) for use in ("chat", "long-context")}
    cap_process_memory(plans["chat"].budget_bytes)
    placements = {use: Placement("cuda", torch.bfloat16, plan, "", plan.kv_cache) for use, plan in plans.items()}
    started = time.perf_counter()
    model = bench.build_random_model(MODEL, "cuda", torch.bfloat16, plans["chat"].expert_slots, expert_backend="auto")
    rows = [{"build_seconds": time.perf_counter() - started}]
    current = "chat"
    for _ in range(args.switches):
        target = "long-context" if current == "chat" else "chat"
        torch.cuda.synchronize()
        began = time.perf_counter()
        done = switch_plan(model, placements[current], placements[target])
        torch.cuda.synchronize()
        switched = time.perf_counter() - began
        plan = plans[target]
        row = bench.measure(model, "cuda", 512, 8, plan.prefill_chunk_tokens, 1, plan.kv_tokens)
        rows.append(
            {
                "to": target,
                "in_place": done,
                "switch_seconds": switched,
                "slots": model.expert_executor.cache.slots,
                "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                "budget_bytes": plan.budget_bytes,
                "prefill_tokens_per_s": row.get("prefill_tokens_per_s"),
                "decode_tokens_per_s": row.get("decode_tokens_per_s"),
            }
        )
        print(
            f"{current} -> {target}: in place {done}, {switched:.2f} s, {rows[-1]['slots']} slots; then prefill "
            f"{rows[-1]['prefill_tokens_per_s']:.0f} tok/s, decode {rows[-1]['decode_tokens_per_s']:.1f} tok/s",
            flush=True,
        )
        current = target
    if args.output:
        with open(args.output, "w") as out:
            json.dump({"plans": {u: p.to_dict() for u, p in plans.items()}, "rows": rows}, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
