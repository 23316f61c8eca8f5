"""Expert executors: given a layer's bank, the hidden states and the router's choice, the routed output.

The reference executor decodes each chosen expert on the host and computes where the hidden
states live; the GPU cache and CPU kernels of later issues implement the same call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.experts.bank import ExpertBank


class ReferenceExpertExecutor:
    def __init__(self):
        self.expert_calls = 0  # experts computed so far: a counter the runtime and tests read

    def __call__(self, bank: ExpertBank, x: torch.Tensor, expert_ids: torch.Tensor,
                 expert_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in expert_ids.unique().tolist():
            token_idx, slot = torch.where(expert_ids == expert)
            gate, up, down = (w.to(x.device) for w in bank.weights(expert, x.dtype))
            hidden = F.silu(F.linear(x[token_idx], gate)) * F.linear(x[token_idx], up)
            out.index_add_(0, token_idx, F.linear(hidden, down) * expert_weights[token_idx, slot, None].to(x.dtype))
            self.expert_calls += 1
        return out
