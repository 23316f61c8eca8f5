"""The demo model's training data (tools/demo_data.py): the reasoning is right, held-out problems stay out,
prompts are byte-identical to what the app renders, and the tokenizer gives every digit its own token."""

import random
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.runtime.tokenizer import ChatTokenizer  # noqa: E402
from tools import demo_data as D  # noqa: E402

STEP = re.compile(r"^(Ones|Tens|Hundreds|Thousands): (.*)$")


def _check_addition(a, b, lines):
    """Replay 'Ones: 7 + 6 = 13, write 3, carry 1.' lines against the digits of a and b."""
    da, db = D._digits(a), D._digits(b)
    carry, written = 0, []
    for i, line in enumerate(lines):
        place, body = STEP.match(line).groups()
        assert place == D.PLACES[i]
        if body.startswith("write the carry"):
            assert carry == 1 and body == "write the carry 1."
            written.append(1)
            carry = 0
            continue
        m = re.fullmatch(r"(\d) \+ (\d)(?: \+ (\d))? = (\d+), write (\d)(?:, carry (\d))?\.", body)
        assert m, line
        x, y, c, total, w, c_out = m.groups()
        assert int(x) == (da[i] if i < len(da) else 0) and int(y) == (db[i] if i < len(db) else 0)
        assert int(c or 0) == carry and (c is None) == (carry == 0)
        assert int(total) == int(x) + int(y) + carry
        assert int(w) == int(total) % 10
        carry = int(total) // 10
        assert int(c_out or 0) == carry
        written.append(int(w))
    assert carry == 0
    return int("".join(map(str, reversed(written))))


def _check_subtraction(a, b, lines):
    """Replay 'Tens: 5 - 8 is negative, so borrow: 15 - 8 = 7, write 7, borrow 1.' lines (a >= b)."""
    da, db = D._digits(a), D._digits(b)
    borrow, written = 0, []
    assert len(lines) == len(da)
    for i, line in enumerate(lines):
        place, body = STEP.match(line).groups()
        assert place == D.PLACES[i]
        x, y = da[i], (db[i] if i < len(db) else 0)
        owed = " - 1" if borrow else ""
        if x - y - borrow >= 0:
            value = x - y - borrow
            assert body == f"{x} - {y}{owed} = {value}, write {value}."
            borrow = 0
        else:
            m = re.fullmatch(r"(\d) - (\d)( - 1)? is negative, so borrow: 1(\d) - (\d)( - 1)? = (\d), write (\d), "
                             r"borrow 1\.", body)
            assert m, line
            assert int(m[1]) == int(m[4]) == x and int(m[2]) == int(m[5]) == y
            assert bool(m[3]) == bool(m[6]) == bool(borrow)
            value = int(m[7])
            assert value == 10 + x - y - borrow and int(m[8]) == value
            borrow = 1
        written.append(value)
    assert borrow == 0
    return int("".join(map(str, reversed(written))))


def check_reasoning(a, b, op):
    text = D.arithmetic_reasoning(a, b, op)
    lines = text.split("\n")
    header, steps, summary = lines[0], lines[1:-1], lines[-1]
    if op == "+":
        assert header == f"{a} + {b}: add digit by digit from the right."
        result = _check_addition(a, b, steps)
        assert summary == f"So {a} + {b} = {result}."
    elif a >= b:
        assert header == f"{a} - {b}: {a} is not less than {b}, so subtract digit by digit from the right."
        result = _check_subtraction(a, b, steps)
        assert summary == f"So {a} - {b} = {result}."
    else:
        assert header == f"{a} - {b}: {a} is less than {b}, so compute {b} - {a} and make it negative."
        result = -_check_subtraction(b, a, steps)
        assert summary == f"So {b} - {a} = {-result}, and {a} - {b} = {result}."
    assert result == D.evaluate(a, b, op)
    assert D.arithmetic_answer(a, b, op) == f"{a} {op} {b} = {result}."


def test_reasoning_is_arithmetically_right():
    rng = random.Random(0)
    cases = [(457, 386, "+"), (999, 999, "+"), (999, 1, "+"), (0, 0, "+"), (5, 386, "+"), (457, 386, "-"),
             (386, 457, "-"), (1000 - 1, 999, "-"), (100, 1, "-"), (0, 999, "-"), (7, 7, "-"), (505, 6, "-")]
    cases += [(rng.randint(0, 999), rng.randint(0, 999), rng.choice("+-")) for _ in range(3000)]
    cases += [(rng.randint(0, 99), rng.randint(0, 99), rng.choice("+-")) for _ in range(500)]
    for case in cases:
        check_reasoning(*case)


def test_generated_arithmetic_replies_are_right():
    rng = random.Random(1)
    for _ in range(2000):
        conv = D.conversation(rng)
        for i, m in enumerate(conv.messages):
            if m["role"] != "assistant" or "reasoning_content" not in m or not re.match(r"-?\d", m["content"]):
                continue
            a, op, b = re.fullmatch(r"(\d+) ([+-]) (\d+) = -?\d+\.", m["content"]).groups()
            a, b = int(a), int(b)
            assert m["content"] == D.arithmetic_answer(a, b, op)
            assert m["reasoning_content"] == D.arithmetic_reasoning(a, b, op)
            question = conv.messages[i - 1]["content"]
            assert str(a) in question and str(b) in question


def test_held_out_problems_never_reach_training_data():
    held = set(D.held_out_pairs(max_value=120))
    assert 0.01 < len(held) / (2 * 121 * 121) < 0.03  # about 2 %
    assert all(D.is_held_out(*p) for p in held)
    rng = random.Random(2)
    for _ in range(20000):  # the sampler for training problems refuses them
        assert not D.is_held_out(*D.training_problem(rng))
    rng = random.Random(3)
    seen_problems = 0
    for _ in range(5000):
        conv = D.conversation(rng)
        text = "".join(t for t, _ in D.training_segments(conv))
        # every problem the data poses: the reasoning's first line and the final answers. (Single-digit facts
        # inside the steps, and b - a inside the reasoning for a - b with a < b, are parts of other problems.)
        problems = re.findall(r"^(\d+) ([+-]) (\d+): ", text, re.M)
        problems += re.findall(r"(\d+) ([+-]) (\d+) = -?\d+\.<\|im_end\|>", text)
        for a, op, b in problems:
            seen_problems += 1
            assert not D.is_held_out(int(a), int(b), op), (a, op, b)
    assert seen_problems > 5000
    # and the evaluation draws exactly what it asks for
    rng = random.Random(4)
    assert all(D.is_held_out(*p) for p in D.sample_problems(rng, 50, held_out=True))
    assert not any(D.is_held_out(*p) for p in D.sample_problems(rng, 50, held_out=False))


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    """A demo tokenizer folder written the way train_demo writes it (a small corpus keeps this fast)."""
    from tools.train_demo import write_tokenizer

    folder = tmp_path_factory.mktemp("demo-tokenizer")
    tokenizer = D.build_tokenizer(D.tokenizer_corpus(0, 2000), vocab_size=800)
    write_tokenizer(tokenizer, folder)
    return folder


def _sample_conversations(n=300, seed=6):
    rng = random.Random(seed)
    convs = [D.conversation(rng, kind) for kind in D.MIX for _ in range(n // len(D.MIX))]
    return convs


def test_fast_render_equals_the_template_and_chat_tokenizer(tokenizer_folder):
    chat = ChatTokenizer.from_folder(tokenizer_folder)
    for conv in _sample_conversations():
        messages = conv.messages
        for cut in range(1, len(messages) + 1):
            part = messages[:cut]
            if not any(m["role"] == "user" for m in part):
                continue
            for thinking in (True, False):
                for generation_prompt in (True, False):
                    ours = D.render(part, generation_prompt, thinking)
                    assert ours == D.jinja_render(part, generation_prompt, thinking)
                    assert ours == chat.render(part, add_generation_prompt=generation_prompt,
                                               enable_thinking=thinking)


def test_training_prompts_are_what_the_app_feeds(tokenizer_folder):
    chat = ChatTokenizer.from_folder(tokenizer_folder)
    for conv in _sample_conversations():
        segments = D.training_segments(conv)
        messages = conv.messages
        replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        # the first prompt is ChatTokenizer's render of the history up to the first reply to learn
        first = replies[0] if conv.history == "session" else replies[-1]
        assert segments[0] == (chat.render(messages[:first], add_generation_prompt=True,
                                           enable_thinking=conv.enable_thinking), False)
        # targets are the generated text, ending in <|im_end|>
        for text, target in segments:
            assert target == text.endswith(D.IM_END)
        # session history: prompt + replies + continuations is the template's render with all reasoning kept,
        # i.e. exactly the context ChatSession builds
        if conv.history == "session" and len(replies) > 1:
            whole = "".join(t for t, _ in segments)
            kept = [dict(m, content=(D.generated_text(m, conv.enable_thinking)) if m["role"] == "assistant" else m["content"])
                    for m in messages]
            expected_head = chat.render(messages[:replies[0]], add_generation_prompt=True,
                                        enable_thinking=conv.enable_thinking)
            assert whole.startswith(expected_head)
            rest = whole[len(expected_head):]
            for i, m in enumerate(kept[replies[0]:], start=replies[0]):
                if m["role"] == "assistant":
                    assert rest.startswith(m["content"] + D.IM_END)
                    rest = rest[len(m["content"] + D.IM_END):]
                else:
                    assert rest.startswith(f"\n{D.IM_START}user\n{m['content'].strip()}{D.IM_END}\n")
                    rest = rest[rest.index(f"{D.IM_START}assistant\n") + len(f"{D.IM_START}assistant\n"):]
                    head = "<think>\n" if conv.enable_thinking else "<think>\n\n</think>\n\n"
                    assert rest.startswith(head)
                    rest = rest[len(head):]
            assert rest == ""


def test_session_continuation_matches_chat_session(tokenizer_folder):
    """The continuation text equals what ChatSession computes with the real template."""
    from engine.runtime import session as session_module

    chat = ChatTokenizer.from_folder(tokenizer_folder)
    sentinel = session_module._SENTINEL
    rng = random.Random(8)
    for thinking in (True, False):
        for _ in range(20):
            user = D.arithmetic_turn(rng, *D.training_problem(rng))[:1]
            framed = [{"role": "user", "content": sentinel}, {"role": "assistant", "content": sentinel}]
            expected = chat.render(framed + user, add_generation_prompt=True,
                                   enable_thinking=thinking).rsplit(sentinel, 1)[1]
            assert D.IM_END + D._continuation(user, thinking) == expected


def test_tokenizer_splits_numbers_into_single_digits(tokenizer_folder):
    chat = ChatTokenizer.from_folder(tokenizer_folder)
    for text in ("What is 457 + 386?", "what's 12+7", "1234567890", "386 - 457 = -71.", "Ones: 7 + 6 = 13"):
        tokens = [chat.decode([i]) for i in chat.encode(text)]
        assert "".join(tokens) == text
        for token in tokens:
            assert not re.search(r"\d\D|\D\d|\d\d", token), (text, tokens)
    for token in D.SPECIAL_TOKENS:  # each special token is one id, in the fixed order
        assert chat.encode(token) == [D.SPECIAL_TOKENS.index(token)]
    assert chat.eos_token_ids == {D.SPECIAL_TOKENS.index("<|im_end|>")}
    assert chat.think_start == "<think>" and chat.think_end == "</think>"


def test_transformers_tokenizes_like_the_tokenizer_file(tokenizer_folder):
    """transformers rebuilds Qwen's pre-tokeniser around tokenizer.json's vocabulary; the ids must not change."""
    transformers = pytest.importorskip("transformers")
    chat = ChatTokenizer.from_folder(tokenizer_folder)
    hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer_folder))
    for conv in _sample_conversations(60, seed=9):
        for text, _ in D.training_segments(conv):
            assert hf.encode(text, add_special_tokens=False) == chat.encode(text)


def test_answer_checking():
    assert D.is_correct("x\n</think>\n\n457 + 386 = 843.", 457, 386, "+")
    assert not D.is_correct("x\n</think>\n\n457 + 386 = 842.", 457, 386, "+")
    assert D.is_correct("386 - 457 = -71.", 386, 457, "-")
    assert D.answer_value("So 1 + 1 = 2.\n</think>\n\n3 - 10 = -7.") == -7


def test_generation_is_deterministic():
    a = [D.training_segments(c) for c in D.conversations(11, 200)]
    b = [D.training_segments(c) for c in D.conversations(11, 200)]
    assert a == b
    kinds = {c.tags[0] for c in D.conversations(12, 500)}
    assert kinds == set(D.MIX)
