"""Fit llama.cpp's `--n-cpu-moe N` to a VRAM budget it cannot be held to, by measuring (issue 22).

llama.cpp has no VRAM cap, so tools/gpu/issue22_runs.sh measures: it samples the GPU's memory.used while
llama-bench runs (nvidia-smi -lms) and takes the peak above the idle GPU. One probe with every layer's experts
on the CPU (N = 40) gives the memory that does not depend on N; each layer whose experts move to the GPU adds
exactly its expert tensors (Q4_K: 1,769,472 bytes an expert x 256 experts), so the largest number of GPU layers
that fits follows in one step, and the measured run checks it (one more step where it did not fit).

    python3 tools/gpu/llama_vram.py peak SAMPLES_MIB BASELINE_MIB          # bytes above the idle GPU
    python3 tools/gpu/llama_vram.py choose BUDGET_GIB PEAK_BYTES PROBE_N   # the N to run
    python3 tools/gpu/llama_vram.py buffers LLAMA_BENCH_VERBOSE_LOG        # llama's own CUDA0 buffers, JSON
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

LAYERS = 40
EXPERT_BYTES = 1_769_472  # a Q4_K expert: 3 x 512 x 2048 weights x 144 / 256 bytes (tools/gguf_random.py)
LAYER_EXPERT_BYTES = EXPERT_BYTES * 256
MIB = 2**20
GIB = 2**30
# Kept free below the budget: the CUDA pool grows with the work, and a sampled peak can miss a brief high
MARGIN_BYTES = 96 * MIB
BUFFER_LINE = re.compile(r"(\S+)\s+(model|KV|RS|compute|output) buffer size\s*=\s*([\d.]+) MiB")


def peak_bytes(samples: str, baseline_mib: float) -> int:
    """The highest sampled memory.used (nvidia-smi, MiB, one a line) above the idle GPU's, in bytes."""
    values = [float(line.split(",")[0]) for line in samples.splitlines() if line.strip()[:1].isdigit()]
    if not values:
        raise ValueError("no memory.used samples (did nvidia-smi run?)")
    return int(max(0.0, max(values) - baseline_mib) * MIB)


def choose_n_cpu_moe(budget_bytes: int, probe_peak_bytes: int, probe_n: int, margin_bytes: int = MARGIN_BYTES) -> int:
    """The fewest layers with CPU experts whose measured VRAM fits the budget, from a probe's peak at `probe_n`
    CPU layers: each layer moved to the GPU adds its expert tensors and nothing else."""
    room = budget_bytes - margin_bytes - probe_peak_bytes
    layers_moved = room // LAYER_EXPERT_BYTES  # negative: the probe itself did not fit
    return int(min(LAYERS, max(0, probe_n - layers_moved)))


def buffers(log: str) -> dict[str, float]:
    """llama.cpp's printed buffer sizes (MiB) on the GPU, summed by kind, e.g. {"model": 2100.5, "KV": 330.0}."""
    sizes: dict[str, float] = {}
    for device, kind, mib in BUFFER_LINE.findall(log):
        if device.startswith("CUDA") and not device.endswith("_Host"):
            sizes[kind] = sizes.get(kind, 0.0) + float(mib)
    return sizes


def main(argv: list[str]) -> int:
    """Run one of the commands above, printing its answer; an error says what was wrong."""
    try:
        command, *rest = argv
        if command == "peak":
            print(peak_bytes(Path(rest[0]).read_text(), float(rest[1])))
        elif command == "choose":
            print(choose_n_cpu_moe(int(float(rest[0]) * GIB), int(rest[1]), int(rest[2])))
        elif command == "buffers":
            print(json.dumps(buffers(Path(rest[0]).read_text(errors="replace"))))
        else:
            raise ValueError(f"unknown command {command!r}")
    except (ValueError, IndexError, OSError) as exc:
        print(f"llama_vram: {exc}; usage: see the docstring of tools/gpu/llama_vram.py", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
