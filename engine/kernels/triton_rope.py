"""Each head's RMSNorm and its rotary embedding in one Triton kernel: an attention layer's q and k took about
twenty small launches for them (two norms, cos and sin of the angles, the rotate-half's slices, negation,
concatenations, products and sums).

Same contract as reference.norm_rope, whose roundings it repeats: the normed row is rounded to x's dtype, cos and
sin are, and so are both products and their sum, as the reference's elementwise ops in x's dtype round them. One
program per (token, head) row, the position read on the device (capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import reference

MAX_FEATURES = 4096  # one head's row in registers


@triton.jit
def _norm_rope_kernel(
    x_ptr,
    w_ptr,
    positions_ptr,
    inv_freq_ptr,
    out_ptr,
    heads,
    stride_xt,
    stride_xh,
    features,
    eps,
    offset,
    ROTARY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    token, head = row // heads, row % heads
    d = tl.arange(0, BLOCK)
    inside = d < features
    x_row = x_ptr + token.to(tl.int64) * stride_xt + head.to(tl.int64) * stride_xh
    x = tl.load(x_row + d, mask=inside, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=0) / features + eps))
    weight = tl.load(w_ptr + d, mask=inside, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    normed = ((x * scale) * (offset + weight)).to(dtype).to(tl.float32)
    # rotate-half: feature d < ROTARY / 2 pairs with d + ROTARY / 2, which enters negated
    half = ROTARY // 2
    rotated = d < ROTARY
    partner = tl.where(d < half, d + half, d - half)
    px = tl.load(x_row + partner, mask=rotated, other=0.0).to(tl.float32)
    pw = tl.load(w_ptr + partner, mask=rotated, other=0.0).to(tl.float32)
    paired = ((px * scale) * (offset + pw)).to(dtype).to(tl.float32)
    paired = tl.where(d < half, -paired, paired)
    position = tl.load(positions_ptr + token).to(tl.float32)
    angle = position * tl.load(inv_freq_ptr + (d % half), mask=rotated, other=0.0)
    cos = tl.cos(angle).to(dtype).to(tl.float32)
    sin = tl.sin(angle).to(dtype).to(tl.float32)
    turned = (normed * cos).to(dtype).to(tl.float32) + (paired * sin).to(dtype).to(tl.float32)
    out = tl.where(rotated, turned, normed)
    tl.store(out_ptr + row.to(tl.int64) * features + d, out.to(dtype), mask=inside)


def norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
) -> torch.Tensor:
    tokens, heads, features = x.shape
    rotary = 2 * inv_freq.numel()
    if features > MAX_FEATURES or x.stride(-1) != 1 or rotary > features or rotary == 0:
        return reference.norm_rope(x, weight, eps, offset, positions, inv_freq)
    out = torch.empty(tokens, heads, features, dtype=x.dtype, device=x.device)
    if tokens * heads:
        block = triton.next_power_of_2(features)
        _norm_rope_kernel[(tokens * heads,)](
            x,
            weight,
            positions,
            inv_freq,
            out,
            heads,
            x.stride(0),
            x.stride(1),
            features,
            eps,
            offset,
            ROTARY=rotary,
            BLOCK=block,
            num_warps=min(4, max(1, block // 128)),
        )
    return out
