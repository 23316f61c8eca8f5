"""Full attention with q/k norms, partial RoPE, grouped KV heads and (Qwen3.5/3.6) a sigmoid output gate."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import kernels
from engine.checkpoint.source import WeightSource
from engine.errors import CheckpointError, ContextOverflowError
from engine.layers.linear import JoinedLinear, Linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import Rotary
from engine.step import DecodeStep

E4M3_MAX = 448.0  # e4m3fn's largest finite value
# A measured scale maps the first rows' largest magnitude to E4M3_MAX / margin, so later tokens up to 4x as large
# still fit before they saturate; the cost is two binades at the small end, where values under 1/7,000 of the
# largest lose precision (subnormals) and add next to nothing to a dot product.
MEASURED_SCALE_MARGIN = 4.0


@dataclass(frozen=True)
class HostRows:
    """A KV cache's first tokens in host RAM, as blocks of consecutive rows: a copy that extends another shares
    the other's blocks instead of copying them again. An FP8 cache's rows are e4m3 bytes, `scales` [2, Hkv]
    their keys' and values' scales."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    scales: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return sum(block.shape[0] for block in self.keys)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.keys + self.values + ((self.scales,) if self.scales is not None else ())


class KVCache:
    """Keys and values of one attention layer; preallocated when the token budget is known, else grown.

    With dtype torch.float8_e4m3fn the rows are e4m3 bytes (uint8 storage: torch's CPU index_copy_ takes no float8)
    and `scales` [2, Hkv] float32 holds each KV head's key and value scale (value = e4m3 x scale). `fixed_scales`
    (the checkpoint's) are used as given; otherwise each head's scale is measured from the first rows written,
    on the device, so a captured decode step may be the first writer."""

    def __init__(
        self,
        kv_heads: int,
        head_dim: int,
        capacity: int | None,
        device,
        dtype,
        fixed_scales: torch.Tensor | None = None,
    ):
        self.limit = capacity
        size = capacity if capacity is not None else 256
        fp8 = dtype == torch.float8_e4m3fn
        self.keys = torch.empty(size, kv_heads, head_dim, device=device, dtype=torch.uint8 if fp8 else dtype)
        self.values = torch.empty_like(self.keys)
        self.length = 0
        self.scales = None  # unquantised rows
        if fp8:  # zero: not measured yet
            self.scales = torch.zeros(2, kv_heads, device=device, dtype=torch.float32)
            if fixed_scales is not None:
                self.scales.copy_(fixed_scales.to(device, torch.float32).expand(2, kv_heads))

    def _stored(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows in the cache's storage: e4m3 bytes for an FP8 cache (scales measured first where still zero)."""
        if self.scales is None:
            return keys, values
        measured = torch.stack([keys.abs().amax(dim=(0, 2)), values.abs().amax(dim=(0, 2))]).float()
        torch.where(self.scales > 0, self.scales, measured * (MEASURED_SCALE_MARGIN / E4M3_MAX), out=self.scales)
        divisor = torch.where(self.scales > 0, self.scales, 1.0)[:, None, :, None]  # an all-zero head stays zero
        return tuple(
            (rows.float() / d).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
            for rows, d in ((keys, divisor[0]), (values, divisor[1]))
        )

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add rows (in the compute dtype, or an FP8 cache's own bytes); all rows held so far, in storage."""
        end = self.length + keys.shape[0]
        if end > self.keys.shape[0]:
            if self.limit is not None:
                raise ContextOverflowError(end, self.limit)
            grown = max(end, 2 * self.keys.shape[0])
            self.keys = _grow(self.keys, grown)
            self.values = _grow(self.values, grown)
        if keys.dtype != self.keys.dtype:
            keys, values = self._stored(keys, values)
        self.keys[self.length : end] = keys
        self.values[self.length : end] = values
        self.length = end
        return self.keys[:end], self.values[:end]

    def write_at(self, position: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """One token's key and value into row `position` (a device tensor: nothing read on the host). The
        caller moves `length` on."""
        keys, values = self._stored(keys, values)
        self.keys.index_copy_(0, position, keys)
        self.values.index_copy_(0, position, values)

    def advance(self) -> None:
        """Count the token `write_at` wrote."""
        self.length += 1

    def snapshot(self) -> int:
        return self.length

    snapshot_bytes = 0  # a snapshot is the length alone: the cache only grows, so nothing is copied

    def restore(self, length: int) -> None:
        self.length = length

    def host_copy(self, after: HostRows | None = None) -> HostRows:
        """The cached tokens' keys and values in host RAM, valid whatever this cache is used for next; where
        `after` holds this cache's first rows (this sequence was loaded from it, or grew from it), its blocks
        are shared and only the rows past them copied."""
        start = after.length if after is not None else 0
        if start > self.length:
            raise ValueError(f"a host copy of {self.length} tokens cannot extend one of {start}")
        shared = (after.keys, after.values) if after is not None else ((), ())
        scales = self.scales.to("cpu", copy=True) if self.scales is not None else None
        if start == self.length:
            return HostRows(*shared, scales)
        keys = self.keys[start : self.length].to("cpu", copy=True)
        values = self.values[start : self.length].to("cpu", copy=True)
        return HostRows(shared[0] + (keys,), shared[1] + (values,), scales)

    def load(self, saved: HostRows) -> None:
        """Hold exactly the tokens of a host_copy() of a cache of the same dtype, with its scales; rows of another
        shape or dtype are refused."""
        if (saved.scales is None) != (self.scales is None):
            raise ValueError("a host copy loads only into a KV cache of its own dtype (FP8 or not)")
        if self.scales is not None:
            self.scales.copy_(saved.scales)
        self.length = 0
        for keys, values in zip(saved.keys, saved.values):
            for rows in (keys, values):
                if rows.shape[1:] != self.keys.shape[1:] or rows.dtype != self.keys.dtype:
                    raise ValueError(f"saved KV rows of {tuple(rows.shape)} {rows.dtype} do not fit this cache")
            self.append(keys.to(self.keys.device), values.to(self.values.device))

    def clone(self) -> KVCache:
        copy = object.__new__(KVCache)
        copy.limit, copy.length = self.limit, self.length
        copy.keys, copy.values = self.keys.clone(), self.values.clone()
        copy.scales = self.scales.clone() if self.scales is not None else None
        return copy


def _grow(t: torch.Tensor, rows: int) -> torch.Tensor:
    bigger = torch.empty(rows, *t.shape[1:], device=t.device, dtype=t.dtype)
    bigger[: t.shape[0]] = t
    return bigger


class Attention:
    def __init__(self, source: WeightSource, prefix: str, rotary: Rotary):
        c = source.config
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.output_gate = c.attention_output_gate
        q_out = self.heads * self.head_dim * (2 if self.output_gate else 1)
        kv_out = self.kv_heads * self.head_dim
        self.qkv_proj = JoinedLinear(
            source, [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"], c.hidden_size, [q_out, kv_out, kv_out]
        )
        self.o_proj = Linear(source, f"{prefix}.o_proj", self.heads * self.head_dim, c.hidden_size)
        self.q_norm = RMSNorm(source, f"{prefix}.q_norm.weight", self.head_dim, c.zero_centered_norms)
        self.k_norm = RMSNorm(source, f"{prefix}.k_norm.weight", self.head_dim, c.zero_centered_norms)
        self.rotary = rotary
        self.scale = self.head_dim**-0.5
        self.kv_dtype = source.kv_dtype
        self.kv_scales = _checkpoint_kv_scales(source, prefix) if self.kv_dtype == torch.float8_e4m3fn else None

    def new_state(self, max_tokens: int | None, device, dtype) -> KVCache:
        """A KV cache for `max_tokens` (None: grown), in the source's KV dtype where it has one, else `dtype`."""
        return KVCache(self.kv_heads, self.head_dim, max_tokens, device, self.kv_dtype or dtype, self.kv_scales)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        q, k, v, gate = self.project(x, positions)
        return self.output(self.attend(q, k, v, cache), gate)

    def decode_step(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, step: DecodeStep) -> torch.Tensor:
        """One token at positions[0] (a device tensor). A preallocated cache that a kernel reads at the device's
        position is written and read inside the step; otherwise attention, whose length grows, runs on the
        host's side of a cut, and only the projections around it are captured."""
        q, k, v, gate = self.project(x, positions)
        if cache.limit is not None and (
            not step.graphed or kernels.decode_attention_capturable(q, cache.keys, cache.values)
        ):
            cache.write_at(positions, k, v)
            step.at_end(cache.advance)
            out = kernels.decode_attention(q, cache.keys, cache.values, positions, self.scale, cache.scales)
            return self.output(out, gate)
        out = step.host_tensor(lambda: self.attend(q, k, v, cache), lambda: torch.empty_like(q))
        return self.output(out, gate)

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """(q [T, H, D] and k [T, Hkv, D] normed and rotated, v [T, Hkv, D], the output gate or None)."""
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x)
        q = q.reshape(tokens, self.heads, -1)
        gate = None
        if self.output_gate:  # each head's projection is [query | gate]
            q, gate = q.split(self.head_dim, dim=-1)
        k = k.reshape(tokens, self.kv_heads, self.head_dim)
        v = v.reshape(tokens, self.kv_heads, self.head_dim)
        return self._norm_rope(q, self.q_norm, positions), self._norm_rope(k, self.k_norm, positions), v, gate

    def _norm_rope(self, x: torch.Tensor, norm: RMSNorm, positions: torch.Tensor) -> torch.Tensor:
        return kernels.norm_rope(x, norm.weight, norm.eps, norm.offset, positions, self.rotary.inv_freq)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache) -> torch.Tensor:
        keys, values = cache.append(k, v)
        return kernels.causal_attention(q, keys, values, self.scale, cache.scales)

    def output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(out.shape[0], self.heads * self.head_dim))


# Where exports keep an FP8 KV cache's calibrated scales (value = e4m3 x scale, one per tensor): ModelOpt under
# the k/v projections, compressed-tensors (and vLLM's own naming) on the attention module.
KV_SCALE_NAMES = (("k_proj.k_scale", "v_proj.v_scale"), ("k_scale", "v_scale"))


def _checkpoint_kv_scales(source: WeightSource, prefix: str) -> torch.Tensor | None:
    """The checkpoint's key and value scales of attention `prefix` as [2, 1] (per tensor) or [2, Hkv] (per KV
    head) float32, or None where it ships none."""
    kv_heads = source.config.num_key_value_heads
    for key_name, value_name in KV_SCALE_NAMES:
        names = (f"{prefix}.{key_name}", f"{prefix}.{value_name}")
        if all(source.checkpoint.has(n) for n in names):
            scales = [source.checkpoint.tensor(n).float().reshape(-1) for n in names]
            if any(t.numel() not in (1, kv_heads) for t in scales):
                raise CheckpointError(
                    source.checkpoint.folder,
                    f"has KV cache scales {names} of {[t.numel() for t in scales]} values, not 1 or {kv_heads}",
                    "the checkpoint is damaged; download it again",
                )
            return torch.stack([t.expand(max(t.numel() for t in scales)) for t in scales])
    return None
