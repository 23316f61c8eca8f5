"""One decode token's attention in Triton, reading the number of keys from the device, so a CUDA graph can
capture it: SDPA takes the keys as a tensor whose length the host must slice every step, which kept
attention (10 of the 40 layers of Qwen3.6) outside the graphed decode step, costing host time while the GPU
waited (2.5 ms of a 20 ms step on the H200).

Same contract as reference.decode_attention: q [1, Hq, D] attends to rows 0..position of the preallocated
caches keys [capacity, Hkv, D] and values [capacity, Hkv, Dv], query head h reading KV head h // (Hq // Hkv).
Flash decoding in two kernels: the keys are cut into `splits` ranges (enough programs to fill the GPU at any
length), each program takes one KV head and one range and keeps an online softmax for the KV head's query
heads together, so each key is read once; the second kernel merges the ranges. Scores and sums are float32; the
dots take TF32 tensor cores for 16-bit and FP8 caches on Ampere and up, IEEE float32 otherwise (dot_precision).

An FP8 cache (e4m3 bytes, one key and one value scale per KV head) is read as bytes and decoded by bit
manipulation (e4m3_to_float32), not by the fp8 conversion instructions of sm_89 and up, so Turing and Ampere
run it; a program's KV head has one scale, so the key scale multiplies the scores and the value scale the sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import reference

# (keys per inner step, warps) by dot precision, the fastest measured on the H200 at 4,096 and 16,896 keys
# (Qwen3.6's 16 query and 2 KV heads of 256): TF32 22 us at 16,896 keys; IEEE float32 188 us with 16 keys a step
# (tl.dot's smallest N), worse with more (register spills)
TILES = {"tf32": (64, 4), "ieee": (16, 8)}
MAX_SPLITS = 64
MERGE = 16  # ranges the merge kernel reads at a time


@triton.jit
def e4m3_to_float32(raw):
    """Float32 values of e4m3fn bytes (uint8): sign, 4 exponent bits (bias 7), 3 mantissa bits, no infinities,
    0x7F/0xFF NaN; the exponent is rebiased into a float32's bits, subnormals (exponent 0) are mantissa x 2^-9."""
    bits = raw.to(tl.int32)
    magnitude = bits & 0x7F
    sign = (bits & 0x80) << 24
    normal = sign | ((magnitude + (120 << 3)) << 20)
    # the sign goes in as a bit: negating a float zero on the GPU may give +0.0
    subnormal = ((magnitude & 7).to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True) | sign
    value = tl.where(magnitude < 8, subnormal, normal).to(tl.float32, bitcast=True)
    return tl.where(magnitude == 0x7F, float("nan"), value)


@triton.jit
def _split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    scales_ptr,
    position_ptr,
    acc_ptr,
    m_ptr,
    l_ptr,
    scale,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    FP8: tl.constexpr,
):
    head, split = tl.program_id(0), tl.program_id(1)
    key_scale, value_scale = scale, 1.0
    if FP8:  # scales [2, Hkv]: keys' then values'
        key_scale = scale * tl.load(scales_ptr + head)
        value_scale = tl.load(scales_ptr + tl.num_programs(0) + head)
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
        keys = tl.load(
            k_ptr + n[:, None].to(tl.int64) * stride_kn + head * stride_kh + d[None, :], mask=valid[:, None], other=0
        )
        keys = e4m3_to_float32(keys) if FP8 else keys.to(tl.float32)
        scores = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * key_scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        total = total * alpha + tl.sum(p, axis=1)
        values = tl.load(
            v_ptr + n[:, None].to(tl.int64) * stride_vn + head * stride_vh + dv[None, :], mask=valid[:, None], other=0
        )
        values = e4m3_to_float32(values) if FP8 else values.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, values, input_precision=PRECISION)
        m = m_new
    keep = g < GROUP
    at = rows * SPLITS + split
    tl.store(acc_ptr + at[:, None] * DV + dv[None, :], acc * value_scale, mask=keep[:, None])
    tl.store(m_ptr + at, m, mask=keep)
    tl.store(l_ptr + at, total, mask=keep)


@triton.jit
def _merge_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, DV: tl.constexpr, SPLITS: tl.constexpr, MERGE: tl.constexpr):
    row = tl.program_id(0)
    m_max = tl.max(tl.load(m_ptr + row * SPLITS + tl.arange(0, SPLITS)), axis=0)
    dv = tl.arange(0, DV)
    total = tl.zeros([MERGE], tl.float32)
    out = tl.zeros([DV], tl.float32)
    for first in range(0, SPLITS, MERGE):  # MERGE ranges at a time: SPLITS x DV floats would not fit in registers
        s = first + tl.arange(0, MERGE)
        weight = tl.exp(tl.load(m_ptr + row * SPLITS + s) - m_max)  # empty ranges hold -inf: weight 0
        total += tl.load(l_ptr + row * SPLITS + s) * weight
        acc = tl.load(acc_ptr + (row * SPLITS + s)[:, None] * DV + dv[None, :])
        out += tl.sum(acc * weight[:, None], axis=0)
    tl.store(out_ptr + row * DV + dv, (out / tl.sum(total, axis=0)).to(out_ptr.dtype.element_ty))


def _splits(device: torch.device) -> int:
    """Ranges of keys per KV head: two programs per multiprocessor over the KV heads of a layer (2 for Qwen3.6),
    a power of two for the merge."""
    if device.type != "cuda":
        return 4
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return min(MAX_SPLITS, triton.next_power_of_2(sms))


def dot_precision(keys: torch.Tensor) -> str:
    """TF32 tensor cores (Ampere and up) for 16-bit and FP8 caches: a bf16, fp16 or e4m3 key converts to TF32
    exactly, so only the softmax weights round (2^-11, below the bf16 output's rounding); the float32 FMA path took
    188 us at 16,896 keys on the H200 against 9 us of memory traffic. Float32 caches (the reference runs) keep IEEE
    float32."""
    if keys.dtype == torch.float32 or keys.device.type != "cuda":
        return "ieee"
    return precision_for(torch.cuda.get_device_capability(keys.device)[0])


def precision_for(compute_major: int) -> str:
    """The dot precision a 16-bit or FP8 cache takes on a card of this compute capability: TF32 from Ampere on."""
    return "tf32" if compute_major >= 8 else "ieee"


def decode_attention_capturable(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the kernel takes these shapes (head sizes powers of two, heads grouped evenly)."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, value_dim = keys.shape[1], values.shape[2]
    return (
        q.shape[0] == 1
        and heads % kv_heads == 0
        and dim == triton.next_power_of_2(dim) >= 16
        and value_dim == triton.next_power_of_2(value_dim) >= 16
        and keys.stride(-1) == values.stride(-1) == 1
    )


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position: torch.Tensor,
    scale: float,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """reference.decode_attention in two Triton kernels; with kv_scales [2, Hkv], keys and values are e4m3 bytes."""
    if not decode_attention_capturable(q, keys, values):
        return reference.decode_attention(q, keys, values, position, scale, kv_scales)
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, value_dim = keys.shape[1], values.shape[2]
    group = heads // kv_heads
    splits = _splits(q.device)
    precision = dot_precision(keys)
    block_n, warps = TILES[precision]
    q = q.reshape(heads, dim).contiguous()
    acc = torch.empty(heads, splits, value_dim, dtype=torch.float32, device=q.device)
    m = torch.empty(heads, splits, dtype=torch.float32, device=q.device)
    total = torch.empty_like(m)
    _split_kernel[(kv_heads, splits)](
        q,
        keys,
        values,
        kv_scales if kv_scales is not None else q,  # unread without FP8
        position,
        acc,
        m,
        total,
        scale,
        keys.stride(0),
        keys.stride(1),
        values.stride(0),
        values.stride(1),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        D=dim,
        DV=value_dim,
        BLOCK_N=block_n,
        SPLITS=splits,
        PRECISION=precision,
        FP8=kv_scales is not None,
        num_warps=warps,
    )
    out = torch.empty(1, heads, value_dim, dtype=q.dtype, device=q.device)
    _merge_kernel[(heads,)](acc, m, total, out, DV=value_dim, SPLITS=splits, MERGE=min(MERGE, splits), num_warps=4)
    return out
