"""The streaming tool-call parser on answers in the Qwen3.5/3.6 (qwen_xml) and Qwen3 (qwen_json) formats.

The sample answers are written in exactly the shapes the real chat templates render and the models are trained
to write (see tests/fixtures/real-tokenizers); the round-trip tests render calls through those templates
themselves and read them back token by token."""

import json
import random
import re

import pytest
from locations import FIXTURES

from engine.runtime.tokenizer import ChatTokenizer, IncrementalDetokenizer
from engine.runtime.tool_calls import (
    CALL_OPEN,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallFinished,
    ToolCallParser,
    ToolCallStarted,
    ToolCallWarning,
    call_opening,
    tool_call_style,
)

REAL_TOKENIZERS = FIXTURES / "real-tokenizers"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather",
            "parameters": {
                "type": "object",
                "required": ["city"],
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"type": "string"}},
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
                "properties": {
                    "query": {"type": "string"},
                    "limit": {"type": "integer"},
                    "exact": {"type": "boolean"},
                    "ratio": {"type": "number"},
                    "filters": {"type": "object"},
                    "sites": {"type": "array"},
                    "before": {"type": ["integer", "null"]},
                    "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                },
            },
        },
    },
]


def xml_call(name, *parameters):
    """A call as the Qwen3.5/3.6 template renders it; parameters are (key, value text) pairs."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def json_call(name, arguments):
    """A call as the Qwen3 template renders it."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}\n</tool_call>'


XML_SAMPLES = {
    "one_call": xml_call("get_weather", ("city", "Paris")),
    "parallel_calls": "I'll check both cities.\n\n"
    + xml_call("get_weather", ("city", "Paris"), ("days", "3"))
    + "\n"
    + xml_call("get_weather", ("city", "Berlin"), ("unit", "celsius")),
    "after_reasoning": "Based on what you asked, I need the forecast first.\n\n"
    + xml_call("get_weather", ("city", "Lyon"), ("days", "2")),
    "nested": xml_call(
        "search",
        ("query", "museums"),
        ("filters", '{"lang": "fr", "open": {"days": ["mon", "tue"]}}'),
        ("sites", '["louvre.fr", {"host": "orsay.fr", "weight": 0.5}]'),
        ("exact", "true"),
        ("ratio", "0.25"),
        ("limit", "10"),
        ("before", "null"),
    ),
    "unicode": "Je regarde 🌦…\n\n" + xml_call("get_weather", ("city", "Zürich — 東京 🗼"), ("unit", "°C")),
    "multiline_value": xml_call("search", ("query", 'line one\nline two\n\n  indented <b>tag</b> & "quotes" \\')),
    "no_parameters": xml_call("search"),
    "text_with_angles": "if a < b and b <c then <b>bold</b>, <tool>, <tool_cal, </tool_call> stay text <",
    "text_after_call": xml_call("get_weather", ("city", "Oslo")) + "\n\nThat is all.\n",
    "truncated": "Checking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
    "missing_function_close": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>"
    "\nafter",
    "text_between_parameters": "<tool_call>\n<function=get_weather>\nuh\n<parameter=city>\nParis\n</parameter>\n"
    "</function>\n</tool_call>",
    "no_function": "Mention of <tool_call> in prose, then </tool_call> more.",
    "malformed_then_good": "<tool_call>\n<function=>\n</function>\n</tool_call>\n" + xml_call("search", ("query", "x")),
}

JSON_SAMPLES = {
    "one_call": json_call("get_weather", {"city": "Paris"}),
    "parallel_calls": "I'll check both cities.\n"
    + json_call("get_weather", {"city": "Paris", "days": 3})
    + "\n"
    + json_call("get_weather", {"city": "Berlin"}),
    "after_reasoning": "Based on what you asked, I need the forecast first.\n"
    + json_call("get_weather", {"city": "Lyon"}),
    "nested": json_call(
        "search",
        {
            "query": "museums",
            "filters": {"lang": "fr", "open": {"days": ["mon", "tue"]}},
            "sites": [{"host": "orsay.fr", "weight": 0.5}, None, True],
            "limit": 10,
        },
    ),
    "unicode": "Je regarde 🌦…\n" + json_call("get_weather", {"city": "Zürich — 東京 🗼", "unit": "°C"}),
    "escapes_in_strings": '<tool_call>\n{"name": "search", "arguments": {"query": "a \\"}\\" ] { [ \\\\", '
    '"u": "\\u00e9\\ud83d\\uddfc"}}\n</tool_call>',
    "compact_json": '<tool_call>{"name":"search","arguments":{"query":"x","limit":2}}</tool_call>',
    "arguments_first": '<tool_call>\n{"arguments": {"query": "x"}, "name": "search"}\n</tool_call>',
    "arguments_as_string": '<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}\n</tool_call>',
    "text_with_angles": "if a < b and b <c then <b>bold</b>, <tool>, <tool_cal, </tool_call> stay text <",
    "text_after_call": json_call("get_weather", {"city": "Oslo"}) + "\n\nThat is all.\n",
    "truncated": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
    "bad_json": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",}}\n</tool_call>\nafter',
    "missing_outer_brace": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
    "arguments_not_object": '<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call>',
    "no_name": '<tool_call>\n{"arguments": {}}\n</tool_call>',
    "bad_name": '<tool_call>\n{"name": "get\\x", "arguments": {"city": "Paris"}}\n</tool_call>',
    "no_function": "Mention of <tool_call> in prose, then </tool_call> more.",
}

SAMPLES = [("qwen_xml", key) for key in XML_SAMPLES] + [("qwen_json", key) for key in JSON_SAMPLES]


def sample(style, key):
    return (XML_SAMPLES if style == "qwen_xml" else JSON_SAMPLES)[key]


def parse(style, chunks, tools=TOOLS, seed=7):
    """All events of an answer fed as `chunks`, then finished."""
    parser = ToolCallParser(style, tools=tools, seed=seed)
    events = [event for chunk in chunks for event in parser.feed(chunk)]
    return events + parser.finish()


def joined(events):
    """events with neighbouring text deltas, and neighbouring argument deltas of one call, merged."""
    merged = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, TextDelta) and isinstance(last, TextDelta):
            merged[-1] = TextDelta(last.text + event.text)
        elif (
            isinstance(event, ToolCallArgumentsDelta)
            and isinstance(last, ToolCallArgumentsDelta)
            and last.index == event.index
        ):
            merged[-1] = ToolCallArgumentsDelta(event.index, last.delta + event.delta)
        else:
            merged.append(event)
    return merged


def text_of(events):
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def calls_of(events):
    return [(e.name, e.arguments) for e in events if isinstance(e, ToolCallFinished)]


def warnings_of(events):
    return [e for e in events if isinstance(e, ToolCallWarning)]


def check_protocol(events):
    """Every call starts once, before its deltas; a finished call's deltas join to its arguments' JSON."""
    started = {e.index: e for e in events if isinstance(e, ToolCallStarted)}
    assert len(started) == sum(isinstance(e, ToolCallStarted) for e in events)
    assert sorted(started) == list(range(len(started)))
    assert len({e.call_id for e in started.values()}) == len(started)
    seen = set()
    for event in events:
        if isinstance(event, ToolCallStarted):
            seen.add(event.index)
        elif isinstance(event, (ToolCallArgumentsDelta, ToolCallFinished)):
            assert event.index in seen
    for finished in (e for e in events if isinstance(e, ToolCallFinished)):
        start = started[finished.index]
        assert (finished.call_id, finished.name) == (start.call_id, start.name)
        deltas = "".join(e.delta for e in events if isinstance(e, ToolCallArgumentsDelta) and e.index == finished.index)
        assert json.loads(deltas) == finished.arguments
    for warning in warnings_of(events):  # a warning is followed by its call's raw text
        position = events.index(warning)
        assert isinstance(events[position + 1], TextDelta) and events[position + 1].text.startswith(warning.raw_text)
        assert warning.index is None or warning.index in started
        assert not any(isinstance(e, ToolCallFinished) and e.index == warning.index for e in events)


# ---- the template's style ----


def test_style_of_the_real_templates():
    qwen36 = (REAL_TOKENIZERS / "qwen3.6" / "chat_template.jinja").read_text(encoding="utf-8")
    qwen3 = json.loads((REAL_TOKENIZERS / "qwen3" / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert tool_call_style(qwen36) == "qwen_xml"
    assert tool_call_style(qwen3["chat_template"]) == "qwen_json"


@pytest.mark.parametrize(
    "source",
    [
        None,
        "",
        "{% for m in messages %}{{ m.content }}{% endfor %}",
        "{{- '<tool_call>' }}{{ tool_call.name }}{{ '</tool_call>' }}",
    ],
)
def test_templates_without_a_known_tool_call_format_have_no_style(source):
    assert tool_call_style(source) is None


def test_an_unknown_style_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="qwen_xml, qwen_json"):
        ToolCallParser("hermes")


# ---- the samples' outcomes ----


def test_one_xml_call():
    events = joined(parse("qwen_xml", [XML_SAMPLES["one_call"]]))
    call_id = events[0].call_id
    assert re.fullmatch("call_[0-9a-f]{24}", call_id)
    assert events == [
        ToolCallStarted(0, call_id, "get_weather"),
        ToolCallArgumentsDelta(0, '{"city": "Paris"}'),
        ToolCallFinished(0, call_id, "get_weather", {"city": "Paris"}),
    ]


def test_one_json_call():
    events = joined(parse("qwen_json", [JSON_SAMPLES["one_call"]]))
    call_id = events[0].call_id
    assert events == [
        ToolCallStarted(0, call_id, "get_weather"),
        ToolCallArgumentsDelta(0, '{"city": "Paris"}'),
        ToolCallFinished(0, call_id, "get_weather", {"city": "Paris"}),
    ]


@pytest.mark.parametrize("style", ["qwen_xml", "qwen_json"])
def test_parallel_calls_after_text(style):
    events = parse(style, [sample(style, "parallel_calls")])
    check_protocol(events)
    assert text_of(events) == "I'll check both cities."  # the newlines only separate the calls
    assert calls_of(events) == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("get_weather", {"city": "Berlin", "unit": "celsius"} if style == "qwen_xml" else {"city": "Berlin"}),
    ]
    assert [e.index for e in events if isinstance(e, ToolCallStarted)] == [0, 1]
    assert not warnings_of(events)


@pytest.mark.parametrize("style", ["qwen_xml", "qwen_json"])
def test_a_call_after_the_answers_opening_text(style):
    events = joined(parse(style, [sample(style, "after_reasoning")]))
    assert events[0] == TextDelta("Based on what you asked, I need the forecast first.")
    assert isinstance(events[1], ToolCallStarted)
    assert calls_of(events)[0][1]["city"] == "Lyon"


def test_nested_xml_values_take_their_declared_types():
    events = parse("qwen_xml", [XML_SAMPLES["nested"]])
    check_protocol(events)
    assert calls_of(events) == [
        (
            "search",
            {
                "query": "museums",
                "filters": {"lang": "fr", "open": {"days": ["mon", "tue"]}},
                "sites": ["louvre.fr", {"host": "orsay.fr", "weight": 0.5}],
                "exact": True,
                "ratio": 0.25,
                "limit": 10,
                "before": None,
            },
        )
    ]


def test_nested_json_arguments_stream_as_written():
    events = parse("qwen_json", [JSON_SAMPLES["nested"]])
    check_protocol(events)
    arguments = {
        "query": "museums",
        "filters": {"lang": "fr", "open": {"days": ["mon", "tue"]}},
        "sites": [{"host": "orsay.fr", "weight": 0.5}, None, True],
        "limit": 10,
    }
    assert calls_of(events) == [("search", arguments)]
    assert joined(events)[1] == ToolCallArgumentsDelta(0, json.dumps(arguments, ensure_ascii=False))


@pytest.mark.parametrize("style", ["qwen_xml", "qwen_json"])
def test_unicode_text_and_arguments(style):
    events = parse(style, [sample(style, "unicode")])
    check_protocol(events)
    assert text_of(events) == "Je regarde 🌦…"
    assert calls_of(events) == [("get_weather", {"city": "Zürich — 東京 🗼", "unit": "°C"})]


def test_json_string_escapes_do_not_end_the_arguments():
    events = parse("qwen_json", [JSON_SAMPLES["escapes_in_strings"]])
    check_protocol(events)
    assert calls_of(events) == [("search", {"query": 'a "}" ] { [ \\', "u": "é🗼"})]


def test_an_xml_value_keeps_its_lines_and_markup_and_drops_only_the_templates_newlines():
    events = parse("qwen_xml", [XML_SAMPLES["multiline_value"]])
    check_protocol(events)
    assert calls_of(events) == [("search", {"query": 'line one\nline two\n\n  indented <b>tag</b> & "quotes" \\'})]


def test_an_xml_call_without_parameters_has_empty_arguments():
    events = joined(parse("qwen_xml", [XML_SAMPLES["no_parameters"]]))
    assert events[1:] == [ToolCallArgumentsDelta(0, "{}"), ToolCallFinished(0, events[0].call_id, "search", {})]


@pytest.mark.parametrize("style", ["qwen_xml", "qwen_json"])
def test_text_with_angle_brackets_that_are_not_calls_passes_unchanged(style):
    text = sample(style, "text_with_angles")
    events = parse(style, [text])
    assert events == [TextDelta(text[: text.rindex(" <")]), TextDelta(" <")]  # the last "<" waits for finish()


def test_text_is_held_back_only_while_it_may_begin_a_call():
    parser = ToolCallParser("qwen_xml")
    assert parser.feed("Hello wor") == [TextDelta("Hello wor")]
    assert parser.feed("ld <tool") == [TextDelta("ld")]
    assert parser.feed("box>") == [TextDelta(" <toolbox>")]
    assert parser.feed("\n\n") == []  # whitespace may only separate a call that follows
    assert parser.feed("x") == [TextDelta("\n\nx")]
    assert parser.feed("\n") == []
    assert parser.finish() == [TextDelta("\n")]


@pytest.mark.parametrize("style", ["qwen_xml", "qwen_json"])
def test_text_after_a_call_passes_without_the_separating_whitespace(style):
    events = parse(style, [sample(style, "text_after_call")])
    assert text_of(events) == "That is all.\n"
    assert calls_of(events) == [("get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize("style", ["qwen_xml", "qwen_json"])
def test_arguments_stream_before_the_call_ends(style):
    answer = sample(style, "one_call")
    parser = ToolCallParser(style, seed=1)
    events = parser.feed(answer[: answer.index("Paris") + 3])
    assert [type(e) for e in joined(events)] == [ToolCallStarted, ToolCallArgumentsDelta]
    assert joined(events)[1].delta == '{"city": "Par'
    assert not any(isinstance(e, ToolCallFinished) for e in events)


@pytest.mark.parametrize("style", ["qwen_xml", "qwen_json"])
def test_a_call_cut_off_by_the_end_of_generation_comes_back_as_text(style):
    answer = sample(style, "truncated")
    events = parse(style, [answer])
    check_protocol(events)
    [warning] = warnings_of(events)
    assert warning.index == 0 and "ended inside it" in warning.message and "get_weather" in warning.message
    assert warning.raw_text == answer[answer.index("<tool_call>") :]
    assert text_of(events) == answer
    assert not calls_of(events)


@pytest.mark.parametrize(
    "style, key, reason, started",
    [
        ("qwen_xml", "missing_function_close", "</function> is missing", True),
        ("qwen_xml", "text_between_parameters", "'uh", True),
        ("qwen_xml", "no_function", "stands where <function=", False),
        ("qwen_json", "bad_json", "does not parse", True),
        ("qwen_json", "missing_outer_brace", "does not parse", True),
        ("qwen_json", "arguments_not_object", "not a JSON object", True),
        ("qwen_json", "no_name", '"name" string', False),
        ("qwen_json", "bad_name", "does not parse", False),
        ("qwen_json", "no_function", "does not parse", False),
    ],
)
def test_a_malformed_call_comes_back_as_text_with_a_warning(style, key, reason, started):
    answer = sample(style, key)
    events = parse(style, [answer])
    check_protocol(events)
    [warning] = warnings_of(events)
    assert reason in warning.message and "passed on as text" in warning.message
    assert (warning.index == 0) if started else (warning.index is None)
    assert (
        warning.raw_text in answer
        and warning.raw_text.startswith("<tool_call>")
        and warning.raw_text.endswith("</tool_call>")
    )
    assert text_of(events) == answer
    assert not calls_of(events)


def test_json_that_nests_too_deeply_to_read_comes_back_as_text():
    answer = '<tool_call>\n{"name": "search", "arguments": {"a": ' + "[" * 100_000 + "]" * 100_000 + "}}\n</tool_call>"
    events = joined(parse("qwen_json", [answer]))
    assert "nests too deeply" in events[2].message and events[2].index == 0
    assert events[3] == TextDelta(answer) and not calls_of(events)


def test_a_good_call_after_a_malformed_one_is_still_read():
    events = parse("qwen_xml", [XML_SAMPLES["malformed_then_good"]])
    check_protocol(events)
    [warning] = warnings_of(events)
    assert "does not name a function" in warning.message and warning.index is None
    assert calls_of(events) == [("search", {"query": "x"})]
    assert [e.index for e in events if isinstance(e, ToolCallStarted)] == [0]


@pytest.mark.parametrize(
    "key, arguments",
    [
        ("compact_json", {"query": "x", "limit": 2}),
        ("arguments_first", {"query": "x"}),
        ("arguments_as_string", {"query": "x"}),
    ],
)
def test_json_calls_in_other_layouts_are_read_whole(key, arguments):
    events = parse("qwen_json", [JSON_SAMPLES[key]])
    check_protocol(events)
    assert calls_of(events) == [("search", arguments)] and not warnings_of(events)


# ---- types of qwen_xml values ----


@pytest.mark.parametrize(
    "key, text, value",
    [
        ("limit", "3", 3),
        ("limit", " 4 ", 4),
        ("limit", "5.0", 5),
        ("limit", "three", "three"),
        ("limit", "2.5", "2.5"),
        ("limit", "true", "true"),
        ("ratio", "1e3", 1000.0),
        ("ratio", "7", 7),
        ("ratio", "NaN", "NaN"),
        ("exact", "True", True),
        ("exact", "false", False),
        ("exact", "yes", "yes"),
        ("filters", '{"a": [1]}', {"a": [1]}),
        ("filters", "[1]", "[1]"),
        ("filters", "{bad", "{bad"),
        ("sites", "[]", []),
        ("sites", '{"a": 1}', '{"a": 1}'),
        ("sites", "[" * 100_000, "[" * 100_000),
        ("sites", "[" * 100_000 + "]" * 100_000, "[" * 100_000 + "]" * 100_000),
        ("before", "null", None),
        ("before", "12", 12),
        ("before", "soon", "soon"),
        ("note", "null", None),
        ("note", "3", "3"),
        ("query", "42", "42"),
        ("query", "null", "null"),
        ("undeclared", "7", "7"),
    ],
)
def test_xml_values_take_the_declared_type_or_stay_strings(key, text, value):
    events = parse("qwen_xml", [xml_call("search", (key, text))])
    check_protocol(events)
    assert calls_of(events) == [("search", {key: value})]


def test_without_tools_every_xml_value_is_a_string():
    events = parse("qwen_xml", [XML_SAMPLES["nested"]], tools=None)
    check_protocol(events)
    assert calls_of(events)[0][1]["limit"] == "10" and calls_of(events)[0][1]["exact"] == "true"


def test_tool_specs_that_are_not_specs_are_ignored():
    junk = [
        None,
        "search",
        {"function": "x"},
        {"function": {"name": 3}},
        {"name": "search", "parameters": {"properties": {"limit": {"type": "integer"}, "exact": "boolean"}}},
    ]
    events = parse("qwen_xml", [xml_call("search", ("limit", "2"), ("exact", "true"))], tools=junk)
    assert calls_of(events) == [("search", {"limit": 2, "exact": "true"})]


# ---- call ids ----


def test_call_ids_are_unique_and_repeat_with_the_seed():
    answer = "\n".join(xml_call("search", ("query", str(n))) for n in range(50))
    ids = [e.call_id for e in parse("qwen_xml", [answer], seed=3) if isinstance(e, ToolCallStarted)]
    assert len(ids) == len(set(ids)) == 50
    assert ids == [e.call_id for e in parse("qwen_xml", [answer], seed=3) if isinstance(e, ToolCallStarted)]
    assert ids[0] != next(e.call_id for e in parse("qwen_xml", [answer], seed=4) if isinstance(e, ToolCallStarted))
    unseeded = [
        next(e.call_id for e in parse("qwen_xml", [answer], seed=None) if isinstance(e, ToolCallStarted))
        for _ in range(2)
    ]
    assert unseeded[0] != unseeded[1]


# ---- every split point ----


@pytest.mark.parametrize("style, key", SAMPLES, ids=[f"{s}-{k}" for s, k in SAMPLES])
def test_the_events_do_not_depend_on_how_the_text_is_split(style, key):
    answer = sample(style, key)
    whole = joined(parse(style, [answer]))
    check_protocol(whole)
    assert joined(parse(style, list(answer))) == whole  # one character at a time
    for cut in range(1, len(answer)):
        assert joined(parse(style, [answer[:cut], answer[cut:]])) == whole, cut
    rng = random.Random(key)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(answer)), min(len(answer) - 1, rng.randint(1, 12))))
        chunks = [answer[a:b] for a, b in zip([0] + cuts, cuts + [len(answer)])]
        assert joined(parse(style, chunks)) == whole, chunks


# ---- round trip through the real templates ----

ROUND_TRIP_CALLS = [
    ("get_weather", {"city": "Paris", "days": 3}),
    (
        "search",
        {
            "query": "Paris news 🗼 <b>\nsecond line",
            "limit": 5,
            "exact": False,
            "ratio": 0.5,
            "filters": {"lang": "fr", "nested": {"list": [1, "two", None]}},
            "sites": ["a.fr", "b.fr"],
        },
    ),
    ("get_weather", {"city": "Zürich"}),
]


@pytest.fixture(scope="module")
def real_tokenizer(real_tokenizer_folder):
    """real_tokenizer(name) -> that checkpoint's ChatTokenizer, read once for the module."""
    made = {}

    def get(name):
        if name not in made:
            made[name] = ChatTokenizer.from_folder(real_tokenizer_folder(name))
        return made[name]

    return get


@pytest.mark.parametrize("name, style", [("qwen3.6", "qwen_xml"), ("qwen3", "qwen_json")])
@pytest.mark.parametrize("content", ["Let me look these up.", ""], ids=["with_text", "calls_only"])
def test_calls_rendered_by_the_real_template_parse_back(real_tokenizer_folder, real_tokenizer, name, style, content):
    folder = real_tokenizer_folder(name)
    tokenizer = real_tokenizer(name)
    template = (
        (folder / "chat_template.jinja").read_text(encoding="utf-8")
        if name == "qwen3.6"
        else json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]
    )
    assert tool_call_style(template) == style
    messages = [
        {"role": "user", "content": "Weather in Paris, news, and Zürich?"},
        {
            "role": "assistant",
            "content": content,
            "reasoning_content": "Three lookups.",
            "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in ROUND_TRIP_CALLS],
        },
    ]
    rendered = tokenizer.render(messages, tools=TOOLS, add_generation_prompt=False)
    reply = rendered.rsplit("<|im_start|>assistant\n", 1)[1].split("<|im_end|>")[0]
    answer = reply.split("</think>", 1)[1].lstrip("\n")  # the session splits the reasoning off like this
    assert answer.count("<tool_call>") == 3
    # stream it as the model would: token by token through the detokenizer
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.feed(token) for token in tokenizer.encode(answer)] + [detokenizer.flush()]
    assert "".join(pieces) == answer
    events = parse(style, pieces)
    check_protocol(events)
    assert calls_of(events) == ROUND_TRIP_CALLS
    assert text_of(events) == content
    assert not warnings_of(events)


# ---- arbitrary text ----

FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<function=search>",
    "<function=",
    "</function>",
    "<parameter=limit>",
    "<parameter=query>",
    "</parameter>",
    '{"name": "search", "arguments": ',
    "{",
    "}",
    "[",
    "]",
    '"',
    "\\",
    ":",
    ",",
    "\n",
    " ",
    "a",
    "7",
    "é",
    "<",
    ">",
    "=",
    '{"name": "',
    '", "arguments": ',
    "\\x",
    "\t",
    XML_SAMPLES["one_call"],
    XML_SAMPLES["nested"],
    JSON_SAMPLES["one_call"],
    JSON_SAMPLES["nested"],
]


@pytest.mark.parametrize("style", ["qwen_xml", "qwen_json"])
def test_arbitrary_text_never_breaks_the_parser_and_is_never_lost(style):
    rng = random.Random(style)
    for _ in range(300):
        answer = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 40)))
        events = joined(parse(style, [answer]))
        check_protocol(events)
        if not calls_of(events):  # nothing was read as a call, so every character comes back as text
            assert text_of(events) == answer
        cuts = sorted(rng.sample(range(len(answer) + 1), min(len(answer) + 1, 6)))
        chunks = [answer[a:b] for a, b in zip([0] + cuts, cuts + [len(answer)])]
        assert joined(parse(style, chunks)) == events, chunks


def test_a_call_opening_parses_as_the_start_of_that_call():
    """The opening a required call is forced to, followed by arguments, reads as a call of that tool, in both
    styles; a name with quotes stays one JSON string."""
    # with no tool specs to read types from, qwen_xml's values stay strings
    for style, rest, arguments in [
        ("qwen_xml", "<parameter=a>\n2\n</parameter>\n</function>\n</tool_call>", {"a": "2"}),
        ("qwen_json", '{"a": 2}}\n</tool_call>', {"a": 2}),
    ]:
        for name in ("multiply", 'say "hi"'):
            parser = ToolCallParser(style)
            events = parser.feed(CALL_OPEN + call_opening(style, name) + rest) + parser.finish()
            finished = [e for e in events if isinstance(e, ToolCallFinished)]
            assert [(f.name, f.arguments) for f in finished] == [(name, arguments)], (style, name, events)
