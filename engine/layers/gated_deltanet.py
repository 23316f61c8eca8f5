"""Gated DeltaNet (Qwen3.5/3.6 linear attention): causal conv over q/k/v, then the gated delta rule.

Its state per sequence is fixed-size: the last K-1 conv inputs and a [value heads, Dk, Dv] matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import kernels
from engine.checkpoint.source import WeightSource
from engine.layers.linear import JoinedLinear, Linear


@dataclass
class DeltaNetState:
    conv: torch.Tensor  # [conv channels, kernel - 1]
    recurrent: torch.Tensor  # [value heads, key dim, value dim], float32

    def clone(self) -> DeltaNetState:
        return DeltaNetState(self.conv.clone(), self.recurrent.clone())

    def snapshot(self) -> DeltaNetState:
        """A copy in host memory, so restore points cost no VRAM: pinned and copied asynchronously from a GPU
        (ordered on the current stream, before the next step changes the state)."""
        return DeltaNetState(_to_host(self.conv), _to_host(self.recurrent))

    @property
    def snapshot_bytes(self) -> int:
        """Host RAM one snapshot of this state takes: both tensors, copied whole."""
        return self.conv.nbytes + self.recurrent.nbytes

    def restore(self, saved: DeltaNetState) -> None:
        self.conv.copy_(saved.conv, non_blocking=True)
        self.recurrent.copy_(saved.recurrent, non_blocking=True)

    def host_copy(self, after: DeltaNetState | None = None) -> DeltaNetState:
        """A full copy in host RAM, as snapshot(): a fixed-size state shares nothing with an earlier copy."""
        return self.snapshot()

    def load(self, saved: DeltaNetState) -> None:
        """Hold a host_copy() (a snapshot is already a full copy), refusing one of another shape or dtype."""
        for mine, theirs in ((self.conv, saved.conv), (self.recurrent, saved.recurrent)):
            if theirs.shape != mine.shape or theirs.dtype != mine.dtype:
                raise ValueError(f"a saved state of {tuple(theirs.shape)} {theirs.dtype} does not fit this layer")
        self.restore(saved)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.conv, self.recurrent


def _to_host(t: torch.Tensor) -> torch.Tensor:
    on_gpu = t.device.type == "cuda"
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=on_gpu)
    host.copy_(t, non_blocking=on_gpu)
    return host


class GatedDeltaNet:
    def __init__(self, source: WeightSource, prefix: str):
        c = source.config
        self.key_heads, self.value_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.key_dim, self.value_dim = c.linear_key_head_dim, c.linear_value_head_dim
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.conv_channels = 2 * keys + values
        self.kernel_size = c.linear_conv_kernel_dim
        self.in_proj_qkvz = JoinedLinear(
            source, [f"{prefix}.in_proj_qkv", f"{prefix}.in_proj_z"], c.hidden_size, [self.conv_channels, values]
        )
        self.in_proj_ba = JoinedLinear(
            source, [f"{prefix}.in_proj_b", f"{prefix}.in_proj_a"], c.hidden_size, [self.value_heads, self.value_heads]
        )
        self.out_proj = Linear(source, f"{prefix}.out_proj", values, c.hidden_size)
        self.conv_weight = source.param(f"{prefix}.conv1d.weight", (self.conv_channels, 1, self.kernel_size))[:, 0]
        self.a_log = source.param(f"{prefix}.A_log", (self.value_heads,))
        self.dt_bias = source.param(f"{prefix}.dt_bias", (self.value_heads,))
        self.norm_weight = source.param(f"{prefix}.norm.weight", (self.value_dim,))
        self.eps = c.rms_norm_eps

    def new_state(self, max_tokens: int | None, device, dtype) -> DeltaNetState:
        del max_tokens  # fixed-size state, whatever the context length
        return DeltaNetState(
            conv=torch.zeros(self.conv_channels, self.kernel_size - 1, device=device, dtype=dtype),
            recurrent=torch.zeros(self.value_heads, self.key_dim, self.value_dim, device=device, dtype=torch.float32),
        )

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, state: DeltaNetState) -> torch.Tensor:
        qkv, z = self.in_proj_qkvz(x)
        b, a = self.in_proj_ba(x)
        out = kernels.gated_deltanet(
            qkv,
            z,
            b,
            a,
            state.conv,
            self.conv_weight,
            state.recurrent,
            self.a_log,
            self.dt_bias,
            self.norm_weight,
            self.eps,
            self.key_heads,
            self.value_heads,
            self.key_dim,
            self.value_dim,
        )
        return self.out_proj(out)

    def decode_step(self, x: torch.Tensor, positions: torch.Tensor, state: DeltaNetState, step) -> torch.Tensor:
        """One token: the same fixed-shape work as a chunk, nothing read on the host, so captured whole."""
        return self(x, positions, state)
