"""Chat sessions: streaming events, reasoning split, stop strings, cancel, multi-turn reuse, rollback."""

import pytest
import torch
from scripted_model import ScriptedModel

import engine
from engine.runtime.events import AnswerDelta, ReasoningDelta, TurnFinished
from engine.runtime.sampling import SamplingParams
from engine.runtime.session import ChatSession
from engine.runtime.tokenizer import ChatTokenizer

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=64)
SHORT = SamplingParams(temperature=0.0, max_new_tokens=6)  # replies of the real tiny model: short, to stay fast
REPLY = "<think>\nLet me think: 你好 😀\n</think>\n\nAnswer: 答案 🎉 done."


@pytest.fixture(scope="module")
def folder(tiny_checkpoint):
    return tiny_checkpoint("qwen3_5_moe", "bf16")


@pytest.fixture(scope="module")
def tokenizer(folder):
    return ChatTokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def model(folder):
    return engine.load_model(folder)


def scripted(tokenizer, text=REPLY, delay=0.0, **kwargs):
    script = tokenizer.encode(text) + [min(tokenizer.eos_token_ids)]
    model = ScriptedModel(320, script, delay)
    return model, ChatSession(
        model,
        tokenizer,
        context_tokens=kwargs.pop("context_tokens", 4096),
        sampling=kwargs.pop("sampling", GREEDY),
        **kwargs,
    )


def split(events):
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    answer = "".join(e.text for e in events if isinstance(e, AnswerDelta))
    return reasoning, answer, events[-1]


def test_reasoning_is_streamed_apart_from_the_answer(tokenizer):
    _, session = scripted(tokenizer)
    events = list(session.send("Hi"))
    reasoning, answer, final = split(events)
    assert isinstance(final, TurnFinished) and final.stats.stop_reason == "eos"
    assert reasoning == "Let me think: 你好 😀\n" and final.reasoning == "Let me think: 你好 😀"
    assert answer == "Answer: 答案 🎉 done." == final.answer
    # characters split over several byte-level tokens arrive whole, never as replacement characters
    assert all("\ufffd" not in e.text for e in events[:-1])
    assert len([e for e in events if isinstance(e, AnswerDelta)]) > 3  # streamed, not one blob
    assert session.messages[-1] == {"role": "assistant", "content": final.answer, "reasoning_content": final.reasoning}


def test_thinking_off_puts_an_empty_think_block_in_the_prompt(tokenizer):
    model, session = scripted(tokenizer, text="Plain answer.", enable_thinking=False)
    reasoning, answer, final = split(list(session.send("Hi")))
    assert reasoning == "" and answer == "Plain answer."
    assert tokenizer.decode(model.fed[0]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    model, session = scripted(tokenizer, text="Plain answer.", enable_thinking=True)
    reasoning, answer, final = split(list(session.send("Hi")))
    assert tokenizer.decode(model.fed[0]).endswith("<|im_start|>assistant\n<think>\n")
    assert reasoning == "Plain answer." and answer == ""  # no </think> came: all of it was thinking


def test_stop_string_ends_the_reply_without_showing_it(tokenizer):
    _, session = scripted(tokenizer, sampling=SamplingParams(temperature=0.0, stop=("答案",)))
    reasoning, answer, final = split(list(session.send("Hi")))
    assert final.stats.stop_reason == "stop"
    assert answer == "Answer: " and "答" not in answer


def test_length_limit(tokenizer):
    _, session = scripted(tokenizer, sampling=SamplingParams(temperature=0.0, max_new_tokens=5))
    final = list(session.send("Hi"))[-1]
    assert final.stats.stop_reason == "length" and final.stats.new_tokens == 5


def test_system_prompt_is_rendered_first(tokenizer):
    model, session = scripted(tokenizer, system_prompt="Be brief.")
    list(session.send("Hi"))
    assert tokenizer.decode(model.fed[0]).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi")


def test_second_turn_prefills_only_its_new_tokens(tokenizer):
    model, session = scripted(tokenizer)
    first = list(session.send("Hi"))[-1]
    fed_before = session.prefilled_tokens_total
    second = list(session.send("And then?"))[-1]
    assert second.stats.prefill_tokens == session.prefilled_tokens_total - fed_before
    expected_suffix = tokenizer.encode(
        "<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    assert second.stats.prefill_tokens == len(expected_suffix)
    prompt_forward = next(ids for ids in reversed(model.fed) if len(ids) > 1)
    assert prompt_forward == expected_suffix
    assert second.stats.prompt_tokens == first.stats.prompt_tokens + first.stats.new_tokens + len(expected_suffix) - 1


def test_context_overflow_is_refused_before_running(tokenizer):
    model, session = scripted(tokenizer, context_tokens=30)
    final = list(session.send("word " * 40))[-1]
    assert final.stats.stop_reason == "error"
    assert "needs" in final.stats.error and "at most 30" in final.stats.error
    assert model.fed == [] and session.messages == []  # nothing ran, nothing recorded


def test_cancel_during_decode_stops_at_the_next_step(tokenizer):
    model, session = scripted(
        tokenizer, text="word " * 200, sampling=SamplingParams(temperature=0.0, max_new_tokens=400)
    )
    forwards = []
    forward = model.forward
    model.forward = lambda *args, **kwargs: forwards.append(1) or forward(*args, **kwargs)
    events = session.send("Hi")
    for _ in range(5):
        next(events)  # decoding has started
    session.cancel()
    at_cancel = len(forwards)
    final = list(events)[-1]
    assert final.stats.stop_reason == "cancelled" and 0 < final.stats.new_tokens < 400
    assert len(forwards) - at_cancel <= 1  # at most the step already under way
    # the partial reply is kept and the conversation goes on from it
    assert session.messages[-1]["role"] == "assistant"
    assert list(session.send("More", SHORT))[-1].stats.stop_reason == "length"


def test_cancel_during_prefill_undoes_the_turn(model, tokenizer, monkeypatch):
    session = ChatSession(model, tokenizer, context_tokens=8192, sampling=SHORT, prefill_chunk_tokens=256)
    list(session.send("Hello"))
    used, messages = session.context_used, list(session.messages)
    forward, chunks, interrupted = model.forward, [], []

    def cancel_in_third_chunk(token_ids, state, interrupt=None):
        chunks.append(len(token_ids))
        if len(chunks) == 3:
            session.cancel()  # as the app does from another thread, while this chunk is on its way
        try:
            return forward(token_ids, state, interrupt=interrupt)
        except BaseException:
            interrupted.append(len(chunks))
            raise

    monkeypatch.setattr(model, "forward", cancel_in_third_chunk)
    final = list(session.send("long " * 1000))[-1]
    monkeypatch.undo()
    assert final.stats.stop_reason == "cancelled" and final.stats.new_tokens == 0
    assert chunks == [256, 256, 256] and interrupted == [3]  # the chunk it was cancelled in stops, no other starts
    assert session.context_used == used and session.messages == messages
    assert list(session.send("Short"))[-1].stats.stop_reason in ("eos", "length")


def test_regenerate_restores_the_snapshot(model, tokenizer):
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=7, max_new_tokens=12)
    session = ChatSession(model, tokenizer, context_tokens=4096, sampling=params)
    list(session.send("First question"))
    first = list(session.send("Second question"))[-1]
    used = session.context_used
    prefilled = session.prefilled_tokens_total
    again = list(session.regenerate())[-1]
    assert (again.answer, again.reasoning) == (first.answer, first.reasoning)  # same seed, same state
    assert again.stats.prefill_tokens == first.stats.prefill_tokens  # only the last turn was recomputed
    assert session.prefilled_tokens_total - prefilled == first.stats.prefill_tokens
    assert session.context_used == used and len(session.messages) == 4


def test_edit_rolls_back_to_that_message(model, tokenizer):
    session = ChatSession(model, tokenizer, context_tokens=4096, sampling=SHORT)
    list(session.send("One"))
    after_one = session.context_used
    list(session.send("Two"))
    list(session.send("Three"))
    list(session.edit(2, "Two, edited"))
    assert [m["content"] for m in session.messages if m["role"] == "user"] == ["One", "Two, edited"]
    fresh = ChatSession(model, tokenizer, context_tokens=4096, sampling=SHORT)
    list(fresh.send("One"))
    assert fresh.context_used == after_one
    edited_reply = list(fresh.send("Two, edited"))[-1]
    assert session.messages[-1]["content"] == edited_reply.answer
    with pytest.raises(ValueError, match="not a user message"):
        session.edit(1, "x")


def test_restore_points_are_kept_in_host_memory_and_bounded(model, tokenizer):
    """Each turn's snapshot holds the recurrent states as host copies independent of the live state; only the
    last `max_snapshots` are kept, and an edit further back is no longer a rollback (the app prefills again)."""
    session = ChatSession(model, tokenizer, context_tokens=4096, sampling=SHORT, max_snapshots=2)
    for text in ("One", "Two", "Three", "Four"):
        list(session.send(text))
    kept = [b.message_index for b in session._boundaries]
    assert kept == [4, 6] and not session.can_edit(0) and not session.can_edit(2) and session.can_edit(4)
    recurrent = [saved for saved in session._boundaries[-1].snapshot.layers if not isinstance(saved, int)]
    live = [s for s in session._state.layers if not isinstance(s.snapshot(), int)]
    assert recurrent and all(saved.recurrent.device.type == "cpu" for saved in recurrent)
    assert all(saved.recurrent.data_ptr() != state.recurrent.data_ptr() for saved, state in zip(recurrent, live))
    first = list(session.regenerate())[-1]
    fresh = ChatSession(model, tokenizer, context_tokens=4096, sampling=SHORT)
    for text in ("One", "Two", "Three"):
        list(fresh.send(text))
    assert list(fresh.send("Four"))[-1].answer == first.answer
    with pytest.raises(ValueError, match="max_snapshots must be 1 or more"):
        ChatSession(model, tokenizer, context_tokens=4096, max_snapshots=0)


def test_snapshot_bytes_is_what_a_restore_point_copies(model, tokenizer, tiny_checkpoint):
    """The size the Settings page shows per restore point: the recurrent states a snapshot copies, none without."""
    session = ChatSession(model, tokenizer, context_tokens=4096, sampling=SHORT)
    list(session.send("One"))
    copied = [saved for saved in session._boundaries[-1].snapshot.layers if not isinstance(saved, int)]
    assert copied and session.snapshot_bytes == sum(s.conv.nbytes + s.recurrent.nbytes for s in copied)
    assert engine.load_model(tiny_checkpoint("qwen3_moe", "bf16")).new_state(4096).snapshot_bytes == 0


def test_saved_history_is_prefilled_with_the_next_message(tokenizer):
    model, session = scripted(tokenizer, text="Fine.", enable_thinking=False)
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    session.reset(history)
    final = list(session.send("How are you?"))[-1]
    # the history is rendered with every reply's think block kept, as the live state holds it
    expected = tokenizer.render(
        history + [{"role": "user", "content": "How are you?"}], enable_thinking=False, preserve_thinking=True
    )
    assert "<think>\n\n</think>\n\nHello!" in expected
    assert tokenizer.decode(model.fed[0]) == expected
    assert final.stats.prefill_tokens == len(tokenizer.encode(expected))
    assert [m["content"] for m in session.messages] == ["Hi", "Hello!", "How are you?", "Fine."]


class FailingModel(ScriptedModel):
    """Runs out of memory on forward call number `fail_at` (counting from 1) once it is set."""

    fail_at, calls = None, 0

    def forward(self, token_ids, state, interrupt=None):
        self.calls += 1
        if self.calls == self.fail_at:
            state.position += 1  # a failure part-way leaves the state advanced: the session must undo it
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().forward(token_ids, state, interrupt)


@pytest.mark.parametrize("fail_at, phase", [(2, "reading the prompt"), (8, "writing the reply")])
def test_out_of_memory_undoes_the_turn_and_the_session_goes_on(tokenizer, fail_at, phase):
    script = tokenizer.encode("Fine, thanks.") + [min(tokenizer.eos_token_ids)]
    model = FailingModel(320, script)
    session = ChatSession(
        model, tokenizer, context_tokens=4096, sampling=GREEDY, enable_thinking=False, prefill_chunk_tokens=16
    )
    list(session.send("Hi"))
    # the next prompt takes two 16-token chunks (calls 1-2), then one call per reply token
    next_prompt, _ = session._prompt_ids([{"role": "user", "content": "How are you?"}])
    assert 16 < len(next_prompt) <= 32
    model.fail_at, model.calls = fail_at, 0
    used, messages = session.context_used, list(session.messages)
    final = list(session.send("How are you?"))[-1]
    assert final.stats.stop_reason == "error"
    assert f"ran out of memory while {phase}" in final.stats.error and "larger VRAM preset" in final.stats.error
    assert session.context_used == used and session.messages == messages
    model.fail_at = None
    again = list(session.send("How are you?"))[-1]
    assert again.stats.stop_reason == "eos" and again.answer == "Fine, thanks."


def test_a_cancel_before_the_first_event_is_not_lost(tokenizer):
    model, session = scripted(tokenizer, delay=0.005)  # its forward asks the interrupt, as the real one does
    turn = session.send("Hi")
    session.cancel()  # the app's Stop, between asking for the reply and its first event
    final = list(turn)[-1]
    assert final.stats.stop_reason == "cancelled" and final.stats.new_tokens == 0
    assert session.messages == [] and session.context_used == 0
    assert list(session.send("Hi again"))[-1].stats.stop_reason == "eos"  # the next turn is not cancelled


@pytest.fixture(scope="module")
def qwen36(real_tokenizer_folder):
    return ChatTokenizer.from_folder(real_tokenizer_folder("qwen3.6"))


def _real_session(tokenizer, reply, **kwargs):
    """A scripted session on a real tokenizer; the reply ends in <|im_end|> as Qwen's replies do."""
    model = ScriptedModel(tokenizer.vocab_size, tokenizer.encode(reply) + [tokenizer.token_id("<|im_end|>")])
    return ChatSession(model, tokenizer, context_tokens=4096, sampling=GREEDY, **kwargs)


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no_thinking"])
def test_state_is_the_render_of_the_history_with_its_reasoning(qwen36, thinking):
    """The state keeps earlier replies as generated, reasoning included: exactly the template's render with
    preserve_thinking, so reusing it and rendering the history afresh give the same tokens."""
    reply = ("Let me think: 你好 😀\n</think>\n\n" if thinking else "") + "Answer: 答案 🎉 done."
    session = _real_session(qwen36, reply, system_prompt="Be brief.", enable_thinking=thinking)
    list(session.send("Hi"))
    list(session.send("And then?"))
    list(session.send("Last one."))
    history = [{"role": "system", "content": "Be brief."}] + session.messages
    assert [m.get("reasoning_content") for m in history if m["role"] == "assistant"] == (
        ["Let me think: 你好 😀"] * 3 if thinking else [None] * 3
    )

    def rendered(messages, add_generation_prompt, preserve_thinking=True):
        return qwen36.encode(
            qwen36.render(
                messages,
                add_generation_prompt=add_generation_prompt,
                enable_thinking=thinking,
                preserve_thinking=preserve_thinking,
            )
        )

    # the last reply's <|im_end|> is written by the next turn; the rest of the history is in the state
    assert session._fed + qwen36.encode("<|im_end|>\n") == rendered(history, add_generation_prompt=False)
    assert session.context_used == len(session._fed)
    third_prompt = rendered(history[:-1], add_generation_prompt=True)
    assert session._fed[: len(third_prompt)] == third_prompt
    # the template's default drops the earlier turns' reasoning (and their empty think blocks): not the state
    assert session._fed[: len(third_prompt)] != rendered(history[:-1], True, preserve_thinking=False)

    # a saved chat loaded into a fresh session is prefilled as the same tokens the live session holds
    reloaded = _real_session(qwen36, reply, system_prompt="Be brief.", enable_thinking=thinking)
    reloaded.reset(session.messages[:-2])
    list(reloaded.send("Last one."))
    assert reloaded._fed == session._fed
    assert reloaded.model.fed[0] == third_prompt


@pytest.mark.parametrize("cut_after", [3, 14])  # in the thinking, and in the answer
def test_resume_goes_on_with_a_cut_reply_as_if_it_never_stopped(tokenizer, cut_after):
    _, whole = scripted(tokenizer)
    uncut_reasoning, uncut_answer, uncut = split(list(whole.send("Hi")))
    _, session = scripted(tokenizer, sampling=SamplingParams(temperature=0.0, max_new_tokens=cut_after))
    cut_reasoning, cut_answer, cut = split(list(session.send("Hi")))
    assert cut.stats.stop_reason == "length" and session.can_resume()

    events = list(session.resume(GREEDY))
    reasoning, answer, final = split(events)
    assert final.stats.stop_reason == "eos" and not session.can_resume()
    assert (final.reasoning, final.answer) == (uncut.reasoning, uncut.answer)
    # the events carry only the new text, which goes on exactly where the cut reply's text ended
    assert (cut_reasoning + reasoning, cut_answer + answer) == (uncut_reasoning, uncut_answer)
    assert session.messages == whole.messages  # one reply, grown in place


def test_resume_is_refused_after_a_reply_that_ended(tokenizer):
    _, session = scripted(tokenizer)
    list(session.send("Hi"))
    assert not session.can_resume()
    with pytest.raises(ValueError):
        session.resume()


def test_the_overflow_message_gives_the_advice_it_was_given_and_no_other(tokenizer):
    _, plain = scripted(tokenizer, context_tokens=8)
    message = list(plain.send("a long message " * 8))[-1].stats.error
    assert message.endswith("start a new chat or shorten the prompt") and "raise" not in message
    _, advised = scripted(tokenizer, context_tokens=8, context_advice="a larger VRAM preset holds more")
    message = list(advised.send("a long message " * 8))[-1].stats.error
    assert message.endswith("start a new chat or shorten the prompt; a larger VRAM preset holds more")


@pytest.mark.parametrize(
    "cut, rest",
    [
        ({"role": "assistant", "content": "", "reasoning_content": "Let me"}, " think.\n</think>\n\nAnswer: ok"),
        ({"role": "assistant", "content": "Answer:", "reasoning_content": "Let me think."}, " ok"),
    ],
)
def test_continue_from_prefills_the_history_and_the_cut_reply_then_goes_on(tokenizer, cut, rest):
    model, session = scripted(tokenizer, text=rest)  # the model writes the rest of the reply
    history = [{"role": "user", "content": "Hi"}]
    events = list(session.continue_from(history, cut, GREEDY))
    reasoning, answer, final = split(events)
    prompt = tokenizer.decode(model.fed[0])
    # the prompt is the chat's generation prompt, then the reply as the model wrote it so far, left open
    if cut["content"]:
        assert prompt.endswith("<|im_start|>assistant\n<think>\nLet me think.\n</think>\n\nAnswer:")
        assert (reasoning, answer) == ("", " ok")
    else:
        assert prompt.endswith("<|im_start|>assistant\n<think>\nLet me")
        assert (reasoning, answer) == (" think.\n", "Answer: ok")
    assert (final.reasoning, final.answer, final.stats.stop_reason) == ("Let me think.", "Answer: ok", "eos")
    assert session.messages == history + [
        {"role": "assistant", "content": "Answer: ok", "reasoning_content": "Let me think."}
    ]
    with pytest.raises(ValueError):
        session.continue_from([], cut)


def test_a_reset_empties_the_state_in_place_and_answers_as_a_fresh_session(model, tokenizer, monkeypatch):
    """A plan's KV cache fits in VRAM once: reset and a new system prompt reuse the state's memory instead of
    allocating a second state beside it, and the next reply is the one a fresh session gives."""
    session = ChatSession(model, tokenizer, context_tokens=1024, sampling=SHORT)
    list(session.send("Hello"))
    new_state = model.new_state

    def one_state_only(max_tokens, *args):
        assert max_tokens == 0, "a second state of the session's size"  # 0: the blank copy, no KV rows
        return new_state(max_tokens, *args)

    monkeypatch.setattr(model, "new_state", one_state_only)
    session.reset()
    session.set_system_prompt("Be brief.")
    assert session.context_used == 0
    again = list(session.send("What is 2 + 2?"))[-1]
    monkeypatch.undo()
    fresh = ChatSession(model, tokenizer, context_tokens=1024, sampling=SHORT, system_prompt="Be brief.")
    assert list(fresh.send("What is 2 + 2?"))[-1].answer == again.answer
