"""The expert cache and the cached executor: LRU slots and whole-layer blocks filled from packed host
records; the cached path computes what the reference does."""

import pytest
import torch

import engine
from engine import kernels
from engine.checkpoint.formats import DENSE, StoredWeight
from engine.experts.cache import ExpertCache
from engine.experts.packed import pack_banks
from engine.kernels.record_layout import RecordLayout


class Bank:
    """A bank of dense experts whose every weight holds its expert's number."""

    def __init__(self, experts=4, hidden=3, intermediate=2):
        self.num_experts, self.intermediate = experts, intermediate

        def full(e, rows, cols):
            return StoredWeight(DENSE, {"weight": torch.full((rows, cols), float(e))}, (rows, cols), f"e{e}")

        self.weights = [
            (full(e, intermediate, hidden), full(e, intermediate, hidden), full(e, hidden, intermediate))
            for e in range(experts)
        ]

    def stored(self, expert):
        return self.weights[expert]


def packed_layers(layers=2, experts=4):
    packed, report = pack_banks({layer: Bank(experts) for layer in range(layers)}, None, pin=False)
    return packed, report


def cache_for(packed, slots):
    first = packed[0]
    return ExpertCache("cpu", slots, first.layout, first.records.shape[0], max(packed) + 1)


def expert_in_slot(cache, slot):
    return float(cache.weights["down"].tensors["weight"][slot, 0, 0])


def test_records_round_trip_every_tensor():
    packed, report = packed_layers()
    views = packed[1].layout.view(packed[1].records)
    assert views["gate_up"].shape == (4, 4, 3) and views["down"].shape == (4, 3, 2)
    for e in range(4):
        gate_up = views["gate_up"].select(e).dequantize()
        assert torch.equal(gate_up, torch.full((4, 3), float(e)))
    assert report == {"pinned_expert_bytes": 0, "pageable_expert_bytes": 2 * packed[0].nbytes, "pin_budget_bytes": None}
    assert packed[0].layout.record_bytes % 64 == 0


def test_least_recently_used_expert_is_evicted():
    packed, _ = packed_layers()
    cache = cache_for(packed, slots=2)
    for expert in (0, 1, 0, 2):  # 0 was used after 1, so 1 goes when 2 arrives
        (slot,) = cache.fetch(0, [expert], packed[0])
        assert expert_in_slot(cache, slot) == expert
    assert cache.missing(0, [0, 1, 2]) == [1]
    assert (cache.hits, cache.misses) == (1, 3)
    assert cache.bytes_copied == 3 * packed[0].layout.record_bytes
    assert cache.nbytes == 2 * packed[0].layout.record_bytes  # memory stays at two slots
    assert cache.stats()["expert_cache_hit_rate"] == pytest.approx(1 / 4)


def test_hits_in_a_fetch_are_not_evicted_by_its_misses():
    packed, _ = packed_layers()
    cache = cache_for(packed, slots=2)
    cache.fetch(0, [0], packed[0])
    cache.fetch(0, [1], packed[0])
    slots = cache.fetch(0, [2, 0], packed[0])  # 0 is the oldest, but it is asked for too
    assert [expert_in_slot(cache, s) for s in slots] == [2, 0]


def test_layers_are_separate_keys():
    packed, _ = packed_layers()
    cache = cache_for(packed, slots=4)
    cache.fetch(0, [1], packed[0])
    cache.fetch(1, [1], packed[1])
    assert cache.misses == 2 and cache.missing(0, [1]) == cache.missing(1, [1]) == []


def test_a_whole_layer_streams_into_the_least_recently_used_block():
    packed, _ = packed_layers(layers=3)
    cache = cache_for(packed, slots=8)  # two blocks of four
    assert cache.blocks == 2
    base0 = cache.stream_layer(0, packed[0])
    base1 = cache.stream_layer(1, packed[1])
    assert {base0, base1} == {0, 4} and cache.misses == 8
    assert cache.stream_layer(0, packed[0]) == base0 and cache.hits == 4  # held whole: no copy
    assert cache.stream_layer(2, packed[2]) == base1  # layer 1 was used longest ago
    assert cache.missing(1, [0]) == [0] and cache.missing(2, list(range(4))) == []
    assert cache.bytes_copied == 3 * 4 * packed[0].layout.record_bytes


def test_kept_layers_stay_while_the_others_take_turns():
    """Prefill visits the layers in order every chunk: with kept layers only the others are copied again."""
    packed, _ = packed_layers(layers=5)
    cache = cache_for(packed, slots=16)  # four blocks of four: two kept, two taking turns
    cache.keep_when_streaming([0, 1])
    record = packed[0].layout.record_bytes
    for chunk in range(3):
        for layer in range(5):
            cache.stream_layer(layer, packed[layer])
        assert cache.bytes_copied == (5 + 3 * chunk) * 4 * record  # after the first chunk: layers 2, 3 and 4
    assert cache.missing(0, list(range(4))) == [] and cache.missing(1, list(range(4))) == []
    assert cache.hits == 2 * 2 * 4 and cache.misses == (5 + 3 + 3) * 4


def test_without_kept_layers_each_chunk_copies_every_layer_again():
    packed, _ = packed_layers(layers=5)
    cache = cache_for(packed, slots=16)
    for _ in range(2):
        for layer in range(5):
            cache.stream_layer(layer, packed[layer])
    assert cache.hits == 0 and cache.bytes_copied == 10 * 4 * packed[0].layout.record_bytes


def test_keeping_more_layers_than_leave_turn_blocks_is_refused():
    packed, _ = packed_layers(layers=5)
    cache = cache_for(packed, slots=16)
    with pytest.raises(ValueError, match="room for 2"):
        cache.keep_when_streaming([0, 1, 2])


def test_streaming_a_layer_drops_its_single_expert_copies():
    packed, _ = packed_layers(layers=2)
    cache = cache_for(packed, slots=9)  # two blocks and one slot beyond them
    (single,) = cache.fetch(1, [3], packed[1])
    base = cache.stream_layer(1, packed[1])
    assert cache.fetch(1, [3], packed[1]) == [base + 3]
    assert expert_in_slot(cache, base + 3) == 3
    assert cache.stream_layer(0, packed[0]) != base  # the freed slot did not break block bookkeeping


def test_a_decode_steps_lookups_on_the_device_make_their_block_the_recent_one():
    """Blocks are read off the one slot table, so a hit the device's kernel made counts as the host's would."""
    packed, _ = packed_layers(layers=3)
    cache = cache_for(packed, slots=8)  # two blocks of four
    base0, base1 = cache.stream_layer(0, packed[0]), cache.stream_layer(1, packed[1])
    table = cache.device_table(lookups=1)
    layer0, layer1, absent = [*range(base0, base0 + 4)], [*range(base1, base1 + 4)], [-1] * 4  # where's entries
    assert table["where"].tolist() == [*layer0, *layer1, *absent]
    slots, copies = torch.zeros(1, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32)
    kernels.assign_slots(
        torch.tensor([2]),
        0,
        table["keys"],
        table["ages"],
        table["clock"],
        table["where"],
        slots,
        copies,
        table["counts"],
    )
    assert int(slots[0]) == base0 + 2 and copies.tolist() == [[-1, -1]]  # layer 0's expert 2: a hit
    assert cache.stream_layer(2, packed[2]) == base1  # layer 0 was used last, by the device
    assert cache.missing(0, [0, 1, 2, 3]) == [] and cache.missing(1, [0]) == [0]
    # the host's stream went to the table: the next device table's index has it
    assert cache.device_table()["where"].tolist() == [*layer0, *absent, *layer1]
    stats = cache.stats()
    assert (stats["expert_cache_hits"], stats["expert_cache_misses"]) == (1, 12)


def test_a_prefetch_is_not_counted_until_used():
    packed, _ = packed_layers()
    cache = cache_for(packed, slots=8)
    cache.stream_layer(1, packed[1], count_as_lookups=False)
    assert (cache.hits, cache.misses) == (0, 0) and cache.bytes_copied == packed[1].nbytes
    cache.stream_layer(1, packed[1])
    assert (cache.hits, cache.misses) == (0, 4) and cache.bytes_copied == packed[1].nbytes  # copied for this use
    cache.stream_layer(1, packed[1])
    assert (cache.hits, cache.misses) == (4, 4)


def test_an_expert_of_another_shape_is_refused():
    one = Bank(hidden=3).stored(0)
    layout = RecordLayout.of({"gate_up": one[0], "down": one[2]})
    other = Bank(hidden=4).stored(0)
    with pytest.raises(ValueError, match="must share one shape and format"):
        layout.write(torch.empty(layout.record_bytes, dtype=torch.uint8), {"gate_up": other[0], "down": other[2]})


def test_no_slots_is_refused():
    packed, _ = packed_layers()
    with pytest.raises(ValueError, match="at least one slot"):
        cache_for(packed, slots=0)


@pytest.mark.parametrize(
    "layout",
    [
        ("qwen3_5_moe", "nvfp4", False),
        ("qwen3_5_moe", "bf16", True),
        ("qwen3_moe", "fp8_block", False),
        ("qwen3_5_moe", "nvfp4_ct", False),
    ],
    ids=lambda case: "-".join(map(str, case)),
)
@pytest.mark.parametrize("layers_of_slots", [0.5, 1, 2, 3])
def test_cached_path_equals_the_reference(tiny_checkpoint, layout, layers_of_slots):
    """Prefill chunks (whole layers streamed when a block exists, rounds of fetches when not) and decode
    steps (single-expert fetches) give the reference's logits."""
    folder = tiny_checkpoint(*layout)
    ids = torch.randint(2, 320, (90,), generator=torch.Generator().manual_seed(3))
    reference_model = engine.load_model(folder)
    slots = int(8 * layers_of_slots)  # the tiny models have 8 experts a layer
    model = engine.load_model(folder, expert_cache_slots=slots)
    assert torch.allclose(
        model.score(ids), reference_model.score(ids), rtol=0, atol=1e-5 * float(reference_model.score(ids).abs().max())
    )
    states = reference_model.new_state(100), model.new_state(100)
    for chunk in (ids[:40], ids[40:41], ids[41:42], ids[42:45]):
        expected, got = (m.forward(chunk, s) for m, s in zip((reference_model, model), states))
        assert torch.allclose(got, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
    stats = model.expert_executor.stats()
    record = model.expert_executor.cache.layout.record_bytes
    assert stats["expert_cache_misses"] >= 8  # every layer's experts came in at least once
    assert stats["expert_bytes_copied"] >= stats["expert_cache_misses"] * record  # prefetches copy uncounted
    assert stats["expert_cache_slots"] == slots and stats["expert_cache_bytes"] == slots * record


def test_a_cache_big_enough_for_every_expert_copies_each_once(tiny_checkpoint):
    folder = tiny_checkpoint("qwen3_5_moe", "nvfp4")
    model = engine.load_model(folder, expert_cache_slots=4 * 8)  # every expert of all 4 layers
    ids = torch.randint(2, 320, (90,), generator=torch.Generator().manual_seed(4))
    model.score(ids)
    first = model.expert_executor.stats()
    model.score(ids)
    second = model.expert_executor.stats()
    assert second["expert_cache_misses"] == first["expert_cache_misses"]  # the second pass only hits
    assert second["expert_bytes_copied"] == first["expert_bytes_copied"]
    record = model.expert_executor.cache.layout.record_bytes
    assert first["expert_bytes_copied"] == 4 * 8 * record  # each layer streamed once, as one block


def test_a_cache_short_of_every_layer_keeps_its_first_layers_between_chunks(tiny_checkpoint):
    """Three blocks for four layers: layer 0 stays, layers 1-3 take turns in two blocks, so a second pass over
    the prompt copies three layers, not four."""
    folder = tiny_checkpoint("qwen3_5_moe", "nvfp4")
    model = engine.load_model(folder, expert_cache_slots=3 * 8)
    ids = torch.randint(2, 320, (90,), generator=torch.Generator().manual_seed(5))
    model.score(ids)
    first = model.expert_executor.stats()
    model.score(ids)
    second = model.expert_executor.stats()
    record = model.expert_executor.cache.layout.record_bytes
    assert first["expert_bytes_copied"] == 4 * 8 * record
    assert second["expert_bytes_copied"] - first["expert_bytes_copied"] == 3 * 8 * record
    assert second["expert_cache_hits"] - first["expert_cache_hits"] == 8
    assert second["expert_cache_kept_layers"] == 1
