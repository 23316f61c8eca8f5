"""One decode token's attention in Triton, reading the number of keys from the device, so a CUDA graph can
capture it: SDPA takes the keys as a tensor whose length the host must slice every step, which kept
attention (10 of the 40 layers of Qwen3.6) outside the graphed decode step, costing host time while the GPU
waited (2.5 ms of a 20 ms step on the H200).

Same contract as reference.decode_attention: q [1, Hq, D] attends to rows 0..position of the preallocated
caches keys [capacity, Hkv, D] and values [capacity, Hkv, Dv], query head h reading KV head h // (Hq // Hkv).
Flash decoding in two kernels: the keys are cut into `splits` ranges (enough programs to fill the GPU at any
length), each program takes one KV head and one range and keeps an online softmax for the KV head's query
heads together, so each key is read once; the second kernel merges the ranges. Scores and sums are float32 and
the dots use IEEE float32 (tl.dot's FMA path on every card from Turing up: no bf16 tensor cores needed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import reference

BLOCK_N = 16  # keys per inner step; tl.dot's smallest N
MAX_SPLITS = 64


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, position_ptr, acc_ptr, m_ptr, l_ptr, scale,
                  stride_kn, stride_kh, stride_vn, stride_vh,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                  BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
    head, split = tl.program_id(0), tl.program_id(1)
    length = tl.load(position_ptr).to(tl.int32) + 1
    per_split = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, length)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    dv = tl.arange(0, DV)
    rows = head * GROUP + g
    q = tl.load(q_ptr + rows[:, None] * D + d[None, :], mask=(g < GROUP)[:, None], other=0.0).to(tl.float32)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DV], tl.float32)
    for first in range(start, end, BLOCK_N):
        n = first + tl.arange(0, BLOCK_N)
        valid = n < end
        keys = tl.load(k_ptr + n[:, None].to(tl.int64) * stride_kn + head * stride_kh + d[None, :],
                       mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(keys), input_precision="ieee") * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        total = total * alpha + tl.sum(p, axis=1)
        values = tl.load(v_ptr + n[:, None].to(tl.int64) * stride_vn + head * stride_vh + dv[None, :],
                         mask=valid[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, values, input_precision="ieee")
        m = m_new
    keep = g < GROUP
    at = rows * SPLITS + split
    tl.store(acc_ptr + at[:, None] * DV + dv[None, :], acc, mask=keep[:, None])
    tl.store(m_ptr + at, m, mask=keep)
    tl.store(l_ptr + at, total, mask=keep)


@triton.jit
def _merge_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, DV: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0)
    s = tl.arange(0, SPLITS)
    dv = tl.arange(0, DV)
    m = tl.load(m_ptr + row * SPLITS + s)
    weight = tl.exp(m - tl.max(m, axis=0))  # empty ranges hold -inf: weight 0
    total = tl.sum(tl.load(l_ptr + row * SPLITS + s) * weight, axis=0)
    acc = tl.load(acc_ptr + (row * SPLITS + s)[:, None] * DV + dv[None, :])
    out = tl.sum(acc * weight[:, None], axis=0) / total
    tl.store(out_ptr + row * DV + dv, out.to(out_ptr.dtype.element_ty))


def _splits(device: torch.device) -> int:
    """Ranges of keys per KV head: two programs per multiprocessor over the KV heads of a layer (2 for Qwen3.6),
    a power of two for the merge."""
    if device.type != "cuda":
        return 4
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return min(MAX_SPLITS, triton.next_power_of_2(sms))


def decode_attention_capturable(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the kernel takes these shapes (head sizes powers of two, heads grouped evenly)."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, value_dim = keys.shape[1], values.shape[2]
    return (q.shape[0] == 1 and heads % kv_heads == 0 and dim == triton.next_power_of_2(dim) >= 16
            and value_dim == triton.next_power_of_2(value_dim) >= 16 and keys.stride(-1) == values.stride(-1) == 1)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor,
                     scale: float) -> torch.Tensor:
    if not decode_attention_capturable(q, keys, values):
        return reference.decode_attention(q, keys, values, position, scale)
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, value_dim = keys.shape[1], values.shape[2]
    group = heads // kv_heads
    splits = _splits(q.device)
    q = q.reshape(heads, dim).contiguous()
    acc = torch.empty(heads, splits, value_dim, dtype=torch.float32, device=q.device)
    m = torch.empty(heads, splits, dtype=torch.float32, device=q.device)
    total = torch.empty_like(m)
    _split_kernel[(kv_heads, splits)](q, keys, values, position, acc, m, total, scale,
                                      keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
                                      GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=dim,
                                      DV=value_dim, BLOCK_N=BLOCK_N, SPLITS=splits, num_warps=8)
    out = torch.empty(1, heads, value_dim, dtype=q.dtype, device=q.device)
    _merge_kernel[(heads,)](acc, m, total, out, DV=value_dim, SPLITS=splits, num_warps=4)
    return out
