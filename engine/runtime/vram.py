"""Holding a process to a VRAM budget on a bigger card, and measuring what it really used.

The budget covers everything the process takes on the GPU: PyTorch's caching allocator and what lives
outside it (the CUDA context, kernel images, per-thread local memory). The allocator is capped at the
budget less the outside part of the runtime reserve plans use on this GPU (measured there by
engine/runtime/reserve.py, else the planner's formula) (`set_per_process_memory_fraction`), so an
allocation past the plan fails as a CUDA out-of-memory error, as it would on the small card. The
measured peak adds the outside part seen now to the allocator's peak: the outside part only grows, so
this is an upper bound of the process's true peak, checked against the budget.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from engine.runtime.planner import runtime_reserve_bytes

DEFAULT_THREADS_PER_MULTIPROCESSOR = 2048  # Volta to Hopper; consumer Turing/Ampere/Ada cards report 1024-1536


@dataclass(frozen=True)
class VramCap:
    budget_bytes: int
    allocator_limit_bytes: int  # what PyTorch may hold: the budget less the outside estimate
    outside_estimate_bytes: int  # context, kernels, local memory: the runtime reserve's outside part
    total_bytes: int  # the card's memory

    def to_dict(self) -> dict:
        return asdict(self)


def gpu_runtime_reserve_bytes(device: torch.device | str = "cuda") -> int:
    """The planner's runtime reserve for this GPU (its SM count and threads per SM set the local memory)."""
    props = torch.cuda.get_device_properties(device)
    threads = getattr(props, "max_threads_per_multi_processor", DEFAULT_THREADS_PER_MULTIPROCESSOR)
    return runtime_reserve_bytes(props.multi_processor_count, threads, props.major)


def outside_allocator_bytes(device: torch.device | str = "cuda") -> int:
    """This GPU's process memory outside PyTorch's allocator as plans budget it: the runtime reserve in use here
    (engine/runtime/reserve.py) less its part inside the allocator (so: context, kernel images, instantiated
    graphs, per-thread local memory)."""
    from engine.runtime.reserve import runtime_reserve

    return runtime_reserve(device).outside_allocator_bytes


def cap_process_memory(budget_bytes: int, device: torch.device | str = "cuda") -> VramCap:
    """Cap PyTorch's allocator on `device` so the whole process stays within `budget_bytes`."""
    outside = outside_allocator_bytes(device)  # first: a first measurement reads the card before CUDA starts
    torch.cuda.init()
    device = torch.device("cuda", torch.device(device).index or torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    limit = budget_bytes - outside
    if limit <= 0 or budget_bytes > total:
        raise ValueError(
            f"a VRAM limit of {budget_bytes / 2**30:.2f} GiB cannot be held on this "
            f"{total / 2**30:.1f} GiB GPU: it needs {outside / 2**30:.2f} GiB outside PyTorch's allocator"
        )
    torch.cuda.set_per_process_memory_fraction(limit / total, device)
    return VramCap(budget_bytes, limit, outside, total)


def measured_peak(device: torch.device | str = "cuda") -> dict:
    """The process's peak GPU memory: allocator peak plus what lies outside the allocator now. Assumes
    nothing else runs on the GPU (a dedicated benchmark machine), since the outside part is read from
    the card's free memory."""
    free, total = torch.cuda.mem_get_info(device)
    outside = (total - free) - torch.cuda.memory_reserved(device)
    return {
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
        "outside_allocator_bytes": outside,
        "peak_process_bytes": torch.cuda.max_memory_reserved(device) + outside,
    }


def process_usage_bytes(device: torch.device | str = "cuda") -> int:
    """This process's GPU memory now: what the allocator holds plus the reserve's outside part (the
    card's free memory would also count other programs, such as the desktop)."""
    return torch.cuda.memory_reserved(device) + outside_allocator_bytes(device)
