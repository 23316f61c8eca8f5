"""Where a model runs: on the GPU under a memory plan, or on the CPU with the reason said plainly.

`plan_placement` decides (GPU usable? which budget? which plan?) without reading weights;
`load_placed` loads the model the way the placement says. The app's worker and the CLI share both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.checkpoint.quant_config import kv_cache_choice, read_quant_settings
from engine.config import read_config
from engine.loader import load_model
from engine.models.base import CausalLM
from engine.runtime.footprint import footprint_from_checkpoint
from engine.runtime.planner import DEFAULT_USE, MemoryPlan, plan_memory, preset_budget_bytes

MIN_COMPUTE_CAPABILITY = (7, 5)  # Turing: the oldest cards the Triton kernels target


@dataclass(frozen=True)
class Placement:
    device: str  # "cuda" or "cpu"
    dtype: torch.dtype
    plan: MemoryPlan | None  # the GPU's memory plan; None on the CPU
    note: str  # for the user: what runs where, and why
    kv_cache: str = "bf16"  # the KV cache's dtype, "bf16" or "fp8": the plan's where there is one

    def to_dict(self) -> dict:
        return {
            "device": self.device,
            "dtype": str(self.dtype).removeprefix("torch."),
            "kv_cache": self.kv_cache,
            "note": self.note,
            "plan": self.plan.to_dict() if self.plan else None,
        }


def gpu_status() -> tuple[bool, str]:
    """(usable, the GPU's name or why there is none usable)."""
    if torch.version.cuda is None:
        return False, (
            "this PyTorch build has no CUDA support (a CPU-only build): reinstall MoE Desk with an "
            "NVIDIA driver present to get the CUDA build"
        )
    if not torch.cuda.is_available():
        return False, "no NVIDIA GPU or driver was found (install or update the NVIDIA driver to use the GPU)"
    from engine.runtime.reserve import note_card_baseline

    note_card_baseline()  # the card's memory before this process's CUDA context, for measuring the reserve
    major, minor = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    if (major, minor) < MIN_COMPUTE_CAPABILITY:
        return False, (
            f"{name} is compute capability {major}.{minor}; MoE Desk's GPU kernels need "
            f"{MIN_COMPUTE_CAPABILITY[0]}.{MIN_COMPUTE_CAPABILITY[1]} (RTX 20 series) or newer"
        )
    return True, name


def plan_placement(
    folder: str | Path,
    preset: str,
    budget_bytes: int | None = None,
    custom: dict | None = None,
    device: str = "auto",
    kv_cache_dtype: str = "auto",
    use: str = DEFAULT_USE,
) -> Placement:
    """The placement of the checkpoint at `folder`, its KV cache in the dtype kv_cache_dtype gives it
    (quant_config.kv_cache_choice), the memory beyond the target prompt spent as `use` says (planner.USES).
    PlanError when the GPU is usable but no plan fits."""
    usable, status = gpu_status()
    if device == "cpu" or not usable:
        why = "the CPU was chosen in the settings" if device == "cpu" else status
        config = read_config(Path(folder))
        kv_cache = kv_cache_choice(kv_cache_dtype, read_quant_settings(Path(folder), config.quantization_config))
        return Placement("cpu", torch.float32, None, f"CPU mode: {why}.", kv_cache)
    from engine.runtime.reserve import runtime_reserve

    reserve = runtime_reserve()  # before the free memory is read: a first measurement frees what it used
    if budget_bytes is None:
        budget_bytes = preset_budget_bytes(preset) or torch.cuda.mem_get_info()[0]
    plan = plan_memory(
        footprint_from_checkpoint(folder, kv_cache_dtype),
        budget_bytes,
        preset,
        custom,
        reserve_bytes=reserve.reserve_bytes,
        reserve_source=reserve.source,
        use=use,
    )
    return Placement("cuda", gpu_dtype(), plan, f"GPU mode on {status}: {plan.summary()}", plan.kv_cache)


def gpu_dtype() -> torch.dtype:
    """The dtype the GPU computes in: bf16 needs Ampere or newer; Turing computes in fp16."""
    return torch.bfloat16 if torch.cuda.get_device_capability()[0] >= 8 else torch.float16


def load_placed(
    folder: str | Path,
    placement: Placement,
    pin_budget_bytes: int | None = None,
    expert_backend: str = "auto",
    cpu_threads: int | None = None,
) -> CausalLM:
    slots = placement.plan.expert_slots if placement.plan is not None else None
    return load_model(
        folder,
        placement.device,
        placement.dtype,
        expert_cache_slots=slots,
        pin_budget_bytes=pin_budget_bytes,
        expert_backend=expert_backend,
        cpu_threads=cpu_threads,
        kv_cache_dtype=placement.kv_cache,
    )


def can_switch_plan(loaded: Placement, new: Placement) -> bool:
    """Tell whether switch_plan can take a model loaded under `loaded` to `new` in place: the same device,
    compute dtype and KV cache dtype, and a plan on both sides."""
    same_kind = (loaded.device, loaded.dtype, loaded.kv_cache) == (new.device, new.dtype, new.kv_cache)
    return same_kind and loaded.plan is not None and new.plan is not None


def switch_plan(model: CausalLM, loaded: Placement, new: Placement) -> bool:
    """Give `model`, loaded under `loaded`, the expert cache of `new`'s plan without reading the checkpoint again
    (the slots are rebuilt from the host records); True if done, False where `new` needs a reload (another
    device, compute dtype or KV cache dtype, or a side without a plan). The plan's KV cache and prefill chunk
    are a new state's and session's to take: drop the old states first, whose KV would stay beside it."""
    if not can_switch_plan(loaded, new):
        return False
    if new.plan.expert_slots != loaded.plan.expert_slots:
        if model.decode_runner is not None:  # its graphs read the old slots and hold their memory
            model.decode_runner.release()
        model.expert_executor.resize(new.plan.expert_slots)
    return True
