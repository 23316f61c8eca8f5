"""Per-device kernel dispatch: layers call these functions, and the tensor's device picks the kernel.

Every device starts on the plain-PyTorch reference; a device-specific module (Triton on CUDA)
registers itself for the ops it accelerates and is tested against the reference.
"""

from __future__ import annotations

from types import ModuleType

import torch

from engine.kernels import reference

_BY_DEVICE: dict[str, dict[str, object]] = {}


def register(device_type: str, module: ModuleType, ops: list[str]) -> None:
    _BY_DEVICE.setdefault(device_type, {}).update({op: getattr(module, op) for op in ops})


def _kernel(op: str, tensor):
    return _BY_DEVICE.get(tensor.device.type, {}).get(op) or getattr(reference, op)


def _capturable(op: str, device, *args) -> bool:
    """Whether `op` on `device` takes `args` without reading tensors on the host, so a CUDA graph can capture it:
    the device's `<op>_capturable` check says so (the references read them)."""
    check = _BY_DEVICE.get(torch.device(device).type, {}).get(f"{op}_capturable")
    return bool(check and check(*args))


def linear(x, weight, swiglu=False):
    """x [..., K] @ W^T for any stored format; with swiglu, x [..., 2K] holds gate then up and the input is
    silu(gate) * up (reference.linear)."""
    return _kernel("linear", x)(x, weight, swiglu=swiglu)


def rms_norm(x, weight, eps, offset=0.0):
    return _kernel("rms_norm", x)(x, weight, eps, offset)


def add_rms_norm(x, y, weight, eps, offset=0.0):
    """(x + y, rms_norm of it) (reference.add_rms_norm); on CUDA one kernel."""
    return _kernel("add_rms_norm", x)(x, y, weight, eps, offset)


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
    """A Gated DeltaNet layer between its projections (reference.gated_deltanet): conv, delta rule and gated norm,
    updating conv_state and recurrent in place; [T, value heads * value dim] in qkv's dtype. On CUDA one token
    runs as two fused Triton kernels (a decode step's ~50 small launches otherwise)."""
    return _kernel("gated_deltanet", qkv)(
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
    )


def causal_attention(q, k, v, scale, kv_scales=None):
    """Grouped-query causal attention of q [T, Hq, D], the last T positions of k, v [S, Hkv, D]. With kv_scales
    ([2, Hkv] float32), k and v are an FP8 cache's e4m3 bytes, decoded a block at a time
    (reference.fp8_causal_attention; on CUDA one Triton kernel)."""
    if kv_scales is not None:
        return _kernel("fp8_causal_attention", q)(q, k, v, scale, kv_scales)
    return _kernel("causal_attention", q)(q, k, v, scale)


def decode_attention(q, keys, values, position, scale, kv_scales=None):
    """One token's attention (reference.decode_attention): q [1, Hq, D] at `position`, a device int tensor [1]
    the CUDA kernel reads on the device (capturable), against rows 0..position of preallocated KV caches (e4m3
    bytes with kv_scales [2, Hkv], which the CUDA kernel decodes as it reads them)."""
    return _kernel("decode_attention", q)(q, keys, values, position, scale, kv_scales)


def decode_attention_capturable(q, keys, values) -> bool:
    """Whether decode_attention on q's device runs without reading `position` on the host (the reference
    reads it)."""
    return _capturable("decode_attention", q.device, q, keys, values)


def norm_rope(x, weight, eps, offset, positions, inv_freq):
    """Each head's RMSNorm of x [T, H, D] and the rotary embedding of positions [T] (a device tensor) on its
    first 2 * len(inv_freq) features (reference.norm_rope); on CUDA one kernel, reading the positions there."""
    return _kernel("norm_rope", x)(x, weight, eps, offset, positions, inv_freq)


def router_topk(logits, top_k, normalise):
    """An MoE router's choice from its logits [T, E]: (ids [T, k] int64, weights [T, k] float32) of the k most
    probable experts, renormalised to sum to one when `normalise` (reference.router_topk)."""
    return _kernel("router_topk", logits)(logits, top_k, normalise)


def assign_slots(ids, key_base, keys, ages, clock, where, slots, table, counts, cpu_counts=None, gpu_rows=None) -> None:
    """The expert cache's LRU slot choice for one token's experts, on the device, keeping the reverse index
    `where` of the keys, leaving the CPU its count of the misses when cpu_counts is given (reference.assign_slots)."""
    _kernel("assign_slots", keys)(ids, key_base, keys, ages, clock, where, slots, table, counts, cpu_counts, gpu_rows)


def post_cpu_share(ids, weights, gpu_rows, y, sequence_base, ordinal, mailbox) -> None:
    """One layer's CPU experts and their input to the CPU threads' mailbox in host memory
    (engine/kernels/cpu_share.py; reference.post_cpu_share). On CUDA a kernel writes it: capturable."""
    _kernel("post_cpu_share", ids)(ids, weights, gpu_rows, y, sequence_base, ordinal, mailbox)


def wait_cpu_share(gpu_rows, sequence_base, ordinal, mailbox, cpu_routed, waits) -> None:
    """Wait for the CPU threads' sum of one layer, into cpu_routed on the device, counting in waits [2] whether
    the GPU had to wait (reference.wait_cpu_share). On CUDA a kernel spins on the mailbox: capturable."""
    _kernel("wait_cpu_share", gpu_rows)(gpu_rows, sequence_base, ordinal, mailbox, cpu_routed, waits)


def combine_experts(h, routed, weights, gpu_rows=None, shared=None, cpu_routed=None, shared_gate=None):
    """The residual h [1, H] plus a token's MoE output: its shared expert [1, H] (gated by sigmoid(shared_gate)
    when given), routed rows [k, H] times
    weights [k] (rows with gpu_rows 0 masked out) and the CPU's sum [1, H], in float32 (reference.combine_experts).
    On CUDA one kernel: a captured decode step's layer ends in one launch."""
    return _kernel("combine_experts", h)(h, routed, weights, gpu_rows, shared, cpu_routed, shared_gate)


def assign_slots_capturable(keys) -> bool:
    """Whether assign_slots runs on the device without the host reading the table (the reference reads it)."""
    return _capturable("assign_slots", keys.device, keys)


def gather_records(records, pool, table) -> None:
    """Expert records into cache slots: pool[table[r, 1]] = records[table[r, 0]] for the rows of the device table
    [n, 2] whose source is not -1. On CUDA a kernel reads pinned host records in place (capturable)."""
    _kernel("gather_records", pool)(records, pool, table)


def gather_records_capturable(records, pool) -> bool:
    """Whether gather_records into `pool` runs without the host reading the table (the reference reads it)."""
    return _capturable("gather_records", pool.device, records, pool)


def grouped_linear(x, weight, groups):
    """Rows of x [M, K] sorted into `groups` (engine/kernels/groups.py), each times its own expert of the
    stacked weight [S, N, K]: out[rows of g] = x[rows of g] @ weight[slot of g]^T; [M, N] in x's dtype."""
    return _kernel("grouped_linear", x)(x, weight, groups)


def slot_linear(x, weight, slots, swiglu=False):
    """Row r of x [M, K] times the expert in slot slots[r] of the stacked weight [S, N, K]; [M, N] in x's dtype.
    slots: int [M] on x's device, read by the kernel, so a captured decode step takes new slots every replay.
    With swiglu, x [M, 2K] holds gate then up, and the rows are silu(gate) * up (SwiGLU's activation, fused)."""
    return _kernel("slot_linear", x)(x, weight, slots, swiglu=swiglu)


def slot_linear_capturable(weight, device) -> bool:
    """Whether slot_linear on `device` runs the stacked `weight` without reading its slots on the host, so a
    CUDA graph can capture it (the reference reads them)."""
    return _capturable("slot_linear", device, weight)


def _register_cuda_kernels() -> None:
    """SDPA attention (flash / memory-efficient: no score matrix over the whole context), and Triton kernels
    for NVIDIA cards where Triton is installed (absent is fine: the reference runs)."""
    from engine.kernels import sdpa_attention

    register("cuda", sdpa_attention, ["causal_attention"])
    try:
        from engine.kernels import (
            triton_attention,
            triton_combine,
            triton_cpu_share,
            triton_gather,
            triton_gdn,
            triton_linear,
            triton_norm,
            triton_prefill_attention,
            triton_rope,
            triton_router,
            triton_slots,
        )
    except ImportError:
        return
    register("cuda", triton_router, ["router_topk"])
    register("cuda", triton_slots, ["assign_slots", "assign_slots_capturable"])
    register("cuda", triton_gather, ["gather_records", "gather_records_capturable"])
    register("cuda", triton_cpu_share, ["post_cpu_share", "wait_cpu_share"])
    register("cuda", triton_combine, ["combine_experts"])
    register("cuda", triton_attention, ["decode_attention", "decode_attention_capturable"])
    register("cuda", triton_gdn, ["gated_deltanet"])
    register("cuda", triton_prefill_attention, ["fp8_causal_attention"])
    register("cuda", triton_norm, ["rms_norm", "add_rms_norm"])
    register("cuda", triton_rope, ["norm_rope"])
    register("cuda", triton_linear, ["linear", "grouped_linear", "slot_linear", "slot_linear_capturable"])


if torch.cuda.is_available():
    _register_cuda_kernels()
