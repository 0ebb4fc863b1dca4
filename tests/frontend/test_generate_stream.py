"""BentoML-style POST /generate: plain text that arrives as it is generated, and SSE framing read the way
curl shows it and an SSE client parses it (multi-line text included)."""
from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from frontend.respond import EVENT_SSE, sse_message
from kvyard.tokenizer import TextTokenizer
from tests.conftest import Cluster
from tests.support.stub_backend import StubFrontend, stub_frontend

TEXT = "Line one\nLine two\n\n  indented: yes\nend"
SSE = {"Accept": "text/event-stream"}


def parse_sse(raw: str) -> list[tuple[str, str | None]]:
    """(event, data) per dispatched event, as the SSE spec reads a stream: CR, LF or CRLF end a line, one
    space after the colon is dropped, data lines join with LF. A data-less event (BentoML's end) is kept
    with data None."""
    events: list[tuple[str, str | None]] = []
    event, data = "", []
    for line in re.split(r"\r\n|\r|\n", raw):
        if line == "":
            if data or event:
                events.append((event or "message", "\n".join(data) if data else None))
            event, data = "", []
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
    return events


@pytest.fixture(scope="module")
def stub(tokenizer: TextTokenizer) -> Iterator[StubFrontend]:
    ids = [*tokenizer.encode(TEXT), 2]
    with stub_frontend(tokenizer, lambda _req: ids, delay_s=0.03) as frontend:
        yield frontend


@pytest.mark.parametrize("text", ["plain", "two\nlines", "\n", "a\n\nb\n", " leading space", "cr\rlf\r\nend",
                                  "data: looks like a field", ""])
def test_sse_message_round_trips(text: str) -> None:
    raw = sse_message(text)
    assert raw.startswith("event: message\n") and raw.endswith("\n\n")
    assert "\n\n" not in raw[:-2]  # one event, however many lines
    assert parse_sse(raw) == [("message", text.replace("\r\n", "\n").replace("\r", "\n"))]
    assert EVENT_SSE.end == "event: end\n\n"


def test_plain_text_streams_as_generated(stub: StubFrontend) -> None:
    chunks: list[str] = []
    with httpx.stream("POST", f"{stub.url}/generate", content="Say something", timeout=30) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
        chunks = list(resp.iter_text())
    assert "".join(chunks) == TEXT
    assert len(chunks) > 3  # it arrived in pieces, not as one body at the end


def test_sse_framing(stub: StubFrontend) -> None:
    resp = httpx.post(f"{stub.url}/generate?max_tokens=50&temperature=0", content="Say something",
                      headers=SSE, timeout=30)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    raw = resp.text
    assert raw.endswith("\n\nevent: end\n\n")
    assert re.fullmatch(r"(event: message\n(data: [^\r\n]*\n)+\n)+event: end\n\n", raw), raw
    events = parse_sse(raw)
    assert events[-1] == ("end", None)
    assert all(name == "message" for name, _ in events[:-1])
    assert "".join(data or "" for _, data in events[:-1]) == TEXT
    stub_request = stub.backend.servicer.requests[-1].generate_config
    assert stub_request.max_new_tokens == 50 and stub_request.temperature == 0


def test_curl_sees_the_same_text(stub: StubFrontend) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    plain = subprocess.run(["curl", "-sN", "-X", "POST", f"{stub.url}/generate", "-d", "What is the meaning?"],
                           capture_output=True, text=True, timeout=30)
    assert plain.returncode == 0 and plain.stdout == TEXT
    sse = subprocess.run(["curl", "-sN", "-H", "Accept: text/event-stream", f"{stub.url}/generate", "-d", "Hi"],
                         capture_output=True, text=True, timeout=30)
    assert parse_sse(sse.stdout)[-1] == ("end", None)


@pytest.mark.parametrize("query, body, status, needle", [
    ("?model=other", "Hi", 404, "other"),
    ("", "", 400, "empty"),
    ("?max_tokens=0", "Hi", 400, "max_tokens"),
    ("?temperature=-1", "Hi", 400, "temperature"),
    (f"?seed={2**70}", "Hi", 400, "seed"),        # past the proto's int64 (was a 500)
    (f"?seed=-{2**70}", "Hi", 400, "seed"),
    (f"?top_k={2**40}", "Hi", 400, "top_k"),      # past int32
    (f"?max_tokens={2**40}", "Hi", 400, "max_tokens"),
])
def test_errors_before_the_stream_are_http_errors(stub: StubFrontend, query: str, body: str, status: int,
                                                  needle: str) -> None:
    resp = httpx.post(f"{stub.url}/generate{query}", content=body, headers=SSE, timeout=30)
    assert resp.status_code == status
    error: dict[str, Any] = resp.json()["error"]
    assert needle in error["message"] + str(error["param"])


def test_max_tokens_past_the_context_is_a_400_as_elsewhere(stub: StubFrontend) -> None:
    """/generate used to clamp max_tokens to the room left; like /v1/completions it now refuses it."""
    for path, kwargs in [("/generate?max_tokens=300", {"content": "Hi"}),
                         ("/v1/completions", {"json": {"prompt": "Hi", "max_tokens": 300}})]:
        resp = httpx.post(f"{stub.url}{path}", headers=SSE, timeout=30, **kwargs)  # type: ignore[arg-type]
        assert resp.status_code == 400, path
        error = resp.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens", error


def test_prompt_tokenized_as_completions_does(stub: StubFrontend, tokenizer: TextTokenizer) -> None:
    """The same text reaches the backend as the same ids from /generate and /v1/completions (special
    tokens parsed, BOS at most once)."""
    prompt = "<|im_start|>user\nHi<|im_end|>"
    sent = []
    for path, kwargs in [("/generate?max_tokens=4", {"content": prompt}),
                         ("/v1/completions", {"json": {"prompt": prompt, "max_tokens": 4}})]:
        assert httpx.post(f"{stub.url}{path}", timeout=30, **kwargs).status_code == 200  # type: ignore[arg-type]
        sent.append(list(stub.backend.servicer.requests[-1].token_ids))
    assert sent[0] == sent[1]
    assert tokenizer.encode("<|im_start|>", parse_special=True)[0] in sent[0]


@pytest.mark.slow
def test_real_plain_and_sse_agree(pdfusion: Cluster) -> None:
    url = f"{pdfusion.base_url}/generate?max_tokens=24&temperature=0"
    prompt = "Here is a list of three fruits:\n1."
    plain = httpx.post(url, content=prompt, timeout=120)
    sse = httpx.post(url, content=prompt, headers=SSE, timeout=120)
    assert plain.status_code == sse.status_code == 200
    events = parse_sse(sse.text)
    assert events[-1] == ("end", None)
    assert "".join(data or "" for _, data in events[:-1]) == plain.text.replace("\r\n", "\n").replace("\r", "\n")
    assert plain.text.strip()


def test_a_long_prompt_is_left_truncated_as_bentoml_does(stub: StubFrontend, tokenizer: TextTokenizer) -> None:
    """BentoML's service keeps the last context - max_new_tokens - 1 tokens of a long prompt (the other
    dialects answer it with a 400 unless asked to truncate)."""
    prompt = " ".join(f"word{i}" for i in range(400))
    ids = tokenizer.encode(prompt)
    assert len(ids) > 256
    assert httpx.post(f"{stub.url}/generate?max_tokens=8", content=prompt, timeout=30).status_code == 200
    sent = list(stub.backend.servicer.requests[-1].token_ids)
    assert len(sent) == 256 - 8 - 1 and sent == ids[-len(sent):]
    long = httpx.post(f"{stub.url}/v1/completions", json={"prompt": prompt, "max_tokens": 8}, timeout=30)
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
