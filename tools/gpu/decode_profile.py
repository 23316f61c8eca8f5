"""Where a decode step's time goes: a preset's plan under its cap (default 4gb), full-size random weights, an
expert backend (default offload).

Prints the graph capture's time and memory, the steady step time, a torch.profiler table of GPU time, and the
GPU's busy time per step (and how much of it is expert copies). From the repository root on a CUDA machine:

    python3 tools/gpu/decode_profile.py [offload|cpu|hybrid] [4gb|8gb|12gb]

At 12gb nearly every expert hits the GPU's cache, so the profile is the GPU's own work of a step.
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from engine import bench
from engine.layers.attention import Attention
from engine.runtime.vram import cap_process_memory, gpu_runtime_reserve_bytes, measured_peak

MODEL = "qwen3.6-35b-a3b-nvfp4"
STEPS = 32


def memory() -> tuple[int, int]:
    """(allocator reserved, process memory outside the allocator) now."""
    free, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved()
    return reserved, total - free - reserved


def main() -> None:
    backend = sys.argv[1] if len(sys.argv) > 1 else "offload"
    preset = sys.argv[2] if len(sys.argv) > 2 else "4gb"
    plan = bench.plan_for(MODEL, preset, None, gpu_runtime_reserve_bytes())
    torch.cuda.empty_cache()
    cap_process_memory(plan.budget_bytes)
    print("preset:", preset, flush=True)
    model = bench.build_random_model(MODEL, "cuda", torch.bfloat16, plan.expert_slots, expert_backend=backend)
    print("expert backend:", model.expert_executor.backend, flush=True)
    print("graphed decode:", model.decode_runner is not None, flush=True)
    state = model.new_state(plan.kv_tokens)
    model.forward(torch.randint(0, 1000, (128,)), state)
    token = int(model.forward([5], state).argmax())  # the first step runs the plain forward: kernels compile
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    before = memory()
    started = time.perf_counter()
    token = int(model.forward([token], state).argmax())  # captures the graphs, then replays them
    torch.cuda.synchronize()
    after = memory()
    graphs = len(model.decode_runner.graphs)
    print(
        f"capture and first replay {time.perf_counter() - started:.3f} s, {graphs} graphs, "
        f"pool {(after[0] - before[0]) / 2**20:.1f} MiB, "
        f"outside the allocator {(after[1] - before[1]) / 2**20:.1f} MiB"
    )
    for _ in range(4):
        token = int(model.forward([token], state).argmax())
    step, token = timed_steps(model, state, token)
    print(f"decode step {step * 1e3:.2f} ms, {1 / step:.1f} tok/s", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiled:
        for _ in range(4):
            token = int(model.forward([token], state).argmax())
        torch.cuda.synchronize()
    events = profiled.key_averages()
    print(events.table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=70))
    gpu = [e for e in events if e.device_type.name == "CUDA"]
    busy = sum(e.self_device_time_total for e in gpu) / 4
    copies = sum(e.self_device_time_total for e in gpu if "Memcpy" in e.key) / 4
    print(f"GPU busy per step {busy / 1e3:.2f} ms, of which copies {copies / 1e3:.2f} ms")
    timeline(profiled)
    host_breakdown(model, state, token)
    print(measured_peak())


def timed_steps(model, state, token: int) -> tuple[float, int]:
    """Seconds per decode step over STEPS greedy steps, and the last token."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(STEPS):
        token = int(model.forward([token], state).argmax())
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / STEPS, token


def timeline(profiled) -> None:
    """The GPU's kernels in time order: per step its span, busy time and the idle gaps between kernels (graph
    launch and kernel-to-kernel latency), the idle time between steps (the host's), and one middle MoE layer's
    kernels one by one, so the per-layer chain can be read."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        profiled.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    kernels = sorted(
        (e["ts"], e["dur"], e["name"])
        for e in trace["traceEvents"]
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "ts" in e
    )
    ends = [i for i, (_, _, name) in enumerate(kernels) if "argmax" in name or "ArgMax" in name]
    starts = [0] + [i + 1 for i in ends[:-1]]
    print(f"timeline: {len(kernels)} device activities, {len(ends)} steps found (ended by argmax)")
    for first, last in zip(starts, ends):
        span = kernels[last][0] + kernels[last][1] - kernels[first][0]
        busy = sum(d for _, d, _ in kernels[first : last + 1])
        print(
            f"  step: {last - first + 1} kernels, span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms, "
            f"idle between kernels {(span - busy) / 1e3:.2f} ms"
        )
    for before, after in zip(ends, starts[1:]):
        print(f"  between steps: {(kernels[after][0] - kernels[before][0] - kernels[before][1]) / 1e3:.2f} ms")
    if len(ends) < 2:
        return
    first, last = starts[1], ends[1]
    routers = [i for i in range(first, last) if "router" in kernels[i][2]]
    if len(routers) < 3:
        return
    print("each MoE layer (router to router, us): span, its longest kernels")
    for begin, end in zip(routers, routers[1:] + [last]):
        longest = sorted(kernels[begin:end], key=lambda e: -e[1])[:3]
        print(f"  {kernels[end][0] - kernels[begin][0]:7.1f}  " + ", ".join(f"{n[:24]} {d:.1f}" for _, d, n in longest))
    middle = len(routers) // 2
    print("one MoE layer (router to router): start offset us, duration us, idle before us, kernel")
    layer_start = kernels[routers[middle]][0]
    for i in range(routers[middle], routers[middle + 1]):
        ts, dur, name = kernels[i]
        idle = ts - kernels[i - 1][0] - kernels[i - 1][1]
        print(f"  {ts - layer_start:8.1f} {dur:7.1f} {idle:6.1f}  {name[:90]}")


class _Timed:
    """Wraps a callable, adding its wall time to a total."""

    def __init__(self, fn, totals: dict, name: str):
        self.fn, self.totals, self.name = fn, totals, name

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.totals[self.name] = self.totals.get(self.name, 0.0) + time.perf_counter() - started


def host_breakdown(model, state, token: int) -> None:
    """Host time per step in each host action, the wait for the router's ids, and graph replays."""
    runner, executor, totals = model.decode_runner, model.expert_executor, {}
    decode = executor.decode
    decode._fetch = _Timed(decode._fetch, totals, "fetch (incl. ids wait)")
    for layer in model.layers:
        if isinstance(layer.mixer, Attention):
            layer.mixer.attend = _Timed(layer.mixer.attend, totals, "attend")
    event = decode._ids_ready
    event.synchronize = _Timed(event.synchronize, totals, "ids wait")
    executor.fetch_for_step = _Timed(executor.fetch_for_step, totals, "fetch_for_step")
    executor.compute_on_cpu = _Timed(executor.compute_on_cpu, totals, "compute_on_cpu")
    if executor.cpu_kernel is not None:
        executor.cpu_kernel.run = _Timed(executor.cpu_kernel.run, totals, "  of which the kernel")
    runner._program = [
        _Timed(action, totals, "graph replays")
        if isinstance(getattr(action, "__self__", None), torch.cuda.CUDAGraph)
        else action
        for action in runner._program
    ]
    step, token = timed_steps(model, state, token)
    print(f"host breakdown, step {step * 1e3:.2f} ms:")
    for name, total in totals.items():
        print(f"  {name:26s} {total / STEPS * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
