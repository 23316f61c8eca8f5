"""The demo model's training data (tools/demo_data.py): the reasoning is right, held-out problems stay out,
the training context is token for token what the app's session or the server feeds, tool calls are in
Qwen3.6's format, the mix holds its shares, and the tokenizer gives every digit its own token."""

import collections
import itertools
import json
import os
import random
import re
import subprocess
import sys

import pytest
import torch
from locations import ROOT

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.models.base import ModelState  # noqa: E402
from engine.runtime.sampling import SamplingParams  # noqa: E402
from engine.runtime.session import ChatSession  # noqa: E402
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
            m = re.fullmatch(
                r"(\d) - (\d)( - 1)? is negative, so borrow: 1(\d) - (\d)( - 1)? = (\d), write (\d), "
                r"borrow 1\.",
                body,
            )
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
    cases = [
        (457, 386, "+"),
        (999, 999, "+"),
        (999, 1, "+"),
        (0, 0, "+"),
        (5, 386, "+"),
        (457, 386, "-"),
        (386, 457, "-"),
        (1000 - 1, 999, "-"),
        (100, 1, "-"),
        (0, 999, "-"),
        (7, 7, "-"),
        (505, 6, "-"),
    ]
    cases += [(rng.randint(0, 999), rng.randint(0, 999), rng.choice("+-")) for _ in range(3000)]
    cases += [(rng.randint(0, 99), rng.randint(0, 99), rng.choice("+-")) for _ in range(500)]
    for case in cases:
        check_reasoning(*case)


def test_generated_arithmetic_replies_are_right():
    rng = random.Random(1)
    sums = products = 0
    for _ in range(3000):
        conv = D.conversation(rng)
        for i, m in enumerate(conv.messages):
            if m["role"] != "assistant" or not re.match(r"-?\d", m["content"]):
                continue
            question = conv.messages[i - 1]["content"]
            if "×" in m["content"]:  # a product: quoted from the tool's result, for the factors of the call
                a, b, product = map(int, re.fullmatch(r"(\d+) × (\d+) = (\d+)\.", m["content"]).groups())
                assert product == a * b
                assert conv.messages[i - 1]["role"] == "tool" and str(product) in question
                call = conv.messages[i - 2]["tool_calls"][0]["function"]
                assert call["name"] == "multiply" and list(call["arguments"].values()) == [a, b]
                products += 1
                continue
            a, op, b = re.fullmatch(r"(\d+) ([+-]) (\d+) = -?\d+\.", m["content"]).groups()
            a, b = int(a), int(b)
            assert m["content"] == D.arithmetic_answer(a, b, op)
            if conv.enable_thinking:
                assert m["reasoning_content"] == D.arithmetic_reasoning(a, b, op)
            else:
                assert "reasoning_content" not in m
            assert str(a) in question and str(b) in question
            sums += 1
    assert sums > 3000 and products > 100


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


def _shapes(seed=6, per_kind=40):
    """Conversations of every kind, and a multi-turn chat and a tool round trip of each history and mode."""
    rng = random.Random(seed)
    return [D.conversation(rng, kind) for kind in D.MIX for _ in range(per_kind)]


def _token_ids(chat, segments):
    return [i for text, _ in segments for i in chat.encode(text)]


def test_demo_template_renders_like_qwen36(tokenizer_folder, real_tokenizer_folder):
    """Every conversation shape of the data, with every option the app and the server pass, renders through
    the demo's template exactly as through Qwen3.6's own, so the server's tool-call handling applies alike."""
    demo = ChatTokenizer.from_folder(tokenizer_folder)
    real = ChatTokenizer.from_folder(real_tokenizer_folder("qwen3.6"))
    checked = 0
    for conv in _shapes(per_kind=8):
        for cut in range(1, len(conv.messages) + 1):
            part = conv.messages[:cut]
            if not any(m["role"] == "user" for m in part):
                continue
            for tools, generation_prompt, thinking, preserve in itertools.product(
                (None, [D.MULTIPLY_TOOL]), (True, False), (True, False), (True, False)
            ):
                options = dict(
                    add_generation_prompt=generation_prompt,
                    enable_thinking=thinking,
                    preserve_thinking=preserve,
                    tools=tools if conv.tools is None else conv.tools,
                )
                assert demo.render(part, **options) == real.render(part, **options)
                checked += 1
    assert checked > 2000


class ReplayModel:
    """A stand-in model that answers its n-th prompt with the n-th reply's tokens (each ending in <|im_end|>)."""

    def __init__(self, vocab_size: int, replies: list[list[int]]):
        self.vocab_size, self.replies = vocab_size, replies
        self.turn, self.cursor = -1, 0

    def new_state(self, max_tokens=None):
        return ModelState([], max_tokens)

    def forward(self, token_ids, state, interrupt=None):
        ids = [int(t) for t in token_ids]
        reply = self.replies[self.turn] if self.turn >= 0 else []
        if len(ids) == 1 and self.cursor + 1 < len(reply) and ids[0] == reply[self.cursor]:
            self.cursor += 1  # the token it sampled, fed back
        else:
            self.turn, self.cursor = self.turn + 1, 0  # a prompt: the next reply starts
        state.position += len(ids)
        logits = torch.full((self.vocab_size,), -30.0)
        logits[self.replies[self.turn][self.cursor]] = 30.0
        return logits


def test_app_history_is_what_chat_session_prefills(tokenizer_folder):
    """A multi-turn chat in the app's history: the training ids are exactly the ids a ChatSession holds after
    the same chat (its last <|im_end|> aside, which the next turn would feed), and the replies it records
    are the conversation's."""
    chat = ChatTokenizer.from_folder(tokenizer_folder)
    rng = random.Random(21)
    chats = [c for c in (D.conversation(rng, "multi_turn") for _ in range(200)) if c.history == "session"]
    assert {c.enable_thinking for c in chats} == {True, False}
    for conv in chats[:40]:
        segments = D.training_segments(conv, chat)
        replies = [chat.encode(text) for text, target in segments if target]
        system = conv.messages[0]["content"] if conv.messages[0]["role"] == "system" else None
        session = ChatSession(
            ReplayModel(chat.vocab_size, replies),
            chat,
            context_tokens=8192,
            sampling=SamplingParams(temperature=0.0, max_new_tokens=4096),
            system_prompt=system,
            enable_thinking=conv.enable_thinking,
        )
        for message in conv.messages:
            if message["role"] == "user":
                final = list(session.send(message["content"]))[-1]
                assert final.stats.stop_reason == "eos"
        assert session._fed + [chat.token_id(D.IM_END)] == _token_ids(chat, segments)
        expected = [m for m in conv.messages if m["role"] != "system"]
        assert [(m["content"], m.get("reasoning_content")) for m in session.messages] == [
            (m["content"], m.get("reasoning_content")) for m in expected
        ]


def test_api_history_is_what_the_server_prefills(tokenizer_folder):
    """Conversations as an API client resends them (tools included): each learnt reply's prompt, with the
    context before it, is the ids ChatTokenizer.encode_chat gives for that request, and every reply is learnt
    only where the context shows it as it was generated."""
    chat = ChatTokenizer.from_folder(tokenizer_folder)
    convs = [c for c in _shapes(seed=22, per_kind=60) if c.history == "template"]
    assert {c.tags[0] for c in convs} >= {"multi_turn", "tool_call", "tools_no_call"}
    for conv in convs:
        segments = D.training_segments(conv, chat)
        learnt = D.learnt_replies(conv)
        options = D.render_options(conv)
        assert not options["preserve_thinking"]
        for k, i in enumerate(learnt):
            request, _ = chat.encode_chat(conv.messages[:i], add_generation_prompt=True, **options)
            assert _token_ids(chat, segments[: 2 * k + 1]) == request
        whole, _ = chat.encode_chat(conv.messages, add_generation_prompt=False, **options)
        assert _token_ids(chat, segments) + chat.encode("\n") == whole
        last_query = max(i for i, m in enumerate(conv.messages) if m["role"] == "user")
        assert all(i > last_query for i in learnt)


def test_tool_round_trip_renders_in_qwen36_format(tokenizer_folder):
    chat = ChatTokenizer.from_folder(tokenizer_folder)
    rng = random.Random(0)
    trip = D.tool_round_trip(rng, 23, 47, D.MULTIPLY_TOOL, thinking=True)
    trip[2]["content"] = "1081"
    conv = D.Conversation(trip, True, "template", [D.MULTIPLY_TOOL])
    segments = D.training_segments(conv, chat)
    assert [target for _, target in segments] == [False, True, False, True]
    (prompt, call), (result, answer) = [(segments[k][0], segments[k + 1][0]) for k in (0, 2)]
    assert prompt.startswith(
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n"
        "<tools>\n" + json.dumps(D.MULTIPLY_TOOL) + "\n</tools>"
    )
    assert prompt.endswith(f"<|im_start|>user\n{trip[0]['content']}<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert call == (
        "The user asks for 23 × 47. I cannot multiply reliably on my own, but I have the multiply tool, "
        "so I call it with a = 23 and b = 47.\n</think>\n\n<tool_call>\n<function=multiply>\n"
        "<parameter=a>\n23\n</parameter>\n<parameter=b>\n47\n</parameter>\n</function>\n</tool_call>"
        "<|im_end|>"
    )
    assert result == (
        "\n<|im_start|>user\n<tool_response>\n1081\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    assert answer == "The multiply tool returned 1081, so 23 × 47 = 1081.\n</think>\n\n23 × 47 = 1081.<|im_end|>"
    # the tool markup is one token each, kept when decoding (not "special"), and the reply reads back as a call
    ids = chat.encode(call)
    for token in D.TOOL_TOKENS[:2]:
        assert chat.token_id(token) in ids
    assert chat.decode(ids) == call
    reasoning, text = D.split_reply(call[: -len(D.IM_END)])
    assert reasoning.startswith("The user asks for 23 × 47.")
    assert D.parse_tool_calls(text) == ("", [{"name": "multiply", "arguments": {"a": 23, "b": 47}}])
    # without thinking the call comes straight after the empty think block
    plain = D.tool_round_trip(rng, 5, 6, D.multiply_tool("x", "y"), thinking=False)
    segments = D.training_segments(D.Conversation(plain, False, "template", [D.multiply_tool("x", "y")]), chat)
    assert segments[0][0].endswith("<think>\n\n</think>\n\n")
    assert segments[1][0] == (
        "<tool_call>\n<function=multiply>\n<parameter=x>\n5\n</parameter>\n<parameter=y>\n6\n"
        "</parameter>\n</function>\n</tool_call><|im_end|>"
    )


def test_a_call_sent_back_without_its_reasoning_is_not_learnt(tokenizer_folder):
    chat = ChatTokenizer.from_folder(tokenizer_folder)
    trip = D.tool_round_trip(random.Random(1), 12, 34, D.MULTIPLY_TOOL, thinking=True)
    del trip[1]["reasoning_content"]
    segments = D.training_segments(D.Conversation(trip, True, "template", [D.MULTIPLY_TOOL]), chat)
    assert [target for _, target in segments] == [False, True]
    assert "<think>\n\n</think>\n\n<tool_call>" in segments[0][0]
    assert segments[1][0].endswith("12 × 34 = 408.<|im_end|>")


def test_reading_tool_calls():
    call = (
        "<tool_call>\n<function=multiply>\n<parameter=a>\n12\n</parameter>\n<parameter=b>\n7\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    assert D.parse_tool_calls("Let me call it.\n\n" + call) == (
        "Let me call it.",
        [{"name": "multiply", "arguments": {"a": 12, "b": 7}}],
    )
    assert D.parse_tool_calls(call + "\n" + call.replace("12", '"x y"')) == (
        "",
        [{"name": "multiply", "arguments": {"a": 12, "b": 7}}, {"name": "multiply", "arguments": {"a": "x y", "b": 7}}],
    )
    assert D.parse_tool_calls("12 × 7 = 84.") == ("12 × 7 = 84.", [])
    assert D.parse_tool_calls(call[:-5]) is None  # cut off
    assert D.parse_tool_calls(call + " and more") is None  # text after a call
    assert D.parse_tool_calls(call.replace("<function=multiply>\n", "")) is None
    assert D.split_reply("r\n</think>\n\nanswer") == ("r", "answer")


def test_multi_turn_chats_are_long_and_mixed():
    rng = random.Random(23)
    chats = [D.conversation(rng, "multi_turn") for _ in range(2000)]
    turns = collections.Counter(sum(m["role"] == "user" for m in c.messages) for c in chats)
    assert set(turns) == set(D.MULTI_TURN_TURNS)
    assert sum(n for t, n in turns.items() if t >= 5) / len(chats) > 0.5
    histories = collections.Counter(c.history for c in chats)
    assert 0.7 < histories["session"] / len(chats) < 0.8
    mixed = [c for c in chats if len(c.messages) >= 10 and c.enable_thinking]
    operators = [
        {op for m in c.messages if m["role"] == "assistant" for op in re.findall(r"^\d+ ([+-]) \d+ = ", m["content"])}
        for c in mixed
    ]
    assert sum(ops == {"+", "-"} for ops in operators) / len(mixed) > 0.8
    # the app keeps every earlier reasoning in the context, an API client's render only the last reply's
    session = next(c for c in mixed if c.history == "session")
    template = next(c for c in mixed if c.history == "template")
    context = "".join(t for t, _ in D.training_segments(session))
    assert all(m["reasoning_content"] in context for m in session.messages if m["role"] == "assistant")
    prompt = D.training_segments(template)[0][0]
    earlier = [m for m in template.messages[:-1] if m["role"] == "assistant"]
    assert all(m["content"] in prompt and m["reasoning_content"] not in prompt for m in earlier)


def test_mix_holds_its_shares():
    assert abs(sum(D.MIX.values()) - 1) < 1e-9
    n = 20000
    kinds = collections.Counter(c.tags[0] for c in D.conversations(31, n))
    for kind, share in D.MIX.items():
        assert abs(kinds[kind] / n - share) < 0.015, (kind, kinds[kind] / n, share)
    # tools are offered exactly in the tool kinds, and a product is answered from the tool only with one
    for conv in D.conversations(32, 3000):
        kind = conv.tags[0]
        assert (conv.tools is not None) == (kind in ("tool_call", "tools_no_call"))
        calls = [m for m in conv.messages if m.get("tool_calls")]
        assert (len(calls) == 1) == (kind == "tool_call")
        if kind == "product_no_tool":
            assert conv.messages[-1]["content"] == D.NO_MULTIPLY_TOOL


def test_training_prompts_are_what_the_app_feeds(tokenizer_folder):
    """The first prompt of every conversation is ChatTokenizer's render with the generation prompt, and every
    target is a reply ending in <|im_end|>."""
    chat = ChatTokenizer.from_folder(tokenizer_folder)
    for conv in _shapes():
        segments = D.training_segments(conv, chat)
        first = D.learnt_replies(conv)[0]
        assert segments[0] == (
            chat.render(conv.messages[:first], add_generation_prompt=True, **D.render_options(conv)),
            False,
        )
        for text, target in segments:
            assert target == text.endswith(D.IM_END)
            assert text.count(D.IM_END) == 1 or not target


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
    for conv in _shapes(seed=9, per_kind=8):
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
    assert a != [D.training_segments(c) for c in D.conversations(12, 200)]
    kinds = {c.tags[0] for c in D.conversations(12, 500)}
    assert kinds == set(D.MIX)


class OracleModel:
    """Stands in for a trained model in train_demo's evaluation: `generate` continues each (left-padded)
    prompt with the reply the training data teaches for a sum, a difference or a product, with every number
    one off when `wrong`; anything else gets a fixed refusal."""

    def __init__(self, tokenizer, wrong: bool = False):
        self.tokenizer, self.wrong = tokenizer, wrong

    def parameters(self):
        yield torch.zeros(1)

    def eval(self):
        return self

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, **decoding):
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            prompt = self.tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
            rows.append(ids + self.tokenizer.encode(self._reply(prompt), add_special_tokens=False).ids)
        width = max(map(len, rows))
        return torch.tensor([row + [pad_token_id] * (width - len(row)) for row in rows])

    def _reply(self, prompt: str) -> str:
        thinking = not prompt.endswith("<think>\n\n</think>\n\n")
        last = prompt.rsplit("<|im_start|>user\n", 1)[1].split(D.IM_END)[0]
        off = int(self.wrong)
        if last.startswith("<tool_response>"):
            a, b = map(int, re.findall(r"<parameter=[ab]>\n(\d+)\n", prompt)[-2:])
            trip = D.tool_round_trip(random.Random(0), a, b, D.MULTIPLY_TOOL, thinking)
            return D.training_segments(D.Conversation(trip, thinking, "template", [D.MULTIPLY_TOOL]))[3][0]
        if "*" in last:
            a, b = map(int, re.fullmatch(r"What is (\d+) \* (\d+)\?", last).groups())
            trip = D.tool_round_trip(random.Random(0), a + off, b, D.MULTIPLY_TOOL, thinking)
            return D.training_segments(D.Conversation(trip, thinking, "template", [D.MULTIPLY_TOOL]))[1][0]
        asked = re.fullmatch(r"What is (\d+) ([+-]) (\d+)\?", last)
        if asked is None:
            return f"I can't.{D.IM_END}"
        a, op, b = asked.groups()
        a, b = int(a), int(b)
        answer = f"{a} {op} {b} = {D.evaluate(a, b, op) + off}."
        return f"{D.arithmetic_reasoning(a, b, op)}\n</think>\n\n{answer}{D.IM_END}"


def test_evaluation_scores_tool_round_trips_and_chats(tokenizer_folder):
    from tokenizers import Tokenizer

    from tools import train_demo as T

    tokenizer = Tokenizer.from_file(str(tokenizer_folder / "tokenizer.json"))
    eos, pad = [tokenizer.token_to_id(D.IM_END)], tokenizer.token_to_id("<|endoftext|>")
    pairs = [(23, 47), (0, 999), (5, 6), (120, 7)]
    for thinking in (True, False):
        right = T.tool_accuracy(OracleModel(tokenizer), tokenizer, pairs, eos, pad, thinking=thinking)
        assert (right["parsed"], right["arguments_right"], right["answer_right"], right["round_trip"]) == (1, 1, 1, 1)
        assert right["wrong"] == []
    wrong = T.tool_accuracy(OracleModel(tokenizer, wrong=True), tokenizer, pairs, eos, pad)
    assert (wrong["parsed"], wrong["arguments_right"], wrong["answer_right"], wrong["round_trip"]) == (1, 0, 0, 0)
    assert len(wrong["wrong"]) == len(pairs)

    chats = [[(457, 386, "+"), (902, 18, "-"), (1, 2, "+")], [(5, 60, "-"), (99, 1, "+"), (300, 300, "-")]]
    marks, histories = T.chat_replies(OracleModel(tokenizer), tokenizer, chats, eos, pad)
    assert marks == [[True] * 3] * 2
    assert histories[0][-2:] == [
        {"role": "user", "content": "What is 1 + 2?"},
        {"role": "assistant", "content": "1 + 2 = 3.", "reasoning_content": D.arithmetic_reasoning(1, 2, "+")},
    ]
    marks, _ = T.chat_replies(OracleModel(tokenizer, wrong=True), tokenizer, chats, eos, pad)
    assert marks == [[False] * 3] * 2


def test_evaluation_figures_reach_the_model_card(tokenizer_folder):
    from tokenizers import Tokenizer

    from tools import train_demo as T

    tokenizer = Tokenizer.from_file(str(tokenizer_folder / "tokenizer.json"))
    ids = {token: tokenizer.token_to_id(token) for token in D.SPECIAL_TOKENS}
    args = T.parse_args(["--out", "unused", "--eval-pairs", "8", "--device", "cpu"])
    lines = []
    ev = T.evaluate(OracleModel(tokenizer), tokenizer, ids, args, lines.append)
    assert ev["chat_turn_accuracy"] == [1.0] * T.CHAT_TURNS and ev["chat_all_turns_accuracy"] == 1.0
    assert ev["fifth_turn_probe"]["content"] == "345 + 678 = 1023."
    assert ev["tool"]["round_trip"] == ev["tool_no_think"]["round_trip"] == ev["tools_offered_accuracy"] == 1.0
    assert ev["chats"] == 4 and ev["tool"]["pairs"] == 4
    assert any("fifth turn of the field report's chat, 345 + 678 -> '345 + 678 = 1023.'" in line for line in lines)
    wrong = T.evaluate(OracleModel(tokenizer, wrong=True), tokenizer, ids, args, lines.append)
    assert wrong["fifth_turn_accuracy"] == 0 and wrong["tool"]["round_trip"] == 0
    run = {
        "eval": ev,
        "train": {"steps": 3, "planned_steps": 3, "seconds": 1.0, "final_loss": 0.1},
        "args": dict(vars(args), out="unused"),
        "device_name": "a CPU",
        "software": "Python",
    }
    card = T.model_card(T.text_config(400, ids, tiny=True), {"total": 1, "active_per_token": 1}, run)
    assert "per turn 100.0%, 100.0%, 100.0%, 100.0%, 100.0%; the fifth turn 100.0%" in card
    assert "the whole round trip is right in 100.0% of 4 (thinking off: 100.0% of 4)" in card


def test_train_demo_runs_end_to_end_on_a_cpu(tmp_path):
    """A few steps of the tiny configuration write a checkpoint folder the engine loads, with the tool tokens
    and the demo's template."""
    import engine

    out = tmp_path / "demo"
    command = [
        sys.executable,
        str(ROOT / "tools" / "train_demo.py"),
        "--out",
        str(out),
        "--tiny",
        "--steps",
        "3",
        "--device",
        "cpu",
        "--batch-size",
        "4",
        "--workers",
        "0",
        "--no-eval",
        "--vocab-size",
        "400",
        "--tokenizer-conversations",
        "1000",
        "--log-every",
        "1",
    ]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="2"),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (out / "chat_template.jinja").read_text(encoding="utf-8") == D.CHAT_TEMPLATE
    log = json.loads((out / "train_log.json").read_text())
    assert log["train"]["steps"] == 3 and log["eval"] is None
    card = (out / "README.md").read_text()
    assert "multiply" in card and f"{D.MIX['multi_turn']:.0%} multi turn" in card
    config = json.loads((out / "tokenizer_config.json").read_text())
    added = {v["content"]: v["special"] for v in config["added_tokens_decoder"].values()}
    assert added == {token: token not in D.NOT_SPECIAL_TOKENS for token in D.SPECIAL_TOKENS}
    chat = ChatTokenizer.from_folder(out)
    assert [chat.token_id(t) for t in D.SPECIAL_TOKENS] == list(range(len(D.SPECIAL_TOKENS)))
    model = engine.load_model(out)
    state = model.new_state(64)
    logits = model.forward(chat.encode(D.prompt_text("What is 2 * 3?", tools=[D.MULTIPLY_TOOL]))[:60], state)
    assert logits.shape[-1] == chat.vocab_size and torch.isfinite(logits).all()
