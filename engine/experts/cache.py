"""The expert cache: a fixed number of slots on the compute device, each holding one routed expert in
its stored format, filled from the host bank on a miss and recycled least-recently-used first.

Slots are allocated once, on the first miss, with the shapes of that expert's tensors (every
routed expert of a model has the same shapes), so the cache's memory is what the plan says
whatever the traffic. With slots = one layer of experts, a prefill chunk that touches most of a
layer's experts streams that layer in and the next layer's misses evict it: layer streaming.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from engine.checkpoint.formats import StoredWeight


class ExpertCache:
    def __init__(self, device: torch.device | str, slots: int):
        if slots < 1:
            raise ValueError(f"the expert cache needs at least one slot, got {slots}")
        self.device = torch.device(device)
        self.slots = slots
        self._slot_of: OrderedDict[tuple[int, int], int] = OrderedDict()  # (layer, expert) -> slot, oldest first
        self._buffers: list[tuple[StoredWeight, ...]] = []  # per slot, preallocated on the device
        self.hits = self.misses = self.bytes_copied = 0

    def get(self, layer: int, expert: int, bank) -> tuple[StoredWeight, ...]:
        """The expert's weights in a slot on the device, copying them from `bank` on a miss."""
        key = (layer, expert)
        slot = self._slot_of.get(key)
        if slot is not None:
            self._slot_of.move_to_end(key)
            self.hits += 1
            return self._buffers[slot]
        self.misses += 1
        source = bank.stored(expert)
        if len(self._buffers) < self.slots:
            slot = len(self._buffers)
            self._buffers.append(tuple(_empty_like(w, self.device) for w in source))
        else:
            _, slot = self._slot_of.popitem(last=False)
        for target, weight in zip(self._buffers[slot], source):
            if target.shape != weight.shape or target.format != weight.format:
                raise ValueError(f"{weight.name} does not fit the cache slots made for {target.name}: "
                                 f"every routed expert of a model must share one shape and format")
            for role, tensor in weight.tensors.items():
                target.tensors[role].copy_(tensor, non_blocking=tensor.is_pinned())
                self.bytes_copied += tensor.numel() * tensor.element_size()
        self._slot_of[key] = slot
        return self._buffers[slot]

    def holds(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self._slot_of

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for slot in self._buffers for w in slot)

    def stats(self) -> dict:
        lookups = self.hits + self.misses
        return {"expert_cache_slots": self.slots, "expert_cache_hits": self.hits,
                "expert_cache_misses": self.misses, "expert_bytes_copied": self.bytes_copied,
                "expert_cache_hit_rate": self.hits / lookups if lookups else 0.0}


def _empty_like(weight: StoredWeight, device: torch.device) -> StoredWeight:
    tensors = {role: torch.empty(t.shape, dtype=t.dtype, device=device) for role, t in weight.tensors.items()}
    return StoredWeight(weight.format, tensors, weight.shape, weight.name, weight.block_size)
