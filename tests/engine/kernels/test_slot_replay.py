"""The expert cache's one replacement rule (engine/kernels/slot_table.py), replayed over a long run of lookups
with repeats and locality by: the cache's host path (ExpertCache.fetch, records copied into the pool), the
device's kernel (triton_slots, in Triton's CPU interpreter or on CUDA), the reference (reference.assign_slots), a
textbook LRU written here, and one cache whose lookups switch at random between the host and the kernel working
on its one table. Slot contents and hits and misses must agree at every step, kernel and reference tensor by
tensor, and the reverse index `where` the kernel keeps must be the one the keys give."""

import random
from collections import OrderedDict

import pytest
import torch

pytest.importorskip("triton", reason="Triton ships for Linux; the Windows app runs the reference kernels")

from engine.checkpoint.formats import DENSE, StoredWeight  # noqa: E402
from engine.experts.cache import ExpertCache  # noqa: E402
from engine.experts.packed import pack_banks  # noqa: E402
from engine.kernels import reference, triton_slots  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAYERS, EXPERTS, TOP_K, SLOTS = 3, 16, 4, 22  # 48 keys through 22 slots: hits, misses and evictions all day


class Bank:
    """A bank of dense experts whose every weight holds 100 * layer + expert, so a slot's record names its key."""

    def __init__(self, layer):
        self.num_experts, self.intermediate = EXPERTS, 2

        def full(e, rows, cols):
            return StoredWeight(DENSE, {"weight": torch.full((rows, cols), 100.0 * layer + e)}, (rows, cols), "w")

        self.weights = [(full(e, 2, 3), full(e, 2, 3), full(e, 3, 2)) for e in range(EXPERTS)]

    def stored(self, expert):
        return self.weights[expert]


class TextbookLru:
    """LRU as a textbook has it: an ordered map of key -> slot, least recently used first. A call's hits are
    used first, so its misses cannot evict them; a miss takes the lowest free slot, else the oldest entry's."""

    def __init__(self, slots):
        self.order: OrderedDict[int, int] = OrderedDict()
        self.free = list(range(slots))
        self.hits = self.misses = 0

    def lookup(self, keys):
        for key in keys:
            if key in self.order:
                self.order.move_to_end(key)
                self.hits += 1
        for key in keys:
            if key not in self.order:
                slot = self.free.pop(0) if self.free else self.order.popitem(last=False)[1]
                self.order[key] = slot
                self.misses += 1
        return [self.order[key] for key in keys]

    def contents(self):
        keys = [-1] * (len(self.free) + len(self.order))
        for key, slot in self.order.items():
            keys[slot] = key
        return keys


def lookups(seed, count):
    """(layer, distinct experts) of `count` decode-like calls, layers in turn: each layer mostly draws from a
    small hot set that drifts, sometimes from all its experts, so keys repeat, stay a while and go."""
    rng = random.Random(seed)
    hot = [rng.sample(range(EXPERTS), 6) for _ in range(LAYERS)]
    for call in range(count):
        layer = call % LAYERS
        if rng.random() < 0.2:  # the hot set drifts: one expert leaves, another comes
            hot[layer][rng.randrange(6)] = rng.randrange(EXPERTS)
        chosen = []
        while len(chosen) < TOP_K:
            expert = rng.choice(hot[layer]) if rng.random() < 0.8 else rng.randrange(EXPERTS)
            if expert not in chosen:
                chosen.append(expert)
        yield layer, chosen


def new_cache(device="cpu"):
    packed, _ = pack_banks({layer: Bank(layer) for layer in range(LAYERS)}, None, pin=False)
    first = packed[0]
    return ExpertCache(device, SLOTS, first.layout, first.records.shape[0], LAYERS), packed


def new_table(device):
    """An empty slot table as kernels.assign_slots takes it, on `device`."""
    return {
        "keys": torch.full((SLOTS,), -1, dtype=torch.int32, device=device),
        "ages": torch.full((SLOTS,), -1, dtype=torch.int32, device=device),
        "clock": torch.full((1,), -1, dtype=torch.int32, device=device),
        "where": torch.full((LAYERS * EXPERTS,), -1, dtype=torch.int32, device=device),
        "counts": torch.zeros(2, dtype=torch.int64, device=device),
    }


def kernel_lookup(table, layer, experts, device, assign=triton_slots.assign_slots):
    """One token's lookup by the device's kernel (or `assign`) on `table`: slots and copy table."""
    slots = torch.zeros(TOP_K, dtype=torch.int32, device=device)
    copies = torch.zeros(TOP_K, 2, dtype=torch.int32, device=device)
    ids = torch.tensor(experts, device=device)
    keys, ages, clock, where, counts = (table[name] for name in ("keys", "ages", "clock", "where", "counts"))
    assign(ids, layer * EXPERTS, keys, ages, clock, where, slots, copies, counts)
    return slots.tolist(), copies


def indexed(keys):
    """The reverse index the keys [S] give: each key's slot, -1 for keys no slot holds."""
    where = [-1] * (LAYERS * EXPERTS)
    for slot, key in enumerate(keys.tolist()):
        if key >= 0:
            where[key] = slot
    return where


def records_in_pool(cache, slots):
    """The key the record in each of `slots` is of, from the bytes in the pool (the bank's values name them); only
    filled slots: the others hold whatever the allocation did, NaN at times."""
    values = cache.weights["down"].tensors["weight"][:, 0, 0].tolist()
    return [int(values[s]) // 100 * EXPERTS + int(values[s]) % 100 for s in slots]


def test_host_path_kernel_and_textbook_lru_agree_at_every_step():
    host, packed = new_cache()
    kernel, theirs = new_table(DEVICE), new_table("cpu")
    textbook = TextbookLru(SLOTS)
    for step, (layer, experts) in enumerate(lookups(seed=5, count=300)):
        keys = [layer * EXPERTS + e for e in experts]
        host_slots = host.fetch(layer, experts, packed[layer])
        kernel_slots, kernel_copies = kernel_lookup(kernel, layer, experts, DEVICE)
        reference_slots, reference_copies = kernel_lookup(theirs, layer, experts, "cpu", reference.assign_slots)
        expected = textbook.lookup(keys)
        assert host_slots == kernel_slots == reference_slots == expected, step
        assert torch.equal(kernel_copies.cpu(), reference_copies), step
        for name in theirs:
            assert torch.equal(kernel[name].cpu(), theirs[name]), (step, name)
        assert kernel["where"].tolist() == indexed(kernel["keys"]), step
        contents = textbook.contents()
        assert host.table.keys.tolist() == kernel["keys"].tolist() == contents, step
        assert host.table.ages.tolist() == kernel["ages"].tolist(), step  # one rule, the same ticks
        assert (host.hits, host.misses) == tuple(kernel["counts"].tolist()) == (textbook.hits, textbook.misses)
        held = [slot for slot, key in enumerate(contents) if key >= 0]
        assert records_in_pool(host, held) == [contents[s] for s in held], step
    assert textbook.hits > 600 and textbook.misses > 200 and not textbook.free  # every kind of step happened


def test_one_table_shared_by_host_lookups_and_the_kernel_agrees_with_the_textbook():
    """Decode steps choosing on the device and host lookups between them update one table: the host reads what
    the kernel wrote (no bookkeeping of its own) and the kernel what the host wrote."""
    cache, packed = new_cache(DEVICE)  # the kernel works on the table where the cache is
    textbook = TextbookLru(SLOTS)
    rng = random.Random(7)
    on_device = 0
    for step, (layer, experts) in enumerate(lookups(seed=6, count=300)):
        keys = [layer * EXPERTS + e for e in experts]
        if rng.random() < 0.5:
            on_device += 1
            table = cache.device_table(TOP_K)
            assert table["where"].tolist() == indexed(table["keys"]), step  # rebuilt after the host's lookups
            slots, copies = kernel_lookup(table, layer, experts, DEVICE)
            assert table["where"].tolist() == indexed(table["keys"]), step  # kept by the kernel
            reference.gather_records(packed[layer].records, cache.pool, copies)
        else:
            slots = cache.fetch(layer, experts, packed[layer])
        assert slots == textbook.lookup(keys), step
        stats = cache.stats()
        assert (stats["expert_cache_hits"], stats["expert_cache_misses"]) == (textbook.hits, textbook.misses), step
        contents = textbook.contents()
        for other in range(LAYERS):  # what the host sees is what the kernel left
            held = [e for e in range(EXPERTS) if other * EXPERTS + e in contents]
            assert cache.missing(other, list(range(EXPERTS))) == [e for e in range(EXPERTS) if e not in held], step
        held = [slot for slot, key in enumerate(contents) if key >= 0]
        assert records_in_pool(cache, held) == [contents[s] for s in held], step
    assert 100 < on_device < 200 and textbook.misses > 200
