"""The decode step's model of the tiers a token's bytes cross (issue 22, part 5; issue 24), and the cards it is
projected onto: the GPU's own step reads resident weights, the cache's experts and the KV cache at VRAM bandwidth;
missed experts cross PCIe (offload), are read by the CPU from host DRAM (cpu), or both at once (hybrid). The
bench's projection (engine/bench_projection.py) and the plan's expected decode speed (decode_estimate.py) share
these formulas.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.runtime.footprint import ModelFootprint

RUN_GPU_VRAM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}  # NVIDIA's figures (SXM) for the runs' GPUs


@dataclass(frozen=True)
class Card:
    """A card and its host, in the figures the projection uses; `assumed` names those not from a spec sheet."""

    name: str
    preset: str
    vram_bytes_per_s: float
    pcie_bytes_per_s: float  # host->GPU copies from pinned memory, effective
    cpu_threads: int
    dram_bytes_per_s: float  # the host's peak
    tensor_flops: float  # dense bf16 with FP32 accumulate, peak
    assumed: str


CARDS = (
    Card(
        "RTX 2050 laptop 4 GB (field report)",
        "4gb",
        112e9,
        6.5e9,
        8,
        51.2e9,
        6.1e12,
        "PCIe 4.0 x4 at 6.5 GB/s; DDR4-3200 dual channel; tensor peak from 16 SMs at 1.5 GHz",
    ),
    Card(
        "RTX 4060 laptop 8 GB",
        "8gb",
        256e9,
        13e9,
        8,
        89.6e9,
        24.6e12,
        "PCIe 4.0 x8 at 13 GB/s; DDR5-5600 dual channel; 8 threads; tensor peak from 24 SMs at 2.0 GHz",
    ),
    Card(
        "RTX 3060 12 GB",
        "12gb",
        360e9,
        26e9,
        8,
        51.2e9,
        12.7e12,
        "PCIe 4.0 x16 at 26 GB/s; DDR4-3200 dual channel; 8 threads",
    ),
)


def transfer_seconds(miss_bytes: float, pcie_bytes_per_s: float, cpu_bytes_per_s: float | None, backend: str) -> float:
    """Seconds a token's missed expert bytes take to cross PCIe (offload), to be read by the CPU (cpu) or both
    at once, split in proportion (hybrid)."""
    rates = {
        "offload": pcie_bytes_per_s,
        "cpu": cpu_bytes_per_s or 0.0,
        "hybrid": pcie_bytes_per_s + (cpu_bytes_per_s or 0.0),
    }
    rate = rates.get(backend, pcie_bytes_per_s)
    return miss_bytes / rate if rate else float("inf")


def decode_step_seconds(
    gpu_step_seconds: float, miss_bytes: float, pcie_bytes_per_s: float, cpu_bytes_per_s: float | None, backend: str
) -> float:
    """A modelled decode step: the GPU's own step, then the missed experts' transfer (no overlap)."""
    return gpu_step_seconds + transfer_seconds(miss_bytes, pcie_bytes_per_s, cpu_bytes_per_s, backend)


def gpu_bytes_per_token(footprint: ModelFootprint, hit_share: float, context_tokens: int) -> float:
    """Bytes a decode token reads from VRAM: every resident weight, the cache's hits, the KV cache."""
    top_k = footprint.config.num_experts_per_tok
    record = footprint.expert_layer_bytes / footprint.experts_per_layer
    return (
        footprint.resident_bytes
        + hit_share * footprint.moe_layers * top_k * record
        + footprint.kv_bytes_per_token * context_tokens
    )


def card_gpu_step(
    run_step: float, run_bytes: float, run_vram_bytes_per_s: float, card_bytes: float, card: Card
) -> float:
    """The GPU's own step on `card`: the run's, its bytes read at the card's bandwidth instead."""
    return max(0.0, run_step - run_bytes / run_vram_bytes_per_s) + card_bytes / card.vram_bytes_per_s
