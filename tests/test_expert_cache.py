"""The expert cache: LRU slots filled from the host bank; the cached path computes what the reference does."""

import pytest
import torch

import engine
from engine.checkpoint.formats import DENSE, StoredWeight
from engine.experts.cache import ExpertCache


class Bank:
    """A bank of experts made of one dense tensor each, recording which experts were read."""

    def __init__(self, experts=4, shape=(2, 3)):
        self.weights = [StoredWeight(DENSE, {"weight": torch.full(shape, float(e))}, shape, f"e{e}")
                        for e in range(experts)]
        self.reads = []

    def stored(self, expert):
        self.reads.append(expert)
        return (self.weights[expert],)


def test_least_recently_used_expert_is_evicted():
    cache, bank = ExpertCache("cpu", slots=2), Bank()
    for expert in (0, 1, 0, 2):  # 0 was used after 1, so 1 goes when 2 arrives
        cache.get(0, expert, bank)
    assert cache.holds(0, 0) and cache.holds(0, 2) and not cache.holds(0, 1)
    assert bank.reads == [0, 1, 2] and (cache.hits, cache.misses) == (1, 3)
    (weight,) = cache.get(0, 2, bank)
    assert torch.equal(weight.tensors["weight"], torch.full((2, 3), 2.0))
    assert cache.bytes_copied == 3 * 2 * 3 * 4 and cache.nbytes == 2 * 2 * 3 * 4  # memory stays at two slots
    assert cache.stats()["expert_cache_hit_rate"] == pytest.approx(2 / 5)


def test_layers_are_separate_keys():
    cache, bank = ExpertCache("cpu", slots=4), Bank()
    cache.get(0, 1, bank)
    cache.get(1, 1, bank)
    assert cache.misses == 2 and cache.holds(0, 1) and cache.holds(1, 1)


def test_an_expert_of_another_shape_is_refused():
    cache = ExpertCache("cpu", slots=1)
    cache.get(0, 0, Bank(shape=(2, 3)))
    with pytest.raises(ValueError, match="must share one shape and format"):
        cache.get(0, 1, Bank(shape=(3, 3)))


def test_no_slots_is_refused():
    with pytest.raises(ValueError, match="at least one slot"):
        ExpertCache("cpu", slots=0)


@pytest.mark.parametrize("layout", [("qwen3_5_moe", "nvfp4", False), ("qwen3_5_moe", "bf16", True),
                                    ("qwen3_moe", "fp8_block", False)], ids=lambda l: "-".join(map(str, l)))
@pytest.mark.parametrize("layers_of_slots", [0.5, 1, 2])
def test_cached_path_equals_the_reference(tiny_checkpoint, layout, layers_of_slots):
    folder = tiny_checkpoint(*layout)
    ids = torch.randint(2, 320, (90,), generator=torch.Generator().manual_seed(3))
    reference = engine.load_model(folder).score(ids)
    slots = int(8 * layers_of_slots)  # the tiny models have 8 experts a layer
    model = engine.load_model(folder, expert_cache_slots=slots)
    assert torch.allclose(model.score(ids), reference, rtol=0, atol=1e-5 * float(reference.abs().max()))
    stats = model.expert_executor.stats()
    assert stats["expert_cache_misses"] + stats["expert_cache_hits"] == stats["expert_calls"]
    assert stats["expert_cache_misses"] >= min(slots, stats["expert_calls"])


def test_a_cache_big_enough_for_every_expert_copies_each_once(tiny_checkpoint):
    folder = tiny_checkpoint("qwen3_5_moe", "nvfp4")
    model = engine.load_model(folder, expert_cache_slots=4 * 8)  # every expert of all 4 layers
    ids = torch.randint(2, 320, (90,), generator=torch.Generator().manual_seed(4))
    model.score(ids)
    first = model.expert_executor.stats()
    model.score(ids)
    second = model.expert_executor.stats()
    assert second["expert_cache_misses"] == first["expert_cache_misses"]  # the second pass only hits
    assert second["expert_cache_hits"] - first["expert_cache_hits"] == first["expert_calls"]
    expert_bytes = sum(w.nbytes for w in model.layers[0].mlp.experts.stored(0))
    assert first["expert_bytes_copied"] == first["expert_cache_misses"] * expert_bytes
