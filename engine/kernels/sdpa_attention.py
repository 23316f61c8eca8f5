"""Memory-bounded causal attention on torch's fused scaled_dot_product_attention (flash or memory-efficient).

Same contract as reference.causal_attention: q [T, Hq, D] are the LAST T positions of k, v [S, Hkv, D],
query head h reads KV head h // (Hq // Hkv), and the result is [T, Hq, Dv]. Unlike the reference, nothing
of size Hq x T x S is ever made and K/V are never copied to every query head:

* Grouped query heads are views. The Hq query heads are arranged [Hkv, groups, T, D] (batch = KV head,
  heads = the query heads sharing it) and k/v are expanded to [Hkv, groups, S, D] with stride 0 over the
  group, so every head count matches. Torch's native GQA (enable_gqa) is not used: only the flash backend
  takes unequal head counts, and the memory-efficient one (the only fused one on pre-Ampere cards, and the
  one the lower-right causal mask falls back to) would then drop to the math backend and its full scores.
* The causal mask is bottom-right aligned, since the queries are the last T of S positions: T == S is the
  plain is_causal mask; a chunk after a prefix uses torch.nn.attention.bias.causal_lower_right, which on CUDA
  runs the flash kernel (its causal mask is bottom-right) or the memory-efficient kernel's bottom-right
  mask, never a materialised mask.
* Decode (T == 1) sees every key, so it needs no mask: the query heads of each KV head become that head's
  query rows, [1, Hkv, groups, D] against k/v viewed [1, Hkv, S, D] (no expand at all).

On CUDA, torch's cuDNN backend is switched off for the call while flash or memory-efficient is enabled, so
torch tries flash, then memory-efficient, then math. The fused kernels take fp16 and bf16 on sm80+ (flash and
memory-efficient) and fp16/fp32 on older cards (memory-efficient only; no bf16 on Turing). Other inputs still
get the right answer, from the math backend, without the memory bound. On CPU torch runs its own tiled (flash)
kernel; the lower-right mask is materialised there as one [T, S] bool tensor shared by all heads.

Measured on an H200 (torch 2.11, bf16, Hq=16, Hkv=2, D=256; .device_scripts/attention_check.py): 256 queries
after a 32768-token prefix 0.45 ms with flash and 18 MiB of workspace (the reference: 2.8 ms, 1.8 GiB); a
decode step at S = 32768 0.08-0.13 ms with flash, 2 MiB. The memory-efficient kernel, Turing's path, took
1.8 ms and 1.7 ms there: it does not split the keys of a decode step across the GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

_CUDA = torch.backends.cuda


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, Hq, D] are the last T positions of k, v [S, Hkv, D]; grouped-query; returns [T, Hq, Dv]."""
    new, heads, dim = q.shape
    total, kv_heads = k.shape[0], k.shape[1]
    value_dim = v.shape[2]
    if heads % kv_heads or v.shape[:2] != k.shape[:2] or k.shape[2] != dim or new > total:
        raise ValueError(f"causal_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if new == 0:
        return q.new_empty(0, heads, value_dim)
    if not (
        q.is_cuda and _CUDA.cudnn_sdp_enabled() and (_CUDA.flash_sdp_enabled() or _CUDA.mem_efficient_sdp_enabled())
    ):
        return _attention(q, k, v, scale)
    # cuDNN off for this call: on an H200 (torch 2.11) torch tries it before flash where it takes the inputs,
    # and it ran the decode layout below 9x slower than flash (0.69 vs 0.075 ms at S = 32768); forced onto
    # chunks after a prefix, 4x slower.
    # Flipping the flag cost under 1 us of host time a call; sdpa_kernel(..., set_priority=True) cost 60 us.
    _CUDA.enable_cudnn_sdp(False)
    try:
        return _attention(q, k, v, scale)
    finally:
        _CUDA.enable_cudnn_sdp(True)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    new, heads, dim = q.shape
    total, kv_heads, value_dim = k.shape[0], k.shape[1], v.shape[2]
    groups = heads // kv_heads
    keys, values = k.permute(1, 0, 2), v.permute(1, 0, 2)  # [Hkv, S, D] views of the cache
    if new == 1:  # decode: every key is visible, so a KV head's query heads are its query rows
        query = q[0].view(kv_heads, groups, dim)[None]  # [1, Hkv, groups, D]
        out = F.scaled_dot_product_attention(query, keys[None], values[None], scale=scale)
        return out.reshape(1, heads, value_dim)
    query = q.view(new, kv_heads, groups, dim).permute(1, 2, 0, 3)  # [Hkv, groups, T, D]
    keys = keys[:, None].expand(kv_heads, groups, total, dim)  # stride 0 over the group: no copy
    values = values[:, None].expand(kv_heads, groups, total, value_dim)
    if new == total:
        out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale)
    else:
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=causal_lower_right(new, total), scale=scale)
    return out.permute(2, 0, 1, 3).reshape(new, heads, value_dim)  # [Hkv, groups, T, Dv] -> [T, Hq, Dv]
