"""Tool-call parsers (renderers/tool_parsers.py) and their OpenAI shaping (renderers/response_stream.py): the same
answer however the text is split, malformed calls degrade to text, the registry."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from renderers import ParsedToolCall, ToolEvent, get_tool_parser, register_tool_parser
from renderers.hermes_tools import HermesToolParser
from renderers.json_tools import JsonToolParser
from renderers.response_stream import PlainText, ToolCallStream, whole_message

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}'
WEATHER_CALL = ParsedToolCall("get_weather", '{"city": "Paris", "unit": "°C"}')


def streamed(parser_name: str, pieces: list[str]) -> list[ToolEvent]:
    parser = get_tool_parser(parser_name)()
    events = [ev for p in pieces for ev in parser.feed(p)] + parser.finish()
    # Coalesce adjacent text the way a client concatenating deltas would see it.
    out: list[ToolEvent] = []
    for ev in events:
        if ev.call is None and out and out[-1].call is None:
            out[-1] = ToolEvent(text=out[-1].text + ev.text)
        elif ev.call is not None or ev.text:
            out.append(ev)
    return out


def split_at(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(points, points[1:])]


HERMES_CASES = [
    # (model output, expected events)
    (f"<tool_call>\n{WEATHER}\n</tool_call>", [ToolEvent(call=WEATHER_CALL)]),
    (f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n",
     [ToolEvent(text="Let me check.\n"), ToolEvent(call=WEATHER_CALL)]),
    (f"<tool_call>{WEATHER}</tool_call>\n<tool_call>{WEATHER}</tool_call>",
     [ToolEvent(call=WEATHER_CALL), ToolEvent(call=WEATHER_CALL)]),
    ('<tool_call>{"name": "now", "parameters": {}}</tool_call>', [ToolEvent(call=ParsedToolCall("now", "{}"))]),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
     [ToolEvent(call=ParsedToolCall("f", '{"a": 1}'))]),
    (f"<tool_call>\n{WEATHER}\n", [ToolEvent(call=WEATHER_CALL)]),   # eos before the closing tag
    ("No tools needed: 2 < 3 and <b>bold</b>.", [ToolEvent(text="No tools needed: 2 < 3 and <b>bold</b>.")]),
    ("ends with a partial tag <tool_ca", [ToolEvent(text="ends with a partial tag <tool_ca")]),
    # Malformed: text, exactly as the model wrote it.
    ('<tool_call>{"name": "f", "arguments": {oops}}</tool_call>',
     [ToolEvent(text='<tool_call>{"name": "f", "arguments": {oops}}</tool_call>')]),
    ('<tool_call>{"arguments": {}}</tool_call>', [ToolEvent(text='<tool_call>{"arguments": {}}</tool_call>')]),
    ('<tool_call>["not", "a", "call"]</tool_call>', [ToolEvent(text='<tool_call>["not", "a", "call"]</tool_call>')]),
    ('<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
     [ToolEvent(text='<tool_call>{"name": "f", "arguments": "not json"}</tool_call>')]),
    ('<tool_call>{"name": "f", "argu', [ToolEvent(text='<tool_call>{"name": "f", "argu')]),
    (f'<tool_call>{{bad}}</tool_call>\n<tool_call>{WEATHER}</tool_call>',
     [ToolEvent(text="<tool_call>{bad}</tool_call>\n"), ToolEvent(call=WEATHER_CALL)]),
]


@pytest.mark.parametrize(("output", "expected"), HERMES_CASES)
def test_hermes_whole_and_char_by_char(output: str, expected: list[ToolEvent]) -> None:
    assert get_tool_parser("hermes")().parse(output) == expected
    assert streamed("hermes", list(output)) == expected


@settings(max_examples=200, deadline=None)
@given(case=st.sampled_from(HERMES_CASES), cuts=st.lists(st.integers(0, 200), max_size=10))
def test_hermes_any_split_gives_the_same_events(case: tuple[str, list[ToolEvent]], cuts: list[int]) -> None:
    output, expected = case
    assert streamed("hermes", split_at(output, cuts)) == expected


def test_hermes_never_emits_part_of_a_tag_as_text() -> None:
    parser = HermesToolParser()
    assert parser.feed("Sure <tool") == [ToolEvent(text="Sure ")]
    assert parser.feed("_call>{") == []
    assert parser.feed('"name": "f"}</tool_call>') == [ToolEvent(call=ParsedToolCall("f", "{}"))]


JSON_CASES = [
    (WEATHER, [ToolEvent(call=WEATHER_CALL)]),
    (f"  [{WEATHER}, {WEATHER}]", [ToolEvent(call=WEATHER_CALL), ToolEvent(call=WEATHER_CALL)]),
    (f"[TOOL_CALLS] [{WEATHER}]", [ToolEvent(call=WEATHER_CALL)]),
    (f"<|python_tag|>{WEATHER}; {WEATHER}", [ToolEvent(call=WEATHER_CALL), ToolEvent(call=WEATHER_CALL)]),
    ("The answer is 4.", [ToolEvent(text="The answer is 4.")]),
    ('{"answer": 4}', [ToolEvent(text='{"answer": 4}')]),           # JSON, but not a call
    ('[{"name": "f"}, 3]', [ToolEvent(text='[{"name": "f"}, 3]')]),
    ('{"name": "f", "arguments": {', [ToolEvent(text='{"name": "f", "arguments": {')]),
    ("<b>html</b>", [ToolEvent(text="<b>html</b>")]),
]


@pytest.mark.parametrize(("output", "expected"), JSON_CASES)
def test_json_family(output: str, expected: list[ToolEvent]) -> None:
    assert get_tool_parser("json")().parse(output) == expected
    assert streamed("json", list(output)) == expected


def test_json_plain_text_streams_without_waiting() -> None:
    parser = JsonToolParser()
    assert parser.feed("  ") == []
    assert parser.feed("Hello") == [ToolEvent(text="  Hello")]
    assert parser.feed(" world") == [ToolEvent(text=" world")]


def test_registry() -> None:
    assert get_tool_parser("qwen") is HermesToolParser
    assert get_tool_parser("llama3_json") is JsonToolParser
    assert get_tool_parser("mistral").__mro__[1] is JsonToolParser  # reads the same, writes Mistral's markers
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")
    with pytest.raises(ValueError, match="hermes"):
        register_tool_parser("hermes")(JsonToolParser)


def test_tools_prompt_lists_every_tool() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "now"}}]
    for name in ("hermes", "json"):
        text = get_tool_parser(name).tools_prompt(tools, "required")
        assert "get_weather" in text and '"now"' in text
        assert "must call" in text
    named = get_tool_parser("hermes").tools_prompt(tools, {"type": "function", "function": {"name": "now"}})
    assert "'now'" in named


def test_whole_message() -> None:
    content, calls = whole_message(ToolCallStream(HermesToolParser()), f"  \n<tool_call>{WEATHER}</tool_call>")
    assert content is None
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": WEATHER_CALL.arguments}
    content, calls = whole_message(ToolCallStream(HermesToolParser()), f" Sure. <tool_call>{WEATHER}</tool_call>"
                                                                      f"\n<tool_call>{WEATHER}</tool_call>")
    assert content == "Sure." and [c["function"] for c in calls] == [calls[0]["function"]] * 2
    assert calls[0]["id"] != calls[1]["id"]
    assert whole_message(ToolCallStream(HermesToolParser()), "plain") == ("plain", [])
    assert whole_message(PlainText(), " plain <tool_call>") == (" plain <tool_call>", [])


def test_stream_deltas_carry_index_id_name_then_argument_fragments() -> None:
    stream = ToolCallStream(HermesToolParser())
    deltas = [d for piece in [f"Hi <tool_call>{WEATHER}</tool_call>", f"<tool_call>{WEATHER}</tool_call>"]
              for d in stream.feed(piece)] + stream.finish()
    assert deltas[0] == {"content": "Hi "}
    calls = [d["tool_calls"][0] for d in deltas[1:]]
    assert all(set(d) == {"tool_calls"} and len(d["tool_calls"]) == 1 for d in deltas[1:])
    for index in (0, 1):
        mine = [c for c in calls if c["index"] == index]
        head, rest = mine[0], mine[1:]
        assert head["id"].startswith("call_") and head["type"] == "function"
        assert head["function"] == {"name": "get_weather", "arguments": ""}
        assert len(rest) > 1  # arguments arrive in several fragments
        assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in rest)
        assert json.loads("".join(c["function"]["arguments"] for c in rest)) == {"city": "Paris", "unit": "°C"}
    assert stream.calls == 2
