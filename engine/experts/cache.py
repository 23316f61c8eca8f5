"""The expert cache: a pool of slots on the compute device, each holding one routed expert's record
(engine/experts/packed.py), filled from the host records.

Two ways in:
- `fetch(layer, experts)`: the given experts, copying only the misses into least-recently-used slots
  (decode, small chunks);
- `stream_layer(layer)`: a whole layer of experts in one copy into a block of slots, the unit of
  layer-streamed prefill. The pool is cut into `slots // experts` such blocks: with two or more,
  layer i+1 streams into one while layer i computes from another (prefill overlap). When the pool holds
  fewer blocks than the model has layers, plain LRU would evict every layer before its next use (prefill
  visits the layers in order, chunk after chunk); `keep_when_streaming` names the layers whose blocks stay,
  and the rest take turns in the other blocks.

On CUDA every copy runs on a copy stream. Events order it against compute: a copy into a block waits
for the last compute that read the block (`release`), compute waits for the copies it reads (`ready`).
The pool is allocated once, at its full size, so the cache's memory is what the plan says whatever
the traffic. With a link limit (benchmarks: engine/experts/link.py) the copy stream is held as a narrower
link would hold it. Hits, misses and bytes copied are counted for the app's gauges.

Which expert sits in which slot, and the recency order, is one table (engine/kernels/slot_table.py) with one
replacement rule. The host's lookups apply the rule to it; decode steps that choose their slots on the device
(`device_table`) apply it there with kernels.assign_slots, which finds the hits through a reverse index of the
keys (`where`, rebuilt from the keys whenever the host's changes go down, and kept by the kernel), and the host's
next lookup reads the table back (on CUDA one copy of the same tensors; on the host's device they are the same
memory; `where` stays on the device). Whole-layer blocks are read off the table: a block holds a layer when its
slots hold the layer's experts in order, and its last use is the latest age of its slots.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from engine.experts.link import LinkThrottle
from engine.experts.packed import PackedExperts
from engine.kernels import slot_table
from engine.kernels.record_layout import RecordLayout
from engine.kernels.slot_table import SlotTable

# Blocks that streamed layers take turns in beside the kept ones: one computes while the next layer streams into
# the other, so a copy never waits for the compute it would overwrite.
STREAM_TURN_BLOCKS = 2


class ExpertCache:
    def __init__(
        self,
        device: torch.device | str,
        slots: int,
        layout: RecordLayout,
        experts_per_layer: int,
        layers: int,
        link: LinkThrottle | None = None,
    ):
        """Allocate a pool of `slots` records of `layout` for the experts of layers 0 .. layers - 1 (keys below
        layers * experts_per_layer); with `link`, copies are held as that link would hold them."""
        if slots < 1:
            raise ValueError(f"the expert cache needs at least one slot, got {slots}")
        self.device = torch.device(device)
        self.slots, self.experts_per_layer, self.layers, self.layout = slots, experts_per_layer, layers, layout
        self.pool = torch.empty((slots, layout.record_bytes), dtype=torch.uint8, device=self.device)
        self.weights = layout.view(self.pool)  # stacked [slots, out, in] views: what the kernels read
        self._slot_rows = list(self.pool.unbind(0))  # one view per slot, made once: a decode step copies into them
        self.blocks = slots // experts_per_layer  # whole layers the pool can hold
        cuda = self.device.type == "cuda"
        self.table = SlotTable.empty(slots, pin=cuda)  # which expert each slot holds, and when it was last used
        self._device_table: dict[str, torch.Tensor] | None = None  # the table's tensors where decode kernels run
        self._device_current = False  # whether decode steps may have changed the table since the host read it
        self._clock_bound = -1  # while they may: the highest tick their lookups can reach
        self._prefetched: set[int] = set()  # layers streamed ahead of use: their first use counts as misses
        self._kept: tuple[int, ...] = ()  # layers whose whole blocks a streamed layer never takes
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self._released = {} if cuda else None  # block (or -1: slots outside blocks) -> event after its last read
        self._ready = None  # event after the latest copy
        self._link = link  # holds the copy stream as an emulated narrower link would (benchmarks)
        self.hits = self.misses = self.bytes_copied = 0  # the host's lookups and copies; the device counts its own

    @property
    def nbytes(self) -> int:
        return self.pool.numel()

    def holds_layer(self, layer: int) -> bool:
        """Whether a block holds every expert of `layer`, so streaming it copies nothing."""
        return self._block_holding(layer) is not None

    def missing(self, layer: int, experts: list[int]) -> list[int]:
        """The experts of `experts` (of `layer`) that no slot holds, in order: a lookup's misses."""
        base = layer * self.experts_per_layer
        return [key - base for key in self._host_table().missing([base + e for e in experts])]

    def fetch(
        self, layer: int, experts: list[int], packed: PackedExperts, deferred: list[tuple[int, int]] | None = None
    ) -> list[int]:
        """Slots holding `experts` of `layer` (distinct, at most `slots` of them), copying the misses in; with
        `deferred`, the misses' (expert, slot) pairs go there instead, for the caller to copy before anything
        reads them."""
        if len(experts) > self.slots:
            raise ValueError(f"{len(experts)} experts asked of a cache of {self.slots} slots")
        table = self._host_table()
        table.reserve(len(experts))
        base = layer * self.experts_per_layer
        found, misses = table.lookup([base + e for e in experts])
        self.hits += len(experts) - len(misses)
        self.misses += len(misses)
        copies = [(experts[j], found[j]) for j in misses]
        if deferred is not None:
            deferred.extend(copies)
            self.bytes_copied += len(copies) * self.layout.record_bytes
        elif copies:
            with self._copying(packed.pinned) as copy:
                for expert, slot in copies:
                    copy(self._slot_rows[slot], packed.rows[expert], self._block(slot))
        return found

    @property
    def kept_layers(self) -> tuple[int, ...]:
        """The layers whose blocks streamed layers leave alone (keep_when_streaming)."""
        return self._kept

    def keep_when_streaming(self, layers: list[int]) -> None:
        """Keep the blocks holding `layers` whole when other layers stream in, so each prefill chunk copies only
        the layers that do not fit; at least STREAM_TURN_BLOCKS blocks stay free to take turns."""
        kept = max(0, self.blocks - STREAM_TURN_BLOCKS)
        if len(layers) > kept:
            raise ValueError(f"{len(layers)} layers to keep, but {self.blocks} blocks leave room for {kept}")
        self._kept = tuple(layers)

    def stream_layer(self, layer: int, packed: PackedExperts, count_as_lookups: bool = True) -> int:
        """Put every expert of `layer` in one block (one copy unless it is already there); its first slot. Each
        expert counts as a lookup, touched in expert order; `count_as_lookups=False` for a prefetch, whose
        lookups count as misses when the layer is used."""
        if not self.blocks:
            raise ValueError("the expert cache is smaller than one layer of experts: it cannot stream layers")
        table, experts = self._host_table(), self.experts_per_layer
        table.reserve(experts)
        base = layer * experts
        block = self._block_holding(layer)
        copied_for_this_use = block is None or layer in self._prefetched
        if block is None:
            block = self._stream_victim()
            first = block * experts
            with self._copying(packed.pinned) as copy:
                copy(self.pool[first : first + experts], packed.records, block)
            table.place_run(base, first, experts)  # copies of its experts elsewhere are now redundant: freed
            if not count_as_lookups:
                self._prefetched.add(layer)
        elif count_as_lookups:
            table.touch_run(block * experts, experts)
        if count_as_lookups:
            self._prefetched.discard(layer)
            if copied_for_this_use:
                self.misses += experts
            else:
                self.hits += experts
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
        device_hits, device_misses = self._device_table["counts"].tolist() if self._device_table else (0, 0)
        hits, misses = self.hits + device_hits, self.misses + device_misses
        copied = self.bytes_copied + device_misses * self.layout.record_bytes  # each device miss copies a record
        lookups = hits + misses
        return {
            "expert_cache_slots": self.slots,
            "expert_cache_hits": hits,
            "expert_cache_misses": misses,
            "expert_bytes_copied": copied,
            "expert_cache_bytes": self.nbytes,
            "expert_cache_hit_rate": hits / lookups if lookups else 0.0,
            "expert_cache_kept_layers": len(self._kept),
        }

    # ---- the slot table where decode steps choose slots inside their graphs --------------------------------

    def device_table(self, lookups: int = 0) -> dict[str, torch.Tensor]:
        """The slot table as kernels.assign_slots takes it (keys, ages, clock, where: the reverse index of the
        keys, and counts: the device's hits and misses), for `lookups` more lookups (a step's): the same tensors
        every time. On the host's device keys, ages and clock are the table's own; on CUDA the host's changes are
        copied down first; either way `where` is rebuilt from the keys after the host's changes. The clock is
        int32: before it could run out (a long stretch of decoding with no prompt in between), the ages are
        renumbered."""
        if self._device_current and self._clock_bound + lookups > slot_table.TICKS:
            self._host_table()
        if self._device_table is None:
            on_device = [t.to(self.device) if self.device.type == "cuda" else t for t in self.table.tensors]
            where = torch.empty(self.layers * self.experts_per_layer, dtype=torch.int32, device=self.device)
            counts = torch.zeros(2, dtype=torch.int64, device=self.device)
            self._device_table = dict(zip(("keys", "ages", "clock", "where", "counts"), [*on_device, where, counts]))
        if not self._device_current:
            self.table.reserve(lookups)
            for name, on_host in zip(("keys", "ages", "clock"), self.table.tensors):
                if self._device_table[name] is not on_host:
                    self._device_table[name].copy_(on_host)
            slot_table.index_keys(self._device_table["keys"], self._device_table["where"])
            self._clock_bound = int(self.table.clock[0])
            self._device_current = True
        self._clock_bound += lookups
        return self._device_table

    def _host_table(self) -> SlotTable:
        """The slot table for the host's lookups: after decode steps it is read back from where they changed it
        (on CUDA one copy, which synchronises)."""
        if not self._device_current:
            return self.table
        for name, on_host in zip(("keys", "ages", "clock"), self.table.tensors):
            if self._device_table[name] is not on_host:
                on_host.copy_(self._device_table[name])
        self.table.reindex()
        self._device_current = False
        if self._released is not None:  # copies the host issues next wait for the steps' gathers and reads
            event = torch.cuda.Event()
            event.record()
            for block in [*range(self.blocks), -1]:
                self._released[block] = event
        return self.table

    # ---- blocks: whole layers, read off the table ------------------------------------------------------

    def _block(self, slot: int) -> int:
        block = slot // self.experts_per_layer
        return block if block < self.blocks else -1

    def _block_holding(self, layer: int) -> int | None:
        """The block whose slots hold `layer`'s experts in expert order, or None."""
        table, experts = self._host_table(), self.experts_per_layer
        first = table.find(layer * experts)
        if first is None or first % experts or self._block(first) < 0:
            return None
        whole = np.array_equal(table.keys[first : first + experts], np.arange(layer * experts, (layer + 1) * experts))
        return first // experts if whole else None

    def _stream_victim(self) -> int:
        """The block a streamed layer goes into: of those not holding a kept layer whole, the one whose last use
        (the latest age of its slots) is the oldest, the lowest index among equals."""
        last_use = self.table.ages[: self.blocks * self.experts_per_layer].reshape(self.blocks, -1).max(axis=1)
        last_use = last_use.astype(np.float64)
        for layer in self._kept:
            block = self._block_holding(layer)
            if block is not None:
                last_use[block] = np.inf
        return int(np.argmin(last_use))

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
