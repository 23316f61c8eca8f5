"""The device's LRU slot choice (engine/kernels/triton_slots.py) against the reference, in Triton's CPU
interpreter (CI; conftest.py sets it) or on CUDA: a run of tokens over several layers through a table smaller
than their experts, so hits, free slots and evictions all happen; every output and the table must match, and the
reverse index `where` must be the keys' after every token."""

import pytest
import torch

pytest.importorskip("triton", reason="Triton ships for Linux; the Windows app runs the reference kernels")

from engine.kernels import reference, triton_slots  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _table(slots, keys):
    return {
        "keys": torch.full((slots,), -1, dtype=torch.int32),
        "ages": torch.full((slots,), -1, dtype=torch.int32),
        "clock": torch.tensor([-1], dtype=torch.int32),
        "where": torch.full((keys,), -1, dtype=torch.int32),
        "counts": torch.zeros(2, dtype=torch.int64),
    }


def indexed(keys, size):
    """The reverse index of `keys` [S]: each key's slot, -1 for keys no slot holds."""
    where = [-1] * size
    for slot, key in enumerate(keys.tolist()):
        if key >= 0:
            where[key] = slot
    return where


def _lookup(assign, ids, key_base, table, outputs, split=()):
    """One token's lookup by `assign` (the kernel's or the reference's) on `table`, into `outputs`."""
    slots, copies, *gpu_rows = outputs
    keys, ages, clock, where, counts = (table[name] for name in ("keys", "ages", "clock", "where", "counts"))
    assign(ids, key_base, keys, ages, clock, where, slots, copies, counts, *split, *gpu_rows)


@pytest.mark.parametrize("slots, top_k", [(9, 4), (13, 4), (9, 3)])  # 9: evictions; 3 lookups: K padded to 4
def test_slot_choice_matches_the_reference(slots, top_k):
    gen = torch.Generator().manual_seed(slots + top_k)
    experts, layers = 6, 2
    mine = {name: t.to(DEVICE) for name, t in _table(slots, layers * experts).items()}
    theirs = _table(slots, layers * experts)
    for step in range(12):
        for layer in range(layers):
            ids = torch.randperm(experts, generator=gen)[:top_k]
            got_slots, got_copies = (
                torch.zeros(top_k, dtype=torch.int32, device=DEVICE),
                torch.zeros(top_k, 2, dtype=torch.int32, device=DEVICE),
            )
            slots_ref, copies_ref = torch.zeros(top_k, dtype=torch.int32), torch.zeros(top_k, 2, dtype=torch.int32)
            _lookup(triton_slots.assign_slots, ids.to(DEVICE), layer * experts, mine, (got_slots, got_copies))
            _lookup(reference.assign_slots, ids, layer * experts, theirs, (slots_ref, copies_ref))
            assert torch.equal(got_slots.cpu(), slots_ref) and torch.equal(got_copies.cpu(), copies_ref)
            for name in theirs:
                assert torch.equal(mine[name].cpu(), theirs[name]), name
            assert mine["where"].tolist() == indexed(mine["keys"], layers * experts), step
            # every chosen expert is in its slot now, and the copy table lists exactly the misses
            assert torch.equal(theirs["keys"][slots_ref.long()], (ids + layer * experts).to(torch.int32))
            listed = copies_ref[copies_ref[:, 0] >= 0]
            assert len(set(listed[:, 1].tolist())) == len(listed)
    hits, misses = theirs["counts"].tolist()
    assert hits > 0 and misses > 0 and hits + misses == 12 * layers * top_k


@pytest.mark.parametrize("cpu_counts", [[0, 1, 1, 2, 2], [0, 1, 2, 3, 4]])  # hybrid's about half, cpu's all
def test_the_cpus_misses_take_no_slot_and_match_the_reference(cpu_counts):
    """With a CPU share, the last cpu_counts[m] of m misses take no slot, no copy and no lookup, and get no
    weight on the GPU; hits and the GPU's misses are as without it."""
    gen = torch.Generator().manual_seed(len(cpu_counts) + sum(cpu_counts))
    experts, top_k, slots = 6, 4, 9
    counts_table = torch.tensor(cpu_counts, dtype=torch.int32)
    mine = {name: t.to(DEVICE) for name, t in _table(slots, experts).items()}
    theirs = _table(slots, experts)
    on_cpu_seen = 0
    for step in range(12):
        ids = torch.randperm(experts, generator=gen)[:top_k]
        outputs = {
            side: (
                torch.zeros(top_k, dtype=torch.int32, device=d),
                torch.zeros(top_k, 2, dtype=torch.int32, device=d),
                torch.full((top_k,), -1.0, device=d),
            )
            for side, d in (("mine", DEVICE), ("theirs", "cpu"))
        }
        cached = [bool((theirs["keys"] == int(e)).any()) for e in ids]
        _lookup(triton_slots.assign_slots, ids.to(DEVICE), 0, mine, outputs["mine"], (counts_table.to(DEVICE),))
        _lookup(reference.assign_slots, ids, 0, theirs, outputs["theirs"], (counts_table,))
        for got, expected in zip(outputs["mine"], outputs["theirs"]):
            assert torch.equal(got.cpu(), expected)
        for name in theirs:
            assert torch.equal(mine[name].cpu(), theirs[name]), name
        assert mine["where"].tolist() == indexed(mine["keys"], experts), step
        slots_ref, copies_ref, gpu_rows = outputs["theirs"]
        misses = [j for j in range(top_k) if not cached[j]]
        cpu = misses[len(misses) - cpu_counts[len(misses)] :] if cpu_counts[len(misses)] else []
        assert gpu_rows.tolist() == [0.0 if j in cpu else 1.0 for j in range(top_k)]
        assert all(int(copies_ref[j, 0]) == -1 and int(slots_ref[j]) == 0 for j in cpu)
        assert not any(bool((theirs["keys"] == int(ids[j])).any()) for j in cpu)  # not cached by the CPU's compute
        on_cpu_seen += len(cpu)
    hits, copies = theirs["counts"].tolist()
    assert on_cpu_seen > 0 and hits + copies + on_cpu_seen == 12 * top_k
