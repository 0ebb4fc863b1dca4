"""RTP-LLM's request fields on chat: chat_id (the response id), trace_id (heads the backend request id, so the
backend's task list and log lines carry it), extend_fields (passed back), master_info (refused)."""
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


@pytest.mark.parametrize("field,value", [("trace_id", "a b"), ("trace_id", "x" * 129), ("chat_id", "id\nforged"),
                                         ("master_info", {"server_ip": "10.0.0.1"})])
def test_bad_or_unsupported_fields_are_a_400_naming_them(http: httpx.Client, field: str, value: object) -> None:
    resp = http.post("/v1/chat/completions", json={**CHAT, field: value})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == field, resp.text
