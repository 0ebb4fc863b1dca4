"""A real ROLE_TYPE=FRONTEND process when its backend fails: an error before or after the stream started,
a backend that is down, and a client that leaves mid-stream (the backend call is cancelled)."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.frontend.role_stack import HI, MODEL, SCRIPT_TEXT, Stack, client, http  # noqa: F401  (fixtures)
from tests.support.openai_errors import ERROR_KEYS, assert_error
from tests.support.stub_backend import reconfigured

BACKEND_ERROR = ("INVALID_ARGUMENT", "token id 99 is not allowed here")  # an ErrorCodePB name, the message


def test_backend_error_non_stream(http: httpx.Client, stack: Stack) -> None:
    with reconfigured(stack.engine, error=BACKEND_ERROR):
        resp = http.post("/v1/chat/completions", json={"messages": HI})
    err = assert_error(resp, 400, "invalid_argument")
    assert err["message"] == BACKEND_ERROR[1]


def test_backend_error_stream(http: httpx.Client, stack: Stack) -> None:
    """The backend refusing a streamed request before its first token: the stream's 200 has not gone out
    yet, so the answer is the refusal's own status and error object, as without stream."""
    with reconfigured(stack.engine, error=BACKEND_ERROR):
        resp = http.post("/v1/chat/completions", json={"messages": HI, "stream": True})
    assert resp.status_code == 400 and resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS
    assert body["error"]["code"] == "invalid_argument"
    assert body["error"]["message"] == BACKEND_ERROR[1]


def test_backend_error_stream_with_openai_client(client: openai.OpenAI, stack: Stack) -> None:
    with reconfigured(stack.engine, error=BACKEND_ERROR):
        with pytest.raises(openai.APIError, match="token id 99"):
            list(client.chat.completions.create(model=MODEL, messages=HI, stream=True))


def test_backend_down(stack: Stack) -> None:
    down = stack.down.url
    with httpx.Client(base_url=down, timeout=10) as c:
        start = time.monotonic()
        health = c.get("/health")
        assert health.status_code == 503
        assert_error(health, 503)
        resp = c.post("/v1/chat/completions", json={"messages": HI})
        assert_error(resp, 503, "unavailable")
        assert resp.headers.get("retry-after") == "1"
        stream = c.post("/v1/chat/completions", json={"messages": HI, "stream": True})
        assert_error(stream, 503, "unavailable")  # before a first token: the status, streaming or not
        assert stream.headers.get("retry-after") == "1"
        assert time.monotonic() - start < 8
        # Everything that needs no backend still works.
        assert c.post("/v1/chat/render", json={"messages": HI}).status_code == 200
        assert c.get("/v1/models").status_code == 200
    client = openai.OpenAI(base_url=f"{down}/v1", api_key="x", max_retries=0, timeout=5)
    with pytest.raises(openai.InternalServerError) as exc:
        client.chat.completions.create(model=MODEL, messages=HI)
    assert exc.value.status_code == 503


def test_client_disconnect_cancels_backend_call(stack: Stack) -> None:
    steps = (stack.script_ids[:-1] * 50)[:50]
    servicer = stack.servicer
    with reconfigured(stack.engine, steps=lambda _req: steps, delay_s=0.2):
        time.sleep(0.3)  # let any earlier call's late cancellation land before the baseline
        before, n_requests = servicer.cancelled, len(servicer.requests)
        with httpx.Client(base_url=stack.url, timeout=10) as c:
            with c.stream("POST", "/v1/chat/completions", json={"messages": HI, "stream": True}) as resp:
                assert resp.status_code == 200
                seen = 0
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        seen += 1
                        if seen == 2:
                            break
        closed = time.monotonic()
        while servicer.cancelled == before and time.monotonic() - closed < 3:
            time.sleep(0.05)
        assert servicer.cancelled == before + 1, "backend call not cancelled within 3 s"
        assert len(servicer.requests) == n_requests + 1
    # The frontend is still fine afterwards.
    with httpx.Client(base_url=stack.url, timeout=10) as c:
        assert c.post("/v1/chat/completions", json={"messages": HI}).json()["choices"][0]["message"][
            "content"] == SCRIPT_TEXT
