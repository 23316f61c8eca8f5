"""RMSNorm in one Triton kernel, for CUDA: the reference's nine elementwise and reduction launches cost more
than the work itself on a decode step (four norms a layer, ~160 a token), whether launched or replayed.

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
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, features, eps, offset, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < features
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    # IEEE sqrt and division: the approximate ones would drift from the CPU reference by a few ulps
    scale = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=0) / features + eps))
    weight = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    y = (x * scale) * (offset + weight)
    tl.store(out_ptr + row * features + cols, y.to(out_ptr.dtype.element_ty), mask=inside)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    features = x.shape[-1]
    rows = x.reshape(-1, features) if x.numel() else x.new_empty(0, features)  # a view where the strides allow
    if features > MAX_FEATURES or rows.stride(-1) != 1 or weight.numel() != features:
        return reference.rms_norm(x, weight, eps, offset)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(features)
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            weight,
            out,
            rows.stride(0),
            features,
            eps,
            offset,
            BLOCK=block,
            num_warps=min(8, max(1, block // 256)),
        )
    return out
