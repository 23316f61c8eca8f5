"""The expert cache: a pool of slots on the compute device, each holding one routed expert's record
(engine/experts/packed.py), filled from the host records.

Two ways in:
- `fetch(layer, experts)`: the given experts, copying only the misses into least-recently-used slots
  (decode, small chunks);
- `stream_layer(layer)`: a whole layer of experts in one copy into a block of slots, the unit of
  layer-streamed prefill. The pool is cut into `slots // experts` such blocks: with two or more,
  layer i+1 streams into one while layer i computes from another (prefill overlap).

On CUDA every copy runs on a copy stream. Events order it against compute: a copy into a block waits
for the last compute that read the block (`release`), compute waits for the copies it reads (`ready`).
The pool is allocated once, at its full size, so the cache's memory is what the plan says whatever
the traffic. With a link limit (benchmarks: engine/experts/link.py) the copy stream is held as a narrower
link would hold it. Hits, misses and bytes copied are counted for the app's gauges.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch

from engine.experts.link import LinkThrottle
from engine.experts.packed import PackedExperts
from engine.kernels.record_layout import RecordLayout


DEVICE_TICKS = 2**31 - 2**20  # the device table's int32 clock, with a margin


class ExpertCache:
    def __init__(
        self,
        device: torch.device | str,
        slots: int,
        layout: RecordLayout,
        experts_per_layer: int,
        link: LinkThrottle | None = None,
    ):
        if slots < 1:
            raise ValueError(f"the expert cache needs at least one slot, got {slots}")
        self.device = torch.device(device)
        self.slots, self.experts_per_layer, self.layout = slots, experts_per_layer, layout
        self.pool = torch.empty((slots, layout.record_bytes), dtype=torch.uint8, device=self.device)
        self.weights = layout.view(self.pool)  # stacked [slots, out, in] views: what the kernels read
        self._slot_rows = list(self.pool.unbind(0))  # one view per slot, made once: a decode step copies into them
        self.blocks = slots // experts_per_layer  # whole layers the pool can hold
        self._slot_of: OrderedDict[tuple[int, int], int] = OrderedDict()  # (layer, expert) -> slot, oldest first
        self._key_in: dict[int, tuple[int, int]] = {}  # slot -> (layer, expert)
        self._free = list(range(slots - 1, -1, -1))
        self._block_of_layer: dict[int, int] = {}  # layers held whole in a block
        self._prefetched: set[int] = set()  # layers streamed ahead of use: their first use counts as misses
        self._block_use: OrderedDict[int, None] = OrderedDict((b, None) for b in range(self.blocks))  # LRU order
        cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self._released = {} if cuda else None  # block (or -1: slots outside blocks) -> event after its last read
        self._ready = None  # event after the latest copy
        self._link = link  # holds the copy stream as an emulated narrower link would (benchmarks)
        self.hits = self.misses = self.bytes_copied = 0
        self._device_table: dict[str, torch.Tensor] | None = None  # the slot table decode steps update on the device
        self._device_owned = False  # while True, the device table is the truth and the host's bookkeeping stale
        self._handed_at = -1  # the device table's clock when the host handed it over
        self._ticks_left = 0  # lookups the device's clock can still count

    @property
    def nbytes(self) -> int:
        return self.pool.numel()

    def holds_layer(self, layer: int) -> bool:
        """Whether a block holds every expert of `layer`, so streaming it copies nothing."""
        self.take_back()
        return layer in self._block_of_layer

    def holds(self, layer: int, expert: int) -> bool:
        self.take_back()
        return (layer, expert) in self._slot_of

    def fetch(
        self, layer: int, experts: list[int], packed: PackedExperts, deferred: list[tuple[int, int]] | None = None
    ) -> list[int]:
        """Slots holding `experts` of `layer` (at most `slots` of them), copying the misses in; with `deferred`,
        the misses' (expert, slot) pairs go there instead, for the caller to copy before anything reads them."""
        if len(experts) > self.slots:
            raise ValueError(f"{len(experts)} experts asked of a cache of {self.slots} slots")
        self.take_back()
        found = {}
        for expert in experts:  # hits first, so the misses below cannot evict them
            slot = self._slot_of.get((layer, expert))
            if slot is not None:
                self._slot_of.move_to_end((layer, expert))
                self._touch_block(slot)
                found[expert] = slot
        self.hits += len(found)
        misses = [e for e in experts if e not in found]
        self.misses += len(misses)
        for expert in misses:
            found[expert] = self._take_slot()
            self._assign(found[expert], (layer, expert))
        if deferred is not None:
            deferred.extend((expert, found[expert]) for expert in misses)
            self.bytes_copied += len(misses) * self.layout.record_bytes
        elif misses:
            with self._copying(packed.pinned) as copy:
                for expert in misses:
                    copy(self._slot_rows[found[expert]], packed.rows[expert], self._block(found[expert]))
        return [found[e] for e in experts]

    def stream_layer(self, layer: int, packed: PackedExperts, count_as_lookups: bool = True) -> int:
        """Put every expert of `layer` in one block (one copy unless it is already there); its first slot.
        `count_as_lookups=False` for a prefetch: its lookups count as misses when the layer is used."""
        if not self.blocks:
            raise ValueError("the expert cache is smaller than one layer of experts: it cannot stream layers")
        self.take_back()
        experts = self.experts_per_layer
        block = self._block_of_layer.get(layer)
        copied_for_this_use = block is None or layer in self._prefetched
        if block is None:
            block = next(iter(self._block_use))  # least recently used
            first = block * experts
            for slot in range(first, first + experts):
                self._evict(slot)
            for e in range(experts):  # copies of this layer's experts elsewhere are now redundant
                elsewhere = self._slot_of.pop((layer, e), None)
                if elsewhere is not None:
                    del self._key_in[elsewhere]
                    self._free.append(elsewhere)
            self._free = [s for s in self._free if not first <= s < first + experts]
            with self._copying(packed.pinned) as copy:
                copy(self.pool[first : first + experts], packed.records, block)
            for e in range(experts):
                self._assign(first + e, (layer, e))
            self._block_of_layer[layer] = block
            if not count_as_lookups:
                self._prefetched.add(layer)
        if count_as_lookups:
            self._prefetched.discard(layer)
            if copied_for_this_use:
                self.misses += experts
            else:
                self.hits += experts
        self._block_use.move_to_end(block)
        return block * experts

    def release(self, slots: list[int]) -> None:
        """Compute queued so far has read `slots`: copies into their blocks must wait for it."""
        if self._released is None:
            return
        for block in {self._block(s) for s in slots}:
            event = torch.cuda.Event()
            event.record()
            self._released[block] = event

    def wait_ready(self) -> None:
        """Make the current (compute) stream wait for every copy issued so far."""
        if self._ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self._ready)

    def stats(self) -> dict:
        hits, misses = self.hits, self.misses
        if self._device_owned:  # counted on the device since it took the table
            device_hits, device_misses = self._device_table["counts"].tolist()
            hits, misses = hits + device_hits, misses + device_misses
        copied = self.bytes_copied + (misses - self.misses) * self.layout.record_bytes
        lookups = hits + misses
        return {
            "expert_cache_slots": self.slots,
            "expert_cache_hits": hits,
            "expert_cache_misses": misses,
            "expert_bytes_copied": copied,
            "expert_cache_bytes": self.nbytes,
            "expert_cache_hit_rate": hits / lookups if lookups else 0.0,
        }

    # ---- the slot table on the device: decode steps that choose slots inside their graphs ----------

    def hand_to_device(self, lookups: int = 0) -> dict[str, torch.Tensor]:
        """The slot table for kernels.assign_slots (keys, ages, clock, counts: device tensors, the same ones every
        time), filled from the host's bookkeeping when the host held it, for `lookups` more lookups (a step's).
        Host lookups take it back first. The device's clock is int32: before it could run out (a long stretch of
        decoding with no prompt in between), the table goes back and forth once, which renumbers the ages."""
        if self._device_owned and self._ticks_left < lookups:
            self.take_back()
        self._ticks_left -= lookups
        if self._device_table is None:
            self._device_table = {
                "keys": torch.full((self.slots,), -1, dtype=torch.int32, device=self.device),
                "ages": torch.full((self.slots,), -1, dtype=torch.int32, device=self.device),
                "clock": torch.zeros(1, dtype=torch.int32, device=self.device),
                "counts": torch.zeros(2, dtype=torch.int64, device=self.device),
            }
        if not self._device_owned:
            keys = torch.full((self.slots,), -1, dtype=torch.int32)
            ages = torch.full((self.slots,), -1, dtype=torch.int32)
            for rank, ((layer, expert), slot) in enumerate(self._slot_of.items()):  # oldest first
                keys[slot], ages[slot] = layer * self.experts_per_layer + expert, rank
            table = self._device_table
            table["keys"].copy_(keys)
            table["ages"].copy_(ages)
            table["clock"].fill_(len(self._slot_of) - 1)
            table["counts"].zero_()
            self._handed_at = len(self._slot_of) - 1  # ticks after it are the device's touches
            self._ticks_left = DEVICE_TICKS - len(self._slot_of) - lookups
            self._device_owned = True
        return self._device_table

    def take_back(self) -> None:
        """The host's bookkeeping again from the device table, and its hit and miss counts (synchronises)."""
        if not self._device_owned:
            return
        table, experts = self._device_table, self.experts_per_layer
        keys, ages = table["keys"].tolist(), table["ages"].tolist()
        hits, misses = table["counts"].tolist()
        self.hits, self.misses = self.hits + hits, self.misses + misses
        self.bytes_copied += misses * self.layout.record_bytes
        held = sorted((age, slot, key) for slot, (key, age) in enumerate(zip(keys, ages)) if key >= 0)
        self._slot_of = OrderedDict(((key // experts, key % experts), slot) for _, slot, key in held)
        self._key_in = {slot: key for key, slot in self._slot_of.items()}
        self._free = [slot for slot in range(self.slots - 1, -1, -1) if keys[slot] < 0]
        # blocks still holding their layer whole; blocks the device touched become the most recent, in tick order
        for layer, block in list(self._block_of_layer.items()):
            first = block * experts
            if keys[first : first + experts] != list(range(layer * experts, (layer + 1) * experts)):
                del self._block_of_layer[layer]
                self._prefetched.discard(layer)
        touched = {b: max(ages[b * experts : (b + 1) * experts]) for b in range(self.blocks)}
        for block in sorted((b for b in touched if touched[b] > self._handed_at), key=touched.get):
            self._block_use.move_to_end(block)
        if self._released is not None:  # copies the host issues next wait for the steps' gathers and reads
            event = torch.cuda.Event()
            event.record()
            for block in [*range(self.blocks), -1]:
                self._released[block] = event
        self._device_owned = False

    # ---- bookkeeping ----------------------------------------------------------------------

    def _block(self, slot: int) -> int:
        block = slot // self.experts_per_layer
        return block if block < self.blocks else -1

    def _touch_block(self, slot: int) -> None:
        block = self._block(slot)
        if block >= 0:
            self._block_use.move_to_end(block)

    def _take_slot(self) -> int:
        if not self._free:
            self._evict(next(iter(self._slot_of.values())))  # the least recently used; it joins the free list
        return self._free.pop()

    def _evict(self, slot: int) -> None:
        key = self._key_in.pop(slot, None)
        if key is not None:
            del self._slot_of[key]
            self._free.append(slot)
        block = self._block(slot)
        for layer, held in list(self._block_of_layer.items()):
            if held == block:  # the block no longer holds that layer whole
                del self._block_of_layer[layer]
                self._prefetched.discard(layer)

    def _assign(self, slot: int, key: tuple[int, int]) -> None:
        self._slot_of[key] = slot
        self._key_in[slot] = key
        self._touch_block(slot)

    @contextlib.contextmanager
    def _copying(self, pinned: bool):
        """A function copy(slot rows, host records, their block) that issues each copy on the copy stream once the
        block's last readers are done; one stream switch and one ready event for all of them. Under a link limit
        the copy stream is held after each run of copies between its waits (a link is idle while a copy waits),
        and pageable copies keep the host waiting as they would on that link."""
        link = self._link
        run_bytes = 0

        def end_run():
            nonlocal run_bytes
            if link is not None and run_bytes:
                link.hold(run_bytes)
            run_bytes = 0

        def start_run():
            if link is not None and not run_bytes:
                link.start()

        if self._copy_stream is None:

            def copy(target, source, block):
                nonlocal run_bytes
                start_run()
                self.bytes_copied += source.numel()
                target.copy_(source)
                run_bytes += source.numel()

            yield copy
            end_run()
            return
        waited = set()

        def copy(target, source, block):
            nonlocal run_bytes
            if block not in waited:
                waited.add(block)
                released = self._released.get(block)
                if released is not None:
                    end_run()
                    self._copy_stream.wait_event(released)
            start_run()
            self.bytes_copied += source.numel()
            target.copy_(source, non_blocking=pinned)
            run_bytes += source.numel()

        with torch.cuda.stream(self._copy_stream):
            yield copy
            held = link is not None and run_bytes > 0
            end_run()
            self._ready = torch.cuda.Event()
            self._ready.record(self._copy_stream)
        if held and not pinned:  # a pageable copy returns once it has crossed the link: the host waited for it
            self._ready.synchronize()
