"""ChatTokenizer and IncrementalDetokenizer on the tiny Qwen-style tokenizer: round trips, special tokens,
the chat template (checked against transformers' renderer), eos ids, streaming text and folder errors."""

import json
import random
import shutil

import pytest
from transformers import PreTrainedTokenizerFast

from engine.errors import CheckpointError
from engine.runtime.tokenizer import ChatTokenizer, IncrementalDetokenizer
from engine.testing.tiny_tokenizer import CHAT_TEMPLATE, write_tiny_tokenizer

TEXTS = {
    "ascii": "The quick brown fox jumps over the lazy dog. It's 42!",
    "cjk": "你好，世界！人工智能正在改变世界。こんにちは、안녕하세요",
    "emoji": "Party 🎉🚀 family 👨‍👩‍👧 flag 🇫🇷 heart ❤️ 🦖",
    "code": 'def f(x: int) -> int:\n    return {"a": x * 2}["a"]  # ok\n\tprint(f"{x!r}")\r\n',
    "mixed": "Grüße 😀 — café\n\n你好 <tag> & 'quotes' \u00a0\u200b",
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    return folder, write_tiny_tokenizer(folder)


@pytest.fixture(scope="module")
def folder(written):
    return written[0]


@pytest.fixture(scope="module")
def special_ids(written):
    return written[1]


@pytest.fixture(scope="module")
def tok(folder):
    return ChatTokenizer.from_folder(folder)


@pytest.fixture
def model_copy(folder, tmp_path):
    """A fresh copy of the tokenizer folder that a test may change."""
    target = tmp_path / "model"
    shutil.copytree(folder, target)
    return target


def test_writer_writes_the_tokenizer_files_and_returns_the_special_ids(folder, special_ids, tok):
    assert sorted(p.name for p in folder.iterdir()) == [
        "chat_template.jinja",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert special_ids == {
        "eos": tok.token_id("<|im_end|>"),
        "im_start": tok.token_id("<|im_start|>"),
        "endoftext": tok.token_id("<|endoftext|>"),
        "think_start": tok.token_id("<think>"),
        "think_end": tok.token_id("</think>"),
    }
    assert len(set(special_ids.values())) == 5 and all(0 <= i < 320 for i in special_ids.values())
    assert tok.vocab_size == 320
    assert (tok.think_start, tok.think_end) == ("<think>", "</think>")


def test_writer_builds_the_vocabulary_size_asked_for(tmp_path):
    write_tiny_tokenizer(tmp_path, vocab_size=300)
    assert ChatTokenizer.from_folder(tmp_path).vocab_size == 300


@pytest.mark.parametrize("name", TEXTS)
def test_encode_decode_round_trip(tok, name):
    ids = tok.encode(TEXTS[name])
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == TEXTS[name]


def test_special_tokens_in_text_become_their_ids(tok, special_ids):
    ids = special_ids
    encoded = tok.encode("<|im_start|>user\nhi<|im_end|><think>x</think><|endoftext|>")
    assert encoded[0] == ids["im_start"]  # and no BOS before it
    assert [i for i in encoded if i in ids.values()] == [
        ids["im_start"],
        ids["eos"],
        ids["think_start"],
        ids["think_end"],
        ids["endoftext"],
    ]
    assert tok.decode(encoded) == "<|im_start|>user\nhi<|im_end|><think>x</think><|endoftext|>"
    assert tok.decode(encoded, skip_special_tokens=True) == "user\nhix"
    assert tok.token_id("<|im_end|>") == ids["eos"] and tok.token_id("no such token") is None


def test_render_system_and_user(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert tok.render(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )


def test_render_drops_the_reasoning_of_earlier_turns(tok):
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nSimple sum.\n</think>\n\n4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "Another sum."},
        {"role": "user", "content": "Thanks"},
    ]
    assert tok.render(messages, add_generation_prompt=False) == (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n6<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
    )


def test_render_keeps_the_reasoning_of_the_reply_in_progress(tok):
    # After the last user query (a tool-calling turn), the assistant's reasoning stays in the prompt.
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "<think>Need the tool.</think>Checking.",
            "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny"},
    ]
    assert tok.render(messages, enable_thinking=False) == (
        "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n"
        "Checking.\n\n<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_render_generation_prompt_follows_enable_thinking(tok):
    messages = [{"role": "user", "content": "Hi"}]
    prefix = "<|im_start|>user\nHi<|im_end|>\n"
    assert tok.render(messages, enable_thinking=True) == prefix + "<|im_start|>assistant\n<think>\n"
    assert tok.render(messages, enable_thinking=False) == prefix + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tok.render(messages, add_generation_prompt=False) == prefix


def test_render_puts_tools_in_the_system_turn_without_escaping(tok):
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Wörter <suchen> & finden"}}]
    text = tok.render([{"role": "system", "content": "Sys"}, {"role": "user", "content": "q"}], tools=tools)
    assert text.startswith(
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
        '{"type": "function", "function": {"name": "lookup", "description": '
        '"Wörter <suchen> & finden"}}\n</tools>'
    )
    assert "</IMPORTANT>\n\nSys<|im_end|>\n<|im_start|>user\nq<|im_end|>\n" in text


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_render_matches_transformers(folder, tok, enable_thinking):
    reference = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), chat_template=CHAT_TEMPLATE)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "Wetter für <Ort> & 🌦",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "system", "content": "You are helpful. 你好"},
        {"role": "user", "content": "Hi 😀"},
        {"role": "assistant", "content": "<think>\ngreet\n</think>\n\nHello!"},
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "use the tool",
            "tool_calls": [
                {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris", "days": [1, 2]}}}
            ],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "22 °C"},
    ]
    for kwargs in ({}, {"tools": tools}):
        ours = tok.render(messages, enable_thinking=enable_thinking, **kwargs)
        theirs = reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking, **kwargs
        )
        assert ours == theirs


def _write_generation_config(folder, eos_token_id):
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_token_id, "temperature": 0.6}))
    return ChatTokenizer.from_folder(folder)


def test_eos_ids_join_generation_config_and_tokenizer_config(tok, model_copy, special_ids):
    im_end, endoftext = special_ids["eos"], special_ids["endoftext"]
    assert tok.eos_token_ids == frozenset({im_end}) and tok.generation_defaults == {}
    single = _write_generation_config(model_copy, endoftext)
    assert single.eos_token_ids == frozenset({im_end, endoftext})
    assert single.generation_defaults == {"eos_token_id": endoftext, "temperature": 0.6}
    assert _write_generation_config(model_copy, [endoftext, 7]).eos_token_ids == frozenset({im_end, endoftext, 7})
    with pytest.raises(CheckpointError, match="eos_token_id"):
        _write_generation_config(model_copy, "<|im_end|>")


def _partial_character_tokens(tok, ids):
    """How many of ids hold only part of a character's UTF-8 bytes at either end."""
    return sum(tok.decode([i]).endswith("\ufffd") or tok.decode([i]).startswith("\ufffd") for i in ids)


def _stream(tok, ids, skip_special_tokens=False):
    detok = IncrementalDetokenizer(tok, skip_special_tokens)
    return [detok.feed(i) for i in ids] + [detok.flush()]


def _assert_clean(pieces):
    for piece in pieces:
        assert "\ufffd" not in piece
        assert not any(0xD800 <= ord(c) <= 0xDFFF for c in piece)


@pytest.mark.parametrize("name", ["cjk", "emoji", "mixed"])
def test_detokenizer_never_emits_a_broken_character(tok, name):
    ids = tok.encode(TEXTS[name])
    assert _partial_character_tokens(tok, ids) > 0  # the text really does split characters across tokens
    pieces = _stream(tok, ids)
    _assert_clean(pieces)
    assert "".join(pieces) == tok.decode(ids) == TEXTS[name]


@pytest.mark.parametrize("character", ["🦖", "龍"])
def test_detokenizer_emits_a_character_on_the_token_that_completes_it(tok, character):
    ids = tok.encode(character)
    assert len(ids) > 1
    assert _stream(tok, ids) == [""] * (len(ids) - 1) + [character, ""]


def test_detokenizer_concatenates_to_decode_on_random_streams(tok, special_ids):
    rng = random.Random(0)
    alphabet = "".join(TEXTS.values())
    specials = sorted(special_ids.values())
    for _ in range(50):
        ids = []
        for _ in range(rng.randint(1, 6)):
            ids += tok.encode("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))))
            ids.append(rng.choice(specials))
        for skip in (False, True):
            pieces = _stream(tok, ids, skip)
            _assert_clean(pieces)
            assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)


def test_detokenizer_flush_returns_an_unfinished_character(tok):
    ids = tok.encode("ok 🦖")
    pieces = _stream(tok, ids[:-1])
    assert pieces[-1].endswith("\ufffd") and "".join(pieces) == tok.decode(ids[:-1])


def test_detokenizer_decodes_a_bounded_window(tok, monkeypatch):
    decoded_lengths = []
    decode = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, **kw: decoded_lengths.append(len(ids)) or decode(ids, **kw))
    ids = tok.encode(TEXTS["mixed"] * 200)
    assert "".join(_stream(tok, ids)) == TEXTS["mixed"] * 200
    assert max(decoded_lengths) <= 8


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(CheckpointError, match="has no tokenizer.json") as error:
        ChatTokenizer.from_folder(tmp_path)
    assert error.value.path == tmp_path and "download" in error.value.hint


def test_damaged_files(model_copy):
    (model_copy / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer_config.json: is not valid JSON"):
        ChatTokenizer.from_folder(model_copy)
    (model_copy / "tokenizer.json").write_text('{"model": 1}')
    with pytest.raises(CheckpointError, match="tokenizer.json: cannot be read as a tokenizer"):
        ChatTokenizer.from_folder(model_copy)


def test_chat_template_that_does_not_parse(model_copy):
    (model_copy / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}")
    with pytest.raises(CheckpointError, match="chat_template.jinja: has a chat template that does not parse") as error:
        ChatTokenizer.from_folder(model_copy)
    assert "original repository" in error.value.hint


def test_chat_template_that_fails_to_render(model_copy):
    (model_copy / "chat_template.jinja").write_text("{{ messages[0].content + 1 }}")
    tok = ChatTokenizer.from_folder(model_copy)
    with pytest.raises(CheckpointError, match="chat template fails to render") as error:
        tok.render([{"role": "user", "content": "hi"}])
    assert error.value.path == model_copy / "chat_template.jinja" and "replace chat_template.jinja" in error.value.hint


def test_chat_template_that_rejects_the_conversation(tok):
    with pytest.raises(CheckpointError, match="rejects this conversation: No user query found"):
        tok.render([{"role": "assistant", "content": "hello"}])


def test_chat_template_from_tokenizer_config(model_copy):
    (model_copy / "chat_template.jinja").unlink()
    config = json.loads((model_copy / "tokenizer_config.json").read_text())
    named = [{"name": "tool_use", "template": "tool use"}, {"name": "default", "template": "default"}]
    for template, rendered in (("config:{{ eos_token }}", "config:<|im_end|>"), (named, "default")):
        config["chat_template"] = template
        (model_copy / "tokenizer_config.json").write_text(json.dumps(config))
        assert ChatTokenizer.from_folder(model_copy).render([]) == rendered
    (model_copy / "chat_template.jinja").write_text("jinja file wins")
    assert ChatTokenizer.from_folder(model_copy).render([]) == "jinja file wins"


def test_folder_without_chat_template(model_copy):
    (model_copy / "chat_template.jinja").unlink()
    with pytest.raises(CheckpointError, match="has no chat template"):
        ChatTokenizer.from_folder(model_copy).render([{"role": "user", "content": "hi"}])


def test_a_tokenizer_built_in_memory_works_like_its_folder(folder):
    """from_parts (a training script's tokenizer, before a folder exists) renders and encodes as from_folder."""
    from tokenizers import Tokenizer

    on_disk = ChatTokenizer.from_folder(folder)
    in_memory = ChatTokenizer.from_parts(
        Tokenizer.from_file(str(folder / "tokenizer.json")), CHAT_TEMPLATE, "<|im_end|>"
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi <|im_end|>"},
        {"role": "assistant", "content": "Hello", "reasoning_content": "greet"},
        {"role": "user", "content": TEXTS["mixed"]},
    ]
    for options in ({}, {"enable_thinking": False}, {"preserve_thinking": True}):
        assert in_memory.render(messages, **options) == on_disk.render(messages, **options)
        assert in_memory.encode_chat(messages, **options) == on_disk.encode_chat(messages, **options)
    assert in_memory.eos_token_ids == on_disk.eos_token_ids
