"""RMSNorm in one Triton kernel, for CUDA, alone or after the residual add before it: the reference's nine
elementwise and reduction launches cost more than the work itself on a decode step (four norms a layer, ~160 a
token), whether launched or replayed.

Same contract and float32 arithmetic as reference.rms_norm: x * rsqrt(mean(x^2) + eps) * (offset + weight), in
x's dtype. One program per row, the whole row in registers (hidden sizes are a few thousand at most). Runs under
TRITON_INTERPRET=1 on the CPU, which is how CI checks it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import reference

MAX_FEATURES = 16384  # one row in registers; wider rows go to the reference


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    y_ptr,
    sum_ptr,
    stride_x,
    stride_y,
    features,
    eps,
    offset,
    BLOCK: tl.constexpr,
    ADD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < features
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    if ADD:  # the residual sum, rounded to its dtype as a stored sum is, then normed
        x += tl.load(y_ptr + row * stride_y + cols, mask=inside, other=0.0).to(tl.float32)
        x = x.to(sum_ptr.dtype.element_ty).to(tl.float32)
        tl.store(sum_ptr + row * features + cols, x.to(sum_ptr.dtype.element_ty), mask=inside)
    # IEEE sqrt and division: the approximate ones would drift from the CPU reference by a few ulps
    scale = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=0) / features + eps))
    weight = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    y = (x * scale) * (offset + weight)
    tl.store(out_ptr + row * features + cols, y.to(out_ptr.dtype.element_ty), mask=inside)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, features], a view where the strides allow."""
    return x.reshape(-1, x.shape[-1]) if x.numel() else x.new_empty(0, x.shape[-1])


def _launch(rows, weight, out, eps, offset, added=None, total=None) -> None:
    if rows.shape[0]:
        features = rows.shape[-1]
        block = triton.next_power_of_2(features)
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            weight,
            out,
            added if added is not None else rows,
            total if total is not None else out,
            rows.stride(0),
            added.stride(0) if added is not None else 0,
            features,
            eps,
            offset,
            BLOCK=block,
            ADD=added is not None,
            num_warps=min(8, max(1, block // 256)),
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    features = x.shape[-1]
    rows = _rows(x)
    if features > MAX_FEATURES or rows.stride(-1) != 1 or weight.numel() != features:
        return reference.rms_norm(x, weight, eps, offset)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(rows, weight, out, eps, offset)
    return out


def add_rms_norm(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    features = x.shape[-1]
    rows, added = _rows(x), _rows(y)
    if (
        features > MAX_FEATURES
        or x.shape != y.shape
        or x.dtype != y.dtype
        or rows.stride(-1) != 1
        or added.stride(-1) != 1
        or weight.numel() != features
    ):
        return reference.add_rms_norm(x, y, weight, eps, offset)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = torch.empty_like(total)
    _launch(rows, weight, out, eps, offset, added, total)
    return total, out
