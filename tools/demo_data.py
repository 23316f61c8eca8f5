"""Synthetic conversations for MoE Desk's built-in demo model, and their rendering into training text.

The demo model does three things: small talk, saying what it is, and adding or subtracting whole numbers
from 0 to 999. Arithmetic replies think first: the <think> block works the sum digit by digit from the
right, one line per place ("Ones: 7 + 6 = 13, write 3, carry 1."), in a format so regular that a model of a
few million parameters can learn the procedure instead of memorising a million sums.

Everything here is deterministic for a given seed. A fixed 2 % of the (A, B, operator) problems, chosen by a
hash, never appears in generated training data, so the evaluation can measure generalisation on them
(`is_held_out`, `held_out_pairs`, `sample_problems`).

Training text is the chat template's output exactly as inference sees it: the prompt part is what
ChatSession feeds (render(..., add_generation_prompt=True, enable_thinking=...)), the target is the text
the model generates after it plus <|im_end|>. Prompt and target are tokenised separately, as the app
tokenises a prompt and then appends generated tokens, so token boundaries match too (`training_segments`).

Only the standard library and `tokenizers`/`jinja2` are used, so this runs wherever the training script runs.
"""

from __future__ import annotations

import importlib.util
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load_tiny_tokenizer_module():
    """engine/testing/tiny_tokenizer.py by path, so the engine package (torch, safetensors) is not imported."""
    path = ROOT / "engine" / "testing" / "tiny_tokenizer.py"
    spec = importlib.util.spec_from_file_location("_moedesk_tiny_tokenizer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_TINY = _load_tiny_tokenizer_module()
CHAT_TEMPLATE: str = _TINY.CHAT_TEMPLATE
SPECIAL_TOKENS: tuple[str, ...] = _TINY.SPECIAL_TOKENS  # <|endoftext|> <|im_end|> <|im_start|> <think> </think>
GENERIC_CORPUS: str = _TINY.CORPUS  # a little varied text, so the vocabulary is not only our phrases

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
MAX_OPERAND = 999
HELD_OUT_PER_MILLE = 20  # 2 % of all problems are held out of training
PLACES = ("Ones", "Tens", "Hundreds", "Thousands")

# --------------------------------------------------------------------------------------------------------
# Fixed texts: what the demo model says about itself
# --------------------------------------------------------------------------------------------------------

IDENTITY = ("I am the built-in demo model of MoE Desk: a tiny mixture-of-experts model, made so the app "
            "works before you download anything. I can only make small talk and "
            "add or subtract whole numbers from 0 to 999. For real questions, download a real model from the "
            "Models page.")
CAPABILITIES = ("I can make small talk and add or subtract whole numbers from 0 to 999, for example "
                "\"What is 457 + 386?\". I am only MoE Desk's built-in demo model; for anything else, "
                "download a real model from the Models page.")
OUT_OF_SCOPE = ("I can't help with that: I am only MoE Desk's built-in demo model, and all I can do is small "
                "talk and adding or subtracting whole numbers from 0 to 999. Download a real model from the "
                "Models page for questions like this.")
REAL_MODEL = ("Open the Models page, choose a model and download it; then select it for your chat. I am only "
              "the built-in demo model, so a real model will answer far better.")


@dataclass(frozen=True)
class Intent:
    """A kind of small-talk message: what users write, what the model thinks, what it answers."""

    name: str
    prompts: tuple[str, ...]
    reasoning: str
    answers: tuple[str, ...]


INTENTS: tuple[Intent, ...] = (
    Intent("greeting",
           ("Hi", "Hi!", "Hello", "Hello!", "Hey", "Hey!", "Hi there", "Hello there!", "Good morning",
            "Good morning!", "Good afternoon", "Good evening", "Greetings", "hi", "hello", "hey there", "Yo",
            "Hiya", "Howdy"),
           "The user greets me. I greet them back and say what I can help with.",
           ("Hello! I'm MoE Desk's demo model. I can make small talk and add or subtract numbers from 0 to 999. "
            "What would you like to calculate?",)),
    Intent("how_are_you",
           ("How are you?", "How are you doing?", "How's it going?", "how are you", "What's up?",
            "How do you do?", "Are you well?", "How are you today?"),
           "The user asks how I am. I answer kindly and offer to help.",
           ("I'm doing well, thank you! I'm ready to add or subtract some numbers for you.",)),
    Intent("thanks",
           ("Thanks!", "Thanks", "Thank you", "Thank you!", "Thank you very much!", "thx", "Thanks a lot!",
            "Great, thanks!", "Cool, thank you.", "Perfect, thanks!"),
           "The user thanks me. I reply politely.",
           ("You're welcome! Ask me another sum whenever you like.",)),
    Intent("goodbye",
           ("Bye", "Bye!", "Goodbye", "Goodbye!", "See you", "See you later!", "Good night", "Ciao",
            "That's all, bye!"),
           "The user says goodbye. I say goodbye too.",
           ("Goodbye! Have a nice day.",)),
    Intent("identity",
           ("Who are you?", "What are you?", "What model are you?", "Which model are you?", "What is your name?",
            "What's your name?", "Tell me about yourself.", "Introduce yourself.", "Are you ChatGPT?",
            "Are you a real AI?", "Are you Qwen?", "What kind of model are you?", "who are you",
            "Are you the demo model?", "How big are you?"),
           "The user asks what I am. I am MoE Desk's built-in demo model, and I should say so truthfully.",
           (IDENTITY,)),
    Intent("capabilities",
           ("What can you do?", "What can you help me with?", "Can you help me?", "What are you good at?",
            "What do you know?", "Help", "help", "What should I ask you?", "How do I use you?",
            "What are your limits?"),
           "The user asks what I can do. I can only make small talk and add or subtract numbers from 0 to 999.",
           (CAPABILITIES,)),
    Intent("real_model",
           ("How do I get a better model?", "How can I download a real model?", "Where do I get a real model?",
            "How do I use a bigger model?", "Can I use a smarter model?", "How do I download Qwen?"),
           "The user wants a real model. Real models are downloaded from the Models page.",
           (REAL_MODEL,)),
    Intent("out_of_scope",
           ("What is the capital of France?", "Write a poem about the sea.", "Explain quantum physics.",
            "Translate 'good morning' into French.", "Write a Python function that sorts a list.",
            "What is 12 times 7?", "What is 144 divided by 12?", "Tell me a joke.", "What's the weather today?",
            "Summarize this article for me.", "Who won the World Cup in 2018?", "What is the square root of 81?",
            "Can you write an email to my boss?", "What is the meaning of life?", "Recommend a good book.",
            "How do I cook pasta?", "What year is it?", "Solve x + 3 = 7."),
           "The user asks something I cannot do. I only do small talk and adding or subtracting whole numbers "
           "from 0 to 999, so I say so and point to the Models page.",
           (OUT_OF_SCOPE,)),
)
INTENT_BY_NAME = {intent.name: intent for intent in INTENTS}

SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are MoE Desk's demo model.", "Be concise.",
                  "You are a friendly assistant that helps with arithmetic.", "Answer briefly.",
                  "You are a helpful assistant. Think step by step.")

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
VERB_PHRASINGS = {"+": ("Add {a} and {b}.", "What do you get if you add {a} and {b}?", "What is the sum of {a} and {b}?"),
                  "-": ("Subtract {b} from {a}.", "What do you get if you subtract {b} from {a}?",
                        "What is {a} take away {b}?")}

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
            lines.append(f"{PLACES[i]}: {x} - {y}{owed} is negative, so borrow: 1{x} - {y}{owed} = {value}, "
                         f"write {value}, borrow 1.")
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


def sample_problems(rng: random.Random, n: int, held_out: bool, max_value: int = MAX_OPERAND) -> list[tuple[int, int, str]]:
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
    """Messages (system optional, then user/assistant turns; each assistant message carries its
    reasoning_content) and the thinking mode the whole conversation runs in."""

    messages: list[dict]
    enable_thinking: bool = True
    # "session": earlier replies stay in the context with their reasoning, as ChatSession feeds them;
    # "template": the prompt is a fresh render of the history, which drops earlier reasoning
    history: str = "session"
    tags: tuple[str, ...] = field(default=())


def _operand(rng: random.Random, max_value: int) -> int:
    """Mostly 3-digit numbers, some 2- and 1-digit ones (when max_value allows)."""
    digits = len(str(max_value))
    weights = {1: (1,), 2: (1, 2), 3: (1, 2, 7)}[min(digits, 3)]
    n = rng.choices(range(1, len(weights) + 1), weights=weights)[0]
    low = 0 if n == 1 else 10 ** (n - 1)
    return rng.randint(low, min(10 ** n - 1, max_value))


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
    return [{"role": "user", "content": question_text(rng, a, b, op)},
            {"role": "assistant", "content": arithmetic_answer(a, b, op),
             "reasoning_content": arithmetic_reasoning(a, b, op)}]


def chat_turn(rng: random.Random, intent: Intent | str) -> list[dict]:
    if isinstance(intent, str):
        intent = INTENT_BY_NAME[intent]
    return [{"role": "user", "content": rng.choice(intent.prompts)},
            {"role": "assistant", "content": rng.choice(intent.answers), "reasoning_content": intent.reasoning}]


def _chat_intent(rng: random.Random) -> Intent:
    weights = {"greeting": 5, "how_are_you": 2, "thanks": 2, "goodbye": 1, "identity": 4, "capabilities": 3,
               "real_model": 1, "out_of_scope": 4}
    return INTENT_BY_NAME[rng.choices(list(weights), weights=list(weights.values()))[0]]


def _system(rng: random.Random) -> list[dict]:
    if rng.random() < 0.8:
        return []
    return [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}]


# Shares of each kind of conversation in the training stream
MIX = {"arithmetic": 0.73, "arithmetic_no_think": 0.08, "chat": 0.09, "chat_no_think": 0.03, "multi_turn": 0.07}


def conversation(rng: random.Random, kind: str | None = None, max_value: int = MAX_OPERAND) -> Conversation:
    """One training conversation; kind is one of MIX's keys (random by MIX's shares when None)."""
    if kind is None:
        kind = rng.choices(list(MIX), weights=list(MIX.values()))[0]
    system = _system(rng)
    if kind == "arithmetic":
        return Conversation(system + arithmetic_turn(rng, *training_problem(rng, max_value)), True, tags=(kind,))
    if kind == "arithmetic_no_think":  # answered without reasoning: small numbers only, learnt by heart
        return Conversation(system + arithmetic_turn(rng, *training_problem(rng, min(99, max_value))), False,
                            tags=(kind,))
    if kind == "chat":
        return Conversation(system + chat_turn(rng, _chat_intent(rng)), True, tags=(kind,))
    if kind == "chat_no_think":
        return Conversation(system + chat_turn(rng, _chat_intent(rng)), False, tags=(kind,))
    if kind == "multi_turn":
        turns = rng.choice((2, 2, 2, 3))
        messages = list(system)
        for t in range(turns):
            if t == 0 and rng.random() < 0.35:
                messages += chat_turn(rng, rng.choice(("greeting", "how_are_you", "identity")))
            elif t > 0 and rng.random() < 0.25:
                messages += chat_turn(rng, rng.choice(("thanks", "thanks", "goodbye", "identity")))
            else:
                messages.append(None)  # an arithmetic turn, filled in once the thinking mode is known
        thinking = rng.random() < 0.85
        limit = max_value if thinking else min(99, max_value)  # no reasoning: only sums small enough to memorise
        filled = []
        for m in messages:
            filled += arithmetic_turn(rng, *training_problem(rng, limit)) if m is None else [m]
        messages = filled
        history = "session" if rng.random() < 0.75 else "template"
        return Conversation(messages, thinking, history, tags=(kind,))
    raise ValueError(f"unknown conversation kind {kind!r}")


def conversations(seed: int, n: int, max_value: int = MAX_OPERAND) -> list[Conversation]:
    rng = random.Random(seed)
    return [conversation(rng, max_value=max_value) for _ in range(n)]


# --------------------------------------------------------------------------------------------------------
# Rendering: the chat template, and the training text cut into prompt and target segments
# --------------------------------------------------------------------------------------------------------


def jinja_render(messages: list[dict], add_generation_prompt: bool = True, enable_thinking: bool = True) -> str:
    """The chat template rendered by Jinja the way Hugging Face (and ChatTokenizer) renders it. Slow; the
    training loop uses `render`, which tests check against this and against ChatTokenizer."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    global _JINJA_TEMPLATE
    if _JINJA_TEMPLATE is None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])

        def raise_exception(message):
            raise ValueError(message)

        env.globals["raise_exception"] = raise_exception
        _JINJA_TEMPLATE = env.from_string(CHAT_TEMPLATE)
    return _JINJA_TEMPLATE.render(messages=messages, tools=None, add_generation_prompt=add_generation_prompt,
                                  enable_thinking=enable_thinking, eos_token=IM_END)


_JINJA_TEMPLATE = None


def render(messages: list[dict], add_generation_prompt: bool = True, enable_thinking: bool = True) -> str:
    """CHAT_TEMPLATE's output for plain system/user/assistant conversations (no tools, string contents), in
    plain Python: Jinja is too slow to render a million training samples."""
    out = []
    if messages[0]["role"] == "system":
        out.append(f"{IM_START}system\n{messages[0]['content'].strip()}{IM_END}\n")
    last_query = max(i for i, m in enumerate(messages) if m["role"] == "user")
    for i, message in enumerate(messages):
        role, content = message["role"], message["content"].strip()
        if role == "system":
            if i:
                raise ValueError("System message must be at the beginning.")
        elif role == "user":
            out.append(f"{IM_START}user\n{content}{IM_END}\n")
        elif role == "assistant":
            reasoning = message.get("reasoning_content")
            if not isinstance(reasoning, str):
                reasoning = ""
                if "</think>" in content:
                    reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                    content = content.split("</think>")[-1].lstrip("\n")
            if i > last_query:
                out.append(f"{IM_START}assistant\n<think>\n{reasoning.strip()}\n</think>\n\n{content}")
            else:
                out.append(f"{IM_START}assistant\n{content}")
            out.append(f"{IM_END}\n")
        else:
            raise ValueError(f"unexpected role {role!r}")
    if add_generation_prompt:
        out.append(f"{IM_START}assistant\n" + ("<think>\n\n</think>\n\n" if enable_thinking is False else "<think>\n"))
    return "".join(out)


def generated_text(message: dict, enable_thinking: bool) -> str:
    """What the model writes after the generation prompt for this assistant message, up to <|im_end|>."""
    content = message["content"].strip()
    if not enable_thinking:
        return content
    return f"{message['reasoning_content'].strip()}\n</think>\n\n{content}"


_SENTINEL = "\u2063moedesk-turn-boundary\u2063"  # the same trick ChatSession uses


def _continuation(new_messages: list[dict], enable_thinking: bool) -> str:
    """The text ChatSession feeds after a finished reply (whose <|im_end|> the model generated itself)."""
    framed = [{"role": "user", "content": _SENTINEL}, {"role": "assistant", "content": _SENTINEL}]
    text = render(framed + new_messages, add_generation_prompt=True, enable_thinking=enable_thinking)
    text = text.rsplit(_SENTINEL, 1)[1]
    if not text.startswith(IM_END):
        raise AssertionError("the template no longer ends a reply with <|im_end|>")
    return text[len(IM_END):]


def training_segments(conv: Conversation) -> list[tuple[str, bool]]:
    """The conversation as (text, is_target) pieces; tokenise each piece on its own and concatenate.

    Targets are the model's own replies, each ending in <|im_end|>. "session" history puts every reply in
    the context as ChatSession does (a loss on each reply); "template" history renders the prompt of the last
    reply afresh from all earlier messages (a loss on the last reply only)."""
    messages, thinking = conv.messages, conv.enable_thinking
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not replies or replies[-1] != len(messages) - 1:
        raise ValueError("a training conversation ends with an assistant message")
    if conv.history == "template" or len(replies) == 1:
        last = replies[-1]
        return [(render(messages[:last], True, thinking), False),
                (generated_text(messages[last], thinking) + IM_END, True)]
    segments = []
    start = 0
    for i in replies:
        if start == 0:
            segments.append((render(messages[:i], True, thinking), False))
        else:
            segments.append((_continuation(messages[start:i], thinking), False))
        segments.append((generated_text(messages[i], thinking) + IM_END, True))
        start = i + 1
    return segments


def prompt_text(question: str, enable_thinking: bool = True, system: str | None = None) -> str:
    """The prompt the app feeds for a first user message."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return render(messages, True, enable_thinking)


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
    for _ in range(n):
        conv = conversation(rng)
        yield "".join(text for text, _ in training_segments(conv))


# --------------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------------

# Qwen3.5's own pre-tokenisation: NFC, this split (\p{N} on its own: every digit is one token), byte-level.
# Hugging Face's Qwen2Tokenizer/Qwen3_5Tokenizer rebuild exactly this pipeline around the vocabulary of
# tokenizer.json, so `transformers` and the `tokenizers` library produce the same ids for this tokenizer.
PRETOKENIZE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                     r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def build_tokenizer(corpus, vocab_size: int = 1024):
    """A byte-level BPE trained on corpus (an iterable of strings); the special tokens take ids 0-4."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=2,
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer
