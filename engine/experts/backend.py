"""The expert backends: where a decode step's expert misses run, chosen once per load (and by auto's trial)."""

from __future__ import annotations

from enum import StrEnum


class Backend(StrEnum):
    """Where a decode step's expert misses run.

    `offload` copies them over PCIe into the GPU cache, `cpu` computes them on the CPU straight from host RAM,
    `hybrid` splits them so both finish together, `gpu` keeps every expert resident in VRAM (never misses once
    warm). `auto` is not a backend a step runs: it resolves to one of the others (engine/experts/policy.py)."""

    AUTO = "auto"
    GPU = "gpu"
    OFFLOAD = "offload"
    CPU = "cpu"
    HYBRID = "hybrid"

    @property
    def shares_with_cpu(self) -> bool:
        """Whether some of a step's misses may run on the CPU."""
        return self in (Backend.CPU, Backend.HYBRID)


BACKENDS = tuple(backend.value for backend in Backend)  # the names a user may choose, auto first
