"""Full attention with q/k norms, partial RoPE, grouped KV heads and (Qwen3.5/3.6) a sigmoid output gate."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import kernels
from engine.checkpoint.source import WeightSource
from engine.errors import ContextOverflowError
from engine.layers.linear import JoinedLinear, Linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import Rotary
from engine.step import DecodeStep


@dataclass(frozen=True)
class HostRows:
    """A KV cache's first tokens in host RAM, as blocks of consecutive rows: a copy that extends another shares
    the other's blocks instead of copying them again."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    @property
    def length(self) -> int:
        return sum(block.shape[0] for block in self.keys)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.keys + self.values


class KVCache:
    """Keys and values of one attention layer; preallocated when the token budget is known, else grown."""

    def __init__(self, kv_heads: int, head_dim: int, capacity: int | None, device, dtype):
        self.limit = capacity
        size = capacity if capacity is not None else 256
        self.keys = torch.empty(size, kv_heads, head_dim, device=device, dtype=dtype)
        self.values = torch.empty_like(self.keys)
        self.length = 0

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + keys.shape[0]
        if end > self.keys.shape[0]:
            if self.limit is not None:
                raise ContextOverflowError(end, self.limit)
            grown = max(end, 2 * self.keys.shape[0])
            self.keys = _grow(self.keys, grown)
            self.values = _grow(self.values, grown)
        self.keys[self.length : end] = keys
        self.values[self.length : end] = values
        self.length = end
        return self.keys[:end], self.values[:end]

    def write_at(self, position: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """One token's key and value into row `position` (a device tensor: nothing read on the host). The
        caller moves `length` on."""
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
        if start == self.length:
            return HostRows(*shared)
        keys = self.keys[start : self.length].to("cpu", copy=True)
        values = self.values[start : self.length].to("cpu", copy=True)
        return HostRows(shared[0] + (keys,), shared[1] + (values,))

    def load(self, saved: HostRows) -> None:
        """Hold exactly the tokens of a host_copy(), refusing rows of another shape or dtype."""
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

    def new_state(self, max_tokens: int | None, device, dtype) -> KVCache:
        return KVCache(self.kv_heads, self.head_dim, max_tokens, device, dtype)

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
            return self.output(kernels.decode_attention(q, cache.keys, cache.values, positions, self.scale), gate)
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
        q = self.q_norm(q)
        k = self.k_norm(k.reshape(tokens, self.kv_heads, self.head_dim))
        v = v.reshape(tokens, self.kv_heads, self.head_dim)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        return self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin), v, gate

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache) -> torch.Tensor:
        keys, values = cache.append(k, v)
        return kernels.causal_attention(q, keys, values, self.scale)

    def output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(out.shape[0], self.heads * self.head_dim))
