"""Rotary position embedding on the leading `rotary_dim` features of each head (rotate-half layout).

Qwen3.5's multimodal RoPE gives every frequency the same text position when the input is text
only, so for a text engine it is plain RoPE over the partial rotary dims. The embedding itself is applied
with each head's norm by kernels.norm_rope.
"""

from __future__ import annotations

import torch


class Rotary:
    def __init__(self, rotary_dim: int, theta: float, device: torch.device):
        self.rotary_dim = rotary_dim
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
        self.inv_freq = 1.0 / (theta**exponents)
