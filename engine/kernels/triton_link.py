"""The CUDA side of an emulated narrow link (engine/experts/link.py): one kernel writes the GPU's global timer
(nanoseconds) to a mark, another spins one warp until the mark plus a hold, so the stream they run on (the
expert cache's copy stream, or a captured decode step's gather) goes on no earlier than a slower link would
let it. The gather's hold counts the records its copy table names on the device, so a CUDA graph replays it
with each step's own misses."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

TABLE_BLOCK = 16  # rows of a copy table read at once (a token's top-k misses: 8 for Qwen3.5/3.6)


@triton.jit
def _mark_kernel(mark_ptr):
    tl.store(mark_ptr, globaltimer())


@triton.jit(do_not_specialize=["ns", "ns_per_record"])
def _hold_kernel(mark_ptr, table_ptr, rows, ns, ns_per_record, COUNT: tl.constexpr, BLOCK: tl.constexpr):
    hold = ns.to(tl.int64)
    if COUNT:  # the records the table copies: rows whose source is not -1
        for first in range(0, rows, BLOCK):
            r = first + tl.arange(0, BLOCK)
            sources = tl.load(table_ptr + 2 * r, mask=r < rows, other=-1)
            hold += tl.sum((sources >= 0).to(tl.int64), axis=0) * ns_per_record
    deadline = tl.load(mark_ptr) + hold
    now = globaltimer()
    while now < deadline:
        now = globaltimer()


def mark_time(mark: torch.Tensor) -> None:
    _mark_kernel[(1,)](mark, num_warps=1)


def hold_after(mark: torch.Tensor, ns: int) -> None:
    _hold_kernel[(1,)](mark, mark, 0, ns, 0, COUNT=False, BLOCK=TABLE_BLOCK, num_warps=1)


def hold_for_records(mark: torch.Tensor, table: torch.Tensor, ns_per_record: int) -> None:
    _hold_kernel[(1,)](mark, table, table.shape[0], 0, ns_per_record, COUNT=True, BLOCK=TABLE_BLOCK, num_warps=1)
