"""Forced routings (engine/experts/routing.py): what each mode draws, and that the model computes with it."""

from collections import OrderedDict

import pytest
import torch

from engine.experts.routing import MODES, ForcedRouting, force_routing


def lru_hit_rate(routing: ForcedRouting, steps: int, slots: int) -> float:
    """Hit rate of a per-layer LRU of `slots` experts over `steps` decode steps of layer 0."""
    cache, hits, looks = OrderedDict(), 0, 0
    for _ in range(steps):
        routing.advance()
        for expert in routing.step_ids[0].tolist():
            looks += 1
            if expert in cache:
                hits += 1
                cache.move_to_end(expert)
            else:
                cache[expert] = True
                if len(cache) > slots:
                    cache.popitem(last=False)
    return hits / looks


@pytest.mark.parametrize("mode", MODES)
def test_each_step_picks_k_distinct_experts_of_the_layer(mode):
    routing = ForcedRouting(mode, [0, 3, 5], num_experts=16, top_k=4, device="cpu", seed=1)
    for _ in range(20):
        routing.advance()
        for row in range(3):
            ids = routing.ids([0, 3, 5][row], 1)
            assert ids.shape == (1, 4) and len(set(ids[0].tolist())) == 4
            assert 0 <= int(ids.min()) and int(ids.max()) < 16


def test_uniform_routing_hits_an_lru_at_its_share_of_the_experts():
    routing = ForcedRouting("uniform", [0], num_experts=256, top_k=8, device="cpu", seed=2)
    assert lru_hit_rate(routing, 3000, 64) == pytest.approx(64 / 256, abs=0.02)


def test_the_locality_model_reproduces_the_published_lru_hit_rates():
    """512 experts, 10 active: an LRU of 64 hits ~67 %, of 128 ~81 %; a static top-32 covers ~10 %."""
    hits = {
        slots: lru_hit_rate(ForcedRouting("locality", [0], 512, 10, "cpu", seed=3), 3000, slots) for slots in (64, 128)
    }
    assert hits[64] == pytest.approx(0.67, abs=0.04) and hits[128] == pytest.approx(0.81, abs=0.04)
    routing = ForcedRouting("locality", [0], 512, 10, "cpu", seed=4)
    picks = []
    for _ in range(4000):
        routing.advance()
        picks += routing.step_ids[0].tolist()
    learned, later = torch.tensor(picks[: len(picks) // 2]), torch.tensor(picks[len(picks) // 2 :])
    hot = torch.bincount(learned, minlength=512).topk(32).indices
    assert torch.isin(later, hot).float().mean() < 0.15


def test_fixed_routing_repeats_one_draw():
    routing = ForcedRouting("fixed", [0, 1], 32, 4, "cpu", seed=5)
    first = routing.step_ids.clone()
    routing.advance()
    assert torch.equal(routing.step_ids, first)


def test_the_worst_case_chunks():
    routing = ForcedRouting("same", [0], 64, 8, "cpu", seed=6)
    same = routing.ids(0, 100)
    assert torch.equal(same, same[:1].expand(100, 8)) and len(set(same[0].tolist())) == 8
    routing.mode = "distinct"
    spread = routing.ids(0, 100)
    assert spread.unique().numel() == 64  # 800 picks over every expert
    assert all(len(set(row.tolist())) == 8 for row in spread)
    assert routing.ids(0, 3).unique().numel() == 24  # few tokens: all different


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="unknown routing mode 'skewed'"):
        ForcedRouting("skewed", [0], 8, 2, "cpu")


def test_the_model_computes_the_forced_experts(tmp_path):
    """A forced routing replaces the router's ids in every MoE layer, prefill and decode alike."""
    from engine import load_model
    from engine.testing.tiny_checkpoints import write_tiny_checkpoint

    model = load_model(write_tiny_checkpoint(tmp_path / "m", "qwen3_5_moe_text", "bf16"), "cpu", expert_cache_slots=32)
    routing = force_routing(model, "fixed", seed=7)
    seen = []
    executor_start = model.expert_executor.start

    def spy(bank, layer, x, ids, weights):
        seen.append((layer, ids.clone()))
        return executor_start(bank, layer, x, ids, weights)

    model.expert_executor.start = spy
    state = model.new_state(64)
    model.forward(list(range(10)), state)
    for _ in range(3):
        routing.advance()
        model.forward([5], state)
    moe_layers = [layer.index for layer in model.layers if hasattr(layer.mlp, "route")]
    prefill, decode = seen[: len(moe_layers)], seen[len(moe_layers) :]
    assert all(ids.shape == (10, 2) for _, ids in prefill)
    for layer, ids in decode:
        assert torch.equal(ids, routing.step_ids[routing.row[layer] : routing.row[layer] + 1])
    stats = model.expert_executor.stats()
    assert stats["expert_cache_hits"] > 0  # the same experts every step: cached after the first
