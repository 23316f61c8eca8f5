"""The Triton gather of expert records into cache slots against the reference, in Triton's CPU interpreter (CI;
conftest.py sets it) or on CUDA (pinned host records read in place)."""

import pytest
import torch

pytest.importorskip("triton", reason="Triton ships for Linux; the Windows app runs the reference kernels")

from engine.kernels import reference, triton_gather  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# one block; a ragged last block; more blocks than programs, so programs take several, of both records
@pytest.mark.parametrize(
    "record_bytes",
    [64, 4 * triton_gather.BLOCK + 12, 4 * triton_gather.BLOCK * (triton_gather.PROGRAMS // 2 + 3) + 8],
)
def test_gather_copies_the_listed_records_and_nothing_else(record_bytes):
    gen = torch.Generator().manual_seed(record_bytes)
    records = torch.randint(0, 256, (9, record_bytes), generator=gen, dtype=torch.uint8)
    if DEVICE == "cuda":
        records = records.pin_memory()
    pool = torch.randint(0, 256, (5, record_bytes), generator=gen, dtype=torch.uint8).to(DEVICE)
    expected = pool.clone()
    table = torch.tensor([[7, 3], [-1, 0], [2, 1], [-1, -1]], dtype=torch.int32, device=DEVICE)
    assert triton_gather.gather_records_capturable(records, pool)
    triton_gather.gather_records(records, pool, table)
    reference.gather_records(records.to(DEVICE), expected, table)
    assert torch.equal(pool, expected)
    assert torch.equal(pool[3].cpu(), records[7]) and torch.equal(pool[1].cpu(), records[2])


def test_records_it_cannot_read_in_place_go_to_the_reference():
    records = torch.randint(0, 256, (4, 6), dtype=torch.uint8)  # 6 bytes: not whole 32-bit words
    pool = torch.zeros(2, 6, dtype=torch.uint8, device=DEVICE)
    assert not triton_gather.gather_records_capturable(records, pool)
    triton_gather.gather_records(records, pool, torch.tensor([[3, 1]], dtype=torch.int32, device=DEVICE))
    assert torch.equal(pool[1].cpu(), records[3]) and not pool[0].any()


@pytest.mark.parametrize("listed", [[], [4], [0, 6, 2, 8, 1, 3, 5]])
def test_any_number_of_listed_records_share_the_programs(listed):
    """A layer's misses, none to seven of eight rows listed, in any rows: each listed record lands in its slot,
    whole, and nothing else changes."""
    record_bytes = 4 * triton_gather.BLOCK * 3 + 20  # blocks over several programs
    gen = torch.Generator().manual_seed(len(listed))
    records = torch.randint(0, 256, (9, record_bytes), generator=gen, dtype=torch.uint8)
    if DEVICE == "cuda":
        records = records.pin_memory()
    pool = torch.randint(0, 256, (8, record_bytes), generator=gen, dtype=torch.uint8).to(DEVICE)
    expected = pool.clone()
    rows = [[-1, -1]] * 8
    for slot, source in enumerate(listed):
        rows[(3 * slot + 1) % 8] = [source, 7 - slot]
    table = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    triton_gather.gather_records(records, pool, table)
    reference.gather_records(records.to(DEVICE), expected, table)
    assert torch.equal(pool, expected)
    for slot, source in enumerate(listed):
        assert torch.equal(pool[7 - slot].cpu(), records[source])
