"""An MoE router's softmax, top-k and renormalisation in one Triton kernel: torch runs them as about eight launches
(softmax, two for topk, sum, division, casts), about 20 us of a decode step's critical path per layer on the H200,
where this takes one.

Same contract and float32 arithmetic as reference.router_topk: probabilities softmax(logits) in float32, the k
largest in descending order (equal values: the lower expert first), divided by their sum when `normalise`.
One program per token, the whole row of logits in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import reference

MAX_EXPERTS = 4096


@triton.jit
def _router_kernel(
    logits_ptr,
    ids_ptr,
    weights_ptr,
    experts,
    stride,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    NORMALISE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK)
    inside = e < experts
    x = tl.load(logits_ptr + row * stride + e, mask=inside, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(inside, p / tl.sum(p, axis=0), -1.0)
    j = tl.arange(0, K_PAD)
    ids = tl.zeros([K_PAD], tl.int64)
    weights = tl.zeros([K_PAD], tl.float32)
    for pick in tl.static_range(K):
        best = tl.argmax(p, axis=0, tie_break_left=True)
        value = tl.max(p, axis=0)
        ids = tl.where(j == pick, best.to(tl.int64), ids)
        weights = tl.where(j == pick, value, weights)
        p = tl.where(e == best, -1.0, p)
    if NORMALISE:
        weights = weights / tl.sum(weights, axis=0)
    tl.store(ids_ptr + row * K + j, ids, mask=j < K)
    tl.store(weights_ptr + row * K + j, weights, mask=j < K)


def router_topk(logits: torch.Tensor, top_k: int, normalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    experts = logits.shape[-1]
    if experts > MAX_EXPERTS or top_k > experts or logits.stride(-1) != 1 or logits.dim() != 2:
        return reference.router_topk(logits, top_k, normalise)
    tokens = logits.shape[0]
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    if tokens:
        _router_kernel[(tokens,)](
            logits,
            ids,
            weights,
            experts,
            logits.stride(0),
            K=top_k,
            K_PAD=triton.next_power_of_2(top_k),
            BLOCK=triton.next_power_of_2(experts),
            NORMALISE=normalise,
            num_warps=_warps(triton.next_power_of_2(experts)),
        )
    return ids, weights


def _warps(block: int) -> int:
    """Warps for a row of `block` logits: its k picks are 2k reductions in a row, which within one warp need no
    shared memory, so small rows take one."""
    return 1 if block <= 512 else 2 if block <= 1024 else 4
