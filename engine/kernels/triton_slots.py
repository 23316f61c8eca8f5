"""The expert cache's least-recently-used slot choice for one decode token, on the device, so a decode step needs
no host action between a router and its experts: with the host choosing slots, each MoE layer waited for the
router's ids to reach Python and the slots to come back (about 85 us a layer, 3.4 ms of a 20 ms step on the H200).

Same contract as reference.assign_slots, whose rule is the slot table's (engine/kernels/slot_table.py): one
program reads the chosen experts' K entries of the reverse index `where` for the hits (touched first, in order,
their ticks from their ranks), so a layer whose experts are all cached costs O(K), not a pass over the key table
(which took about 7 us a call with 10,240 slots on the H200, 40 calls a token). Only a miss the GPU copies reads
the whole age table, taking the slot with the oldest tick (free slots hold -1, lowest index first), its key and
its two entries of `where`, and a row of the copy table for triton_gather. tests/engine/kernels/test_slot_replay.py
replays long runs of lookups through it, the host's lookups on the same table, and a textbook LRU, which must
agree at every step, the reverse index with the keys.
With a CPU share (engine/kernels/cpu_share.py), the last misses of the CPU's count take no slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import reference

MAX_SLOTS = 16384  # one program's registers; bigger caches keep the host's choice


@triton.jit
def _lane(x, lanes, i):
    """Read lane `i` of the small vector `x` over `lanes` as a scalar."""
    return tl.sum(tl.where(lanes == i, x, 0), axis=0)


@triton.jit
def _assign_kernel(
    ids_ptr,
    keys_ptr,
    ages_ptr,
    clock_ptr,
    where_ptr,
    slots_ptr,
    table_ptr,
    counts_ptr,
    cpu_counts_ptr,
    gpu_rows_ptr,
    key_base,
    slots,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    SPLIT: tl.constexpr,
):
    j = tl.arange(0, K_PAD)
    chosen = j < K
    wanted = key_base + tl.load(ids_ptr + j, mask=chosen, other=0).to(tl.int32)
    held = tl.load(where_ptr + wanted, mask=chosen, other=-1)  # each chosen expert's slot, -1 for a miss
    hit = held >= 0
    tick = tl.load(clock_ptr)
    # A hit's tick is one more than the hits before it, in the order of the chosen experts
    hit_ages = tick + tl.cumsum(hit.to(tl.int32), axis=0)
    hits = tl.sum(hit.to(tl.int32), axis=0)
    found_bits = tl.sum(tl.where(hit, 1 << j, 0), axis=0)
    tl.store(ages_ptr + held, hit_ages, mask=hit)
    tl.store(slots_ptr + j, held, mask=hit)
    tl.store(table_ptr + 2 * j, -1, mask=chosen)
    tl.store(table_ptr + 2 * j + 1, -1, mask=chosen)
    if SPLIT:
        tl.store(gpu_rows_ptr + j, 1.0, mask=chosen)
    tick += hits
    on_gpu = K - hits  # misses the GPU copies: all, or with SPLIT those the CPU does not compute
    if SPLIT:
        on_gpu -= tl.load(cpu_counts_ptr + K - hits)
    copies = on_gpu
    s = tl.arange(0, BLOCK)
    if on_gpu > 0:  # the ages are read only for a miss: a layer whose experts are all cached touches K of them
        ages = tl.load(ages_ptr + s, mask=s < slots, other=2147483647)
        for i in tl.static_range(K):  # the hits' new ages from registers: the stores above need not show yet
            ages = tl.where(s == _lane(held, j, i), _lane(hit_ages, j, i), ages)
    else:
        ages = tl.zeros((BLOCK,), tl.int32)  # never read
    for i in tl.static_range(K):  # each miss in order: the oldest slot's, or with SPLIT past on_gpu the CPU's
        if ((found_bits >> i) & 1) == 0:
            if on_gpu > 0:
                victim = tl.argmin(ages, axis=0, tie_break_left=True)
                expert = tl.load(ids_ptr + i).to(tl.int32)
                tick += 1
                ages = tl.where(s == victim, tick, ages)
                # untouched by this call (the table has more slots than K), so memory holds the key it found
                evicted = tl.load(keys_ptr + victim)
                tl.store(where_ptr + evicted, -1, mask=evicted >= 0)
                tl.store(where_ptr + key_base + expert, victim)
                tl.store(keys_ptr + victim, key_base + expert)
                tl.store(ages_ptr + victim, tick)
                tl.store(slots_ptr + i, victim)
                tl.store(table_ptr + 2 * i, expert)
                tl.store(table_ptr + 2 * i + 1, victim)
            elif SPLIT:  # slot 0, never read, and no weight on the GPU
                tl.store(slots_ptr + i, 0)
                tl.store(gpu_rows_ptr + i, 0.0)
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
    where: torch.Tensor,
    slots: torch.Tensor,
    table: torch.Tensor,
    counts: torch.Tensor,
    cpu_counts: torch.Tensor | None = None,
    gpu_rows: torch.Tensor | None = None,
) -> None:
    if not assign_slots_capturable(keys):
        reference.assign_slots(ids, key_base, keys, ages, clock, where, slots, table, counts, cpu_counts, gpu_rows)
        return
    split = cpu_counts is not None
    block = triton.next_power_of_2(keys.numel())
    _assign_kernel[(1,)](
        ids,
        keys,
        ages,
        clock,
        where,
        slots,
        table,
        counts,
        cpu_counts if split else counts,
        gpu_rows if split else counts,
        key_base,
        keys.numel(),
        K=ids.numel(),
        K_PAD=triton.next_power_of_2(ids.numel()),
        BLOCK=block,
        SPLIT=split,
        num_warps=_warps(block),
    )


def _warps(block: int) -> int:
    """Warps for a table of `block` slots: more for bigger tables, whose misses each reduce the whole table."""
    return 4 if block <= 2048 else 8 if block <= 8192 else 16
