"""Chats resume without a prefill: turn states in the prefix cache, its disk tier across restarts, and files
on disk that are damaged, foreign or over the budget."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import engine
from engine.resources import DEMO_MODEL
from engine.runtime.events import TurnFinished
from engine.runtime.prefix_cache import CachedPrefix, PrefixCache
from engine.runtime.sampling import SamplingParams
from engine.runtime.session import ChatSession
from engine.runtime.state_files import SUFFIX, StateFolder
from engine.runtime.tokenizer import ChatTokenizer

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=160)  # replies end (eos): a cut one renders anew
QUESTIONS = ["What is 12 + 30?", "And 45 + 11?"]
MIB = 2**20


@pytest.fixture(scope="module")
def model():
    return engine.load_model(DEMO_MODEL)


@pytest.fixture(scope="module")
def tokenizer():
    return ChatTokenizer.from_folder(DEMO_MODEL)


def _session(model, tokenizer, store=None):
    return ChatSession(model, tokenizer, context_tokens=2048, sampling=GREEDY, state_store=store)


def _turn(session, text):
    before = session.prefilled_tokens_total
    final = [e for e in session.send(text) if isinstance(e, TurnFinished)][-1]
    assert final.stats.error is None
    return final, session.prefilled_tokens_total - before


def _chat(session, questions):
    """Run `questions` as turns of one chat; the history as the app stores it."""
    history = []
    for q in questions:
        final, _ = _turn(session, q)
        assert final.stats.stop_reason == "eos"
        history += [
            {"role": "user", "content": q},
            {"role": "assistant", "content": final.answer, "reasoning_content": final.reasoning},
        ]
    return history


@pytest.fixture(scope="module")
def live(model, tokenizer):
    """A chat that never left: QUESTIONS[0], then QUESTIONS[1] (its prefill and reply are what a resumed chat
    must match), and the store's size after the first turn."""
    store = PrefixCache(256 * MIB)
    session = _session(model, tokenizer, store)
    history = _chat(session, QUESTIONS[:1])
    one_chat = store.nbytes
    final, prefilled = _turn(session, QUESTIONS[1])
    return {"history": history, "final": final, "prefilled": prefilled, "one_chat_bytes": one_chat}


def _same_as_live(live, resumed, prefilled):
    assert resumed.stats.cached_tokens > 0
    assert prefilled == live["prefilled"]
    assert (resumed.answer, resumed.reasoning) == (live["final"].answer, live["final"].reasoning)


def test_returning_to_a_chat_prefills_only_the_new_message(model, tokenizer, live):
    """Chat A, then chat B in the same session, then A again: A's next turn loads A's state from the store,
    prefills what a session that never left prefills, and gives the same reply."""
    session = _session(model, tokenizer, PrefixCache(256 * MIB))
    history = _chat(session, QUESTIONS[:1])
    assert history == live["history"]
    session.reset()
    _chat(session, ["Hello!"])
    session.reset(history)
    _same_as_live(live, *_turn(session, QUESTIONS[1]))


def test_a_chat_resumes_from_disk_after_a_restart(model, tokenizer, live, tmp_path):
    """The store is flushed at close; a new store on the same folder (a restarted app) resumes the chat."""
    store = PrefixCache(256 * MIB, StateFolder(tmp_path, "demo", 512 * MIB))
    _chat(_session(model, tokenizer, store), QUESTIONS[:1])
    store.flush()
    assert len(list(tmp_path.glob("*" + SUFFIX))) == 1  # only the entry that ends the chat, not its prefixes

    session = _session(model, tokenizer, PrefixCache(256 * MIB, StateFolder(tmp_path, "demo", 512 * MIB)))
    session.reset(live["history"])
    _same_as_live(live, *_turn(session, QUESTIONS[1]))


def test_an_entry_evicted_from_ram_is_written_to_disk(model, tokenizer, live, tmp_path):
    """A RAM budget that holds one chat: the first chat's state is spilled to disk when the second evicts it,
    and returning to the first reads it back."""
    folder = StateFolder(tmp_path, "demo", 512 * MIB)
    session = _session(model, tokenizer, PrefixCache(int(live["one_chat_bytes"] * 1.5), folder))
    _chat(session, QUESTIONS[:1])
    session.reset()
    _chat(session, ["Hello!"])
    folder.wait()
    assert len(folder) == 1
    session.reset(live["history"])
    _same_as_live(live, *_turn(session, QUESTIONS[1]))


def _entry(model, tokenizer, text):
    state = model.new_state(256)
    ids = tokenizer.encode(text)
    logits = model.forward(ids, state)
    return CachedPrefix(tuple(ids), state.host_copy(), logits.float())


def test_a_state_read_back_from_disk_is_the_state_written(model, tokenizer, tmp_path):
    folder = StateFolder(tmp_path, "demo", 64 * MIB)
    entry = _entry(model, tokenizer, "What is 12 + 30?")
    folder.write(entry)
    folder.wait()
    again = StateFolder(tmp_path, "demo", 64 * MIB).read(entry.ids)
    assert again.ids == entry.ids and again.state.position == entry.state.position
    for a, b in zip(again.state.tensors, entry.state.tensors, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert torch.equal(again.logits, entry.logits)


def test_another_models_files_are_never_read(model, tokenizer, tmp_path):
    entry = _entry(model, tokenizer, "What is 12 + 30?")
    folder = StateFolder(tmp_path, "demo", 64 * MIB)
    folder.write(entry)
    folder.wait()
    other = StateFolder(tmp_path, "another model", 64 * MIB)
    assert other.longest_prefix(entry.ids) is None and other.read(entry.ids) is None


def test_a_damaged_file_is_a_miss_and_is_removed(model, tokenizer, tmp_path):
    entry = _entry(model, tokenizer, "What is 12 + 30?")
    folder = StateFolder(tmp_path, "demo", 64 * MIB)
    folder.write(entry)
    folder.wait()
    (path,) = tmp_path.glob("*" + SUFFIX)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # cut short, as a crash or a full disk might leave it
    store = PrefixCache(64 * MIB, StateFolder(tmp_path, "demo", 64 * MIB))
    assert store.longest_prefix(entry.ids) is None
    assert not path.exists()


def test_a_hostile_header_is_refused(model, tokenizer, tmp_path):
    """A file with this fingerprint whose layers name a kind the engine does not have (or whose ids do not match
    its length) is refused and removed; nothing in it is run."""
    entry = _entry(model, tokenizer, "Hi")
    for layers, position in ((json.dumps([{"kind": "os.system", "fields": {}}]), len(entry.ids)), ("[]", 999)):
        path = tmp_path / f"hostile{SUFFIX}"
        meta = {
            "format": "moedesk-state-1",
            "fingerprint": "demo",
            "ids": json.dumps(list(entry.ids)),
            "position": str(position),
            "layers": layers,
        }
        save_file({"logits": entry.logits}, str(path), metadata=meta)
        folder = StateFolder(tmp_path, "demo", 64 * MIB)
        assert folder.longest_prefix(entry.ids) == entry.ids
        assert folder.read(entry.ids) is None and not path.exists()


def test_the_folder_keeps_within_its_budget_dropping_the_least_recently_used(model, tokenizer, tmp_path):
    entries = [_entry(model, tokenizer, text) for text in ("one two", "three four five", "six seven")]
    size = max(sum(t.numel() * t.element_size() for t in [*e.state.tensors, e.logits]) for e in entries)
    folder = StateFolder(tmp_path, "demo", int(size * 2.5))
    for entry in entries:
        folder.write(entry)
        folder.wait()
    held = [folder.longest_prefix(e.ids) == e.ids for e in entries]
    assert held == [False, True, True]
    assert sum(p.stat().st_size for p in tmp_path.glob("*" + SUFFIX)) <= int(size * 2.5)


def test_a_saved_state_the_model_cannot_hold_is_prefilled_instead(model, tokenizer, live, tmp_path):
    """A file whose header is right but whose tensors have the wrong shapes fails to load: the turn prefills
    the whole history and answers as the chat that never left (greedy, one prefill against two)."""
    store = PrefixCache(256 * MIB, StateFolder(tmp_path, "demo", 512 * MIB))
    _chat(_session(model, tokenizer, store), QUESTIONS[:1])
    store.flush()
    (path,) = tmp_path.glob("*" + SUFFIX)
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
    name = next(n for n in tensors if n.endswith(".recurrent"))
    tensors[name] = torch.zeros(1, 1, 1)
    save_file(tensors, str(path), metadata=meta)

    session = _session(model, tokenizer, PrefixCache(256 * MIB, StateFolder(tmp_path, "demo", 512 * MIB)))
    session.reset(live["history"])
    resumed, prefilled = _turn(session, QUESTIONS[1])
    assert resumed.stats.cached_tokens == 0 and prefilled == resumed.stats.prompt_tokens > live["prefilled"]
    assert resumed.answer == live["final"].answer
