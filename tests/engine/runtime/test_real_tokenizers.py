"""ChatTokenizer on the real Qwen3.6 and Qwen3 tokenizer files: the golden encodings of the real tokenizer.json,
and the chat templates rendered exactly as transformers' apply_chat_template renders them, as text and as ids."""

import copy
import itertools
import json

import pytest
from locations import FIXTURES
from transformers import AutoTokenizer

from engine.errors import CheckpointError
from engine.runtime.tokenizer import ChatTokenizer, IncrementalDetokenizer

GOLDEN_PATH = FIXTURES / "real-tokenizers" / "qwen3.6" / "golden-encodings.json"
GOLDEN = json.loads(GOLDEN_PATH.read_text(encoding="utf-8"))["entries"]
NAMES = ("qwen3.6", "qwen3")


@pytest.fixture(scope="module", params=NAMES)
def name(request):
    return request.param


@pytest.fixture(scope="module")
def ours(real_tokenizer_folder):
    return {n: ChatTokenizer.from_folder(real_tokenizer_folder(n)) for n in NAMES}


@pytest.fixture(scope="module")
def theirs(real_tokenizer_folder):
    return {n: AutoTokenizer.from_pretrained(str(real_tokenizer_folder(n))) for n in NAMES}


def test_golden_file_holds_64_encodings():
    assert len(GOLDEN) == 64 and len({e["text"] for e in GOLDEN}) == 64
    assert sum(len(e["ids"]) for e in GOLDEN) > 800  # every entry holds its ids, not a placeholder


@pytest.mark.parametrize("entry", GOLDEN, ids=[f"golden{i:02d}" for i in range(len(GOLDEN))])
def test_golden_encodings_of_qwen3_6(ours, entry):
    tok = ours["qwen3.6"]
    assert tok.encode(entry["text"]) == entry["ids"]
    assert tok.decode(entry["ids"]) == entry["text"]
    detok = IncrementalDetokenizer(tok)  # streamed token by token, the text arrives whole and unchanged
    assert "".join([detok.feed(i) for i in entry["ids"]] + [detok.flush()]) == entry["text"]


def test_qwen3_tokenizer_encodes_the_golden_texts_like_transformers(ours, theirs):
    tok, reference = ours["qwen3"], theirs["qwen3"]
    for entry in GOLDEN:
        ids = tok.encode(entry["text"])
        assert ids == reference.encode(entry["text"], add_special_tokens=False)
        assert tok.decode(ids) == entry["text"]


def test_special_tokens_and_generation_defaults(ours):
    qwen36, qwen3 = ours["qwen3.6"], ours["qwen3"]
    assert qwen36.vocab_size == 248_044 + 33 and qwen3.vocab_size == 151_643 + 26
    assert qwen36.eos_token_ids == {qwen36.token_id("<|im_end|>"), qwen36.token_id("<|endoftext|>")} == {248046, 248044}
    assert qwen3.eos_token_ids == {151645, 151643}
    for tok in (qwen36, qwen3):
        assert (tok.think_start, tok.think_end) == ("<think>", "</think>")
    assert (qwen36.generation_defaults["temperature"], qwen3.generation_defaults["temperature"]) == (1.0, 0.6)


def test_transformers_reads_the_same_template(real_tokenizer_folder, theirs):
    folder = real_tokenizer_folder("qwen3.6")
    assert theirs["qwen3.6"].chat_template == (folder / "chat_template.jinja").read_text(encoding="utf-8")
    config = json.loads((real_tokenizer_folder("qwen3") / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert theirs["qwen3"].chat_template == config["chat_template"]
    assert "preserve_thinking" in theirs["qwen3.6"].chat_template
    assert "preserve_thinking" not in theirs["qwen3"].chat_template


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Wetter für <Ort> & 🌦 — current conditions",
            "parameters": {
                "type": "object",
                "required": ["city"],
                "properties": {
                    "city": {"type": "string", "description": 'City name, e.g. "Paris"'},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1}},
            },
        },
    },
]


def _tool_call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATIONS = {
    "multi_turn": [
        {"role": "user", "content": "Hi 😀, wie geht's?"},
        {"role": "assistant", "content": "Gut, danke! 你好"},
        {"role": "user", "content": "  Tell me a joke.\n"},
        {"role": "assistant", "content": "Why did the 🐔 cross the road?"},
        {"role": "user", "content": "Another one, please."},
    ],
    "system": [
        {"role": "system", "content": "You are terse. Antworte kurz."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "reasoning": [
        {"role": "system", "content": "Think first."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "\nSimple sum: 2 and 2 make 4.\n"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "<think>\nInline reasoning in the content.\n</think>\n\n6"},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "You're welcome.", "reasoning_content": "Be polite."},
    ],
    "tool_calls": [
        {"role": "system", "content": "Use tools when they help."},
        {"role": "user", "content": "Weather in Paris and news about it?"},
        {
            "role": "assistant",
            "content": "Let me check both.",
            "reasoning_content": "Two tools are needed.",
            "tool_calls": [
                _tool_call("get_weather", {"city": "Paris", "unit": "celsius"}),
                _tool_call("search", {"query": "Paris news 🗼", "limit": 3, "filters": {"lang": "fr"}}),
            ],
        },
        {"role": "tool", "content": '{"temp": 21, "sky": "sunny"}'},
        {"role": "tool", "content": "1. Seine festival\n2. Metro works"},
        {"role": "tool", "content": "(no more results)"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "One more lookup.",
            "tool_calls": [_tool_call("search", {"query": "Louvre hours"})],
        },
        {"role": "tool", "content": "9:00-18:00"},
        {
            "role": "assistant",
            "content": "It is 21 °C and sunny; the Louvre opens at 9.",
            "reasoning_content": "Summarise the results.",
        },
        {"role": "user", "content": "Merci!"},
    ],
    "tool_response_last": [
        {"role": "user", "content": "Search for cats."},
        {"role": "assistant", "content": "", "tool_calls": [_tool_call("search", {"query": "cats"})]},
        {"role": "tool", "content": "Cats are great."},
        {"role": "tool", "content": "Cats sleep a lot."},
    ],
}
STRING_ARGUMENTS = [
    {"role": "user", "content": "Weather?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [_tool_call("get_weather", '{"city":"Paris",  "unit": "celsius"}')],
    },
    {"role": "tool", "content": "sunny"},
]
OPTIONS = [
    dict(zip(("add_generation_prompt", "enable_thinking", "preserve_thinking"), values))
    for values in itertools.product((True, False), repeat=3)
]


def _compare(tok, reference, messages, tools=None, **options):
    """Assert our render equals transformers' as text and as token ids; return the text."""
    options.setdefault("add_generation_prompt", True)  # ours opens a reply by default, transformers does not
    text = tok.render(copy.deepcopy(messages), tools=copy.deepcopy(tools), **options)
    expected = reference.apply_chat_template(
        copy.deepcopy(messages), tools=copy.deepcopy(tools), tokenize=False, **options
    )
    assert text == expected
    expected_ids = reference.apply_chat_template(
        copy.deepcopy(messages), tools=copy.deepcopy(tools), tokenize=True, return_dict=True, **options
    )["input_ids"]
    assert tok.encode(text) == expected_ids
    return text


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("with_tools", [False, True], ids=["no_tools", "tools"])
def test_render_matches_transformers(ours, theirs, name, conversation, with_tools):
    for options in OPTIONS:
        _compare(ours[name], theirs[name], CONVERSATIONS[conversation], TOOLS if with_tools else None, **options)


def test_tools_go_into_the_system_turn(ours, theirs, name):
    text = _compare(ours[name], theirs[name], CONVERSATIONS["system"], TOOLS)
    assert text.startswith("<|im_start|>system\n") and text.count("<|im_start|>system") == 1
    assert '"description": "Wetter für <Ort> & 🌦 — current conditions"' in text  # JSON, unescaped
    assert "You are terse. Antworte kurz." in text.split("<|im_end|>")[0]


def test_tool_calls_and_consecutive_tool_responses(ours, theirs, name):
    text = _compare(ours[name], theirs[name], CONVERSATIONS["tool_calls"], TOOLS)
    turns = text.split("<|im_end|>", 1)[1]  # after the system turn, whose instructions show a call
    assert turns.count("<tool_call>") == 3 and turns.count("<tool_response>") == 4
    # the three responses in a row share one user turn
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21' in text
    assert "Metro works\n</tool_response>\n<tool_response>\n(no more results)\n</tool_response><|im_end|>" in text
    if name == "qwen3.6":
        assert "<function=search>\n<parameter=query>\nParis news 🗼\n</parameter>\n<parameter=limit>\n3\n" in text
        assert '<parameter=filters>\n{"lang": "fr"}\n</parameter>' in text
    else:
        assert (
            '{"name": "search", "arguments": {"query": "Paris news 🗼", "limit": 3, "filters": {"lang": "fr"}}}' in text
        )


def test_string_arguments(ours, theirs, name):
    """Qwen3's template writes a JSON-string argument as it is; Qwen3.6's takes only a dict, as in transformers."""
    if name == "qwen3":
        text = _compare(ours[name], theirs[name], STRING_ARGUMENTS)
        assert '"arguments": {"city":"Paris",  "unit": "celsius"}}' in text
        return
    with pytest.raises(TypeError, match="mapping"):
        theirs[name].apply_chat_template(copy.deepcopy(STRING_ARGUMENTS), tokenize=False)
    with pytest.raises(CheckpointError, match="fails to render") as error:
        ours[name].render(STRING_ARGUMENTS)
    assert "arguments as a dict" in error.value.hint


def test_thinking_switch_and_generation_prompt(ours, theirs, name):
    messages = CONVERSATIONS["system"]
    head = "<|im_start|>system\nYou are terse. Antworte kurz.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    thinking_prompt = "<think>\n" if name == "qwen3.6" else ""  # Qwen3.6 opens the reasoning itself
    assert _compare(ours[name], theirs[name], messages) == head + "<|im_start|>assistant\n" + thinking_prompt
    assert _compare(ours[name], theirs[name], messages, enable_thinking=False) == (
        head + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert _compare(ours[name], theirs[name], messages, add_generation_prompt=False) == head


def test_earlier_reasoning_is_dropped_unless_preserved(ours, theirs, name):
    messages = CONVERSATIONS["reasoning"]
    default = _compare(ours[name], theirs[name], messages, add_generation_prompt=False)
    preserved = _compare(ours[name], theirs[name], messages, add_generation_prompt=False, preserve_thinking=True)
    last_turn = "<|im_start|>assistant\n<think>\nBe polite.\n</think>\n\nYou're welcome.<|im_end|>\n"
    assert default.endswith(last_turn)  # the reply after the last user message keeps its reasoning
    assert "Simple sum" not in default and "Inline reasoning" not in default
    assert "<|im_start|>assistant\n4<|im_end|>" in default and "<|im_start|>assistant\n6<|im_end|>" in default
    if name == "qwen3":
        assert preserved == default  # Qwen3's template has no such option
        return
    assert preserved.endswith(last_turn)
    assert "<|im_start|>assistant\n<think>\nSimple sum: 2 and 2 make 4.\n</think>\n\n4<|im_end|>" in preserved
    assert "<|im_start|>assistant\n<think>\nInline reasoning in the content.\n</think>\n\n6<|im_end|>" in preserved
