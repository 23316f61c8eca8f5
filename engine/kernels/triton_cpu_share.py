"""The GPU's side of the CPU share's mailbox (engine/kernels/cpu_share.py): kernels that write the CPU's work to
page-locked host memory and spin until its sum is back, so a decode step with a CPU share stays one CUDA graph.
Host memory is read and written in place (CUDA maps pinned memory into the GPU's address space, as
triton_gather reads it); the flags go through system-scope atomics, so the CPU sees the data before the request
and the GPU the sum after the done flag. Measured on the H200: 16 us a round trip (post, a Python thread's
answer, wait and an 8 KB read) inside a graph.

Same contracts as reference.post_cpu_share and reference.wait_cpu_share.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # hidden values moved per iteration


@triton.jit
def _post_kernel(
    ids_ptr,
    weights_ptr,
    gpu_rows_ptr,
    y_ptr,
    base_ptr,
    ordinal,
    box_ids_ptr,
    box_weights_ptr,
    box_x_ptr,
    flags_ptr,
    hidden,
    K: tl.constexpr,
    K_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    j = tl.arange(0, K_BLOCK)
    inside = j < K
    on_cpu = (tl.load(gpu_rows_ptr + j, mask=inside, other=1.0) == 0.0) & inside
    ids = tl.load(ids_ptr + j, mask=inside, other=-1).to(tl.int32)
    tl.store(box_ids_ptr + j, tl.where(on_cpu, ids, -1), mask=inside)
    tl.store(box_weights_ptr + j, tl.load(weights_ptr + j, mask=inside, other=0.0).to(tl.float32), mask=inside)
    if tl.sum(on_cpu.to(tl.int32), axis=0) > 0:
        for start in range(0, hidden, BLOCK):
            h = start + tl.arange(0, BLOCK)
            tl.store(box_x_ptr + h, tl.load(y_ptr + h, mask=h < hidden).to(tl.float32), mask=h < hidden)
    tl.debug_barrier()  # every thread's writes, then the request (a release at system scope orders them first)
    tl.atomic_xchg(flags_ptr, tl.load(base_ptr) + ordinal, sem="release", scope="sys")


@triton.jit
def _wait_kernel(
    gpu_rows_ptr,
    base_ptr,
    ordinal,
    flags_ptr,
    box_out_ptr,
    routed_ptr,
    waits_ptr,
    hidden,
    K: tl.constexpr,
    K_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    sequence = tl.load(base_ptr) + ordinal
    done = tl.atomic_add(flags_ptr + 1, 0, sem="acquire", scope="sys")
    cancelled = tl.load(flags_ptr + 2, volatile=True)
    polls = 0
    while (done < sequence) & (cancelled == 0):
        done = tl.atomic_add(flags_ptr + 1, 0, sem="acquire", scope="sys")
        cancelled = tl.load(flags_ptr + 2, volatile=True)
        polls += 1
    j = tl.arange(0, K_BLOCK)
    on_cpu = (tl.load(gpu_rows_ptr + j, mask=j < K, other=1.0) == 0.0) & (j < K)
    any_cpu = tl.sum(on_cpu.to(tl.int32), axis=0) > 0
    tl.atomic_add(waits_ptr, (any_cpu & (polls > 0)).to(tl.int32))
    tl.atomic_add(waits_ptr + 1, any_cpu.to(tl.int32))
    if any_cpu:
        for start in range(0, hidden, BLOCK):
            h = start + tl.arange(0, BLOCK)
            # .cv: fetched again each time, never a cached copy of the last layer's sum
            tl.store(routed_ptr + h, tl.load(box_out_ptr + h, mask=h < hidden, cache_modifier=".cv"), mask=h < hidden)
    else:
        for start in range(0, hidden, BLOCK):
            h = start + tl.arange(0, BLOCK)
            tl.store(routed_ptr + h, tl.zeros([BLOCK], tl.float32), mask=h < hidden)


def post_cpu_share(
    ids: torch.Tensor,
    weights: torch.Tensor,
    gpu_rows: torch.Tensor,
    y: torch.Tensor,
    sequence_base: torch.Tensor,
    ordinal: int,
    mailbox,
) -> None:
    k = gpu_rows.numel()
    _post_kernel[(1,)](
        ids,
        weights,
        gpu_rows,
        y,
        sequence_base,
        ordinal,
        mailbox.ids,
        mailbox.weights,
        mailbox.x,
        mailbox.flags,
        y.numel(),
        K=k,
        K_BLOCK=triton.next_power_of_2(k),
        BLOCK=BLOCK,
        num_warps=4,
    )


def wait_cpu_share(
    gpu_rows: torch.Tensor,
    sequence_base: torch.Tensor,
    ordinal: int,
    mailbox,
    cpu_routed: torch.Tensor,
    waits: torch.Tensor,
) -> None:
    k = gpu_rows.numel()
    _wait_kernel[(1,)](
        gpu_rows,
        sequence_base,
        ordinal,
        mailbox.flags,
        mailbox.out,
        cpu_routed,
        waits,
        cpu_routed.numel(),
        K=k,
        K_BLOCK=triton.next_power_of_2(k),
        BLOCK=BLOCK,
        num_warps=4,
    )
