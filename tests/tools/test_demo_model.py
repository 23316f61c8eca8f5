"""The built-in demo model really answers: arithmetic through our engine, small talk, and the same
replies through transformers."""

import multiprocessing
import random
import sys
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch
from locations import ROOT
from reference import transformers_greedy, transformers_model

import engine
from engine.resources import DEMO_MODEL
from engine.runtime.sampling import SamplingParams
from engine.runtime.session import ChatSession
from engine.runtime.tokenizer import ChatTokenizer

sys.path.insert(0, str(ROOT))
from tools.demo_data import is_correct, sample_problems  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=200)
TRAINED, HELD_OUT = 200, 50  # problems drawn from the trained range, and from the 2 % held out of training


def _session():
    return ChatSession(
        engine.load_model(DEMO_MODEL), ChatTokenizer.from_folder(DEMO_MODEL), context_tokens=1024, sampling=GREEDY
    )


def _reply(session, text):
    session.reset()
    final = list(session.send(text))[-1]
    return final.answer


def _solve(problems):
    """Greedy answers to `problems` in a fresh process (the evaluation runs on both cores)."""
    torch.set_num_threads(1)
    session = _session()
    return [is_correct(_reply(session, f"What is {a} {op} {b}?"), a, b, op) for a, b, op in problems]


def _rate(problems):
    halves = [problems[0::2], problems[1::2]]
    # spawned, not forked: the test process runs Qt and thread-pool threads that a fork would copy mid-call
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = [r for part in pool.map(_solve, halves) for r in part]
    return sum(results) / len(results)


@pytest.fixture(scope="module")
def session():
    return _session()


def test_arithmetic_is_exactly_right(capsys):
    rng = random.Random(2026)
    trained = _rate(sample_problems(rng, TRAINED, held_out=False))
    held_out = _rate(sample_problems(rng, HELD_OUT, held_out=True))
    with capsys.disabled():
        print(
            f"\ndemo model, greedy through the engine: {trained:.1%} of {TRAINED} problems in 0-999 exactly right, "
            f"{held_out:.1%} of {HELD_OUT} held out of training"
        )
    assert trained >= 0.95
    assert held_out >= 0.90


def test_greeting_and_identity(session):
    assert any(word in _reply(session, "Hello!") for word in ("Hello", "Hi"))
    identity = _reply(session, "Who are you?")
    assert "demo model" in identity and "MoE Desk" in identity and "Models page" in identity


def test_same_replies_through_transformers(session):
    reference = transformers_model(DEMO_MODEL)
    tokenizer = session.tokenizer
    for text in ("What is 457 + 386?", "What is 38 - 905?", "Hi", "Who are you?"):
        prompt = tokenizer.encode(tokenizer.render([{"role": "user", "content": text}]))
        state = session.model.new_state()
        logits = session.model.forward(prompt, state)
        ours = []
        while len(ours) < 150:
            ours.append(int(logits.argmax()))
            if ours[-1] in tokenizer.eos_token_ids:
                break
            logits = session.model.forward([ours[-1]], state)
        assert transformers_greedy(reference, torch.tensor(prompt), len(ours)) == ours, text
