"""Tool-call arguments stream as the model writes them: the character-level JSON reader (renderers/partial_json.py)
agrees with json.loads on every prefix of valid JSON and refuses invalid text at its first bad character; the
hermes and json parsers show a call (`pending`) once its name is complete and its arguments begin, and grow it
character by character; the OpenAI deltas carry the arguments before the call's closing tag was written."""
from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from renderers import ParsedToolCall, ToolEvent
from renderers.partial_json import JsonReader
from renderers.response_stream import ToolCallStream
from renderers.hermes_tools import HermesToolParser
from renderers.json_tools import JsonToolParser
from renderers.tool_parsers import ToolParser

ARGS = '{"city": "Paris", "days": [1, 2.5e3, -0.25], "metric": true, "note": "a \\"quote\\" \\u00e9"}'
HERMES = f'Checking.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>'

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)


def dumps(value: Any, style: int) -> str:
    return [json.dumps(value), json.dumps(value, separators=(",", ":")), json.dumps(value, indent=1),
            json.dumps(value, ensure_ascii=False)][style]


@settings(max_examples=200, deadline=None)
@given(json_values, st.integers(0, 3))
def test_every_prefix_of_valid_json_is_valid_and_spans_match(value: Any, style: int) -> None:
    text = dumps(value, style)
    reader = JsonReader(max_depth=1)
    for i, ch in enumerate(text):
        assert reader.feed(ch) == 1 and reader.valid, (text, i)
        # Done exactly when the value is complete (a number only once something follows it, or at the end).
        assert not reader.done or i == len(text) - 1 or not text[i + 1:].strip(), (text, i)
    top = reader.span()
    assert top is not None and json.loads(text[top.start:top.end if top.end is not None else None]) == value
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    for key, child in children:
        span = reader.span(key)
        assert span is not None
        assert json.loads(text[span.start:span.end]) == child and span.end is not None


@pytest.mark.parametrize(("text", "bad_at"), [
    ("{oops}", 1), ("[1,,2]", 3), ('{"a" 1}', 5), ("tru e", 3), ("[01]", 2), ('"\x01"', 1), ('"\\q"', 2),
    ("-a", 1), ('{"a": 1,}', 8), ("[1 2]", 3), ('"\\u12g4"', 5), ("}", 0),
])
def test_invalid_json_is_refused_at_its_first_bad_character(text: str, bad_at: int) -> None:
    reader = JsonReader()
    taken = reader.feed(text)
    assert not reader.valid and taken == bad_at + 1 and reader.text == text[:bad_at + 1]
    assert reader.feed("more") == 0  # and stays refused


@pytest.mark.parametrize(("text", "taken"), [
    ('{"a": 1} and then text', 9), ("[1, 2]\n<tool_call>", 7), ("12 apples", 3), ('"s"x', 3), ("true;", 4),
])
def test_reading_stops_at_the_first_character_after_the_value(text: str, taken: int) -> None:
    reader = JsonReader()  # whitespace after the value is taken; what follows it is left to the caller
    assert reader.feed(text) == taken and reader.done and reader.valid and reader.text == text[:taken]
    assert json.loads(reader.text) == json.loads(text[:taken])


def grown(parser: ToolParser, text: str) -> tuple[list[ParsedToolCall | None], list[ToolEvent]]:
    """`pending` after each character, and every event, feeding `text` one character at a time."""
    seen, events = [], []
    for ch in text:
        events += parser.feed(ch)
        seen.append(parser.pending())
    return seen, events + parser.finish()


@pytest.mark.parametrize(("parser", "text", "first_at"), [
    (HermesToolParser(), HERMES, HERMES.index('"arguments": {') + len('"arguments": {"')),
    (JsonToolParser(), f'[{{"name": "get_weather", "arguments": {ARGS}}}, {{"name": "now", "arguments": {{}}}}]',
     len('[{"name": "get_weather", "arguments": {"')),
])
def test_a_call_shows_as_its_arguments_are_written(parser: ToolParser, text: str, first_at: int) -> None:
    seen, events = grown(parser, text)
    # Undecided until the name is complete and the arguments begin with valid JSON: nothing to show.
    assert all(p is None for p in seen[:first_at - 1]) and seen[first_at - 1] is not None
    shown = [p for p in seen if p is not None and p.name == "get_weather"]
    # Each step a prefix of the next, growing one character at a time, up to the finished arguments.
    for a, b in zip(shown, shown[1:]):
        assert b.arguments.startswith(a.arguments) and len(b.arguments) - len(a.arguments) <= 1
    assert shown[-1].arguments == ARGS and len({p.arguments for p in shown}) == len(ARGS) - 1
    calls = [ev.call for ev in events if ev.call is not None]
    assert calls[0] == ParsedToolCall("get_weather", ARGS)


def test_a_malformed_call_before_it_is_decided_stays_text() -> None:
    for text in ('<tool_call>{"name": "f", "arguments": {oops}}</tool_call>', '<tool_call>{"nam": 1}</tool_call>',
                 '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>'):
        seen, events = grown(HermesToolParser(), text)
        assert seen == [None] * len(text) and events == [ToolEvent(text=text)]


def test_openai_deltas_carry_arguments_before_the_call_is_closed() -> None:
    stream = ToolCallStream(HermesToolParser())
    close = HERMES.index("\n</tool_call>")
    before = [d for ch in HERMES[:close] for d in stream.feed(ch)]
    after = [d for ch in HERMES[close:] for d in stream.feed(ch)] + stream.finish()
    text = [d for d in before if "content" in d]
    assert "".join(d["content"] for d in text) == "Checking.\n" and before[:len(text)] == text
    head, *fragments = [d["tool_calls"][0] for d in before[len(text):]]
    assert head["index"] == 0 and head["id"].startswith("call_") and head["type"] == "function"
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    # Every fragment went out as it was written (one character each here), all before the closing tag.
    assert len(fragments) == len(ARGS) - 1 and all(len(f["function"]["arguments"]) <= 2 for f in fragments)
    assert "".join(f["function"]["arguments"] for f in fragments) == ARGS
    assert after == [] and stream.calls == 1
