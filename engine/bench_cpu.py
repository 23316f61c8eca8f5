"""`python -m engine bench --cpu-experts`: how fast the CPU computes routed NVFP4 experts
(engine/kernels/cpu_experts/), against the machine's DRAM read bandwidth, the bound such a kernel lives under.

The experts are random full-size ones (hidden 2048, intermediate 512, as in Qwen3.6-35B-A3B) in records that
together far exceed the CPU's caches; each call takes the next experts round that ring, so their bytes come from
DRAM as a decode step's would.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from engine.checkpoint.formats import NVFP4, StoredWeight, fuse_rows
from engine.kernels import cpu_experts
from engine.kernels.record_layout import RecordLayout

HIDDEN, INTERMEDIATE = 2048, 512
RECORDS_BYTES = 640 * 2**20  # the ring of expert records, well past any CPU's last-level cache
DRAM_PROBE_BYTES = 2**30
LAYERS, EXPERTS_PER_TOKEN = 40, 8  # a decode token of the model the tokens/s bound is for
REPEATS = 3

if cpu_experts.numba is not None:
    import numba

    @numba.njit(parallel=True, nogil=True, cache=True)
    def _read_all(words):
        total = np.uint64(0)
        for i in numba.prange(words.shape[0]):
            total += words[i]
        return total


def dram_read_bandwidth(threads: int, nbytes: int | None = None, repeats: int | None = None) -> float:
    """Bytes per second a parallel sum over `nbytes` (default DRAM_PROBE_BYTES) reads at, best of `repeats`."""
    _need_numba()
    nbytes, repeats = nbytes or DRAM_PROBE_BYTES, repeats or REPEATS
    words = np.ones(nbytes // 8, dtype=np.uint64)  # written once, so every page is really there
    cpu_experts.numba_threads(threads)
    _read_all(words)
    return nbytes / min(_timed(_read_all, words) for _ in range(repeats))


def nvfp4_records(
    count: int | None = None, hidden: int | None = None, intermediate: int | None = None, seed: int = 0
) -> tuple[RecordLayout, torch.Tensor]:
    """`count` random NVFP4 experts (default: RECORDS_BYTES of them) as records: random codes, block scales of
    ordinary size, global scale 1."""
    hidden, intermediate = hidden or HIDDEN, intermediate or INTERMEDIATE
    count = count or max(RECORDS_BYTES // _record_bytes(hidden, intermediate), EXPERTS_PER_TOKEN)

    def weight(rows: int, cols: int) -> StoredWeight:
        tensors = {
            "weight": torch.zeros(rows, cols // 2, dtype=torch.uint8),
            "weight_scale": torch.zeros(rows, cols // 16, dtype=torch.float8_e4m3fn),
            "weight_scale_2": torch.ones(()),
        }
        return StoredWeight(NVFP4, tensors, (rows, cols), "expert")

    layout = RecordLayout.of(
        {
            "gate_up": fuse_rows([weight(intermediate, hidden)] * 2, "gate_up"),
            "down": fuse_rows([weight(hidden, intermediate)], "down"),
        }
    )
    generator = torch.Generator().manual_seed(seed)
    records = torch.randint(0, 256, (count, layout.record_bytes), dtype=torch.uint8, generator=generator)
    for matrix in layout.view(records).values():
        scales = matrix.tensors["weight_scale"].view(torch.uint8)
        scales.copy_(torch.randint(0x28, 0x40, scales.shape, dtype=torch.uint8, generator=generator))  # 2^-2..1
        matrix.tensors["weight_scale_2"].fill_(1.0)
    return layout, records


def weight_bytes(layout: RecordLayout) -> int:
    """The bytes of one expert's tensors (codes and scales), without the record's alignment padding."""
    return sum(slot.nbytes for matrix in layout.matrices.values() for slot in matrix.tensors)


def expert_throughput(
    threads: int,
    tokens: int = 1,
    experts: int = EXPERTS_PER_TOKEN,
    records: tuple[RecordLayout, torch.Tensor] | None = None,
    repeats: int | None = None,
    activations: str | None = None,
) -> dict:
    """Best of `repeats` passes round the ring of records (default: nvfp4_records()), `experts` at a time, each
    chosen by all `tokens`; `activations` as CpuExpertKernel takes them (None: the default for this CPU)."""
    layout, ring = records or nvfp4_records()
    kernel = cpu_experts.CpuExpertKernel(layout, activations)
    calls = ring.shape[0] // experts
    x = torch.randn(tokens, kernel.hidden, generator=torch.Generator().manual_seed(1))
    weights = torch.full((tokens, experts), 1.0 / experts)
    on_cpu = torch.ones(tokens, experts, dtype=torch.bool)
    chosen = [torch.arange(c * experts, (c + 1) * experts).expand(tokens, experts) for c in range(calls)]
    with _threads(threads):
        kernel.run(ring, x, chosen[0], weights, on_cpu)  # compiles, or loads the compiled kernel
        best = min(
            _timed(lambda: [kernel.run(ring, x, ids, weights, on_cpu) for ids in chosen])
            for _ in range(repeats or REPEATS)
        )
    return {
        "threads": threads,
        "tokens": tokens,
        "activations": kernel.activations,
        "experts_per_call": experts,
        **_rates(layout, calls * experts, best),
    }


def share_throughput(
    threads: int, records: tuple[RecordLayout, torch.Tensor] | None = None, repeats: int | None = None
) -> dict:
    """Decode's path for the CPU's experts (engine/kernels/cpu_share.py): threads that serve a step's layers as
    the GPU posts them. The ring of records is cut into layers of EXPERTS_PER_TOKEN experts, every one for the
    CPU. A compiled loop plays the GPU: the layers' ids and input are written once, and each layer is only its
    request flag set and its done flag awaited, with the GIL released (a Python loop held it, and the worker's
    start waited for Python's 5 ms switch interval: on the H200 machine that cut 15 threads' rate from about 60
    GB/s to 20). Best of `repeats` steps over the whole ring."""
    from engine.kernels import cpu_share

    layout, ring = records or nvfp4_records()
    layers = [
        ring[i : i + EXPERTS_PER_TOKEN] for i in range(0, ring.shape[0] - EXPERTS_PER_TOKEN + 1, EXPERTS_PER_TOKEN)
    ]
    with _threads(threads):  # the worker takes its thread count when made
        kernel = cpu_experts.CpuExpertKernel(layout)
        worker = cpu_share.CpuShareWorker(kernel, layers, cpu_share.Mailbox(EXPERTS_PER_TOKEN, kernel.hidden, False))
    box = worker.mailbox
    box.ids.copy_(torch.arange(EXPERTS_PER_TOKEN, dtype=torch.int32))
    box.weights.fill_(1.0 / EXPERTS_PER_TOKEN)
    box.x.copy_(torch.randn(kernel.hidden, generator=torch.Generator().manual_seed(1)))
    flags = box.flags.numpy()

    def step():
        _play_gpu(flags, worker.start(len(layers)), len(layers))
        worker.finish()

    try:
        step()
        best = min(_timed(step) for _ in range(repeats or REPEATS))
    finally:
        worker.close()
    return {
        "threads": worker.threads,
        "activations": kernel.activations,
        "experts_per_layer": EXPERTS_PER_TOKEN,
        **_rates(layout, len(layers) * EXPERTS_PER_TOKEN, best),
    }


if cpu_experts.numba is not None:
    from engine.kernels.cpu_experts.atomics import _load_acquire, _raise_to
    from engine.kernels.cpu_share import CANCEL, DONE, REQUEST

    @numba.njit(nogil=True, cache=True)
    def _play_gpu(flags, first, layers):
        """The GPU's side of a step: each layer requested, then its done flag awaited (or cancel)."""
        at = flags.ctypes.data
        for layer in range(layers):
            _raise_to(at + 4 * REQUEST, first + layer)
            while _load_acquire(at + 4 * DONE) < first + layer and _load_acquire(at + 4 * CANCEL) == 0:
                pass


@contextlib.contextmanager
def _threads(threads: int):
    """The CPU expert kernels' thread count set to `threads` for the block, then put back."""
    previous = cpu_experts.threads()
    cpu_experts.set_threads(threads)
    try:
        yield
    finally:
        cpu_experts.set_threads(previous)


def _rates(layout: RecordLayout, computed: int, seconds: float) -> dict:
    """The figures of `computed` experts in `seconds`."""
    return {
        "expert_bytes": weight_bytes(layout),
        "experts_per_s": computed / seconds,
        "expert_bytes_per_s": computed * weight_bytes(layout) / seconds,
    }


def run_cpu_bench(thread_counts: list[int], tokens: int = 1) -> dict:
    """Per thread count and activation precision (bf16 where the CPU has its dot, and float32): DRAM read
    bandwidth, NVFP4 expert throughput, their ratio, and the decode tokens/s that throughput allows when every
    expert of a token is computed on the CPU."""
    _need_numba()
    records = nvfp4_records()
    precisions = (["bf16"] if cpu_experts.bf16_dot_supported() else []) + ["float32"]
    rows, share_rows = [], []
    for threads in thread_counts:
        dram = dram_read_bandwidth(threads)
        for activations in precisions:
            row = expert_throughput(threads, tokens, records=records, activations=activations)
            row.update(
                dram_bytes_per_s=dram,
                ratio=row["expert_bytes_per_s"] / dram,
                tokens_per_s_bound=row["experts_per_s"] * tokens / (LAYERS * EXPERTS_PER_TOKEN),
            )
            rows.append(row)
        if tokens == 1:
            share = share_throughput(threads, records)
            share.update(
                dram_bytes_per_s=dram,
                ratio=share["expert_bytes_per_s"] / dram,
                tokens_per_s_bound=share["experts_per_s"] / (LAYERS * EXPERTS_PER_TOKEN),
            )
            share_rows.append(share)
    layout = records[0]
    gate_up = layout.matrices["gate_up"].shape
    return {
        "format": NVFP4,
        "hidden": gate_up[1],
        "intermediate": gate_up[0] // 2,
        "tokens": tokens,
        "ring_bytes": records[1].numel(),
        "bound_for": f"{LAYERS} layers x {EXPERTS_PER_TOKEN} experts a token",
        "compiled_for": compiled_for(),
        "runs": rows,
        "decode_share_runs": share_rows,
    }


def compiled_for() -> dict:
    """The CPU that numba's LLVM compiles the kernels for, and its vector extensions: a VM that hides the host's
    model or AVX-512 gets slower code with no error."""
    from llvmlite import binding

    features = binding.get_host_cpu_features()
    return {
        "cpu": binding.get_host_cpu_name(),
        "numba_cpu_name": numba.config.CPU_NAME,
        "vector_features": sorted(name for name, on in features.items() if on and name.startswith(("avx", "sse4"))),
        "prefer_512_bit": "-prefer-256-bit" in (numba.config.CPU_FEATURES or ""),
    }


TABLE_HEADER = (
    f"{'threads':>7}  {'activations':>11}  {'DRAM GB/s':>9}  {'expert GB/s':>11}  {'ratio':>5}  {'tokens/s bound':>14}"
)


def format_table(result: dict) -> str:
    lines = [
        f"NVFP4 experts on the CPU (hidden {result['hidden']}, intermediate {result['intermediate']}, "
        f"{result['tokens']} token(s) a call, {result['ring_bytes'] / 2**20:.0f} MiB of records)",
        TABLE_HEADER,
    ]
    lines += [_table_row(row) for row in result["runs"]]
    lines.append(f"tokens/s bound: {result['bound_for']}, every expert on the CPU")
    if result.get("decode_share_runs"):
        lines += [
            "decode's path (threads serving a step's layers, each posted and awaited for the GPU by a compiled loop):",
            TABLE_HEADER,
            *(_table_row(row) for row in result["decode_share_runs"]),
        ]
    target = result["compiled_for"]
    width = ", 512-bit vectors preferred" if target.get("prefer_512_bit") else ""
    lines.append(f"compiled for {target['cpu']}{width}: {' '.join(target['vector_features']) or 'no AVX'}")
    return "\n".join(lines)


def _table_row(row: dict) -> str:
    return (
        f"{row['threads']:>7}  {row['activations']:>11}  {row['dram_bytes_per_s'] / 1e9:>9.1f}  "
        f"{row['expert_bytes_per_s'] / 1e9:>11.2f}  {row['ratio']:>5.2f}  {row['tokens_per_s_bound']:>14.1f}"
    )


def _record_bytes(hidden: int, intermediate: int) -> int:
    """About one NVFP4 expert's record: codes, block scales and a global scale per row of each matrix."""
    return 2 * intermediate * (hidden // 2 + hidden // 16 + 4) + hidden * (intermediate // 2 + intermediate // 16 + 4)


def _timed(work, *args) -> float:
    started = time.perf_counter()
    work(*args)
    return time.perf_counter() - started


def _need_numba() -> None:
    if cpu_experts.numba is None:
        raise RuntimeError("the CPU expert benchmark needs numba (pip install numba)")
