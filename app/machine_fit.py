"""Whether a model fits this machine: its weights against the RAM and the GPU's memory, and a plan for the GPU.

With a usable GPU the planner puts the attention, shared experts and lm head on the card and an expert cache
beside them, while the embedding and every routed expert stay in host RAM; without one (or when no plan fits the
card) every weight is in RAM. The presets' fit (4/8/12 GB cards) is a separate, secondary question.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from app import system_info
from app.system_info import format_bytes

TIGHT_SHARE = 0.85  # past this share of the RAM the OS and other programs are left too little: swapping


@dataclass(frozen=True)
class Machine:
    """This machine's memory: total RAM, the total memory of its GPU (0 without one), and the free disk where
    models are downloaded (None: not asked)."""

    ram_bytes: int  # 0 when unknown
    vram_bytes: int = 0
    gpu_name: str = ""
    disk_free_bytes: int | None = None

    @classmethod
    def read(cls, models_dir: Path | None = None) -> Machine:
        """The figures of the machine the app runs on (NVML or torch for the GPU, psutil for the RAM, the disk
        under `models_dir` when given)."""
        gpu = system_info.gpu_memory()
        ram = system_info.ram()["total_bytes"]
        disk = system_info.disk_free(models_dir) if models_dir is not None else None
        return cls(ram, gpu["total_bytes"] if gpu else 0, gpu["name"] if gpu else "", disk)

    def describe(self) -> str:
        """E.g. "23.50 GiB RAM, no GPU" or "32.00 GiB RAM, NVIDIA RTX 4060 with 8.00 GiB"."""
        ram = f"{format_bytes(self.ram_bytes)} RAM" if self.ram_bytes else "unknown RAM"
        if not self.vram_bytes:
            return f"{ram}, no GPU"
        return f"{ram}, {self.gpu_name or 'a GPU'} with {format_bytes(self.vram_bytes)}"


@dataclass(frozen=True)
class MachineFit:
    """The verdict: `short` fits a table cell, `text` says what the numbers are and what to do."""

    level: str  # "fits" | "tight" | "too_big" | "no_disk" | "unknown"
    short: str
    text: str
    gpu_plan: bool  # a plan fits this machine's GPU (False in CPU mode)


SHORT = {"fits": "✓ fits", "tight": "⚠ tight", "too_big": "✗ too big", "no_disk": "✗ disk full", "unknown": "?"}


def judge(footprint, machine: Machine) -> MachineFit:
    """How the model described by `footprint` (engine.runtime.footprint.ModelFootprint) fits `machine`."""
    from engine.api import PlanError, plan_memory

    weights = footprint.resident_bytes + footprint.embedding_bytes + footprint.routed_expert_bytes
    gpu_plan, gpu_note = False, "CPU mode (no GPU): every weight is in RAM."
    if machine.vram_bytes:
        try:
            plan = plan_memory(footprint, machine.vram_bytes, "auto")
            gpu_plan = True
            gpu_note = (
                f"{machine.gpu_name or 'The GPU'} runs it with {plan.expert_cache_layers} expert-cache "
                f"layer(s); the embedding and the routed experts stay in RAM."
            )
        except PlanError as exc:
            gpu_note = f"No plan fits {machine.gpu_name or 'the GPU'} ({exc}), so it would run in CPU mode."
    in_ram = footprint.embedding_bytes + footprint.routed_expert_bytes if gpu_plan else weights
    return _verdict(weights, in_ram, machine, gpu_note, gpu_plan)


def judge_weights(weight_bytes: int, machine: Machine) -> MachineFit:
    """The fit from the weights' total alone (a Hub file list): they must fit in RAM and VRAM together."""
    note = (
        "The GPU holds part of the weights; the routed experts stay in RAM."
        if machine.vram_bytes
        else "CPU mode (no GPU): every weight is in RAM."
    )
    return _verdict(weight_bytes, weight_bytes if not machine.vram_bytes else None, machine, note, False)


def _verdict(weights: int, in_ram: int | None, machine: Machine, gpu_note: str, gpu_plan: bool) -> MachineFit:
    """The verdict on `weights` bytes of which `in_ram` (None: unknown) must be in host RAM."""
    if not machine.ram_bytes:
        return MachineFit("unknown", SHORT["unknown"], f"This machine's RAM could not be read. {gpu_note}", gpu_plan)
    need = (
        f"it needs ≈ {format_bytes(in_ram)} of RAM for its weights ({format_bytes(weights)} in all)"
        if in_ram is not None
        else f"its weights take {format_bytes(weights)}"
    )
    here = f"this machine has {machine.describe()}"
    disk = ""
    if machine.disk_free_bytes is not None and weights > machine.disk_free_bytes:
        disk = (
            f" The disk has only {format_bytes(machine.disk_free_bytes)} free for the download: free some "
            f"space or choose another download folder."
        )
    if weights > machine.ram_bytes + machine.vram_bytes or (in_ram or 0) > machine.ram_bytes:
        return MachineFit(
            "too_big",
            SHORT["too_big"],
            f"Does not fit this machine: {need}, and {here}. Loading it would fail or swap for "
            f"minutes a token; choose a smaller format (NVFP4 or FP8) or a machine with more "
            f"memory. {gpu_note}{disk}",
            gpu_plan,
        )
    if (in_ram if in_ram is not None else weights) > TIGHT_SHARE * machine.ram_bytes:
        return MachineFit(
            "tight",
            SHORT["tight"],
            f"Tight: {need}, and {here}; close other programs before loading it, or it may swap. {gpu_note}{disk}",
            gpu_plan,
        )
    if disk:
        return MachineFit(
            "no_disk", SHORT["no_disk"], f"Fits in memory, but not on the disk: {need}; {here}.{disk}", gpu_plan
        )
    return MachineFit("fits", SHORT["fits"], f"Fits: {need}; {here}. {gpu_note}", gpu_plan)
