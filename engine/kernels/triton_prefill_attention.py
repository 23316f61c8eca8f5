"""A prompt chunk's attention over an FP8 cache in one Triton kernel, for CUDA: the reference
(reference.fp8_causal_attention) dequantises block by block in torch, about 20 launches a block pair, and ran a
16,384-token 4gb prefill at a fifth of the bf16 cache's speed.

Same contract as reference.fp8_causal_attention: q [T, Hq, D] are the last T positions of the e4m3 caches k
[S, Hkv, D] and v [S, Hkv, Dv] (uint8), kv_scales [2, Hkv] their per-KV-head scales; query head h reads KV head
h // (Hq // Hkv). One program per (block of queries, query head) keeps a flash-attention online softmax over the
keys its last query sees. Keys and values are decoded from their bytes (triton_attention.e4m3_to_float32, which
Turing and Ampere run) and enter the dots unscaled, exact in TF32; the key scale multiplies the scores and the
value scale the output, as in the decode kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import reference
from engine.kernels.triton_attention import dot_precision, e4m3_to_float32

# (queries a program, keys a step, warps) by dot precision; chosen to fit sm_75's and sm_86's shared memory at
# head size 256 (tests/triton_compile_check.py holds each to its card's limit)
TILES = {"tf32": (32, 32, 4), "ieee": (16, 16, 4)}
STAGES = 1  # the loop's loads wait on nothing the dots overlap; more stages multiply the shared memory


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    scales_ptr,
    out_ptr,
    scale,
    new_tokens,
    total,
    kv_heads,
    stride_qt,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    head = tl.program_id(1)
    kv = head // GROUP
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_in = rows < new_tokens
    query_pos = total - new_tokens + rows
    dims = tl.arange(0, D)
    value_dims = tl.arange(0, DV)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=row_in[:, None], other=0.0)
    q = q.to(tl.float32)
    key_scale = tl.load(scales_ptr + kv) * scale
    value_scale = tl.load(scales_ptr + kv_heads + kv)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    weight = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV], tl.float32)
    seen = tl.minimum(total - new_tokens + (block + 1) * BLOCK_M, total)  # the keys the block's last query sees
    for start in range(0, seen, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_in = keys < total
        k = e4m3_to_float32(
            tl.load(k_ptr + keys[:, None] * stride_kn + kv * stride_kh + dims[None, :], mask=key_in[:, None], other=0)
        )
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * key_scale
        scores = tl.where((keys[None, :] <= query_pos[:, None]) & key_in[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # finite: key 0, in the first step, is seen by every query
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        weight = weight * alpha + tl.sum(p, axis=1)
        v = e4m3_to_float32(
            tl.load(
                v_ptr + keys[:, None] * stride_vn + kv * stride_vh + value_dims[None, :], mask=key_in[:, None], other=0
            )
        )
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new
    out = acc * (value_scale / weight[:, None])
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + value_dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_in[:, None],
    )


def fp8_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, kv_scales: torch.Tensor
) -> torch.Tensor:
    """reference.fp8_causal_attention in one kernel where the shapes allow (head sizes powers of two from 16 to
    256, heads grouped evenly, rows contiguous in their last dimension); otherwise the reference."""
    new, heads, dim = q.shape
    total, kv_heads, value_dim = k.shape[0], k.shape[1], v.shape[2]
    if not (
        heads % kv_heads == 0
        and 16 <= dim == triton.next_power_of_2(dim) <= 256
        and 16 <= value_dim == triton.next_power_of_2(value_dim) <= 256
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        and kv_scales.is_contiguous()
        and kv_scales.dtype == torch.float32
    ):
        return reference.fp8_causal_attention(q, k, v, scale, kv_scales)
    precision = dot_precision(k)
    block_m, block_n, warps = TILES[precision]
    out = q.new_empty(new, heads, value_dim)
    _prefill_kernel[(triton.cdiv(new, block_m), heads)](
        q,
        k,
        v,
        kv_scales,
        out,
        scale,
        new,
        total,
        kv_heads,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=heads // kv_heads,
        D=dim,
        DV=value_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PRECISION=precision,
        num_warps=warps,
        num_stages=STAGES,
    )
    return out
