"""The OpenAI surface with the official client, sync and async, against an in-process frontend and the
product mock backend (backend/mock_backend.py): every chat parameter, streaming and not, n > 1, logprobs,
include_usage, stop strings and multi-byte characters split across tokens, tool calls, RTP-LLM's
extensions. /v1/completions and the raw `POST /` are in test_completions_api.py."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from backend.mock_backend import mock_logprob
from kvyard.tokenizer import TextTokenizer
from tests.support.sse import sse_data
from tests.support.mock_stack import MockBackendThread, MockFrontend, script

TEXT = "Hello there, friend!"
EOS = 2
MODEL = "mock-model"
HI = [{"role": "user", "content": "Hi"}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def mock(tokenizer: TextTokenizer) -> Iterator[MockBackendThread]:
    with MockBackendThread(script(tokenizer, TEXT)) as backend:
        yield backend


def stream_text(chunks: list[Any], index: int = 0) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == index)


# ---- chat: parameters reach the backend ------------------------------------------------------------

def test_every_sampling_parameter_is_forwarded(client: openai.OpenAI, mock: MockBackendThread) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=HI, temperature=0.5, top_p=0.9, max_completion_tokens=40, seed=7, n=2,
        presence_penalty=0.5, frequency_penalty=0.25, logit_bias={"42": 5, "7": -100}, user="u-1",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1})
    cfg = mock.servicer.requests[-1].generate_config
    assert cfg.temperature == pytest.approx(0.5) and cfg.top_p == pytest.approx(0.9)
    assert (cfg.top_k, cfg.max_new_tokens, cfg.seed, cfg.num_return_sequences) == (20, 40, 7, 2)
    assert cfg.min_p == pytest.approx(0.05) and cfg.repetition_penalty == pytest.approx(1.1)
    assert cfg.presence_penalty == pytest.approx(0.5) and cfg.frequency_penalty == pytest.approx(0.25)
    assert dict(cfg.logit_bias) == {42: 5.0, 7: -100.0}
    assert [c.index for c in resp.choices] == [0, 1]
    assert all(c.message.content == TEXT and c.finish_reason == "stop" for c in resp.choices)
    n_tokens = len(mock.servicer.script.token_ids)
    assert resp.usage.completion_tokens == 2 * n_tokens
    client.chat.completions.create(model=MODEL, messages=HI, max_tokens=9)
    assert mock.servicer.requests[-1].generate_config.max_new_tokens == 9


def test_message_roles_and_text_parts(client: openai.OpenAI, http: httpx.Client, mock: MockBackendThread) -> None:
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "assistant", "content": "It is 18 C."},
        {"role": "user", "content": "Thanks"},
    ]
    client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL])
    rendered = http.post("/v1/chat/render", json={"messages": messages, "tools": [WEATHER_TOOL]}).json()
    assert list(mock.servicer.requests[-1].token_ids) == rendered["input_ids"]
    prompt = rendered["input_prompt"]
    for piece in ("Be terse.", "Weather in Paris?", '"arguments": {"city": "Paris"}', "<tool_response>\n18 C\n",
                  "It is 18 C.", "Thanks", "<tools>"):
        assert piece in prompt
    assert rendered["renderer_info"]["tools_in_prompt"] is True


@pytest.mark.parametrize("stream", [False, True])
def test_length_finish(client: openai.OpenAI, stream: bool) -> None:
    if stream:
        chunks = list(client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, stream=True))
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        finishes = [client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2).choices[0].finish_reason]
    assert finishes == ["length"]


# ---- chat: streaming -----------------------------------------------------------------------------

def test_stream_n2_each_choice_finishes_once(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, n=2, stream=True))
    for index in (0, 1):
        assert stream_text(chunks, index) == TEXT
        finishes = [c.choices[0].finish_reason for c in chunks
                    if c.choices and c.choices[0].index == index and c.choices[0].finish_reason]
        assert finishes == ["stop"]
    assert {c.choices[0].delta.role for c in chunks[:1]} == {"assistant"}
    assert [c.index for c in chunks[0].choices] == [0, 1]


def test_include_usage_sync_and_async(client: openai.OpenAI, front: MockFrontend, mock: MockBackendThread) -> None:
    n_tokens = len(mock.servicer.script.token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, n=2, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * n_tokens
    assert all(c.usage is None for c in chunks[:-1])

    async def run() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key="x", max_retries=0) as aclient:
            stream = await aclient.chat.completions.create(model=MODEL, messages=HI, stream=True,
                                                           stream_options={"include_usage": True})
            return [c async for c in stream]
    achunks = asyncio.run(run())
    assert stream_text(achunks) == TEXT
    assert achunks[-1].choices == [] and achunks[-1].usage.total_tokens == (
        achunks[-1].usage.prompt_tokens + n_tokens)


def test_async_client_concurrent_requests(front: MockFrontend) -> None:
    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key="x", max_retries=0) as aclient:
            resps = await asyncio.gather(*[aclient.chat.completions.create(model=MODEL, messages=HI)
                                           for _ in range(4)])
        return [r.choices[0].message.content for r in resps]
    assert asyncio.run(run()) == [TEXT] * 4


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_shape(client: openai.OpenAI, tokenizer: TextTokenizer, mock: MockBackendThread,
                        stream: bool) -> None:
    ids = list(mock.servicer.script.token_ids)
    kwargs: dict[str, Any] = dict(model=MODEL, messages=HI, logprobs=True, top_logprobs=3)
    if stream:
        entries = [e for c in client.chat.completions.create(stream=True, **kwargs)
                   if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    else:
        entries = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert len(entries) == len(ids)
    for e, token in zip(entries, ids):
        assert e.logprob == pytest.approx(mock_logprob(token))
        assert e.token == tokenizer.decode([token])
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
    assert b"".join(bytes(e.bytes) for e in entries[:-1]).decode() == TEXT
    plain = client.chat.completions.create(model=MODEL, messages=HI)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_split_across_tokens_never_leak(client: openai.OpenAI, tokenizer: TextTokenizer,
                                                     mock: MockBackendThread, stream: bool) -> None:
    with mock.scripted(script(tokenizer, TEXT, per_char=True)):
        for stop, expected in [(["there"], "Hello "), ("d!", "Hello there, frien"), ([", f", "xyz"], "Hello there")]:
            if stream:
                chunks = list(client.chat.completions.create(model=MODEL, messages=HI, stop=stop, stream=True))
                pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
                assert "".join(pieces) == expected
                assert [c.choices[0].finish_reason for c in chunks if c.choices and
                        c.choices[0].finish_reason] == ["stop"]
            else:
                resp = client.chat.completions.create(model=MODEL, messages=HI, stop=stop)
                assert (resp.choices[0].message.content, resp.choices[0].finish_reason) == (expected, "stop")


def test_multibyte_characters_split_across_tokens(client: openai.OpenAI, tokenizer: TextTokenizer,
                                                   mock: MockBackendThread) -> None:
    text = "🤖 日本語 café ü"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # some characters really span tokens
    with mock.scripted(script(tokenizer, text)):
        chunks = list(client.chat.completions.create(model=MODEL, messages=HI, stream=True))
        pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) == text
        assert client.chat.completions.create(model=MODEL, messages=HI, stop=["本"]).choices[0].message.content \
            == "🤖 日"


# ---- chat: tool calls ----------------------------------------------------------------------------

def test_tool_call_non_stream(client: openai.OpenAI, tokenizer: TextTokenizer, mock: MockBackendThread) -> None:
    with mock.scripted(script(tokenizer, "Checking.\n" + CALL_TEXT)):
        resp = client.chat.completions.create(model=MODEL, messages=HI, tools=[WEATHER_TOOL])
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_tool_calls_through_the_clients_streaming_helpers(client: openai.OpenAI, front: MockFrontend,
                                                          tokenizer: TextTokenizer, mock: MockBackendThread) -> None:
    two_calls = CALL_TEXT + "\n" + CALL_TEXT.replace("Paris", "Rome, the eternal city of seven hills")
    with mock.scripted(script(tokenizer, two_calls, per_char=True)):
        with client.chat.completions.stream(model=MODEL, messages=HI, tools=[WEATHER_TOOL]) as stream:
            events = list(stream)
            final = stream.get_final_completion()

        async def run() -> Any:
            async with openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key="x", max_retries=0) as aclient:
                async with aclient.chat.completions.stream(model=MODEL, messages=HI, tools=[WEATHER_TOOL]) as s:
                    async for _ in s:
                        pass
                    return await s.get_final_completion()
        afinal = asyncio.run(run())
    for completion in (final, afinal):
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert [c.function.parsed_arguments for c in choice.message.tool_calls] == [
            {"city": "Paris"}, {"city": "Rome, the eternal city of seven hills"}]
        assert len({c.id for c in choice.message.tool_calls}) == 2
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert [e.index for e in done] == [0, 1]
    assert sum(e.type == "tool_calls.function.arguments.delta" for e in events) > 2


def test_streaming_tool_deltas_on_the_wire(http: httpx.Client, tokenizer: TextTokenizer,
                                           mock: MockBackendThread) -> None:
    with mock.scripted(script(tokenizer, CALL_TEXT)):
        resp = http.post("/v1/chat/completions", json={"messages": HI, "tools": [WEATHER_TOOL], "stream": True})
    chunks = [json.loads(d) for d in sse_data(resp.text)[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert all("index" in c for c in calls)
    assert calls[0]["id"] and calls[0]["type"] == "function" and calls[0]["function"]["name"] == "get_weather"
    assert all(isinstance(c["function"]["arguments"], str) for c in calls)
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("tool_calls") == 1
    assert not any(d.get("content") for d in deltas)


@pytest.mark.parametrize("stream", [False, True])
def test_malformed_tool_json_degrades_to_content(client: openai.OpenAI, tokenizer: TextTokenizer,
                                                 mock: MockBackendThread, stream: bool) -> None:
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}\n</tool_call>'
    with mock.scripted(script(tokenizer, bad)):
        if stream:
            chunks = list(client.chat.completions.create(model=MODEL, messages=HI, tools=[WEATHER_TOOL], stream=True))
            text = stream_text(chunks)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
        else:
            resp = client.chat.completions.create(model=MODEL, messages=HI, tools=[WEATHER_TOOL])
            text, finish = resp.choices[0].message.content, [resp.choices[0].finish_reason]
            assert resp.choices[0].message.tool_calls is None
    assert text == bad and finish == ["stop"]


def test_tool_choice_none_and_named(client: openai.OpenAI, http: httpx.Client, tokenizer: TextTokenizer,
                                    mock: MockBackendThread) -> None:
    with mock.scripted(script(tokenizer, CALL_TEXT)):
        resp = client.chat.completions.create(model=MODEL, messages=HI, tools=[WEATHER_TOOL], tool_choice="none")
        assert resp.choices[0].message.content == CALL_TEXT and resp.choices[0].finish_reason == "stop"
        assert "<tools>" not in tokenizer.decode(list(mock.servicer.requests[-1].token_ids))
        named = {"type": "function", "function": {"name": "get_weather"}}
        resp = client.chat.completions.create(model=MODEL, messages=HI, tools=[WEATHER_TOOL], tool_choice=named)
        assert resp.choices[0].finish_reason == "tool_calls"
        assert "must call the function 'get_weather'" in tokenizer.decode(list(mock.servicer.requests[-1].token_ids))
        # The deprecated `functions` field is read as tools, and answered as OpenAI's legacy API answers it.
        body = {"messages": HI, "functions": [WEATHER_TOOL["function"]]}
        choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert choice["finish_reason"] == "function_call" and "tool_calls" not in choice["message"]
        assert choice["message"]["function_call"]["name"] == "get_weather"


# ---- chat: RTP-LLM extensions --------------------------------------------------------------------

def test_extra_configs(http: httpx.Client, mock: MockBackendThread) -> None:
    resp = http.post("/v1/chat/completions", json={"messages": HI, "temperature": 0.3, "extra_configs": {
        "top_k": 5, "temperature": 1.5, "max_new_tokens": 11, "stop_words_str": ["friend"], "random_seed": 3,
        "stop_words_list": [[1, 2]], "chat_template_kwargs": {"unused": 1}}})
    assert resp.status_code == 200, resp.text
    cfg = mock.servicer.requests[-1].generate_config
    assert cfg.top_k == 5 and cfg.max_new_tokens == 11 and cfg.seed == 3
    assert cfg.temperature == pytest.approx(0.3)   # the OpenAI field wins
    assert [list(s.ids) for s in cfg.stop_words_list] == [[1, 2]]
    assert resp.json()["choices"][0]["message"]["content"] == "Hello there, "


def test_templates_from_the_request(http: httpx.Client, mock: MockBackendThread, tokenizer: TextTokenizer) -> None:
    body = {"messages": HI, "user_template": "{% for m in messages %}{{ m.content }}|{% endfor %}{{ suffix }}",
            "chat_template_kwargs": {"suffix": "END"}}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    assert tokenizer.decode(list(mock.servicer.requests[-1].token_ids)) == "Hi|END"
    body = {"messages": HI, "template_key": "default"}
    assert http.post("/v1/chat/completions", json=body).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_template_that_renders_nothing_is_a_400(http: httpx.Client, stream: bool) -> None:
    """Found by make test's fuzzer: an empty user_template gave the engine a prompt of no tokens (a 500)."""
    resp = http.post("/v1/chat/completions", json={"messages": HI, "user_template": "", "stream": stream})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "messages" and "empty" in resp.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_debug_info_and_aux_info(http: httpx.Client, mock: MockBackendThread, stream: bool) -> None:
    body = {"messages": HI, "debug_info": True, "aux_info": True, "stream": stream}
    resp = http.post("/v1/chat/completions", json=body)
    n_tokens = len(mock.servicer.script.token_ids)
    if stream:
        chunks = [json.loads(d) for d in sse_data(resp.text)[:-1]]
        debug = chunks[0]["debug_info"]
        aux = [c["aux_info"] for c in chunks if "aux_info" in c]
        assert len(aux) == 1 and aux[0]["output_len"] == n_tokens
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and "aux_info" in chunks[-1]
    else:
        out = resp.json()
        debug, aux = out["debug_info"], out["aux_info"]
        assert debug["output_ids"] == [list(mock.servicer.script.token_ids)]
        assert debug["raw_output"] == [TEXT]
        assert aux["output_len"] == n_tokens and aux["iter_count"] == n_tokens
    assert list(mock.servicer.requests[-1].token_ids) == debug["input_ids"]
    assert debug["renderer_info"]["class_name"] == "basic" and debug["generate_config"]["n"] == 1
    plain = http.post("/v1/chat/completions", json={"messages": HI}).json()
    assert "debug_info" not in plain and "aux_info" not in plain
