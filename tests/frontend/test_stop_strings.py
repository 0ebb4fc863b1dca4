"""StopStringMatcher: stop strings split across streamed pieces never leak, held text is released."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.pipeline import StopStringMatcher


def reference(text: str, stops: list[str]) -> str:
    """The text as a stream would end it: cut before the stop string occurrence that completes first
    (ties: the one that starts first), or the whole text when no stop string occurs."""
    found = [(i + len(s), i) for s in stops if s for i in [text.find(s)] if i >= 0]
    return text[:min(found)[1]] if found else text


def stream(stops: list[str], pieces: list[str]) -> tuple[str, StopStringMatcher]:
    m = StopStringMatcher(stops)
    out = "".join(m.feed(p) for p in pieces)
    return out + m.flush(), m


def split_at(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(points, points[1:])]


# A small alphabet makes partial matches, overlaps and repeats common.
_text = st.text(alphabet="abc \n", max_size=30)
_stops = st.lists(st.text(alphabet="abc \n", min_size=1, max_size=5), min_size=1, max_size=3)


@settings(max_examples=400, deadline=None)
@given(text=_text, stops=_stops, cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=12))
def test_random_splits_match_reference(text: str, stops: list[str], cuts: list[int]) -> None:
    pieces = split_at(text, cuts)
    assert "".join(pieces) == text
    m = StopStringMatcher(stops)
    expected = reference(text, stops)
    emitted = ""
    fed = ""
    longest = max(len(s) for s in stops)
    for piece in pieces:
        emitted += m.feed(piece)
        fed += piece
        # Never a character past the cut, and never a whole stop string.
        assert expected.startswith(emitted)
        assert not any(s in emitted for s in stops)
        if not m.stopped:
            # Only a possible stop-string start is held back: less than the longest stop string.
            assert len(fed) - len(emitted) < longest
    emitted += m.flush()
    assert emitted == expected
    assert m.stopped == any(s in text for s in stops)


@settings(max_examples=200, deadline=None)
@given(text=_text, stops=_stops)
def test_char_by_char_equals_whole_text(text: str, stops: list[str]) -> None:
    assert stream(stops, list(text))[0] == stream(stops, [text])[0] == reference(text, stops)


def test_stop_split_over_many_pieces_never_leaks() -> None:
    m = StopStringMatcher(["there"])
    out = [m.feed(p) for p in ["Hello", " t", "h", "e", "r", "e", ", friend!"]]
    assert out == ["Hello", " ", "", "", "", "", ""]
    assert m.stopped
    assert m.flush() == ""
    assert m.feed("more") == ""


def test_held_prefix_released_by_flush_when_stop_never_completes() -> None:
    m = StopStringMatcher(["there"])
    assert m.feed("Hello th") == "Hello "
    assert m.feed("e") == ""
    assert m.flush() == "the"
    assert not m.stopped


def test_held_prefix_released_when_text_diverges() -> None:
    m = StopStringMatcher(["</s>"])
    assert m.feed("a </") == "a "
    assert m.feed("b>") == "</b>"
    assert not m.stopped


def test_multiple_stop_strings_first_one_wins() -> None:
    text, pieces = "one two three", ["on", "e tw", "o th", "ree"]
    assert stream(["three", "two"], pieces)[0] == "one "
    assert stream(["two", "three"], pieces)[0] == "one "
    assert stream(["x", "ree"], pieces)[0] == "one two th"
    assert reference(text, ["three", "two"]) == "one "


@pytest.mark.parametrize("pieces", [["abcd"], list("abcd"), ["ab", "cd"], ["a", "bcd"]])
def test_overlapping_stop_strings(pieces: list[str]) -> None:
    # "bc" completes before "abcd" does: the stream ends there whatever the split.
    assert stream(["abcd", "bc"], pieces)[0] == "a"
    # "abc" and "bcd" overlap; "abc" completes first.
    assert stream(["bcd", "abc"], ["x", *pieces])[0] == "x"
    # Both end at the same character: the one that starts first cuts.
    assert stream(["cd", "bcd"], pieces)[0] == "a"


def test_self_overlapping_stop_string() -> None:
    # "aab" in "aaab": the held "aa" must shift by one, not be dropped or released whole.
    assert stream(["aab"], list("xaaab"))[0] == "xa"
    assert stream(["aab"], list("xaaac"))[0] == "xaaac"


def test_no_stop_strings_pass_through() -> None:
    for stops in ([], [""]):
        m = StopStringMatcher(stops)
        assert m.feed("<|im_end|>abc") == "<|im_end|>abc"
        assert m.flush() == ""
        assert not m.stopped


def test_stop_at_start_and_unicode() -> None:
    assert stream(["日本"], ["日", "本語"])[0] == ""
    assert stream(["語"], ["日", "本", "語です"])[0] == "日本"
    assert stream(["🙂!"], ["hi 🙂", "?"])[0] == "hi 🙂?"
