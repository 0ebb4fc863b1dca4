"""The first-token and inter-token deadlines (frontend/deadlines.py) against scripted backends whose event loop
is frozen, as a SIGSTOPped backend's is: its connection open, nothing answered, not even a health check.
A request whose backend went silent before its first token is answered by the other backend; one silent
mid-stream ends with an error chunk and [DONE] (a 504 when not streaming); a backend that is slow but
answers its health check keeps its request."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import httpx
import pytest

from kvyard.tokenizer import TextTokenizer
from tests.support.mock_stack import MockBackendThread, mock_frontend
from tests.support.openai_errors import assert_error
from tests.support.sse import sse_data
from tests.support.stub_backend import StubEngine, stub_backend

DEADLINE_S = 1  # FIRST_TOKEN_TIMEOUT_S and INTER_TOKEN_TIMEOUT_S here; the health probe then waits up to 1 s
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40}


@dataclass
class Pair:
    url: str
    ids: list[int]                  # what each backend streams
    engines: tuple[StubEngine, StubEngine]
    backends: tuple[MockBackendThread, MockBackendThread]


@pytest.fixture
def pair(tokenizer: TextTokenizer) -> Iterator[Pair]:
    """Two scripted backends (30 tokens, 50 ms apart) behind a frontend with no master that calls the first
    one first (round robin over BACKEND_ADDRESSES, a fresh frontend per test)."""
    ids = tokenizer.encode(" word") * 30
    with ExitStack() as stack:
        b = [stack.enter_context(stub_backend(lambda _req: ids, delay_s=0.05)) for _ in range(2)]
        addresses = ",".join(backend.address for _, backend in b)
        front = stack.enter_context(mock_frontend(
            tokenizer, b[0][1].address, BACKEND_ADDRESSES=addresses, MAX_SEQ_LEN="256",
            FIRST_TOKEN_TIMEOUT_S=str(DEADLINE_S), INTER_TOKEN_TIMEOUT_S=str(DEADLINE_S)))
        yield Pair(front.url, ids, (b[0][0], b[1][0]), (b[0][1], b[1][1]))


@contextmanager
def frozen(backend: MockBackendThread, seconds: float) -> Iterator[None]:
    """Blocks the backend's event loop for `seconds` (from now); waits for it to thaw on leaving."""
    thawed = threading.Event()

    def freeze() -> None:
        time.sleep(seconds)
        thawed.set()

    backend._loop.call_soon_threadsafe(freeze)
    try:
        yield
    finally:
        thawed.wait(seconds + 5)


def test_a_silent_backend_before_the_first_token_is_rerouted(pair: Pair) -> None:
    with frozen(pair.backends[0], 3.5):
        started = time.monotonic()
        resp = httpx.post(f"{pair.url}/v1/chat/completions", json=CHAT, timeout=30)
        took = time.monotonic() - started
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 30
        assert len(pair.backends[1].servicer.requests) == 1  # answered by the other one
        assert took < 2 * DEADLINE_S + 3, took  # a deadline, a probe and 1.5 s of tokens, not the freeze


def test_a_busy_backend_that_answers_its_health_check_keeps_the_request(pair: Pair) -> None:
    pair.engines[0].delay_s = 1.6 * DEADLINE_S  # each token slower than the deadlines, the loop free
    pair.engines[0].steps = lambda _req: pair.ids[:2]
    resp = httpx.post(f"{pair.url}/v1/chat/completions", json=CHAT, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 2
    assert len(pair.backends[0].servicer.requests) == 1 and not pair.backends[1].servicer.requests


def test_a_stream_whose_backend_goes_silent_ends_with_an_error_chunk_and_done(pair: Pair) -> None:
    events: list[str] = []
    with httpx.stream("POST", f"{pair.url}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        while len(events) < 3:  # the role chunk and two tokens
            events += sse_data(next(lines) + "\n")
        with frozen(pair.backends[0], 2 * DEADLINE_S + 1.5):
            started = time.monotonic()
            for line in lines:
                events += sse_data(line + "\n")
            took = time.monotonic() - started
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "timeout" and "went silent" in error["message"], error
    assert took < 2 * DEADLINE_S + 1.5, took
    assert not pair.backends[1].servicer.requests  # nothing is re-sent once tokens were streamed


def test_a_non_streaming_request_whose_backend_goes_silent_is_a_504(pair: Pair) -> None:
    result: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: result.update(
        r=httpx.post(f"{pair.url}/v1/chat/completions", json=CHAT, timeout=30)))
    thread.start()
    deadline = time.monotonic() + 10
    while not pair.engines[0].running:  # streaming from the first backend
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.2)
    with frozen(pair.backends[0], 2 * DEADLINE_S + 1.5):
        thread.join(2 * DEADLINE_S + 1.5)
        assert not thread.is_alive(), "the request hung past its inter-token deadline"
    error = assert_error(result["r"], 504, "timeout")
    assert error["type"] == "timeout_error" and "went silent" in error["message"], error
