"""CpuExpertKernel: the routed experts of one model, computed on the CPU from its expert records."""

from __future__ import annotations

import numpy as np
import torch

from engine.kernels.cpu_experts.cpu import bf16_dot_supported, numba
from engine.kernels.cpu_experts.fallback import run_torch
from engine.kernels.cpu_experts.meta import _matrix_meta
from engine.kernels.cpu_experts.pool import _launch, numba_threads, threads
from engine.kernels.record_layout import RecordLayout

if numba is not None:
    from engine.kernels.cpu_experts.scheduler import _experts


class CpuExpertKernel:
    """Routed experts of one model computed on the CPU from its expert records (one RecordLayout)."""

    def __init__(self, layout: RecordLayout, activations: str | None = None):
        """activations: "bf16" rounds each token's inputs to bf16 for NVFP4 rows (AVX512-BF16's dot, about 3x the
        float32 path per core for one token an expert, and each row's codes decoded once for up to 4 of an
        expert's tokens; the GPU kernels round activations to bf16 the same way), "float32" keeps them exact;
        None picks bf16 where the CPU has the instructions."""
        if activations is None:
            activations = "bf16" if bf16_dot_supported() else "float32"
        if activations not in ("bf16", "float32"):
            raise ValueError(f"activations must be 'bf16' or 'float32', got {activations!r}")
        if activations == "bf16" and not bf16_dot_supported():
            raise ValueError("bf16 activations need a CPU with AVX512-BF16 and AVX512-BW (and numba)")
        self.activations = activations
        gate_up, down = layout.matrices["gate_up"], layout.matrices["down"]
        intermediate, hidden = gate_up.shape[0] // 2, gate_up.shape[1]
        if gate_up.shape != (2 * intermediate, hidden) or down.shape != (hidden, intermediate):
            raise ValueError(
                f"expert records hold gate_up {list(gate_up.shape)} and down {list(down.shape)}, not [2I, H] and [H, I]"
            )
        self.layout, self.hidden, self.intermediate = layout, hidden, intermediate
        self._meta = np.array([_matrix_meta(gate_up), _matrix_meta(down)], dtype=np.int64)

    def run(
        self,
        records: torch.Tensor,
        x: torch.Tensor,
        expert_ids: torch.Tensor,
        expert_weights: torch.Tensor,
        on_cpu: torch.Tensor,
    ) -> torch.Tensor:
        """sum over (t, j) with on_cpu[t, j] of expert_weights[t, j] * expert_{expert_ids[t, j]}(x[t]):
        float32 [T, H]. records: uint8 [E, record_bytes] on the host; x: [T, H]; the rest [T, k]."""
        if records.dtype != torch.uint8 or records.dim() != 2 or records.shape[1] != self.layout.record_bytes:
            raise ValueError(
                f"records must be uint8 [experts, {self.layout.record_bytes}], "
                f"got {records.dtype} {list(records.shape)}"
            )
        x = x.detach().to(torch.float32).contiguous()
        ids = expert_ids.detach().to(torch.int64).contiguous()
        weights = expert_weights.detach().to(torch.float32).contiguous()
        chosen = on_cpu.detach().to(torch.bool).contiguous()
        if numba is None:
            return run_torch(self.layout, records, x, ids, weights, chosen)
        out = np.zeros((x.shape[0], self.hidden), dtype=np.float32)
        with _launch:
            numba_threads(threads())
            ids_known = _experts(
                records.contiguous().numpy(),
                self._meta,
                x.numpy(),
                ids.numpy(),
                weights.numpy(),
                chosen.numpy(),
                out,
                self.activations == "bf16",
                threads(),
            )
        if not ids_known:
            raise ValueError(f"expert id out of range of the records (0..{records.shape[0] - 1})")
        return torch.from_numpy(out)
