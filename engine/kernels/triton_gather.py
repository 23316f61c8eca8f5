"""A decode step's expert misses copied into their cache slots by one Triton kernel reading page-locked host
memory directly (CUDA maps pinned host memory into the GPU's address space), instead of one cudaMemcpyAsync
per miss (Triton takes a pinned CPU tensor as a kernel argument on purpose: triton-lang/triton pull request
1197): issuing eight copies a layer from Python took about as long as the copies themselves (H200: 10.7 ms
of host time in a 19.6 ms step), and the kernel, captured in the step's graph, reads which records go where
from a device table, so the host writes one small table a layer. Measured on the H200: 7 records of 1.77 MB
in 250 us (49.6 GB/s), the same as 7 copies (245 us). Its programs share out the listed records' blocks,
so a layer with one miss reads as much at once as one with eight.

Same contract as reference.gather_records: for each row r of table [n, 2] with table[r, 0] >= 0,
pool[table[r, 1]] = records[table[r, 0]]; rows with -1 copy nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import reference

BLOCK = 4096  # 32-bit words a program moves at a time: 16 KiB in flight each
# Programs of a call, shared by all its records: one miss keeps as many reads in flight over the link as eight
# (a program per record block starved the shared expert, which runs beside the copies, of multiprocessors)
PROGRAMS = 64


@triton.jit
def _gather_kernel(records_ptr, pool_ptr, table_ptr, rows, words, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.arange(0, ROWS)
    listed = (tl.load(table_ptr + 2 * r, mask=r < rows, other=-1) >= 0).to(tl.int32)
    order = tl.cumsum(listed, axis=0) - 1  # a listed row's place among the listed rows
    blocks = tl.cdiv(words, BLOCK)
    # the listed records' blocks, one after another, dealt out to the programs in turn
    for item in range(tl.program_id(0), tl.sum(listed, axis=0) * blocks, tl.num_programs(0)):
        row = tl.min(tl.where((listed > 0) & (order == item // blocks), r, ROWS), axis=0)
        source = tl.load(table_ptr + 2 * row).to(tl.int64)
        target = tl.load(table_ptr + 2 * row + 1).to(tl.int64)
        offsets = (item % blocks) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < words
        values = tl.load(records_ptr + source * words + offsets, mask=inside)
        tl.store(pool_ptr + target * words + offsets, values, mask=inside)


def gather_records_capturable(records: torch.Tensor, pool: torch.Tensor) -> bool:
    """Whether the kernel reads these records in place: pinned host memory (or device memory), whole 32-bit words."""
    return (
        (records.is_pinned() or records.device == pool.device)
        and records.shape[1] == pool.shape[1]
        and records.shape[1] % 4 == 0
        and records.is_contiguous()
        and pool.is_contiguous()
    )


def gather_records(records: torch.Tensor, pool: torch.Tensor, table: torch.Tensor) -> None:
    if not gather_records_capturable(records, pool):
        reference.gather_records(records, pool, table)
        return
    words, rows = records.shape[1] // 4, table.shape[0]
    programs = min(PROGRAMS, max(1, rows) * triton.cdiv(words, BLOCK))
    _gather_kernel[(programs,)](
        records.view(torch.int32),
        pool.view(torch.int32),
        table,
        rows,
        words,
        ROWS=triton.next_power_of_2(max(1, rows)),
        BLOCK=BLOCK,
        num_warps=4,
    )
