"""The expert cache's slot table and its one replacement rule: least recently used.

The table is three int32 tensors: keys [S] (the key, layer * experts + expert, each slot holds; -1 free), ages
[S] (the tick of each slot's last use; -1 free) and clock [1] (the last tick). The rule, for one call's distinct
keys: the held ones are hits and are touched first, in order, so the call's misses cannot evict them (a touch
advances the clock one tick and gives the slot that age); then each miss takes the slot of the lowest age, the
lowest index among equals (so free slots first, lowest index first), and is touched.

Where the device applies the rule it also keeps `where` [keys' range] (int32): the slot holding each key, -1 for
none, so a call's hits are K reads rather than a pass over every slot. It is derived from the keys
(`index_keys`), and each placement updates it: the evicted key's entry to -1, the new key's to its slot.

`SlotTable.lookup` is that rule, the only definition of it: the host applies it to the cache's table
(engine/experts/cache.py), `reference.assign_slots` applies it to tensors it is given, and the device's kernel
(triton_slots.py) is checked against that reference, step by step, by tests/engine/kernels/test_slot_replay.py.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

TICKS = 2**31 - 2**20  # the int32 clock's room, with a margin


def index_keys(keys: torch.Tensor, where: torch.Tensor) -> None:
    """Fill `where` with the slot of each key that `keys` holds and -1 for the others (any device)."""
    where.fill_(-1)
    held = torch.nonzero(keys >= 0).squeeze(1)
    where[keys[held].long()] = held.to(where.dtype)


class SlotTable:
    """The LRU slot table over host tensors keys, ages and clock (numpy views: their memory is the table), with a
    key -> slot index for the host's lookups."""

    def __init__(self, keys: torch.Tensor, ages: torch.Tensor, clock: torch.Tensor):
        self.tensors = keys, ages, clock
        self.keys, self.ages, self.clock = keys.numpy(), ages.numpy(), clock.numpy()
        self.reindex()

    @classmethod
    def empty(cls, slots: int, pin: bool = False) -> SlotTable:
        """A table of `slots` free slots whose first tick will be 0; in page-locked memory with `pin`."""

        def full():
            return torch.full((slots,), -1, dtype=torch.int32, pin_memory=pin)

        return cls(full(), full(), torch.full((1,), -1, dtype=torch.int32, pin_memory=pin))

    def reindex(self) -> None:
        """Rebuild the key -> slot index from the keys, after something else (a device step) wrote them."""
        self._slot_of = {key: slot for slot, key in enumerate(self.keys.tolist()) if key >= 0}

    def find(self, key: int) -> int | None:
        """The slot holding `key`, or None."""
        return self._slot_of.get(key)

    def missing(self, keys: list[int]) -> list[int]:
        """The keys of `keys` that no slot holds, in order."""
        return [key for key in keys if key not in self._slot_of]

    def lookup(self, keys: list[int], placed: Callable[[int], int] | None = None) -> tuple[list[int | None], list[int]]:
        """Apply the rule to one call's distinct `keys`: (each key's slot, the positions of its misses). Of m
        misses the first `placed(m)` take slots (all without `placed`); the others get None and change nothing."""
        if len(set(keys)) != len(keys):
            raise ValueError(f"a lookup's keys must be distinct, got {keys}")
        found = [self._slot_of.get(key) for key in keys]
        for slot in found:
            if slot is not None:
                self.touch(slot)
        misses = [j for j, slot in enumerate(found) if slot is None]
        for j in misses[: len(misses) if placed is None else placed(len(misses))]:
            found[j] = self.place(keys[j])
        return found, misses

    def place(self, key: int) -> int:
        """Put `key` in the least recently used slot and touch it; the key it held is dropped. Its slot."""
        slot = int(np.argmin(self.ages))  # the first of equal minima: free slots (-1) first, lowest index first
        held = int(self.keys[slot])
        if held >= 0:
            del self._slot_of[held]
        self.keys[slot] = key
        self._slot_of[key] = slot
        self.touch(slot)
        return slot

    def place_run(self, first_key: int, first_slot: int, count: int) -> None:
        """Put keys first_key, first_key + 1, ... in `count` slots from `first_slot` on and touch them in that
        order (a whole layer streamed into a block); the keys those slots held and these keys' other slots go."""
        slots = range(first_slot, first_slot + count)
        for key in self.keys[first_slot : first_slot + count].tolist():
            self._slot_of.pop(key, None)
        elsewhere = [self._slot_of.pop(key) for key in range(first_key, first_key + count) if key in self._slot_of]
        self.keys[elsewhere] = self.ages[elsewhere] = -1
        self.keys[first_slot : first_slot + count] = np.arange(first_key, first_key + count, dtype=np.int32)
        self._slot_of.update(zip(range(first_key, first_key + count), slots))
        self.touch_run(first_slot, count)

    def touch_run(self, first_slot: int, count: int) -> None:
        """Touch `count` slots from `first_slot` on, in order."""
        tick = int(self.clock[0])
        self.ages[first_slot : first_slot + count] = np.arange(tick + 1, tick + count + 1, dtype=np.int32)
        self.clock[0] = tick + count

    def touch(self, slot: int) -> None:
        """Count a use of `slot`: the clock's next tick becomes its age."""
        self.clock[0] += 1
        self.ages[slot] = self.clock[0]

    def reserve(self, ticks: int) -> None:
        """Make room for `ticks` more touches on the int32 clock: ages renumbered 0, 1, ... in their order."""
        if int(self.clock[0]) + ticks <= TICKS:  # read here, so a test can narrow it
            return
        held = np.flatnonzero(self.keys >= 0)
        self.ages[held[np.argsort(self.ages[held])]] = np.arange(len(held), dtype=np.int32)
        self.clock[0] = len(held) - 1
