"""load_model: a checkpoint folder in, a model that produces logits out."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from engine.checkpoint import Checkpoint
from engine.checkpoint.quant_config import QuantSettings, kv_cache_choice
from engine.checkpoint.source import WeightSource
from engine.config import read_config
from engine.experts.cached_executor import CachedExpertExecutor
from engine.experts.executor import ReferenceExpertExecutor
from engine.experts.link import LinkLimit
from engine.experts.packed import default_pin_budget_bytes
from engine.models import BUILDERS
from engine.models.base import CausalLM
from engine.runtime.graph_runner import attach_graph_runner

if sys.platform.startswith("linux"):
    # Grown segments instead of fixed blocks: measured on the H200, fixed blocks left 114 MiB reserved but
    # unusable after loading, enough to fail a 4 GiB plan; read when CUDA first allocates (Linux only)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    expert_cache_slots: int | None = None,
    pin_budget_bytes: int | None = None,
    expert_backend: str = "auto",
    cpu_threads: int | None = None,
    kv_cache_dtype: str = "auto",
) -> CausalLM:
    """Open a Hugging Face checkpoint folder. Raises CheckpointError with the path and a plain cause.

    Routed experts stay in host RAM. With `expert_cache_slots`, that many experts at a time live in
    cache slots on `device` (the plan's expert-cache layers x experts); without, each chosen expert
    is computed from the host bank directly. `pin_budget_bytes` caps the page-locked host memory of the
    expert records (default: half of physical RAM); the split is in `model.expert_executor.stats()`.
    On a GPU, `expert_backend` says where a decode step's cache misses run (engine/experts/backend.py: auto,
    gpu, offload, cpu, hybrid) and `cpu_threads` how many threads compute the CPU's share (default: cores).
    `kv_cache_dtype` (engine.checkpoint.quant_config.KV_CACHE_CHOICES): fp8 keeps the KV cache in e4m3 with
    scales, bf16 in the compute dtype, auto fp8 where the checkpoint declares an FP8 KV cache."""
    folder = Path(path).expanduser()
    config = read_config(folder)
    checkpoint = Checkpoint(folder, config.quantization_config)
    source = WeightSource(checkpoint, config, torch.device(device), dtype, kv_dtype(kv_cache_dtype, checkpoint.quant))
    executor = expert_executor(device, expert_cache_slots, pin_budget_bytes, expert_backend, cpu_threads)
    return build_model(source, executor)


def kv_dtype(kv_cache_dtype: str, quant: QuantSettings) -> torch.dtype | None:
    """The KV cache dtype a WeightSource takes for a kv_cache_dtype option: torch.float8_e4m3fn for fp8, None (the
    compute dtype) for bf16."""
    return torch.float8_e4m3fn if kv_cache_choice(kv_cache_dtype, quant) == "fp8" else None


def build_model(source: WeightSource, executor) -> CausalLM:
    """The model of `source`'s config, its one-token calls run by a graph runner where they can be captured."""
    model = BUILDERS[source.config.model_type](source, executor)
    attach_graph_runner(model)
    return model


def expert_executor(
    device,
    expert_cache_slots: int | None,
    pin_budget_bytes: int | None = None,
    expert_backend: str = "auto",
    cpu_threads: int | None = None,
    link: LinkLimit | None = None,
):
    if not expert_cache_slots:
        return ReferenceExpertExecutor()
    budget = default_pin_budget_bytes() if pin_budget_bytes is None else pin_budget_bytes
    return CachedExpertExecutor(device, expert_cache_slots, budget, expert_backend, cpu_threads, link)
