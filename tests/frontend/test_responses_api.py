"""/v1/responses with the official client (`client.responses.create` and `.stream`) against an in-process
frontend and the product mock backend: text and item input, instructions, function tools and forced calls,
text.format, max_output_tokens, sampling fields, the typed stream events, previous_response_id and GET."""
from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from backend.mock_backend import MockScript
from kvyard.tokenizer import TextTokenizer
from tests.support.mock_stack import MockBackendThread, script

TEXT = "Hello there, friend!"
MODEL = "mock-model"
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def mock(tokenizer: TextTokenizer) -> Iterator[MockBackendThread]:
    with MockBackendThread(script(tokenizer, TEXT)) as backend:
        yield backend


def test_text_input_and_its_fields(client: openai.OpenAI, tokenizer: TextTokenizer, mock: MockBackendThread) -> None:
    resp = client.responses.create(model=MODEL, input="Hi", instructions="Be brief.", temperature=0.3, top_p=0.9,
                                   max_output_tokens=30, metadata={"k": "v"})
    assert resp.status == "completed" and resp.output_text == TEXT and resp.metadata == {"k": "v"}
    assert resp.output[0].type == "message" and resp.output[0].content[0].text == TEXT
    cfg = mock.servicer.requests[-1].generate_config
    assert cfg.temperature == pytest.approx(0.3) and cfg.top_p == pytest.approx(0.9) and cfg.max_new_tokens == 30
    ids = list(mock.servicer.requests[-1].token_ids)
    assert "Be brief." in tokenizer.decode(ids) and resp.usage.input_tokens == len(ids)   # instructions rendered
    assert resp.usage.output_tokens == len(mock.servicer.script.token_ids)


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI) -> None:
    resp = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 2


def test_item_input_with_a_function_call_round_trip(client: openai.OpenAI, http: httpx.Client) -> None:
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    resp = client.responses.create(model=MODEL, input=items, tools=[WEATHER])
    assert resp.output_text == TEXT
    refused = http.post("/v1/responses", json={"input": [{"type": "image", "url": "x"}]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input.0"


def test_tools_become_function_call_items(client: openai.OpenAI, tokenizer: TextTokenizer,
                                          mock: MockBackendThread) -> None:
    with mock.scripted(script(tokenizer, CALL_TEXT)):
        resp = client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER], tool_choice="required")
        assert mock.servicer.requests[-1].generate_config.HasField("constraint")   # the forced-call path
        stream_events = []
        with client.responses.stream(model=MODEL, input="Weather?", tools=[WEATHER]) as stream:
            for ev in stream:
                stream_events.append(ev.type)
            final = stream.get_final_response()
    call = resp.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert "response.function_call_arguments.delta" in stream_events
    assert "response.output_text.delta" not in stream_events
    assert json.loads(final.output[0].arguments) == {"city": "Paris"}


def test_named_tool_choice_and_json_schema_format(client: openai.OpenAI, mock: MockBackendThread) -> None:
    client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER],
                            tool_choice={"type": "function", "name": "get_weather"})
    assert mock.servicer.requests[-1].generate_config.constraint.text
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    client.responses.create(model=MODEL, input="Give a", text={"format": {"type": "json_schema", "name": "a",
                                                                          "schema": schema, "strict": True}})
    assert '"a"' in mock.servicer.requests[-1].generate_config.constraint.text


def test_streaming_events_in_order(client: openai.OpenAI) -> None:
    kinds, deltas = [], []
    with client.responses.stream(model=MODEL, input="Hi") as stream:
        for ev in stream:
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                deltas.append(ev.delta)
        final = stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(deltas) == TEXT and final.output_text == TEXT
    raw = client.responses.create(model=MODEL, input="Hi", stream=True)
    assert [ev.sequence_number for ev in raw] == list(range(len(kinds)))


def test_previous_response_id_and_get(client: openai.OpenAI, http: httpx.Client, mock: MockBackendThread,
                                      tokenizer: TextTokenizer) -> None:
    first = client.responses.create(model=MODEL, input="Remember 42.")
    assert client.responses.retrieve(first.id).output_text == TEXT
    client.responses.create(model=MODEL, input="What number?", previous_response_id=first.id)
    prompt = tokenizer.decode(list(mock.servicer.requests[-1].token_ids))
    assert prompt.index("Remember 42.") < prompt.index(TEXT) < prompt.index("What number?")
    gone = http.post("/v1/responses", json={"input": "x", "previous_response_id": "resp_nope"})
    assert gone.status_code == 400 and gone.json()["error"]["param"] == "previous_response_id"
    assert http.get("/v1/responses/resp_nope").status_code == 404
    unkept = client.responses.create(model=MODEL, input="x", store=False)
    assert http.get(f"/v1/responses/{unkept.id}").status_code == 404


def test_unknown_fields_are_refused(http: httpx.Client) -> None:
    resp = http.post("/v1/responses", json={"input": "x", "frobnicate": 1})
    assert resp.status_code == 400 and "Unrecognized request argument supplied: frobnicate" in resp.json()["error"]["message"]


def test_the_store_is_bounded() -> None:
    from frontend.responses import ResponseStore
    store = ResponseStore(max_items=2, ttl_s=3600)
    for i in range(3):
        store.put({"id": f"r{i}"}, [])
    with pytest.raises(KeyError):
        store.get("r0")
    assert store.get("r2")[0] == {"id": "r2"}
    expired = ResponseStore(max_items=2, ttl_s=0.0)
    expired.put({"id": "r"}, [])
    with pytest.raises(KeyError):
        expired.get("r")
