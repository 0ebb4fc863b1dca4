"""MODEL_TYPE=qwen_agent: Qwen-Agent's `✿FUNCTION✿`/`✿ARGS✿` calls read from the answer (the qwen_agent
tool parser, however the text is split), the prompt it writes (tools in the system turn, earlier calls and
`✿RESULT✿`/`✿RETURN✿` results in the assistant turn), and the renderer's output post-processing
(render_response_stream) through the frontend, streamed and whole."""
from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from kvyard.tokenizer import TextTokenizer
from renderers import RenderRequest, get_renderer, get_tool_parser
from renderers.response_stream import whole_message
from tests.frontend.test_tool_parsers import streamed
from tests.support.mock_stack import MockBackendThread, mock_frontend, script
from tests.support.sse import sse_data

CALL = '✿FUNCTION✿: get_weather\n✿ARGS✿: {"city": "Paris"}'
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def calls_and_text(text: str, pieces: int) -> list[object]:
    """The parser's events for `text` fed in `pieces` roughly equal parts, as (text) or (name, arguments)."""
    size = max(1, len(text) // pieces)
    events = streamed("qwen_agent", [text[i:i + size] for i in range(0, len(text), size)])
    return [ev.text if ev.call is None else (ev.call.name, ev.call.arguments) for ev in events]


@pytest.mark.parametrize("pieces", [1, 3, 7, 1000])
def test_calls_are_read_however_the_text_is_split(pieces: int) -> None:
    text = f"Let me look.\n{CALL}\n✿FUNCTION✿: now\n✿ARGS✿: {{}}\n✿RESULT✿: sunny"
    assert calls_and_text(text, pieces) == ["Let me look.\n", ("get_weather", '{"city": "Paris"}'), ("now", "{}")]
    assert calls_and_text("No tools needed: 2 + 2 = 4.", pieces) == ["No tools needed: 2 + 2 = 4."]
    # not calls: an empty name, a name line without ✿ARGS✿, the output ending inside a name line
    for plain in ("✿FUNCTION✿: \n✿ARGS✿: {}", "✿FUNCTION✿: x\nand more", "see ✿FUNCTION✿: get_wea"):
        assert calls_and_text(plain, pieces) == [plain]


def test_arguments_stream_before_the_call_ends() -> None:
    parser = get_tool_parser("qwen_agent")()
    seen = []
    for ch in CALL + "\n✿RETURN✿":
        parser.feed(ch)
        seen.append(parser.pending())
    final = '{"city": "Paris"}'
    args = [p.arguments for p in seen if p is not None]
    assert args[-1] == final and all(final.startswith(a) for a in args) and len(set(args)) > 5
    assert seen[CALL.index("\n✿ARGS✿") - 1] is None   # undecided until the name line is complete


def test_the_prompt_carries_tools_calls_and_results(tokenizer: TextTokenizer) -> None:
    renderer = get_renderer("qwen_agent", tokenizer)
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"}]
    out = renderer.render(RenderRequest(messages=messages, tools=[WEATHER]))
    assert out.format_stops == ("✿RESULT✿", "✿RETURN✿") and out.renderer == "qwen_agent"
    system, rest = out.prompt.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools")
    assert "get_weather: Weather by city" in system and "✿FUNCTION✿: the tool's name, one of [get_weather]" in system
    # the assistant turn with the call and its result is continued through the user turn (Qwen-Agent's way)
    assert rest == ("<|im_start|>user\nWeather in Paris?\n\n" + CALL + "\n✿RESULT✿: sunny, 21 C\n✿RETURN✿"
                    "<|im_end|>\n<|im_start|>assistant\n")
    # the legacy shapes: function_call on the assistant turn, role "function" for the result, then the reply
    legacy = [messages[0], {"role": "assistant", "content": None,
                            "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
              {"role": "function", "name": "get_weather", "content": "sunny"},
              {"role": "assistant", "content": "It is sunny."}, {"role": "user", "content": "Thanks"}]
    prompt = renderer.render(RenderRequest(messages=legacy, functions=[WEATHER["function"]])).prompt
    assert "<|im_start|>assistant\n" + CALL + "\n✿RESULT✿: sunny\n✿RETURN✿: It is sunny.<|im_end|>" in prompt
    assert "# Tools" not in prompt   # no tools offered this turn (functions are the request's, tools are None)


def test_the_response_stream_takes_off_the_colon_after_return(tokenizer: TextTokenizer) -> None:
    renderer = get_renderer("qwen_agent", tokenizer)
    assert whole_message(renderer.render_response_stream(True), ": It is sunny.") == ("It is sunny.", [])
    stream = renderer.render_response_stream(True)
    deltas = [d for piece in (":", " It", " is") for d in stream.feed(piece)] + stream.finish()
    assert "".join(d["content"] for d in deltas) == "It is"
    content, calls = whole_message(renderer.render_response_stream(True), f"Checking.\n{CALL}")
    assert content == "Checking." and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert whole_message(renderer.render_response_stream(False), ": as is") == (": as is", [])


@pytest.fixture(scope="module")
def mock(tokenizer: TextTokenizer) -> Iterator[MockBackendThread]:
    with MockBackendThread(script(tokenizer, f"Checking.\n{CALL}\n✿RESULT✿: made up")) as backend:
        yield backend


@pytest.fixture(scope="module")
def http(tokenizer: TextTokenizer, mock: MockBackendThread) -> Iterator[httpx.Client]:
    with mock_frontend(tokenizer, mock.address, MODEL_TYPE="qwen_agent") as front, \
            httpx.Client(base_url=front.url, timeout=10) as client:
        yield client


def test_chat_answers_with_tool_calls_streamed_and_whole(http: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER], "max_tokens": 64}
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    chunks = [json.loads(e) for e in sse_data(http.post("/v1/chat/completions", json={**body, "stream": True}).text)
              if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas).strip() == "Checking."
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(c["function"].get("arguments", "") for c in calls)) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert "made up" not in json.dumps(chunks)   # ✿RESULT✿ stopped the answer
    legacy = http.post("/v1/chat/completions", json={**body, "tools": None, "functions": [WEATHER["function"]]}).json()
    assert legacy["choices"][0]["message"]["function_call"]["name"] == "get_weather"
    render = http.post("/v1/chat/render", json=body).json()
    assert {"✿RESULT✿", "✿RETURN✿"} <= set(render["stop_words_list"])
    assert render["renderer_info"]["tool_parser"] == "qwen_agent"


def test_a_forced_call_follows_the_format(http: httpx.Client, tokenizer: TextTokenizer) -> None:
    """tool_choice "required": the grammar admits calls written as the parser reads them, and nothing else."""
    from backend.constraints import GrammarCompiler
    from kvyard.constraint import Constraint, ConstraintKind

    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER], "tool_choice": "required",
            "max_tokens": 64, "parallel_tool_calls": True}
    render = http.post("/v1/chat/render", json=body)
    assert render.status_code == 200, render.text
    grammar = Constraint(ConstraintKind.LARK, render.json()["generate_config"]["constraint"]["text"])
    compiler = GrammarCompiler(tokenizer.to_json(), tokenizer.vocab_size, frozenset({tokenizer.eos_token_id}))
    try:
        two_calls = f"{CALL}\n{CALL}"
        assert calls_and_text(two_calls, 1) == [("get_weather", '{"city": "Paris"}')] * 2
        state = compiler.compile_now(grammar)
        assert state.advance_all(tokenizer.encode(two_calls)) and not state.error
        assert not compiler.compile_now(grammar).advance_all(tokenizer.encode("Sunny."))
    finally:
        compiler.close()
