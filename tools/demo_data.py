"""Synthetic conversations for MoE Desk's built-in demo model, and their rendering into training text.

The demo model does four things: small talk, saying what it is, adding or subtracting whole numbers from 0 to
999, and multiplying by calling a `multiply` tool when the request offers one. Arithmetic replies think
first: the <think> block works the sum digit by digit from the right, one line per place ("Ones: 7 + 6 = 13,
write 3, carry 1."), in a format so regular that a model of a few million parameters can learn the procedure
instead of memorising a million sums. A product is never computed: the model calls the tool in the chat
template's `<tool_call>` format, reads the `<tool_response>` and quotes it.

Conversations come in the kinds of MIX, with the shares given there: single questions, chats of 2 to 8 turns
(the fifth turn and later must stay as reliable as the first), and tool round trips. A chat's history is
rendered the way the app or an API client renders it (`Conversation.history`).

Everything here is deterministic for a given seed. A fixed 2 % of the (A, B, operator) sums and differences,
chosen by a hash, never appears in generated training data, so the evaluation can measure generalisation on
them (`is_held_out`, `held_out_pairs`, `sample_problems`).

Training text is the chat template's output exactly as inference sees it, rendered by the engine's own
ChatTokenizer: each prompt is what the app or the server feeds (render(..., add_generation_prompt=True)),
each target the text the model generates after it up to its <|im_end|>. Prompt and target are tokenised
separately, as the app tokenises a prompt and then appends generated tokens, so token boundaries match too
(`training_segments`).
"""

from __future__ import annotations

import json
import random
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.runtime.tokenizer import ChatTokenizer  # noqa: E402
from engine.testing import tiny_tokenizer as _TINY  # noqa: E402

CHAT_TEMPLATE: str = _TINY.CHAT_TEMPLATE  # renders text, tools, tool calls and results as Qwen3.6's does
# Qwen3.6's tokenizer has the tool markup as single added tokens too; like the thinking tags they are not
# "special" (decoding keeps them). Ids 0-4 are the tiny tokenizers' (<|im_end|> is 1), the tool tokens 5-8.
TOOL_TOKENS: tuple[str, ...] = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
SPECIAL_TOKENS: tuple[str, ...] = _TINY.SPECIAL_TOKENS + TOOL_TOKENS
NOT_SPECIAL_TOKENS: frozenset[str] = frozenset(("<think>", "</think>") + TOOL_TOKENS)
GENERIC_CORPUS: str = _TINY.CORPUS  # a little varied text, so the vocabulary is not only our phrases

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
MAX_OPERAND = 999
HELD_OUT_PER_MILLE = 20  # 2 % of all problems are held out of training
PLACES = ("Ones", "Tens", "Hundreds", "Thousands")

# --------------------------------------------------------------------------------------------------------
# Fixed texts: what the demo model says about itself
# --------------------------------------------------------------------------------------------------------

IDENTITY = (
    "I am the built-in demo model of MoE Desk: a tiny mixture-of-experts model, made so the app "
    "works before you download anything. I can only make small talk, "
    "add or subtract whole numbers from 0 to 999, and multiply with a multiply tool when one is offered. "
    "For real questions, download a real model from the Models page."
)
CAPABILITIES = (
    "I can make small talk and add or subtract whole numbers from 0 to 999, for example "
    '"What is 457 + 386?". When an app offers me a multiply tool, I can multiply by calling it. '
    "I am only MoE Desk's built-in demo model; for anything else, download a real model from the "
    "Models page."
)
OUT_OF_SCOPE = (
    "I can't help with that: I am only MoE Desk's built-in demo model, and all I can do is small "
    "talk and adding or subtracting whole numbers from 0 to 999. Download a real model from the "
    "Models page for questions like this."
)
NO_MULTIPLY_TOOL = (
    "I can't multiply on my own: I am only MoE Desk's built-in demo model. Offer me a multiply "
    "tool and I will call it and give you the result; I can add and subtract whole numbers from 0 "
    "to 999 myself."
)
REAL_MODEL = (
    "Open the Models page, choose a model and download it; then select it for your chat. I am only "
    "the built-in demo model, so a real model will answer far better."
)


@dataclass(frozen=True)
class Intent:
    """A kind of small-talk message: what users write, what the model thinks, what it answers."""

    name: str
    prompts: tuple[str, ...]
    reasoning: str
    answers: tuple[str, ...]


INTENTS: tuple[Intent, ...] = (
    Intent(
        "greeting",
        (
            "Hi",
            "Hi!",
            "Hello",
            "Hello!",
            "Hey",
            "Hey!",
            "Hi there",
            "Hello there!",
            "Good morning",
            "Good morning!",
            "Good afternoon",
            "Good evening",
            "Greetings",
            "hi",
            "hello",
            "hey there",
            "Yo",
            "Hiya",
            "Howdy",
        ),
        "The user greets me. I greet them back and say what I can help with.",
        (
            "Hello! I'm MoE Desk's demo model. I can make small talk and add or subtract numbers from 0 to 999. "
            "What would you like to calculate?",
        ),
    ),
    Intent(
        "how_are_you",
        (
            "How are you?",
            "How are you doing?",
            "How's it going?",
            "how are you",
            "What's up?",
            "How do you do?",
            "Are you well?",
            "How are you today?",
        ),
        "The user asks how I am. I answer kindly and offer to help.",
        ("I'm doing well, thank you! I'm ready to add or subtract some numbers for you.",),
    ),
    Intent(
        "thanks",
        (
            "Thanks!",
            "Thanks",
            "Thank you",
            "Thank you!",
            "Thank you very much!",
            "thx",
            "Thanks a lot!",
            "Great, thanks!",
            "Cool, thank you.",
            "Perfect, thanks!",
        ),
        "The user thanks me. I reply politely.",
        ("You're welcome! Ask me another sum whenever you like.",),
    ),
    Intent(
        "goodbye",
        ("Bye", "Bye!", "Goodbye", "Goodbye!", "See you", "See you later!", "Good night", "Ciao", "That's all, bye!"),
        "The user says goodbye. I say goodbye too.",
        ("Goodbye! Have a nice day.",),
    ),
    Intent(
        "identity",
        (
            "Who are you?",
            "What are you?",
            "What model are you?",
            "Which model are you?",
            "What is your name?",
            "What's your name?",
            "Tell me about yourself.",
            "Introduce yourself.",
            "Are you ChatGPT?",
            "Are you a real AI?",
            "Are you Qwen?",
            "What kind of model are you?",
            "who are you",
            "Are you the demo model?",
            "How big are you?",
        ),
        "The user asks what I am. I am MoE Desk's built-in demo model, and I should say so truthfully.",
        (IDENTITY,),
    ),
    Intent(
        "capabilities",
        (
            "What can you do?",
            "What can you help me with?",
            "Can you help me?",
            "What are you good at?",
            "What do you know?",
            "Help",
            "help",
            "What should I ask you?",
            "How do I use you?",
            "What are your limits?",
        ),
        "The user asks what I can do. I can only make small talk, add or subtract numbers from 0 to 999, "
        "and multiply by calling a multiply tool.",
        (CAPABILITIES,),
    ),
    Intent(
        "real_model",
        (
            "How do I get a better model?",
            "How can I download a real model?",
            "Where do I get a real model?",
            "How do I use a bigger model?",
            "Can I use a smarter model?",
            "How do I download Qwen?",
        ),
        "The user wants a real model. Real models are downloaded from the Models page.",
        (REAL_MODEL,),
    ),
    Intent(
        "out_of_scope",
        (
            "What is the capital of France?",
            "Write a poem about the sea.",
            "Explain quantum physics.",
            "Translate 'good morning' into French.",
            "Write a Python function that sorts a list.",
            "What is 144 divided by 12?",
            "Tell me a joke.",
            "What's the weather today?",
            "Summarize this article for me.",
            "Who won the World Cup in 2018?",
            "What is the square root of 81?",
            "Can you write an email to my boss?",
            "What is the meaning of life?",
            "Recommend a good book.",
            "How do I cook pasta?",
            "What year is it?",
            "Solve x + 3 = 7.",
        ),
        "The user asks something I cannot do. I only do small talk and adding or subtracting whole numbers "
        "from 0 to 999, so I say so and point to the Models page.",
        (OUT_OF_SCOPE,),
    ),
)
INTENT_BY_NAME = {intent.name: intent for intent in INTENTS}

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are MoE Desk's demo model.",
    "Be concise.",
    "You are a friendly assistant that helps with arithmetic.",
    "Answer briefly.",
    "You are a helpful assistant. Think step by step.",
)

# How users ask for a sum: (template, weight). {a} and {b} are the operands, {op} is "+" or "-".
ARITHMETIC_PHRASINGS: tuple[tuple[str, float], ...] = (
    ("What is {a} {op} {b}?", 40),
    ("What's {a} {op} {b}?", 6),
    ("what's {a}{op}{b}", 4),
    ("what is {a} {op} {b}", 4),
    ("Compute {a} {op} {b}.", 5),
    ("Calculate {a} {op} {b}.", 5),
    ("{a} {op} {b} = ?", 5),
    ("{a} {op} {b}", 4),
    ("{a}{op}{b}=?", 3),
    ("{a}{op}{b}", 2),
    ("How much is {a} {op} {b}?", 4),
    ("What is {a} {word} {b}?", 5),
    ("Please compute {a} {op} {b}.", 3),
    ("Can you tell me what {a} {op} {b} is?", 3),
    ("Quick question: what is {a} {op} {b}?", 2),
    ("{verb}", 6),  # "Add 12 and 7." / "Subtract 7 from 12."
)
_PHRASING_WEIGHTS = [w for _, w in ARITHMETIC_PHRASINGS]
OP_WORDS = {"+": "plus", "-": "minus"}
VERB_PHRASINGS = {
    "+": ("Add {a} and {b}.", "What do you get if you add {a} and {b}?", "What is the sum of {a} and {b}?"),
    "-": ("Subtract {b} from {a}.", "What do you get if you subtract {b} from {a}?", "What is {a} take away {b}?"),
}

# --------------------------------------------------------------------------------------------------------
# Arithmetic: the answer and the digit-by-digit reasoning
# --------------------------------------------------------------------------------------------------------


def evaluate(a: int, b: int, op: str) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    raise ValueError(f"unknown operator {op!r}")


def _digits(n: int) -> list[int]:
    """Digits of n >= 0, least significant first."""
    return [int(c) for c in reversed(str(n))]


def addition_steps(a: int, b: int) -> list[str]:
    """One line per place, ones first: 'Tens: 5 + 8 + 1 = 14, write 4, carry 1.' (digits missing from the
    shorter number are 0), then a line for a final carry."""
    da, db = _digits(a), _digits(b)
    lines, carry = [], 0
    for i in range(max(len(da), len(db))):
        x = da[i] if i < len(da) else 0
        y = db[i] if i < len(db) else 0
        total = x + y + carry
        terms = f"{x} + {y}" + (f" + {carry}" if carry else "")
        line = f"{PLACES[i]}: {terms} = {total}, write {total % 10}"
        carry = total // 10
        lines.append(line + (f", carry {carry}." if carry else "."))
    if carry:
        lines.append(f"{PLACES[len(lines)]}: write the carry {carry}.")
    return lines


def subtraction_steps(a: int, b: int) -> list[str]:
    """For a >= b, one line per place of a, ones first:
    'Tens: 5 - 8 is negative, so borrow: 15 - 8 = 7, write 7, borrow 1.' / 'Hundreds: 4 - 3 - 1 = 0, write 0.'"""
    if a < b:
        raise ValueError("subtraction_steps needs a >= b")
    da, db = _digits(a), _digits(b)
    lines, borrow = [], 0
    for i in range(len(da)):
        x = da[i]
        y = db[i] if i < len(db) else 0
        owed = f" - {borrow}" if borrow else ""
        value = x - y - borrow
        if value >= 0:
            lines.append(f"{PLACES[i]}: {x} - {y}{owed} = {value}, write {value}.")
            borrow = 0
        else:
            value += 10
            lines.append(
                f"{PLACES[i]}: {x} - {y}{owed} is negative, so borrow: 1{x} - {y}{owed} = {value}, "
                f"write {value}, borrow 1."
            )
            borrow = 1
    return lines


def arithmetic_reasoning(a: int, b: int, op: str) -> str:
    """The <think> text for 'a op b' (without the tags)."""
    if op == "+":
        lines = [f"{a} + {b}: add digit by digit from the right."]
        lines += addition_steps(a, b)
        lines.append(f"So {a} + {b} = {a + b}.")
    elif a >= b:
        lines = [f"{a} - {b}: {a} is not less than {b}, so subtract digit by digit from the right."]
        lines += subtraction_steps(a, b)
        lines.append(f"So {a} - {b} = {a - b}.")
    else:
        lines = [f"{a} - {b}: {a} is less than {b}, so compute {b} - {a} and make it negative."]
        lines += subtraction_steps(b, a)
        lines.append(f"So {b} - {a} = {b - a}, and {a} - {b} = {a - b}.")
    return "\n".join(lines)


def arithmetic_answer(a: int, b: int, op: str) -> str:
    return f"{a} {op} {b} = {evaluate(a, b, op)}."


_LAST_INTEGER = re.compile(r"-?\d+")


def answer_value(reply: str) -> int | None:
    """The last integer in a reply's answer part (after </think> when there is one), or None."""
    answer = reply.rsplit("</think>", 1)[-1]
    found = _LAST_INTEGER.findall(answer)
    return int(found[-1]) if found else None


def is_correct(reply: str, a: int, b: int, op: str) -> bool:
    """The reply's answer is exactly 'a op b = result.' (the format the model is trained on)."""
    return reply.rsplit("</think>", 1)[-1].strip() == arithmetic_answer(a, b, op)


# --------------------------------------------------------------------------------------------------------
# Held-out problems
# --------------------------------------------------------------------------------------------------------

_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a fixed, well-spread hash of a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def is_held_out(a: int, b: int, op: str) -> bool:
    """Whether the problem 'a op b' belongs to the fixed 2 % that training never shows."""
    key = ((0 if op == "+" else 1) << 40) | (a << 20) | b
    return _mix(key) % 1000 < HELD_OUT_PER_MILLE


def held_out_pairs(max_value: int = MAX_OPERAND) -> Iterator[tuple[int, int, str]]:
    """Every held-out (a, b, op) with operands in 0..max_value (about 40,000 for 0..999)."""
    for op in ("+", "-"):
        for a in range(max_value + 1):
            for b in range(max_value + 1):
                if is_held_out(a, b, op):
                    yield a, b, op


def sample_problems(
    rng: random.Random, n: int, held_out: bool, max_value: int = MAX_OPERAND
) -> list[tuple[int, int, str]]:
    """n distinct problems, operands uniform in 0..max_value, half each operator in expectation, all held out
    (held_out=True) or all from the training side."""
    found: dict[tuple[int, int, str], None] = {}
    while len(found) < n:
        problem = (rng.randint(0, max_value), rng.randint(0, max_value), rng.choice("+-"))
        if is_held_out(*problem) == held_out:
            found[problem] = None
    return list(found)


# --------------------------------------------------------------------------------------------------------
# Conversations
# --------------------------------------------------------------------------------------------------------


@dataclass
class Conversation:
    """Messages (system optional, then user/assistant turns, assistant tool calls and tool results; each
    assistant message with thinking carries its reasoning_content), the tool specs offered, and the thinking
    mode the whole conversation runs in."""

    messages: list[dict]
    enable_thinking: bool = True
    # "session": the app's chat window (ChatSession), which keeps every earlier reply in the context as it was
    # generated, reasoning included (the template's preserve_thinking); a loss on every reply.
    # "template": an API client resending the conversation, rendered by the template's default, which drops
    # the reasoning of turns before the last user message; a loss on the replies after that message.
    history: str = "session"
    tools: list[dict] | None = None
    tags: tuple[str, ...] = field(default=())


def _operand(rng: random.Random, max_value: int) -> int:
    """Mostly 3-digit numbers, some 2- and 1-digit ones (when max_value allows)."""
    digits = len(str(max_value))
    weights = {1: (1,), 2: (1, 2), 3: (1, 2, 7)}[min(digits, 3)]
    n = rng.choices(range(1, len(weights) + 1), weights=weights)[0]
    low = 0 if n == 1 else 10 ** (n - 1)
    return rng.randint(low, min(10**n - 1, max_value))


def training_problem(rng: random.Random, max_value: int = MAX_OPERAND) -> tuple[int, int, str]:
    """A random problem that is not held out."""
    while True:
        problem = (_operand(rng, max_value), _operand(rng, max_value), rng.choice("+-"))
        if not is_held_out(*problem):
            return problem


def question_text(rng: random.Random, a: int, b: int, op: str) -> str:
    template = rng.choices(ARITHMETIC_PHRASINGS, weights=_PHRASING_WEIGHTS)[0][0]
    if template == "{verb}":
        template = rng.choice(VERB_PHRASINGS[op])
    return template.format(a=a, b=b, op=op, word=OP_WORDS[op])


def arithmetic_turn(rng: random.Random, a: int, b: int, op: str) -> list[dict]:
    return [
        {"role": "user", "content": question_text(rng, a, b, op)},
        {
            "role": "assistant",
            "content": arithmetic_answer(a, b, op),
            "reasoning_content": arithmetic_reasoning(a, b, op),
        },
    ]


def chat_turn(rng: random.Random, intent: Intent | str) -> list[dict]:
    if isinstance(intent, str):
        intent = INTENT_BY_NAME[intent]
    return [
        {"role": "user", "content": rng.choice(intent.prompts)},
        {"role": "assistant", "content": rng.choice(intent.answers), "reasoning_content": intent.reasoning},
    ]


def _chat_intent(rng: random.Random) -> Intent:
    weights = {
        "greeting": 5,
        "how_are_you": 2,
        "thanks": 2,
        "goodbye": 1,
        "identity": 4,
        "capabilities": 3,
        "real_model": 1,
        "out_of_scope": 4,
    }
    return INTENT_BY_NAME[rng.choices(list(weights), weights=list(weights.values()))[0]]


def _system(rng: random.Random) -> list[dict]:
    if rng.random() < 0.8:
        return []
    return [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}]


def _without_reasoning(turn: list[dict]) -> list[dict]:
    """A turn as a conversation without thinking holds it: the replies carry no reasoning."""
    return [{k: v for k, v in m.items() if k != "reasoning_content"} for m in turn]


def _plain_turns(rng: random.Random, count: int, thinking: bool, max_value: int) -> list[dict]:
    """`count` turns of a chat: mostly sums and differences, mixed, some small talk between them."""
    limit = max_value if thinking else min(99, max_value)  # no reasoning: only sums small enough to memorise
    messages = []
    for t in range(count):
        if t == 0 and rng.random() < 0.3:
            turn = chat_turn(rng, rng.choice(("greeting", "how_are_you", "identity")))
        elif t > 0 and rng.random() < 0.15:
            turn = chat_turn(rng, rng.choice(("thanks", "thanks", "identity", "capabilities", "how_are_you")))
        else:
            turn = arithmetic_turn(rng, *training_problem(rng, limit))
        messages += turn if thinking else _without_reasoning(turn)
    return messages


# --------------------------------------------------------------------------------------------------------
# The multiply tool
# --------------------------------------------------------------------------------------------------------


def multiply_tool(
    first: str = "a", second: str = "b", description: str = "Multiply two whole numbers and return their product."
) -> dict:
    """The calculator the demo model calls: an OpenAI-style function spec with a JSON schema."""
    return {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {
                    first: {"type": "integer", "description": "The first factor."},
                    second: {"type": "integer", "description": "The second factor."},
                },
                "required": [first, second],
            },
        },
    }


MULTIPLY_TOOL = multiply_tool()
# Specs as clients write them: the model reads the parameter names from the spec it is given
TOOL_SPECS: tuple[tuple[dict, float], ...] = (
    (MULTIPLY_TOOL, 6),
    (multiply_tool(description="Multiply a by b."), 2),
    (multiply_tool("x", "y"), 2),
)
_TOOL_SPEC_WEIGHTS = [w for _, w in TOOL_SPECS]

PRODUCT_PHRASINGS: tuple[tuple[str, float], ...] = (
    ("What is {a} * {b}?", 25),
    ("What is {a} times {b}?", 15),
    ("What is {a} × {b}?", 8),
    ("What's {a} x {b}?", 5),
    ("Multiply {a} by {b}.", 8),
    ("Multiply {a} and {b}.", 5),
    ("What is the product of {a} and {b}?", 6),
    ("Calculate {a} * {b}.", 6),
    ("How much is {a} times {b}?", 4),
    ("Compute {a} × {b}.", 4),
    ("{a} * {b}", 5),
    ("{a}*{b}=?", 3),
)
_PRODUCT_WEIGHTS = [w for _, w in PRODUCT_PHRASINGS]


def product_question(rng: random.Random, a: int, b: int) -> str:
    return rng.choices(PRODUCT_PHRASINGS, weights=_PRODUCT_WEIGHTS)[0][0].format(a=a, b=b)


def product_answer(a: int, b: int) -> str:
    return f"{a} × {b} = {a * b}."


def tool_result(rng: random.Random, value: int) -> str:
    """What a calculator tool returns: the bare number, or a JSON object holding it."""
    return str(value) if rng.random() < 0.8 else json.dumps({"result": value})


def tool_round_trip(rng: random.Random, a: int, b: int, tool: dict, thinking: bool) -> list[dict]:
    """A product asked with the tool offered: the user's question, the assistant's call, the tool's result and
    the answer quoting it."""
    first, second = tool["function"]["parameters"]["required"]
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {first: a, second: b}}}],
    }
    answer = {"role": "assistant", "content": product_answer(a, b)}
    result = tool_result(rng, a * b)
    if thinking:
        call["reasoning_content"] = (
            f"The user asks for {a} × {b}. I cannot multiply reliably on my own, but I "
            f"have the multiply tool, so I call it with {first} = {a} and {second} = {b}."
        )
        answer["reasoning_content"] = f"The multiply tool returned {a * b}, so {a} × {b} = {a * b}."
    return [{"role": "user", "content": product_question(rng, a, b)}, call, {"role": "tool", "content": result}, answer]


# --------------------------------------------------------------------------------------------------------
# The mix
# --------------------------------------------------------------------------------------------------------

# Shares of each kind of conversation in the training stream. Single sums carry most of the arithmetic;
# multi-turn chats (2-8 turns, a loss on every reply) add about four replies each at later positions, so the
# fifth turn and beyond are trained as much as the first; tool conversations teach the call, the answer from
# the result, and not calling when no product is asked.
MIX = {
    "arithmetic": 0.58,  # one sum or difference, thinking on
    "arithmetic_no_think": 0.07,  # thinking off: numbers up to 99, answered directly
    "chat": 0.08,  # small talk, questions about itself, out-of-scope questions
    "chat_no_think": 0.03,
    "multi_turn": 0.14,  # 2-8 turns, mostly mixed sums and differences
    "tool_call": 0.06,  # multiply tool offered, a product asked: call, result, answer
    "tools_no_call": 0.02,  # tool offered, but a sum or small talk: answered without a call
    "product_no_tool": 0.02,  # a product asked without a tool: the model says it needs one
}
MULTI_TURN_TURNS = range(2, 9)  # uniform: half the chats reach a fifth turn


def conversation(rng: random.Random, kind: str | None = None, max_value: int = MAX_OPERAND) -> Conversation:
    """One training conversation; kind is one of MIX's keys (random by MIX's shares when None)."""
    if kind is None:
        kind = rng.choices(list(MIX), weights=list(MIX.values()))[0]
    system = _system(rng)
    if kind == "arithmetic":
        return Conversation(system + arithmetic_turn(rng, *training_problem(rng, max_value)), True, tags=(kind,))
    if kind == "arithmetic_no_think":  # answered without reasoning: small numbers only, learnt by heart
        turn = arithmetic_turn(rng, *training_problem(rng, min(99, max_value)))
        return Conversation(system + _without_reasoning(turn), False, tags=(kind,))
    if kind == "chat":
        return Conversation(system + chat_turn(rng, _chat_intent(rng)), True, tags=(kind,))
    if kind == "chat_no_think":
        return Conversation(system + _without_reasoning(chat_turn(rng, _chat_intent(rng))), False, tags=(kind,))
    if kind == "multi_turn":
        thinking = rng.random() < 0.85
        messages = system + _plain_turns(rng, rng.choice(MULTI_TURN_TURNS), thinking, max_value)
        history = "session" if rng.random() < 0.75 else "template"
        return Conversation(messages, thinking, history, tags=(kind,))
    if kind == "tool_call":
        return _tool_conversation(rng, system, max_value)
    if kind == "tools_no_call":
        tool = rng.choices(TOOL_SPECS, weights=_TOOL_SPEC_WEIGHTS)[0][0]
        turn = (
            arithmetic_turn(rng, *training_problem(rng, max_value))
            if rng.random() < 0.7
            else chat_turn(rng, rng.choice(("greeting", "identity", "capabilities", "thanks")))
        )
        return Conversation(system + turn, True, "template", [tool], tags=(kind,))
    if kind == "product_no_tool":
        thinking = rng.random() < 0.85
        turn = [
            {"role": "user", "content": product_question(rng, _operand(rng, max_value), _operand(rng, max_value))},
            {
                "role": "assistant",
                "content": NO_MULTIPLY_TOOL,
                "reasoning_content": "The user asks for a product. I cannot multiply on my own and no multiply "
                "tool is offered, so I say so.",
            },
        ]
        return Conversation(system + (turn if thinking else _without_reasoning(turn)), thinking, tags=(kind,))
    raise ValueError(f"unknown conversation kind {kind!r}")


def _tool_conversation(rng: random.Random, system: list[dict], max_value: int) -> Conversation:
    """A tool round trip as an API client sends it: sometimes after earlier turns, sometimes followed by one
    more (a thank-you or a sum, answered without a call); sometimes the client sends the call back without its
    reasoning, and then only the answer after the result is learnt."""
    thinking = rng.random() < 0.8
    tool = rng.choices(TOOL_SPECS, weights=_TOOL_SPEC_WEIGHTS)[0][0]
    earlier = _plain_turns(rng, rng.choice((1, 2)), thinking, max_value) if rng.random() < 0.3 else []
    trip = tool_round_trip(rng, _operand(rng, max_value), _operand(rng, max_value), tool, thinking)
    if thinking and rng.random() < 0.25:
        trip[1] = _without_reasoning([trip[1]])[0]
    later = []
    if rng.random() < 0.2:
        later = (
            chat_turn(rng, "thanks")
            if rng.random() < 0.5
            else arithmetic_turn(rng, *training_problem(rng, max_value if thinking else min(99, max_value)))
        )
        later = later if thinking else _without_reasoning(later)
    return Conversation(system + earlier + trip + later, thinking, "template", [tool], tags=("tool_call",))


def conversations(seed: int, n: int, max_value: int = MAX_OPERAND) -> list[Conversation]:
    rng = random.Random(seed)
    return [conversation(rng, max_value=max_value) for _ in range(n)]


# --------------------------------------------------------------------------------------------------------
# Rendering: the chat template through ChatTokenizer, and the training text cut into prompt and targets
# --------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def renderer() -> ChatTokenizer:
    """A ChatTokenizer with the demo's chat template, for rendering text (any tokenizer renders the same text;
    this one exists before the demo's BPE is trained)."""
    from tokenizers import Tokenizer, models

    placeholder = Tokenizer(models.BPE())
    placeholder.add_special_tokens(list(SPECIAL_TOKENS))
    return ChatTokenizer.from_parts(placeholder, CHAT_TEMPLATE, IM_END)


def render_options(conv: Conversation) -> dict:
    """The options the app (history "session") or the server ("template") renders this conversation with."""
    return dict(enable_thinking=conv.enable_thinking, tools=conv.tools, preserve_thinking=conv.history == "session")


def learnt_replies(conv: Conversation) -> list[int]:
    """Indices of the assistant messages the model learns: in the app's history all of them, in an API client's
    those after the last user message (earlier ones render without reasoning, unlike when they were
    generated); with thinking on, only replies that carry their reasoning (a client may drop it)."""
    messages = conv.messages
    last_query = max(i for i, m in enumerate(messages) if m["role"] == "user")
    return [
        i
        for i, m in enumerate(messages)
        if m["role"] == "assistant"
        and (conv.history == "session" or i > last_query)
        and (not conv.enable_thinking or m.get("reasoning_content"))
    ]


def training_segments(conv: Conversation, chat: ChatTokenizer | None = None) -> list[tuple[str, bool]]:
    """The conversation as (text, is_target) pieces; tokenise each piece on its own and concatenate.

    Each learnt reply's prompt is the template's render of the messages before it with the generation prompt,
    as the app or the server feeds it; its target is what that reply adds to the render, up to and with its
    <|im_end|>. Every prompt must continue the text so far, so the pieces joined are one context exactly as
    the model sees it across the turns (ChatSession's state, or the server's request with its cached prefix)."""
    chat = chat or renderer()
    messages, options = conv.messages, render_options(conv)
    learnt = learnt_replies(conv)
    if not learnt or learnt[-1] != len(messages) - 1:
        raise ValueError("a training conversation ends with an assistant message it learns")
    segments, text = [], ""
    for i in learnt:
        prompt = chat.render(messages[:i], add_generation_prompt=True, **options)
        whole = chat.render(messages[: i + 1], add_generation_prompt=False, **options)
        if not prompt.startswith(text) or not whole.startswith(prompt) or not whole.endswith(IM_END + "\n"):
            raise ValueError(f"reply {i} of this conversation does not continue the context before it")
        segments += [(prompt[len(text) :], False), (whole[len(prompt) : -1], True)]
        text = whole[:-1]  # the template's newline after <|im_end|> starts the next prompt
    return segments


def prompt_text(
    question: str, enable_thinking: bool = True, system: str | None = None, tools: list[dict] | None = None
) -> str:
    """The prompt the app (or the server, with tools) feeds for a first user message."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return renderer().render(messages, add_generation_prompt=True, enable_thinking=enable_thinking, tools=tools)


# --------------------------------------------------------------------------------------------------------
# Reading replies: thinking and answer apart, tool calls
# --------------------------------------------------------------------------------------------------------

_TOOL_CALL = re.compile(
    r"<tool_call>\n<function=([^>\n]+)>\n((?:<parameter=[^>\n]+>\n.*?\n</parameter>\n)*)"
    r"</function>\n</tool_call>",
    re.DOTALL,
)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n(.*?)\n</parameter>\n", re.DOTALL)


def split_reply(reply: str) -> tuple[str, str]:
    """(reasoning, answer) of a reply generated after a thinking prompt, as ChatSession stores them."""
    if "</think>" not in reply:
        return "", reply.strip()
    reasoning, answer = reply.split("</think>", 1)
    return reasoning.strip(), answer.strip()


def parse_tool_calls(answer: str) -> tuple[str, list[dict]] | None:
    """(text before the calls, [{"name", "arguments"}]) of an answer in the template's tool-call format
    (argument values read as JSON where they parse, else as text); None when the answer mentions
    <tool_call> but is not that format throughout."""
    calls, position = [], answer.find("<tool_call>")
    if position < 0:
        return answer.strip(), []
    text, rest = answer[:position].strip(), answer[position:]
    while rest:
        match = _TOOL_CALL.match(rest)
        if match is None:
            return None
        arguments = {}
        for name, value in _PARAMETER.findall(match[2]):
            try:
                arguments[name] = json.loads(value)
            except json.JSONDecodeError:
                arguments[name] = value
        calls.append({"name": match[1], "arguments": arguments})
        rest = rest[match.end() :].lstrip("\n")
    return text, calls


def tokenizer_corpus(seed: int, n: int) -> Iterator[str]:
    """Text to train the BPE on: rendered conversations of every kind, plus some generic text."""
    rng = random.Random(seed)
    yield GENERIC_CORPUS
    for intent in INTENTS:  # every fixed phrase at least once
        for prompt in intent.prompts:
            yield prompt
        yield intent.reasoning
        yield from intent.answers
    yield from SYSTEM_PROMPTS
    yield NO_MULTIPLY_TOOL
    for _ in range(n):
        conv = conversation(rng)
        yield "".join(text for text, _ in training_segments(conv))


# --------------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------------

# Qwen3.5's own pre-tokenisation: NFC, this split (\p{N} on its own: every digit is one token), byte-level.
# Hugging Face's Qwen2Tokenizer/Qwen3_5Tokenizer rebuild exactly this pipeline around the vocabulary of
# tokenizer.json, so `transformers` and the `tokenizers` library produce the same ids for this tokenizer.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_tokenizer(corpus, vocab_size: int = 1024):
    """A byte-level BPE trained on corpus (an iterable of strings); SPECIAL_TOKENS take ids 0-8, in order."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer
