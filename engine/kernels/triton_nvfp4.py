"""NVFP4 weight-only linear in Triton: y = x @ W^T with W decoded from 4-bit codes in registers.

The weight never exists in 16 bits in memory: each program loads packed bytes and their fp8
block scales, decodes them with integer arithmetic (no fp8 or fp4 instructions, so it runs on
Turing and Ampere cards such as the RTX 2050, not only on Ada/Hopper), and feeds tl.dot.
Layout (engine/checkpoint/formats.py): codes [N, K/2] uint8, element 2i in the low nibble;
block scales [N, K/16] float8_e4m3fn; one scalar global scale.

Under TRITON_INTERPRET=1 the same kernel runs on the CPU, which is how CI checks it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.checkpoint.formats import NVFP4, NVFP4_CT, NVFP4_GROUP, StoredWeight
from engine.kernels import reference

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64  # tl.dot needs 16+ on every side; BLOCK_K/2 packed bytes per row


@triton.jit
def _e2m1(code):
    """4-bit E2M1 code -> float32: sign bit 3, exponent bits 2-1, mantissa bit 0 (bias 1)."""
    exponent = (code >> 1) & 3
    mantissa = (code & 1).to(tl.float32)
    magnitude = tl.where(exponent == 0, mantissa * 0.5, (1.0 + mantissa * 0.5) * tl.exp2((exponent - 1).to(tl.float32)))
    return tl.where((code >> 3) != 0, -magnitude, magnitude)


@triton.jit
def _e4m3(byte):
    """float8_e4m3fn bits -> float32 (scales are finite and non-negative in practice; sign kept anyway)."""
    exponent = (byte >> 3) & 15
    mantissa = (byte & 7).to(tl.float32) * 0.125
    magnitude = tl.where(exponent == 0, mantissa * 0.015625, (1.0 + mantissa) * tl.exp2((exponent - 7).to(tl.float32)))
    return tl.where((byte >> 7) != 0, -magnitude, magnitude)


@triton.jit
def _nvfp4_linear_kernel(x_ptr, codes_ptr, scales_ptr, global_scale_ptr, out_ptr, M, N, K,
                         stride_xm, stride_cn, stride_sn, stride_om, BM: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                         DIVIDE_BY_GLOBAL: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    pairs = tl.arange(0, BK // 2)  # packed byte j of a block holds inputs 2j and 2j+1
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        even = k0 + 2 * pairs
        in_ok = even < K
        packed = tl.load(codes_ptr + cols[:, None] * stride_cn + (even // 2)[None, :],
                         mask=col_ok[:, None] & in_ok[None, :], other=0).to(tl.int32)
        scale_bits = tl.load(scales_ptr + cols[:, None] * stride_sn + (even // 16)[None, :],
                             mask=col_ok[:, None] & in_ok[None, :], other=0).to(tl.int32)
        scale = _e4m3(scale_bits)
        w_even = (_e2m1(packed & 15) * scale).to(DOT_DTYPE)
        w_odd = (_e2m1(packed >> 4) * scale).to(DOT_DTYPE)
        x_even = tl.load(x_ptr + rows[:, None] * stride_xm + even[None, :],
                         mask=row_ok[:, None] & in_ok[None, :], other=0.0).to(DOT_DTYPE)
        x_odd = tl.load(x_ptr + rows[:, None] * stride_xm + (even + 1)[None, :],
                        mask=row_ok[:, None] & in_ok[None, :], other=0.0).to(DOT_DTYPE)
        acc += tl.dot(x_even, tl.trans(w_even), input_precision=PRECISION) + \
            tl.dot(x_odd, tl.trans(w_odd), input_precision=PRECISION)
    global_scale = tl.load(global_scale_ptr).to(tl.float32)  # read on the device: no host sync per call
    out = acc / global_scale if DIVIDE_BY_GLOBAL else acc * global_scale
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out, mask=row_ok[:, None] & col_ok[None, :])


def _dot_dtype(x: torch.Tensor):
    if x.dtype == torch.float32:
        return tl.float32
    # Turing (sm_75) tensor cores take fp16 only; bf16 needs Ampere or newer
    if x.dtype == torch.bfloat16 and (x.device.type != "cuda" or torch.cuda.get_device_capability(x.device)[0] >= 8):
        return tl.bfloat16
    return tl.float16


def nvfp4_linear(x: torch.Tensor, weight: StoredWeight) -> torch.Tensor:
    """x [..., K] @ W^T for an NVFP4 (ModelOpt or compressed-tensors) weight [N, K]; float32 accumulation."""
    modelopt = weight.format == NVFP4  # ModelOpt's second-level scale multiplies, compressed-tensors' divides
    codes = weight.tensors["weight" if modelopt else "weight_packed"]
    global_scale = weight.tensors["weight_scale_2" if modelopt else "weight_global_scale"]
    scales = weight.tensors["weight_scale"].view(torch.uint8)
    n_out, k_in = weight.shape
    if k_in % NVFP4_GROUP:
        raise ValueError(f"{weight.name}: NVFP4 needs a multiple of {NVFP4_GROUP} inputs, got {k_in}")
    flat = x.reshape(-1, k_in).contiguous()
    out = torch.empty(flat.shape[0], n_out, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(flat.shape[0], BLOCK_M), triton.cdiv(n_out, BLOCK_N))
    dot_dtype = _dot_dtype(x)
    _nvfp4_linear_kernel[grid](flat, codes.contiguous(), scales.contiguous(), global_scale, out, flat.shape[0],
                               n_out, k_in, flat.stride(0), codes.stride(0), scales.stride(0), out.stride(0),
                               BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, DOT_DTYPE=dot_dtype,
                               PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",  # float32 in, float32 math
                               DIVIDE_BY_GLOBAL=not modelopt)
    return out.to(x.dtype).reshape(*x.shape[:-1], n_out)


def linear(x: torch.Tensor, weight: StoredWeight) -> torch.Tensor:
    """The dispatch entry for CUDA: NVFP4 through the kernel, every other format through the reference."""
    if weight.format in (NVFP4, NVFP4_CT) and weight.tensors["weight_scale"].dim() == 2:
        return nvfp4_linear(x, weight)
    return reference.linear(x, weight)
