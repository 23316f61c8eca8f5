"""The emulated narrow link on the GPU (engine/experts/link.py): copies held on their own stream take their bytes
over the limit (not less, and not much more), eagerly and replayed inside a CUDA graph, where the hold counts
each replay's records from the device table."""

import pytest
import torch

from engine.experts.link import LinkLimit, LinkThrottle
from engine.kernels import gather_records

LIMIT = 5e9  # well below any H200 link (40-55 GB/s)
SLACK = 1.15  # a hold ends within this factor of its time (launch and timer granularity)


def _elapsed(run) -> float:
    """Seconds of GPU time `run()` queues on the current stream."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    run()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def test_a_held_copy_takes_its_bytes_over_the_limit_and_still_copies():
    source = torch.randint(0, 256, (64 * 2**20,), dtype=torch.uint8).pin_memory()
    target = torch.zeros_like(source, device="cuda")
    link = LinkThrottle(LinkLimit(LIMIT), "cuda")

    def copy():
        link.start()
        target.copy_(source, non_blocking=True)
        link.hold(source.numel())

    copy()  # compiles the kernels
    seconds = _elapsed(copy)
    assert source.numel() / LIMIT <= seconds <= SLACK * source.numel() / LIMIT
    assert torch.equal(target.cpu(), source)


@pytest.mark.parametrize("misses", [1, 3, 8])
def test_a_captured_gather_is_held_for_each_replays_own_misses(misses):
    record_bytes = 2 * 2**20
    records = torch.randint(0, 256, (16, record_bytes), dtype=torch.uint8).pin_memory()
    pool = torch.zeros(8, record_bytes, dtype=torch.uint8, device="cuda")
    table = torch.full((8, 2), -1, dtype=torch.int32, device="cuda")
    link = LinkThrottle(LinkLimit(LIMIT), "cuda")

    def step():
        link.start()
        gather_records(records, pool, table)
        link.hold_records(table, record_bytes)

    step()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    rows = torch.tensor([[2 * r + 1, r] for r in range(misses)], dtype=torch.int32)
    table.fill_(-1)
    table[:misses].copy_(rows)
    seconds = _elapsed(graph.replay)
    assert misses * record_bytes / LIMIT <= seconds <= SLACK * misses * record_bytes / LIMIT
    assert all(torch.equal(pool[r].cpu(), records[2 * r + 1]) for r in range(misses))
