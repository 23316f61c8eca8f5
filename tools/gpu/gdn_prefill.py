"""Time one Gated DeltaNet layer's prefill chunk on the GPU and measure its peak against the plan's budget.

Runs kernels.gated_deltanet (conv, delta rule, gated norm: everything between the layer's projections) at
Qwen3.6-35B-A3B's shapes on random inputs in bf16, as a prefill chunk of each given length, and prints its time
(median of --repeat, after a warm-up) and its peak allocation beside planner.prefill_workspace's GDN term (which
also counts the projections' outputs, made here before the peak is measured). Run it with PYTHONPATH on two trees
to compare them.

    python tools/gpu/gdn_prefill.py --tokens 1024,2048 --output gdn.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from engine import kernels
from engine.runtime import planner
from engine.synthetic import SYNTHETIC_MODELS


def measure(tokens: int, repeat: int, device: str = "cuda") -> dict:
    """Time and measure one chunk of `tokens` through kernels.gated_deltanet; return the figures."""
    c = SYNTHETIC_MODELS["qwen3.6-35b-a3b-nvfp4"].config
    key_heads, value_heads = c.linear_num_key_heads, c.linear_num_value_heads
    key_dim, value_dim, kernel_size = c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim
    channels, values = 2 * key_heads * key_dim + value_heads * value_dim, value_heads * value_dim
    gen = torch.Generator(device=device).manual_seed(tokens)

    def normal(*shape, scale=1.0, dtype=torch.bfloat16):
        return (scale * torch.randn(*shape, generator=gen, device=device)).to(dtype)

    qkvz = normal(tokens, channels + values, scale=2.0)
    ba = normal(tokens, 2 * value_heads, scale=2.0)
    qkv, z = qkvz.split([channels, values], dim=-1)
    b, a = ba.split(value_heads, dim=-1)
    weights = dict(
        conv_weight=normal(channels, kernel_size, scale=0.5, dtype=torch.float32),
        a_log=torch.empty(value_heads, device=device).uniform_(1.0, 16.0, generator=gen).log(),
        dt_bias=1.0 + normal(value_heads, scale=0.5, dtype=torch.float32),
        norm_weight=1.0 + normal(value_dim, scale=0.1, dtype=torch.float32),
    )
    conv = torch.zeros(channels, kernel_size - 1, dtype=torch.bfloat16, device=device)
    recurrent = torch.zeros(value_heads, key_dim, value_dim, dtype=torch.float32, device=device)

    def run():
        return kernels.gated_deltanet(
            qkv, z, b, a, conv, weights["conv_weight"], recurrent, weights["a_log"], weights["dt_bias"],
            weights["norm_weight"], c.rms_norm_eps, key_heads, value_heads, key_dim, value_dim,
        )  # fmt: skip

    run()
    peak = None
    if device == "cuda":  # the CPU has no allocator statistics: there only the time is measured
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before + qkvz.nbytes + ba.nbytes
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    budget = planner.prefill_workspace(c, tokens)["gated_deltanet"]
    return {"tokens": tokens, "ms": statistics.median(times), "peak_bytes": peak, "budget_bytes": budget}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1024,2048", help="chunk lengths, comma-separated")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--output", help="write the figures here as JSON")
    args = parser.parse_args(argv)
    rows = [measure(int(n), args.repeat, args.device) for n in args.tokens.split(",")]
    print(f"{'tokens':>7} {'ms':>8} {'tok/s':>9} {'peak MiB':>9} {'budget MiB':>10}   ({kernels.__file__})")
    for r in rows:
        print(
            f"{r['tokens']:>7} {r['ms']:>8.2f} {r['tokens'] / r['ms'] * 1e3:>9.0f} "
            f"{r['peak_bytes'] / 2**20 if r['peak_bytes'] else float('nan'):>9.1f} {r['budget_bytes'] / 2**20:>10.1f}"
        )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
