"""RTP-LLM's request fields on chat, completions and `POST /`: chat_id (the response id), trace_id (heads the
backend request id, so the backend's task list and log lines carry it), extend_fields (passed back),
private_request (the prompt stays out of the DEBUG log), master_info (refused)."""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import httpx
import pytest

from kvyard.tokenizer import TextTokenizer
from tests.support.mock_stack import MockBackendThread, script
from tests.support.sse import sse_data

CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def mock(tokenizer: TextTokenizer) -> Iterator[MockBackendThread]:
    with MockBackendThread(script(tokenizer, "Hi there")) as backend:
        yield backend


def test_chat_id_is_the_response_id_and_extend_fields_come_back(http: httpx.Client) -> None:
    extend = {"biz": "search", "n": [1, 2]}
    body = http.post("/v1/chat/completions", json={**CHAT, "chat_id": "conv-42", "extend_fields": extend}).json()
    assert body["id"] == "conv-42" and body["extend_fields"] == extend
    resp = http.post("/v1/chat/completions", json={**CHAT, "stream": True, "chat_id": "conv-43",
                                                   "extend_fields": extend})
    chunks = [json.loads(e) for e in sse_data(resp.text) if e != "[DONE]"]
    assert {c["id"] for c in chunks} == {"conv-43"}
    assert chunks[0]["extend_fields"] == extend and all("extend_fields" not in c for c in chunks[1:])
    # the same chat_id twice at once is fine: the backend's request ids stay unique
    assert http.post("/v1/chat/completions", json={**CHAT, "chat_id": "conv-42"}).status_code == 200


def test_trace_id_reaches_the_backend_and_the_log_lines(http: httpx.Client, mock: MockBackendThread,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="kvyard.frontend"):
        assert http.post("/v1/chat/completions", json={**CHAT, "trace_id": "trace-7f3a"}).status_code == 200
    assert mock.servicer.requests[-1].request_id.startswith("trace-7f3a-")
    assert any("trace-7f3a-" in r.getMessage() for r in caplog.records)
    finished = http.get("/worker_status").json()["finished_task_list"]
    assert finished[-1]["request_id"].startswith("trace-7f3a-")


# The other dialects: (path, body, how a streamed event ends)
DIALECTS = [("/v1/completions", {"prompt": "Hello", "max_tokens": 4}, "[DONE]"),
            ("/", {"prompt": "Hello", "generate_config": {"max_new_tokens": 4}}, "[done]"),
            ("/", {"prompt": ["Hello", "Hey"], "generate_config": {"max_new_tokens": 4}}, "[done]")]


@pytest.mark.parametrize("path,body,done", DIALECTS)
def test_completions_and_raw_take_the_same_fields(http: httpx.Client, mock: MockBackendThread,
                                                  caplog: pytest.LogCaptureFixture, path: str,
                                                  body: dict[str, object], done: str) -> None:
    extend = {"biz": "search", "n": [1, 2]}
    fields = {"chat_id": "conv-9", "trace_id": "trace-c0de", "extend_fields": extend}
    with caplog.at_level(logging.DEBUG, logger="kvyard.frontend"):
        answer = http.post(path, json={**body, **fields})
    assert answer.status_code == 200, answer.text
    assert answer.json()["id"] == "conv-9" and answer.json()["extend_fields"] == extend
    assert mock.servicer.requests[-1].request_id.startswith("trace-c0de-")
    assert any("trace-c0de-" in r.getMessage() and "Hello" in r.getMessage() for r in caplog.records)
    events = [json.loads(e) for e in sse_data(http.post(path, json={**body, **fields, "stream": True}).text)
              if e != done]
    assert len(events) > 1 and {e["id"] for e in events} == {"conv-9"}
    assert events[0]["extend_fields"] == extend and all("extend_fields" not in e for e in events[1:])
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="kvyard.frontend"):
        secret = {**body, "prompt": "my secret 7731", "private_request": True}
        assert http.post(path, json=secret).status_code == 200
    assert "7731" not in caplog.text
    plain = http.post(path, json=body).json()   # without chat_id: the shape is as before
    assert "extend_fields" not in plain and (path != "/" or "id" not in plain)
    for field, value in (("trace_id", "a b"), ("master_info", {"server_ip": "10.0.0.1"})):
        bad = http.post(path, json={**body, field: value})
        assert bad.status_code == 400 and field in bad.text, bad.text


@pytest.mark.parametrize("field,value", [("trace_id", "a b"), ("trace_id", "x" * 129), ("chat_id", "id\nforged"),
                                         ("master_info", {"server_ip": "10.0.0.1"})])
def test_bad_or_unsupported_fields_are_a_400_naming_them(http: httpx.Client, field: str, value: object) -> None:
    resp = http.post("/v1/chat/completions", json={**CHAT, field: value})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == field, resp.text


@pytest.mark.parametrize("key,value,needle", [
    ("num_beams", 4, "no beam search"), ("return_logits", True, "logprobs"),
    ("return_hidden_states", True, "hidden states"), ("top_p_decay", 0.9, "fixed top_p"),
    ("top_p_min", 0.1, "fixed top_p"), ("no_repeat_ngram_size", 3, "n-gram"),
    ("bad_words_list", [[5, 6]], "bad_words"),
])
def test_unimplemented_generate_config_keys_are_a_400_saying_why(http: httpx.Client, key: str, value: object,
                                                                 needle: str) -> None:
    resp = http.post("/v1/chat/completions", json={**CHAT, "extra_configs": {key: value}})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert key in error["message"] and needle in error["message"] and key in (error["param"] or ""), error
    raw = http.post("/", json={"prompt": "Hi", "generate_config": {key: value, "max_new_tokens": 2}})
    assert raw.status_code == 400 and key in raw.json()["error"]["message"], raw.text


def test_adapter_name_the_backend_does_not_hold_is_a_404(http: httpx.Client) -> None:
    """extra_configs.adapter_name reaches the backend (docs/lora.md); the mock holds no adapters."""
    resp = http.post("/v1/chat/completions", json={**CHAT, "extra_configs": {"adapter_name": "lora_0"}})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found", resp.text
    assert "lora_0" in resp.json()["error"]["message"]
    raw = http.post("/", json={"prompt": "Hi", "generate_config": {"adapter_name": "lora_0", "max_new_tokens": 2}})
    assert raw.status_code == 404, raw.text


def test_neutral_values_of_those_keys_are_taken(http: httpx.Client) -> None:
    neutral = {"num_beams": 1, "return_logits": False, "no_repeat_ngram_size": 0, "adapter_name": ""}
    assert http.post("/v1/chat/completions", json={**CHAT, "extra_configs": neutral}).status_code == 200


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "Hi", "max_tokens": 4})])
@pytest.mark.parametrize("key,value", [("is_streaming", True), ("return_output_ids", True), ("return_input_ids", True)])
def test_post_slash_answer_keys_are_refused_on_chat_and_completions(http: httpx.Client, path: str, body: dict[str, object],
                                                                    key: str, value: object) -> None:
    """POST /'s answer keys in extra_configs: they were accepted and ignored (a non-streamed answer for
    is_streaming: true, no ids for return_output_ids); now a 400 naming the key. A value the request does
    anyway is taken."""
    resp = http.post(path, json={**body, "extra_configs": {key: value}})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == f"extra_configs.{key}", resp.text
    neutral = {"is_streaming": False, "return_output_ids": False, "return_input_ids": False}
    assert http.post(path, json={**body, "extra_configs": neutral}).status_code == 200
    streamed = http.post(path, json={**body, "stream": True, "extra_configs": {"is_streaming": True}})
    assert streamed.status_code == 200 and sse_data(streamed.text)[-1] == "[DONE]"


def test_return_incremental(http: httpx.Client) -> None:
    """POST /: as `incremental` (each event only the new text); chat streams deltas anyway, so false is a 400."""
    body = {"prompt": "Hi", "generate_config": {"max_new_tokens": 4, "is_streaming": True, "return_incremental": True}}
    events = [json.loads(e) for e in sse_data(http.post("/", json=body).text) if e != "[done]"]
    pieces = [e["response"] for e in events]
    cumulative = [json.loads(e)["response"] for e in sse_data(http.post(
        "/", json={**body, "generate_config": {**body["generate_config"], "return_incremental": False}}).text)
        if e != "[done]"]
    assert cumulative[-1] == "".join(pieces)  # the new text only, event by event
    assert any(p != c for p, c in zip(pieces, cumulative)) and all(b.startswith(a) for a, b in
                                                                   zip(cumulative, cumulative[1:]))
    resp = http.post("/v1/chat/completions", json={**CHAT, "extra_configs": {"return_incremental": False}})
    assert resp.status_code == 400 and "return_incremental" in resp.json()["error"]["message"]


FUNCTION = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_legacy_functions_are_answered_with_function_call(http: httpx.Client, mock: MockBackendThread,
                                                          tokenizer: TextTokenizer) -> None:
    """OpenAI's legacy `functions`: the answer is `function_call` (streamed as function_call deltas),
    finish_reason "function_call"; a template reads them as the variable `functions` (RTP-LLM's)."""
    body = {**CHAT, "max_tokens": 64, "functions": [FUNCTION]}
    with mock.scripted(script(tokenizer, CALL)):
        choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert choice["finish_reason"] == "function_call"
        assert choice["message"]["function_call"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        chunks = [json.loads(e) for e in sse_data(http.post("/v1/chat/completions",
                                                            json={**body, "stream": True}).text) if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert all("tool_calls" not in d for d in deltas)
    calls = [d["function_call"] for d in deltas if "function_call" in d]
    assert calls[0]["name"] == "get_weather" and json.loads("".join(c.get("arguments", "") for c in calls)) == {
        "city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "function_call"
    render = http.post("/v1/chat/render", json={**body, "user_template": "{{ functions | map(attribute='name') | "
                                                                         "join(',') }}"}).json()
    assert render["input_prompt"] == "get_weather"
