"""The expert cache's least-recently-used slot choice for one decode token, on the device, so a decode step needs
no host action between a router and its experts: with the host choosing slots, each MoE layer waited for the
router's ids to reach Python and the slots to come back (about 85 us a layer, 3.4 ms of a 20 ms step on the H200).

Same contract as reference.assign_slots, whose rule is the slot table's (engine/kernels/slot_table.py): one
program reads the whole key table; one elementwise pass finds the hits (touched first, in order, their ticks from
their ranks), and only a miss reads the ages, taking the slot with the oldest tick (free slots hold -1, lowest
index first) and a row of the copy table for triton_gather. tests/engine/kernels/test_slot_replay.py replays long
runs of lookups through it, the host's lookups on the same table, and a textbook LRU, which must agree at every
step.
With a CPU share (engine/kernels/cpu_share.py), the last misses of the CPU's count take no slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import reference

MAX_SLOTS = 16384  # one program's registers; bigger caches keep the host's choice


@triton.jit
def _assign_kernel(
    ids_ptr,
    keys_ptr,
    ages_ptr,
    clock_ptr,
    slots_ptr,
    table_ptr,
    counts_ptr,
    cpu_counts_ptr,
    gpu_rows_ptr,
    key_base,
    slots,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    SPLIT: tl.constexpr,
):
    s = tl.arange(0, BLOCK)
    inside = s < slots
    keys = tl.load(keys_ptr + s, mask=inside, other=-2)
    tick = tl.load(clock_ptr)
    # Hits in one elementwise pass: which chosen expert (j) each slot holds, -1 for none
    held = tl.full((BLOCK,), -1, tl.int32)
    for j in tl.static_range(K):
        held = tl.where(keys == key_base + tl.load(ids_ptr + j).to(tl.int32), j, held)
    hit = held >= 0
    found_bits = tl.sum(tl.where(hit, 1 << tl.maximum(held, 0), 0), axis=0)
    # A hit's tick is one more than the hits before it, in the order of the chosen experts
    rank = tl.zeros((BLOCK,), tl.int32)
    hits = 0
    for j in tl.static_range(K):
        found = (found_bits >> j) & 1
        rank += tl.where(held >= j, found, 0)
        hits += found
        tl.store(table_ptr + 2 * j, -1)
        tl.store(table_ptr + 2 * j + 1, -1)
        if SPLIT:
            tl.store(gpu_rows_ptr + j, 1.0)
    tl.store(ages_ptr + s, tick + rank, mask=hit)
    tl.store(slots_ptr + held, s, mask=hit)
    tick += hits
    on_gpu = K - hits  # misses the GPU copies: all, or with SPLIT those the CPU does not compute
    if SPLIT:
        on_gpu -= tl.load(cpu_counts_ptr + K - hits)
    copies = on_gpu
    if on_gpu > 0:  # the ages are read only for a miss: a layer whose experts are all cached writes K of them
        ages = tl.where(hit, tick - hits + rank, tl.load(ages_ptr + s, mask=inside, other=2147483647))
    else:
        ages = tl.zeros((BLOCK,), tl.int32)  # never read
    for j in tl.static_range(K):  # each miss in order: the oldest slot's, or with SPLIT past on_gpu the CPU's
        if ((found_bits >> j) & 1) == 0:
            if on_gpu > 0:
                victim = tl.argmin(ages, axis=0, tie_break_left=True)
                expert = tl.load(ids_ptr + j).to(tl.int32)
                tick += 1
                ages = tl.where(s == victim, tick, ages)
                tl.store(keys_ptr + victim, key_base + expert)
                tl.store(ages_ptr + victim, tick)
                tl.store(slots_ptr + j, victim)
                tl.store(table_ptr + 2 * j, expert)
                tl.store(table_ptr + 2 * j + 1, victim)
            elif SPLIT:  # slot 0, never read, and no weight on the GPU
                tl.store(slots_ptr + j, 0)
                tl.store(gpu_rows_ptr + j, 0.0)
            on_gpu -= 1
    tl.store(clock_ptr, tick)
    tl.store(counts_ptr, tl.load(counts_ptr) + hits)
    tl.store(counts_ptr + 1, tl.load(counts_ptr + 1) + copies)


def assign_slots_capturable(keys: torch.Tensor) -> bool:
    return keys.numel() <= MAX_SLOTS


def assign_slots(
    ids: torch.Tensor,
    key_base: int,
    keys: torch.Tensor,
    ages: torch.Tensor,
    clock: torch.Tensor,
    slots: torch.Tensor,
    table: torch.Tensor,
    counts: torch.Tensor,
    cpu_counts: torch.Tensor | None = None,
    gpu_rows: torch.Tensor | None = None,
) -> None:
    if not assign_slots_capturable(keys):
        reference.assign_slots(ids, key_base, keys, ages, clock, slots, table, counts, cpu_counts, gpu_rows)
        return
    split = cpu_counts is not None
    block = triton.next_power_of_2(keys.numel())
    _assign_kernel[(1,)](
        ids,
        keys,
        ages,
        clock,
        slots,
        table,
        counts,
        cpu_counts if split else counts,
        gpu_rows if split else counts,
        key_base,
        keys.numel(),
        K=ids.numel(),
        BLOCK=block,
        SPLIT=split,
        num_warps=_warps(block),
    )


def _warps(block: int) -> int:
    """Warps for a table of `block` slots: more for bigger tables, whose misses each reduce the whole table."""
    return 4 if block <= 2048 else 8 if block <= 8192 else 16
