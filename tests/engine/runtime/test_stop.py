"""Streamed text is cut at the first stop string, and no part of a stop string is ever shown."""

import pytest

from engine.runtime.stop import StopMatcher


def stream(matcher: StopMatcher, deltas) -> list[tuple[str, bool]]:
    return [matcher.feed(delta) for delta in deltas]


def test_a_stop_string_split_over_two_deltas_is_never_shown():
    matcher = StopMatcher(["<|stop|>"])
    assert stream(matcher, ["Hello <|", "stop|> more"]) == [("Hello ", False), ("", True)]
    assert matcher.matched == "<|stop|>"
    assert matcher.flush() == ""


def test_a_stop_string_split_over_many_deltas_is_never_shown():
    matcher = StopMatcher(["<|stop|>"])
    assert stream(matcher, ["Hi", " <", "|st", "op", "|", ">!"]) == [
        ("Hi", False),
        (" ", False),
        ("", False),
        ("", False),
        ("", False),
        ("", True),
    ]


def test_text_before_the_stop_in_the_same_delta_is_shown():
    matcher = StopMatcher(["</s>"])
    assert matcher.feed("done.</s>ignored") == ("done.", True)


def test_the_first_of_several_stop_strings_ends_the_text():
    matcher = StopMatcher(["</s>", "<|end|>"])
    assert matcher.feed("a<|end|>b</s>") == ("a", True)
    assert matcher.matched == "<|end|>"
    other = StopMatcher(["</s>", "<|end|>"])
    assert stream(other, ["x</", "s>"]) == [("x", False), ("", True)]
    assert other.matched == "</s>"


def test_stop_strings_with_a_shared_prefix_wait_until_one_completes():
    matcher = StopMatcher(["<|end|>", "<|eot|>"])
    assert stream(matcher, ["ok <|e", "ot|>"]) == [("ok ", False), ("", True)]
    assert matcher.matched == "<|eot|>"


def test_the_same_stop_is_reported_whether_the_text_comes_whole_or_in_pieces():
    # "<|im_end|>" completes before "<|im_end|>\n" when streamed, so it wins when both start at one place.
    whole = StopMatcher(["<|im_end|>\n", "<|im_end|>"])
    assert whole.feed("a<|im_end|>\nb") == ("a", True)
    pieces = StopMatcher(["<|im_end|>\n", "<|im_end|>"])
    assert stream(pieces, ["a<|im_end|>", "\nb"]) == [("a", True), ("", True)]
    assert whole.matched == pieces.matched == "<|im_end|>"


def test_a_stop_string_overlapping_its_own_prefix_is_found():
    matcher = StopMatcher(["aab"])
    assert stream(matcher, ["xaa", "ab"]) == [("x", False), ("a", True)]


def test_a_prefix_that_turns_out_not_to_be_a_stop_is_released():
    matcher = StopMatcher(["<|stop|>"])
    assert stream(matcher, ["a <|st", "ar|> b"]) == [("a ", False), ("<|star|> b", False)]
    assert matcher.matched is None
    assert matcher.flush() == ""


def test_flush_returns_the_held_tail_when_generation_ends():
    matcher = StopMatcher(["<|stop|>"])
    assert matcher.feed("the end <|sto") == ("the end ", False)
    assert matcher.flush() == "<|sto"
    assert matcher.flush() == ""


def test_a_stop_string_at_the_very_start():
    assert StopMatcher(["<|stop|>"]).feed("<|stop|>hello") == ("", True)
    matcher = StopMatcher(["<|stop|>"])
    assert stream(matcher, ["<|st", "op|>hello"]) == [("", False), ("", True)]


def test_nothing_more_is_shown_after_a_stop():
    matcher = StopMatcher(["</s>"])
    matcher.feed("a</s>")
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""
    assert matcher.matched == "</s>"


def test_without_stop_strings_text_passes_straight_through():
    matcher = StopMatcher([])
    assert stream(matcher, ["<|", "stop|>"]) == [("<|", False), ("stop|>", False)]
    assert matcher.flush() == ""


TEXT = "Sure: a <|en <|end of list|> b <|end|> after"


@pytest.mark.parametrize("first_cut", range(len(TEXT) + 1))
def test_every_way_of_splitting_shows_exactly_the_text_before_the_stop(first_cut):
    for second_cut in range(first_cut, len(TEXT) + 1):
        matcher = StopMatcher(["<|end|>", "<|eot|>"])
        pieces = stream(matcher, [TEXT[:first_cut], TEXT[first_cut:second_cut], TEXT[second_cut:]])
        assert "".join(shown for shown, _ in pieces) == "Sure: a <|en <|end of list|> b "
        assert pieces[-1][1] and matcher.matched == "<|end|>"


def test_empty_stop_strings_are_refused():
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(["</s>", ""])
