"""Rotary position embedding on the leading `rotary_dim` features of each head (rotate-half layout).

Qwen3.5's multimodal RoPE gives every frequency the same text position when the input is text
only, so for a text engine it is plain RoPE over the partial rotary dims.
"""

from __future__ import annotations

import torch


class Rotary:
    def __init__(self, rotary_dim: int, theta: float, device: torch.device):
        self.rotary_dim = rotary_dim
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
        self.inv_freq = 1.0 / (theta**exponents)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [T, 1, rotary_dim]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, D]; rotates x[..., :rotary_dim] and passes the rest through."""
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        first, second = rot.chunk(2, dim=-1)
        rotated = rot * cos + torch.cat([-second, first], dim=-1) * sin
        return torch.cat([rotated, rest], dim=-1)
