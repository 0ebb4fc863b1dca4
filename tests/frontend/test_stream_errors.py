"""Errors after a stream started (an error chunk, then the dialect's end marker, whatever failed), errors
before its first token (the HTTP status, as without stream), and a client that goes away cancels the backend call, streaming or not. The backend answers TEXT (conftest's mock)."""
from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

from backend.mock_backend import MockScript
from kvyard.tokenizer import TextTokenizer
from tests.support.mock_stack import MockBackendThread, MockFrontend, slow_script
from tests.support.openai_errors import ERROR_KEYS
from tests.support.sse import sse_data

TEXT = "Hello there, friend!"
HI = [{"role": "user", "content": "Hi"}]


# ---- errors after the stream started -------------------------------------------------------------

def streams_ending_in_error(http: httpx.Client, code: str) -> list[list[dict]]:
    """Streams chat, completions and POST / into the scripted failure: each must end with an error chunk
    carrying `code` and then its end marker. Returns the chat and completions chunks before the error."""
    before = []
    for path, body in [("/v1/chat/completions", {"messages": HI, "stream": True}),
                       ("/v1/completions", {"prompt": "x", "stream": True})]:
        resp = http.post(path, json=body)
        assert resp.status_code == 200
        data = sse_data(resp.text)
        assert data[-1] == "[DONE]"
        error = json.loads(data[-2])
        assert set(error) == {"error"} and set(error["error"]) == ERROR_KEYS
        assert error["error"]["code"] == code
        before.append([json.loads(d) for d in data[:-2]])
    raw = sse_data(http.post("/", json={"prompt": "x", "stream": True}).text)
    assert raw[-1] == "[done]" and json.loads(raw[-2])["error"]["code"] == code
    return before


@pytest.mark.parametrize(("kind", "code"), [("INTERNAL", "internal"), ("UNAVAILABLE", "unavailable"),
                                            ("TIMEOUT", "timeout")])
def test_error_after_the_stream_started(http: httpx.Client, front: MockFrontend, mock: MockBackendThread,
                                        tokenizer: TextTokenizer, kind: str, code: str) -> None:
    with mock.scripted(MockScript(tuple(tokenizer.encode(TEXT)), error=kind, error_after=3)):
        for chunks in streams_ending_in_error(http, code):
            texts = [c["choices"][0].get("delta", {}).get("content") or c["choices"][0].get("text") or ""
                     for c in chunks]
            assert "".join(texts) == "Hello there,"   # the three tokens before the failure
            assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
        with pytest.raises(openai.APIError):
            client = openai.OpenAI(base_url=f"{front.url}/v1", api_key="x", max_retries=0)
            list(client.chat.completions.create(model="mock-model", messages=HI, stream=True))


@pytest.mark.parametrize(("kind", "status", "code"), [("OVERLOADED", 429, "overloaded"),
                                                      ("MODEL_NOT_FOUND", 404, "model_not_found"),
                                                      ("UNAVAILABLE", 503, "unavailable")])
def test_a_refusal_before_the_first_token_keeps_its_status(http: httpx.Client, front: MockFrontend,
                                                           mock: MockBackendThread, tokenizer: TextTokenizer,
                                                           kind: str, status: int, code: str) -> None:
    """The backend refusing a request before its first token (full, an adapter it does not hold, gone) is the
    same HTTP error streaming or not: a stream's 200 waits for its first token, so a client's retry on 429
    works. Before, every stream answered 200 and then an error chunk."""
    with mock.scripted(MockScript(tuple(tokenizer.encode(TEXT)), error=kind, error_after=0)):
        for path, body in [("/v1/chat/completions", {"messages": HI}), ("/v1/completions", {"prompt": "x"}),
                           ("/v1/responses", {"input": "x"}), ("/", {"prompt": "x"})]:
            for stream in (False, True):
                resp = http.post(path, json={**body, "stream": stream})
                assert resp.status_code == status, (path, stream, resp.text)
                assert resp.headers["content-type"].startswith("application/json"), (path, stream)
                assert set(resp.json()["error"]) == ERROR_KEYS and resp.json()["error"]["code"] == code
        client = openai.OpenAI(base_url=f"{front.url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(model="mock-model", messages=HI, stream=True)
        assert caught.value.status_code == status


def test_a_failure_that_is_not_a_request_error_still_ends_the_stream(http: httpx.Client, mock: MockBackendThread,
                                                                     tokenizer: TextTokenizer) -> None:
    """A backend that answers a token id outside the vocabulary makes the detokenizer raise ValueError, not a
    RequestError: every stream used to drop its connection with no error chunk and no end marker."""
    with mock.scripted(MockScript((*tokenizer.encode(TEXT)[:3], 10**6, 2))):
        streams_ending_in_error(http, "internal")
        events = http.post("/generate", content=b"x", headers={"accept": "text/event-stream"}).text
        assert "event: error\n" in events and events.endswith("event: end\n\n"), events


# ---- the client goes away -----------------------------------------------------------------------

def idle_cancelled(mock: MockBackendThread) -> int:
    """The mock's cancellations once no call of an earlier test is still in flight (on a busy machine one may be
    cancelled after the next test reads the count: a fresh-clone run counted 2 for one request)."""
    deadline = time.monotonic() + 5
    while mock.servicer.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mock.servicer.running == 0, "an earlier call is still running"
    return mock.servicer.cancelled


def wait_cancelled(mock: MockBackendThread, before: int) -> None:
    deadline = time.monotonic() + 5
    while (mock.servicer.cancelled == before or mock.servicer.running) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mock.servicer.cancelled == before + 1, "backend call not cancelled"
    assert mock.servicer.running == 0


@pytest.mark.parametrize(("path", "body"), [("/v1/chat/completions", {"messages": HI}),
                                            ("/v1/completions", {"prompt": "x", "max_tokens": 100}),
                                            ("/", {"prompt": "x"})])
def test_disconnect_cancels_a_non_streaming_request(front: MockFrontend, mock: MockBackendThread,
                                                    tokenizer: TextTokenizer, path: str, body: dict[str, Any]) -> None:
    with mock.scripted(slow_script(tokenizer)):
        before = idle_cancelled(mock)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{front.url}{path}", json=body, timeout=0.5)
        wait_cancelled(mock, before)


def test_disconnect_cancels_a_stream(front: MockFrontend, mock: MockBackendThread, tokenizer: TextTokenizer) -> None:
    with mock.scripted(slow_script(tokenizer)):
        before = idle_cancelled(mock)
        with httpx.stream("POST", f"{front.url}/v1/completions", json={"prompt": "x", "max_tokens": 100,
                                                                       "stream": True}) as resp:
            for i, _ in enumerate(resp.iter_lines()):
                if i == 3:
                    break
        wait_cancelled(mock, before)
