"""Stop strings over parser events (textcore.stops): the reply ends where a stop string begins, the
match and all after it dropped (OpenAI), found across tokens, held back only as long as a match
could still begin, in vLLM's order and window."""

from textcore.parser import ContentDelta, ReasoningDelta, ToolCallStart
from textcore.stops import StopStrings


def _text(events):
    return "".join(getattr(e, "text", "") for e in events)


def test_a_stop_string_spanning_two_tokens_ends_the_reply_before_it():
    stops = StopStrings(["ab"])
    assert stops.feed([ContentDelta("xa")]) == [ContentDelta("x")]  # "a" may begin "ab": held back
    assert stops.feed([ContentDelta("bcd")]) == [] and stops.matched == "ab"
    assert stops.flush() == []  # nothing after the match is part of the reply


def test_text_is_held_back_only_as_long_as_a_match_could_begin():
    stops = StopStrings(["lo!", "x"])
    out = stops.feed([ContentDelta("hello")])
    assert out == [ContentDelta("hel")]  # the last len("lo!") - 1 characters wait
    out += stops.feed([ContentDelta(" world")])
    assert _text(out) == "hello wor" and stops.matched is None
    out += stops.flush()
    assert _text(out) == "hello world"
    assert StopStrings([]).feed([ContentDelta("ab")]) == [ContentDelta("ab")]  # no stop strings: no delay


def test_events_without_text_keep_their_place_and_kinds_are_one_text():
    stops = StopStrings(["cd"])
    released = stops.feed([ReasoningDelta("ab"), ToolCallStart(1, "f"), ContentDelta("c")])
    assert released == [ReasoningDelta("ab"), ToolCallStart(1, "f")]
    assert stops.feed([ContentDelta("de")]) == [] and stops.matched == "cd"
    across = StopStrings(["ab"])  # the text of reasoning and content is one text, as vLLM's output is
    assert across.feed([ReasoningDelta("a")]) == [] and across.feed([ContentDelta("b")]) == []
    assert across.matched == "ab"


def test_first_stop_in_list_order_and_no_search_under_min_tokens():
    in_order = StopStrings(["b", "a"])
    assert in_order.feed([ContentDelta("ab")]) == [ContentDelta("a")] and in_order.matched == "b"
    held = StopStrings(["ab"])
    assert held.feed([ContentDelta("ab")], search=False) == [ContentDelta("a")]  # within min_tokens
    assert held.matched is None
    assert _text(held.feed([ContentDelta("zab")])) == "bz" and held.matched == "ab"


def test_with_include_the_matched_stop_string_ends_the_reply():
    """vLLM's include_stop_str_in_output: the reply ends with the stop string instead of before it."""
    stops = StopStrings(["cat"], include=True)
    out = stops.feed([ContentDelta("a c")]) + stops.feed([ContentDelta("at and more")])
    assert "".join(e.text for e in out) == "a cat" and stops.matched == "cat"
