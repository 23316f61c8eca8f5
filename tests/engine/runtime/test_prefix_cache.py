"""The prefix cache: host copies of states that survive the state running other sequences, longest-prefix
lookup, LRU by bytes, and a 20-request agent conversation that prefills only what is new each time."""

import pytest
import torch

import engine
from engine.resources import DEMO_MODEL
from engine.runtime.events import TurnFinished
from engine.runtime.prefix_cache import PrefixCache
from engine.runtime.sampling import SamplingParams
from engine.runtime.session import ChatSession
from engine.runtime.prompt import chat_prompt
from engine.runtime.tokenizer import ChatTokenizer

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)  # short replies: the tests run on a shared CPU
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two whole numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


@pytest.fixture(scope="module")
def model():
    return engine.load_model(DEMO_MODEL)


@pytest.fixture(scope="module")
def tokenizer():
    return ChatTokenizer.from_folder(DEMO_MODEL)


def _logits(model, state, ids):
    return model.forward(ids, state)


def test_a_host_copy_stays_valid_after_the_state_runs_another_sequence(model, tokenizer):
    first, other, rest = tokenizer.encode("What is 12 + 30?"), tokenizer.encode("hello there"), tokenizer.encode(" ok")
    state = model.new_state(256)
    model.forward(first, state)
    saved = state.host_copy()
    state.load(model.new_state(0).host_copy())  # back to empty, then another sequence overwrites the KV rows
    model.forward(other + other, state)
    state.load(saved)
    assert state.position == len(first)
    restored = model.forward(rest, state)
    fresh = model.forward(first + rest, model.new_state(256))
    torch.testing.assert_close(restored, fresh, atol=2e-2, rtol=0)  # bf16, one chunk against two
    assert int(restored.argmax()) == int(fresh.argmax())


def _entry_state(model, ids):
    state = model.new_state(64)
    logits = model.forward(ids, state)
    return state, logits


def test_longest_prefix_wins_and_least_recently_used_goes_first(model):
    short, long, other = [5, 6], [5, 6, 7, 8], [9, 10, 11]
    states = {tuple(k): _entry_state(model, k) for k in (short, long, other)}
    size = max(s.host_copy().nbytes for s, _ in states.values()) + 4 * model.config.vocab_size
    cache = PrefixCache(2 * size)
    assert cache.store(short, *states[tuple(short)]) and cache.store(long, *states[tuple(long)])
    assert cache.longest_prefix([5, 6, 7, 8, 1]).ids == tuple(long)
    assert cache.longest_prefix([5, 6, 1]).ids == tuple(short)  # now the most recently used
    assert cache.longest_prefix([9, 10]) is None  # an entry longer than the ids is no prefix of them
    cache.store(other, *states[tuple(other)])  # a third does not fit: `long`, used least recently, goes
    assert len(cache) == 2 and not cache.contains(long) and cache.contains(short) and cache.contains(other)
    assert cache.nbytes <= cache.max_bytes


def test_an_entry_larger_than_the_cache_is_not_stored(model):
    state, logits = _entry_state(model, [5, 6, 7])
    cache = PrefixCache(state.host_copy().nbytes // 2)
    assert cache.store([5, 6, 7], state, logits) is None
    assert len(cache) == 0 and cache.nbytes == 0
    with pytest.raises(ValueError, match="0 or more bytes"):
        PrefixCache(-1)


def _run(session, messages, cache):
    prompt = chat_prompt(session.tokenizer, messages, tools=[CALCULATOR])
    before = session.prefilled_tokens_total
    final = [e for e in session.complete(prompt, sampling=GREEDY, prefix_cache=cache) if isinstance(e, TurnFinished)]
    assert final[-1].stats.error is None
    return prompt, final[-1], session.prefilled_tokens_total - before


def test_a_request_from_the_cache_answers_as_a_fresh_one(model, tokenizer):
    """The second request restores the first one's state (its prompt, then its reply) and replies exactly as a
    session without the cache does, which prefills it all."""
    cache = PrefixCache(64 * 2**20)
    session = ChatSession(model, tokenizer, context_tokens=1024, sampling=GREEDY)
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    _, first, _ = _run(session, messages, cache)
    messages += [
        {"role": "assistant", "content": first.answer, "reasoning_content": first.reasoning},
        {"role": "user", "content": "What is 45 + 11?"},
    ]
    prompt, cached, prefilled = _run(session, messages, cache)
    _, fresh, fresh_prefilled = _run(
        ChatSession(model, tokenizer, context_tokens=1024, sampling=GREEDY), messages, None
    )
    assert cached.stats.cached_tokens > 0 and prefilled < fresh_prefilled == len(prompt.ids)
    assert (cached.answer, cached.reasoning) == (fresh.answer, fresh.reasoning)


def test_an_agent_conversation_prefills_only_its_new_tokens(model, tokenizer, capsys):
    """20 requests, each resending the whole conversation: tool calls and results after every reply, a new user
    question every fifth request. Each request restores at least the longest save point of the requests before
    it that it shares (the previous request's whole prompt; after a new user turn, whose arrival makes this
    template drop the reasoning of the replies since the last one, the messages before those replies) and
    prefills only the rest: the new messages plus the template's re-render of the replies."""
    session = ChatSession(model, tokenizer, context_tokens=4096, sampling=GREEDY)
    cache = PrefixCache(256 * 2**20)
    messages = [
        {"role": "system", "content": "You are a careful assistant with a calculator."},
        {"role": "user", "content": "What is 12 + 30?"},
    ]
    previous, saved = None, []  # the last request's prompt; every request's save points, as token-id prefixes
    rows, total_prompt, total_prefilled = [], 0, 0
    for request in range(20):
        prompt, final, prefilled = _run(session, messages, cache)
        stats = final.stats
        assert stats.prompt_tokens == len(prompt.ids)
        assert stats.prefill_tokens == prefilled == len(prompt.ids) - stats.cached_tokens
        if previous is not None:
            shared = [len(ids) for ids in saved if prompt.ids[: len(ids)] == ids]
            assert shared, "each request extends the conversation of the ones before"
            assert stats.cached_tokens >= max(shared)
            if request % 5 != 0:  # no new user turn: everything up to the previous request's reply is reused
                assert stats.cached_tokens >= len(previous.ids)
        saved += [prompt.ids] + [prompt.ids[:p] for p in prompt.save_at]
        rows.append((request, len(prompt.ids), stats.cached_tokens, prefilled))
        total_prompt += len(prompt.ids)
        total_prefilled += prefilled
        previous = prompt
        call = {
            "type": "function",
            "id": f"call_{request}",
            "function": {"name": "multiply", "arguments": {"a": request + 2, "b": 3}},
        }
        messages.append(
            {"role": "assistant", "content": final.answer, "reasoning_content": final.reasoning, "tool_calls": [call]}
        )
        messages.append({"role": "tool", "tool_call_id": f"call_{request}", "content": str((request + 2) * 3)})
        if request % 5 == 4:
            messages.append({"role": "user", "content": f"What is {request} + 100?"})
    assert rows[-1][1] > 1200  # the conversation really grew
    assert total_prefilled < total_prompt / 3
    with capsys.disabled():
        print(f"\nagent conversation, 20 requests: {total_prompt} prompt tokens, {total_prefilled} prefilled")
        for request, tokens, cached, prefilled in rows:
            print(f"  request {request + 1:2}: prompt {tokens:5}, cached {cached:5}, prefilled {prefilled:4}")


def test_a_chat_turn_after_a_whole_request_starts_a_fresh_conversation(model, tokenizer):
    session = ChatSession(model, tokenizer, context_tokens=1024, sampling=GREEDY)
    _run(session, [{"role": "user", "content": "What is 12 + 30?"}], PrefixCache(16 * 2**20))
    final = list(session.send("hello"))[-1]
    alone = chat_prompt(tokenizer, [{"role": "user", "content": "hello"}])
    assert final.stats.prompt_tokens == final.stats.prefill_tokens == len(alone.ids)
    assert session.messages[0] == {"role": "user", "content": "hello"}


def test_entries_of_one_conversation_share_their_kv_rows(model):
    """A state restored from an entry and grown is stored with only its new KV rows copied: the cache counts the
    shared rows once, and the longer entry still restores exactly once the shorter one is evicted."""
    short, longer = [5, 6, 7, 8], [5, 6, 7, 8, 9, 10, 11]
    state, logits = _entry_state(model, short)
    cache = PrefixCache(64 * 2**20)
    first = cache.store(short, state, logits)
    state.load(first.state)
    grown = model.forward(longer[len(short) :], state)
    second = cache.store(longer, state, grown, after=first)
    alone = second.state.nbytes + 4 * model.config.vocab_size
    kv_rows = sum(
        t.numel() * t.element_size() for layer in first.state.layers if hasattr(layer, "keys") for t in layer.tensors
    )
    assert kv_rows > 0 and cache.nbytes == alone + first.state.nbytes - kv_rows + 4 * model.config.vocab_size
    assert cache.store(longer, state, grown, after=first) is second  # held already: not copied again
    other_state, other_logits = _entry_state(model, [9, 10, 11])
    other_alone = other_state.host_copy().nbytes + 4 * model.config.vocab_size
    cache.max_bytes = alone + other_alone  # the shorter entry, used least recently, goes; the rows it shared stay
    cache.store([9, 10, 11], other_state, other_logits)
    assert not cache.contains(short) and cache.contains(longer) and cache.contains([9, 10, 11])
    assert cache.nbytes == alone + other_alone
    restored = model.new_state(64)
    restored.load(cache.longest_prefix(longer + [12]).state)
    assert restored.position == len(longer)
    torch.testing.assert_close(
        model.forward([12], restored), model.forward(longer + [12], model.new_state(64)), atol=2e-2, rtol=0
    )
    with pytest.raises(ValueError, match="begin its own"):
        cache.store([1, 2, 3, 4, 5], state, grown, after=first)
