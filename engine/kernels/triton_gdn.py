"""One Gated DeltaNet decode step (a single token) in two Triton kernels, for CUDA: the reference composition
launches ~50 small kernels a layer, which cost more than the work itself whether launched or replayed. A prompt
chunk runs the reference's chunked rule with its one sequential part, the state carried from chunk to chunk, in a
third kernel (_recurrence_kernel) instead of three small launches a 64-token chunk.

Same contract, float32 arithmetic and rounding points as reference.gated_deltanet:
  1. _delta_kernel, one program per (value head, block of value columns): the causal conv + SiLU of the channels it
     needs (its key head's q and k, its columns of v) from the untouched conv state, the L2 norms of q and k, the
     gates, the delta rule on its columns of the state (updated in place) and o for those columns.
  2. _gate_norm_kernel, one program per value head: RMSNorm of o times SiLU(z); and, since every program of the
     first kernel has read the conv state by then, it also advances its share of the conv state.
No host syncs and fixed-size temporaries, so a CUDA graph captures it. Runs under TRITON_INTERPRET=1 on the CPU,
which is how CI checks it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import reference

L2_EPS = tl.constexpr(1e-6)  # inside the sqrt, as GatedDeltaNet's l2_normalise
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # F.softplus returns x itself above it
MAX_KEY_DIM = 256  # a program holds a [key dim, BLOCK_DV] slice of the state in registers
MAX_VALUE_DIM = 4096  # a whole head's o in registers for its norm
# Each chunk needs the state the one before wrote, so there is nothing to pipeline; more stages would multiply the
# recurrence's shared memory past what sm_86 cards have
RECURRENCE_STAGES = 1
# state rows a dot takes at a time and value columns a program keeps: wider blocks spill to local memory
RECURRENCE_ROWS = 16
RECURRENCE_COLS = 32
RECURRENCE_WARPS = 8


@triton.jit
def _silu(x):
    return tl.math.div_rn(x, 1.0 + tl.exp(-x))


@triton.jit
def _conv_silu(qkv_ptr, conv_state_ptr, weight_ptr, channels, inside, kernel_size, BLOCK_K: tl.constexpr):
    """Depthwise causal conv of `channels` over their K-1 saved inputs and this token's, then SiLU; rounded to the
    activation dtype where the reference rounds (conv output and SiLU output), returned in float32."""
    act = qkv_ptr.dtype.element_ty
    taps = tl.arange(0, BLOCK_K)
    saved = inside[:, None] & (taps < kernel_size - 1)[None, :]
    history = tl.load(conv_state_ptr + channels[:, None] * (kernel_size - 1) + taps[None, :], mask=saved, other=0.0)
    x = tl.load(qkv_ptr + channels, mask=inside, other=0.0)
    history = tl.where((taps == kernel_size - 1)[None, :], x[:, None].to(tl.float32), history.to(act).to(tl.float32))
    weight = tl.load(
        weight_ptr + channels[:, None] * kernel_size + taps[None, :],
        mask=inside[:, None] & (taps < kernel_size)[None, :],
        other=0.0,
    )
    conv = tl.sum(history * weight.to(act).to(tl.float32), axis=1).to(act).to(tl.float32)
    return _silu(conv).to(act).to(tl.float32)


@triton.jit
def _delta_kernel(
    qkv_ptr,
    b_ptr,
    a_ptr,
    conv_state_ptr,
    conv_weight_ptr,
    state_ptr,
    a_log_ptr,
    dt_bias_ptr,
    o_ptr,
    keys,
    key_dim,
    value_dim,
    group,
    kernel_size,
    q_scale,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    head = tl.program_id(0)
    key_head = head // group
    rows = tl.arange(0, BLOCK_DK)
    row_in = rows < key_dim
    cols = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    col_in = cols < value_dim

    q = _conv_silu(qkv_ptr, conv_state_ptr, conv_weight_ptr, key_head * key_dim + rows, row_in, kernel_size, BLOCK_K)
    k = _conv_silu(
        qkv_ptr, conv_state_ptr, conv_weight_ptr, keys + key_head * key_dim + rows, row_in, kernel_size, BLOCK_K
    )
    v = _conv_silu(
        qkv_ptr, conv_state_ptr, conv_weight_ptr, 2 * keys + head * value_dim + cols, col_in, kernel_size, BLOCK_K
    )
    q = q * tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(q * q, axis=0) + L2_EPS)) * q_scale
    k = k * tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(k * k, axis=0) + L2_EPS))

    beta = tl.math.div_rn(1.0, 1.0 + tl.exp(-tl.load(b_ptr + head).to(tl.float32)))
    gate_in = tl.load(a_ptr + head).to(tl.float32) + tl.load(dt_bias_ptr + head).to(tl.float32)
    softplus = tl.where(
        gate_in > SOFTPLUS_THRESHOLD, gate_in, tl.log(1.0 + tl.exp(tl.minimum(gate_in, SOFTPLUS_THRESHOLD)))
    )
    decay = tl.exp(-tl.exp(tl.load(a_log_ptr + head).to(tl.float32)) * softplus)

    offsets = head.to(tl.int64) * key_dim * value_dim + rows[:, None] * value_dim + cols[None, :]
    inside = row_in[:, None] & col_in[None, :]
    s = tl.load(state_ptr + offsets, mask=inside, other=0.0) * decay
    delta = beta * (v - tl.sum(s * k[:, None], axis=0))
    s = s + k[:, None] * delta[None, :]
    tl.store(state_ptr + offsets, s, mask=inside)
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(o_ptr + head * value_dim + cols, o.to(o_ptr.dtype.element_ty), mask=col_in)


@triton.jit
def _gate_norm_kernel(
    o_ptr,
    z_ptr,
    norm_weight_ptr,
    out_ptr,
    qkv_ptr,
    conv_state_ptr,
    value_dim,
    channels,
    kernel_size,
    eps,
    BLOCK_DV: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    act = out_ptr.dtype.element_ty
    head = tl.program_id(0)
    cols = tl.arange(0, BLOCK_DV)
    col_in = cols < value_dim
    o = tl.load(o_ptr + head * value_dim + cols, mask=col_in, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(o * o, axis=0) / value_dim + eps))
    weight = tl.load(norm_weight_ptr + cols, mask=col_in, other=0.0).to(tl.float32)
    normed = (o * scale * weight).to(act).to(tl.float32)
    z = tl.load(z_ptr + head * value_dim + cols, mask=col_in, other=0.0).to(tl.float32)
    tl.store(out_ptr + head * value_dim + cols, (normed * _silu(z).to(act).to(tl.float32)).to(act), mask=col_in)

    # the conv state moves one input along: saved tap j takes tap j+1, the last takes this token's input
    chans = head * BLOCK_C + tl.arange(0, BLOCK_C)
    chan_in = chans < channels
    taps = tl.arange(0, BLOCK_K)
    row = conv_state_ptr + chans[:, None] * (kernel_size - 1)
    later = tl.load(row + taps[None, :] + 1, mask=chan_in[:, None] & (taps + 1 < kernel_size - 1)[None, :], other=0.0)
    x = tl.load(qkv_ptr + chans, mask=chan_in, other=0.0)
    moved = tl.where((taps + 1 == kernel_size - 1)[None, :], x[:, None], later.to(qkv_ptr.dtype.element_ty))
    tl.debug_barrier()  # every tap is read before any is overwritten, whichever thread holds it
    tl.store(
        row + taps[None, :],
        moved.to(conv_state_ptr.dtype.element_ty),
        mask=chan_in[:, None] & (taps < kernel_size - 1)[None, :],
    )


def gated_deltanet(
    qkv,
    z,
    b,
    a,
    conv_state,
    conv_weight,
    recurrent,
    a_log,
    dt_bias,
    norm_weight,
    eps,
    key_heads,
    value_heads,
    key_dim,
    value_dim,
):
    kernel_size = conv_weight.shape[-1]
    laid_out = all(
        t.is_contiguous() for t in (conv_state, conv_weight, recurrent, a_log, dt_bias, norm_weight)
    ) and all(t.stride(-1) == 1 for t in (qkv, z, b, a))
    if (
        qkv.shape[0] != 1
        or not laid_out
        or key_dim > MAX_KEY_DIM
        or value_dim > MAX_VALUE_DIM
        or recurrent.dtype != torch.float32
    ):
        return reference.gated_deltanet(
            qkv,
            z,
            b,
            a,
            conv_state,
            conv_weight,
            recurrent,
            a_log,
            dt_bias,
            norm_weight,
            eps,
            key_heads,
            value_heads,
            key_dim,
            value_dim,
            delta_chunk_states,
        )
    channels, values = qkv.shape[1], value_heads * value_dim
    o = torch.empty(values, dtype=qkv.dtype, device=qkv.device)
    out = torch.empty(1, values, dtype=qkv.dtype, device=qkv.device)
    block_dk = triton.next_power_of_2(key_dim)
    block_dv = min(triton.next_power_of_2(value_dim), max(16, 4096 // block_dk))  # ~4K state elements a program
    _delta_kernel[(value_heads, triton.cdiv(value_dim, block_dv))](
        qkv,
        b,
        a,
        conv_state,
        conv_weight,
        recurrent,
        a_log,
        dt_bias,
        o,
        key_heads * key_dim,
        key_dim,
        value_dim,
        value_heads // key_heads,
        kernel_size,
        key_dim**-0.5,
        BLOCK_DK=block_dk,
        BLOCK_DV=block_dv,
        BLOCK_K=triton.next_power_of_2(kernel_size),
        num_warps=4,
    )
    _gate_norm_kernel[(value_heads,)](
        o,
        z,
        norm_weight,
        out,
        qkv,
        conv_state,
        value_dim,
        channels,
        kernel_size,
        eps,
        BLOCK_DV=triton.next_power_of_2(value_dim),
        BLOCK_C=triton.next_power_of_2(triton.cdiv(channels, value_heads)),
        BLOCK_K=triton.next_power_of_2(kernel_size - 1),
        num_warps=4,
    )
    return out


@triton.jit
def _recurrence_kernel(
    u_ptr,
    w_ptr,
    k_ptr,
    decay_ptr,
    states_ptr,
    chunks,
    heads,
    length,
    key_dim,
    value_dim,
    k_stride_n,
    k_stride_h,
    k_stride_d,
    k_stride_l,
    BLOCK_L: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One program per (head, block of value columns), chunk after chunk: u = U - W S (written over U), then
    S <- decay S + K_to_end u, each state stored as reference.delta_chunk_states returns it. The state is read
    back from the one stored before, BLOCK_R rows at a time, so no thread holds a whole [key dim, BLOCK_DV]
    slice (that spilled to local memory, which the card reserves for every resident thread). The dots are in
    IEEE float32, as the reference's matmuls."""
    head = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    col_in = cols < value_dim
    tokens = tl.arange(0, BLOCK_L)
    token_in = tokens < length
    rows = tl.arange(0, BLOCK_R)
    state_step = heads * key_dim * value_dim
    u_at = tokens[:, None] * value_dim + cols[None, :]
    u_in = token_in[:, None] & col_in[None, :]
    for chunk in range(chunks):
        first = (chunk * heads + head) * length
        before = states_ptr + chunk * state_step + head * key_dim * value_dim
        after = before + state_step
        u = tl.load(u_ptr + first * value_dim + u_at, mask=u_in, other=0.0)
        for start in tl.range(0, key_dim, BLOCK_R, num_stages=1):
            dk = start + rows
            dk_in = dk < key_dim
            w = tl.load(
                w_ptr + (first + tokens[:, None]) * key_dim + dk[None, :],
                mask=token_in[:, None] & dk_in[None, :],
                other=0.0,
            )
            state = tl.load(
                before + dk[:, None] * value_dim + cols[None, :], mask=dk_in[:, None] & col_in[None, :], other=0.0
            )
            u -= tl.dot(w, state, input_precision="ieee")
        tl.store(u_ptr + first * value_dim + u_at, u, mask=u_in)
        decay = tl.load(decay_ptr + chunk * heads + head)
        for start in tl.range(0, key_dim, BLOCK_R, num_stages=1):
            dk = start + rows
            dk_in = dk < key_dim
            at = dk[:, None] * value_dim + cols[None, :]
            inside = dk_in[:, None] & col_in[None, :]
            k_to_end = tl.load(
                k_ptr
                + chunk * k_stride_n
                + head * k_stride_h
                + dk[:, None] * k_stride_d
                + tokens[None, :] * k_stride_l,
                mask=dk_in[:, None] & token_in[None, :],
                other=0.0,
            )
            state = tl.load(before + at, mask=inside, other=0.0)
            tl.store(after + at, state * decay + tl.dot(k_to_end, u, input_precision="ieee"), mask=inside)
        tl.debug_barrier()  # the next chunk's rows are read by other threads than stored them


def delta_chunk_states(new_v, w, k_to_end, end_decay, s):
    """reference.delta_chunk_states in one launch: the states entering each chunk and the last one's result."""
    chunks, heads, length, value_dim = new_v.shape
    key_dim = w.shape[-1]
    tensors = (new_v, w, k_to_end, end_decay, s)
    if any(t.dtype != torch.float32 for t in tensors) or not (
        new_v.is_contiguous() and w.is_contiguous() and s.is_contiguous()
    ):
        return reference.delta_chunk_states(*tensors)
    states = s.new_empty(chunks + 1, *s.shape)
    states[0] = s
    block_dv = max(16, min(triton.next_power_of_2(value_dim), RECURRENCE_COLS))  # tl.dot takes 16 or more
    _recurrence_kernel[(heads, triton.cdiv(value_dim, block_dv))](
        new_v,
        w,
        k_to_end,
        end_decay.reshape(chunks, heads).contiguous(),
        states,
        chunks,
        heads,
        length,
        key_dim,
        value_dim,
        *k_to_end.stride(),
        BLOCK_L=max(16, triton.next_power_of_2(length)),
        BLOCK_DV=block_dv,
        BLOCK_R=RECURRENCE_ROWS,
        num_warps=RECURRENCE_WARPS,
        num_stages=RECURRENCE_STAGES,
    )
    return states
