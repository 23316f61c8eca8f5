"""Feeding a prompt in chunks of any sizes gives the same logits as one pass; state limits are honoured."""

import pytest
import torch

import engine

PATTERNS = [
    [1] * 12 + [138],  # token by token, then the rest
    [3] * 10 + [120],
    [64, 64, 22],  # exactly on GDN chunk boundaries
    [50, 30, 70],  # chunks that straddle the 64-token GDN chunk boundary
    [63, 2, 85],
    [150],
]
TOLERANCE = 1e-4  # relative; the same float32 math in a different order


def _ids(n=150):
    return torch.randint(2, 320, (n,), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module", params=[("qwen3_5_moe", "nvfp4"), ("qwen3_moe", "bf16")], ids=lambda p: "-".join(p))
def model(request, tiny_checkpoint):
    # unquantised KV: an FP8 cache measures its scales on the first chunk, so chunkings differ by its rounding
    return engine.load_model(tiny_checkpoint(*request.param), kv_cache_dtype="bf16")


@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda p: "+".join(map(str, p[:4])))
@pytest.mark.parametrize("max_tokens", [None, 200])
def test_chunked_prefill_equals_one_pass(model, pattern, max_tokens):
    ids = _ids()
    expected = model.score(ids)
    state = model.new_state(max_tokens=max_tokens)
    start = 0
    for size in pattern:
        last = model.forward(ids[start : start + size], state)
        start += size
        # every chunk's last logits equal the one-pass logits at that position
        assert float((last - expected[start - 1]).abs().max() / expected.abs().max()) <= TOLERANCE
    assert state.position == len(ids)


def test_overflow_is_refused_before_any_state_changes(model):
    state = model.new_state(max_tokens=40)
    model.forward(_ids(30), state)
    snapshot = state.clone()
    with pytest.raises(engine.ContextOverflowError, match="needs 50 tokens .* at most 40"):
        model.forward(_ids(20), state)
    assert state.position == 30
    # the state still continues exactly as if the refused chunk had never been offered
    assert torch.equal(model.forward(_ids(5), state), model.forward(_ids(5), snapshot))


def test_clone_is_independent(model):
    ids = _ids(40)
    state = model.new_state()
    model.forward(ids[:30], state)
    copy = state.clone()
    first = model.forward(ids[30:], state)
    assert torch.equal(model.forward(ids[30:], copy), first)


def test_bad_token_ids_are_refused(model):
    with pytest.raises(ValueError, match="token ids must lie in 0..319"):
        model.score([5, 320])
    with pytest.raises(ValueError, match="no tokens"):
        model.forward([], model.new_state())
