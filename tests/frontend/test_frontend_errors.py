"""Every row of the error table through real HTTP (and the official client): 400 not 422, 401 with an API
key (health open), 404, 413, 429 with Retry-After, 503 draining or no backend. Errors after a stream
started and clients that go away: tests/frontend/test_stream_errors.py."""
from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from backend.mock_backend import MockScript
from frontend import admission
from kvyard.tokenizer import TextTokenizer
from master.mock_master import MockMasterConfig, create_mock_master_app
from tests.support.app_thread import AppThread
from tests.support.mock_stack import MockBackendThread, MockFrontend, mock_frontend, slow_script
from tests.support.openai_errors import assert_error as assert_openai_error
from tests.support.procs import free_port_block

HI = [{"role": "user", "content": "Hi"}]
TEXT = "Hello there, friend!"


@pytest.fixture(scope="module")
def mock(tokenizer: TextTokenizer) -> Iterator[MockBackendThread]:
    with MockBackendThread(MockScript((*tokenizer.encode(TEXT), 2))) as backend:
        yield backend


def assert_error(resp: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    """The OpenAI error shape, and a frontend's 429 and 503 say when to retry."""
    error = assert_openai_error(resp, status, code)
    if status in (429, 503):
        assert resp.headers.get("retry-after") == "1"
    return error


def settles(condition: Any, timeout_s: float = 3.0) -> bool:
    """True once condition() is (server-side state may trail the response's last byte a little)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# ---- 400 ----------------------------------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
BAD = [
    ("/v1/chat/completions", {"messages": HI, "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": HI, "tools": [TOOL], "tool_choice": {"type": "function",
                                                                                "function": {"name": "g"}}}),
    ("/v1/chat/completions", {"messages": HI, "tool_choice": "required"}),
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {"name": ""}}]}),
    ("/v1/chat/completions", {"messages": HI, "extra_configs": {"no_such_knob": 1}}),
    ("/v1/chat/completions", {"messages": HI, "extra_configs": {"stop_words_str": [""]}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("/v1/chat/completions", {"messages": HI, "n": 17}),
    ("/v1/chat/completions", {"messages": HI, "stream": "yes please"}),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}),
    ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 1}),
    ("/v1/completions", {"prompt": "x", "best_of": 3, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "best_of": 3}),
    ("/v1/completions", {"prompt": []}),
    ("/v1/completions", {"prompt": ""}),
    ("/v1/completions", {"prompt": [1, 99999999]}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100000}),
    ("/v1/completions", {}),
    ("/", {"prompt": "x", "urls": ["http://example.com/cat.png"]}),
    ("/", {"prompt": "x", "generate_config": {"max_new_tokens": 0}}),
    ("/", {"prompt": "x", "generate_config": {"oops": 1}}),
    ("/", {"prompt": 3}),
    ("/", {"prompt": "x", "generate_config": {"max_new_tokens": 100000}}),
    # integers past the backend proto's int32/int64 fields (were 500s)
    ("/v1/chat/completions", {"messages": HI, "top_k": 2**40}),
    ("/v1/chat/completions", {"messages": HI, "seed": 2**70}),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 2**40}),
    ("/v1/chat/completions", {"messages": HI, "max_completion_tokens": 2**40}),
    ("/v1/chat/completions", {"messages": HI, "extra_configs": {"timeout_ms": 2**70}}),
    ("/v1/chat/completions", {"messages": HI, "extra_configs": {"min_new_tokens": 2**40}}),
    ("/v1/chat/completions", {"messages": HI, "extra_configs": {"stop_words_list": [[2**40]]}}),
    ("/v1/completions", {"prompt": [[1, 2**40]]}),
    ("/", {"prompt": "x", "generate_config": {"random_seed": 2**64}}),
    ("/", {"prompt": "x", "generate_config": {"top_k": 2**33}}),
    # lone UTF-16 surrogates (valid JSON, not encodable text; were 500s)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800 there"}]}),
    ("/v1/chat/completions", {"messages": HI, "stop": ["\udfff"]}),
    ("/v1/completions", {"prompt": "x \ud83d"}),
    ("/", {"prompt": "\ud800"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}], "stream": True}),
    ("/v1/chat/completions", {"messages": HI, "seed": -2**70, "stream": True}),
    ("/v1/completions", {"prompt": "\udc00", "stream": True}),
    # poison-pill penalties the backend's sampler refuses: a 400 here, before a stream's 200
    ("/v1/chat/completions", {"messages": HI, "repetition_penalty": 1e-40}),
    ("/v1/chat/completions", {"messages": HI, "repetition_penalty": 1e-40, "stream": True}),
    ("/v1/chat/completions", {"messages": HI, "extra_configs": {"repetition_penalty": 1e9}}),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 1e-40, "stream": True}),
    ("/", {"prompt": "x", "generate_config": {"repetition_penalty": 1e-40}}),
    # a megabyte of text under MAX_BODY_BYTES: refused by its size, before tokenizing
    ("/v1/completions", {"prompt": "word " * 200_000}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 200_000}], "stream": True}),
]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": [True, False]}, "prompt"),
    ("/v1/completions", {"prompt": [1.0, 2.0]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [3, "x"]]}, "prompt"),
    ("/v1/chat/completions", {"messages": HI, "stop_token_ids": [True]}, "stop_token_ids.0"),
    ("/v1/chat/completions", {"messages": HI, "logit_bias": {"7": "x"}}, "logit_bias.7"),
])
def test_a_bad_value_names_its_field(http: httpx.Client, path: str, body: dict[str, Any], param: str) -> None:
    """The error's param is the request's own path to the value: not pydantic's name for the union member it
    tried (`prompt.str`, `prompt.list[int].0`). JSON's true and 1.0 are not token ids (they were taken as 1)."""
    resp = http.post(path, json=body)
    assert_error(resp, 400)
    assert resp.json()["error"]["param"] == param, resp.json()


@pytest.mark.parametrize(("path", "body"), BAD, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD)])
def test_bad_input_is_400(http: httpx.Client, path: str, body: dict[str, Any]) -> None:
    # json.dumps escapes a lone surrogate as \udXXX: valid JSON a client can send, not encodable text.
    assert_error(http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"}), 400)


def test_the_edge_checks_the_samplers_repetition_penalty_range() -> None:
    """One range (kvyard/limits.py): what the edge takes, the sampler takes, and what it refuses, both refuse."""
    from pydantic import ValidationError

    from frontend.generate_config import GenerateConfig
    from kvyard.limits import REPETITION_PENALTY_RANGE
    from kvyard.sampling_params import SamplingParams
    low, high = REPETITION_PENALTY_RANGE
    for ok in (low, high):
        GenerateConfig(repetition_penalty=ok)
        SamplingParams(repetition_penalty=ok).validate(10)
    for bad in (low / 2, high * 2):
        with pytest.raises(ValidationError):
            GenerateConfig(repetition_penalty=bad)
        with pytest.raises(ValueError, match="repetition_penalty"):
            SamplingParams(repetition_penalty=bad).validate(10)


def test_openai_client_gets_bad_request(front: MockFrontend) -> None:
    client = openai.OpenAI(base_url=f"{front.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="mock-model", prompt="x", suffix="y")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="mock-model", messages=HI, top_logprobs=3)


# ---- 401 ----------------------------------------------------------------------------------------

def test_api_key(tokenizer: TextTokenizer, mock: MockBackendThread) -> None:
    with mock_frontend(tokenizer, mock.address, API_KEY="s3cret") as f, httpx.Client(base_url=f.url) as c:
        for path, body in [("/v1/chat/completions", {"messages": HI}), ("/v1/completions", {"prompt": "x"}),
                           ("/", {"prompt": "x"}), ("/v1/chat/render", {"messages": HI})]:
            assert_error(c.post(path, json=body), 401, "invalid_api_key")
            assert_error(c.post(path, json=body, headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(c.get("/v1/models"), 401)
        ok = c.post("/v1/chat/completions", json={"messages": HI}, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == TEXT
        for scheme in ("bearer", "BEARER", "bEaReR"):  # the scheme is case-insensitive, the key is not
            assert c.get("/v1/models", headers={"Authorization": f"{scheme} s3cret"}).status_code == 200, scheme
        assert_error(c.get("/v1/models", headers={"Authorization": "bearer S3CRET"}), 401)
        assert_error(c.get("/v1/models", headers={"Authorization": "Basic s3cret"}), 401)
        for path in ("/health", "/status", "/", "/metrics"):   # probes and scrapers carry no key
            assert c.get(path).status_code == 200, path
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{f.url}/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=f"{f.url}/v1", api_key="s3cret", max_retries=0)
        assert good.chat.completions.create(model="mock-model", messages=HI).choices[0].message.content == TEXT


# ---- 404 ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"model": "gpt-9", "messages": HI}),
    ("/v1/chat/completions", {"model": "gpt-9", "messages": HI, "stream": True}),
    ("/v1/completions", {"model": "gpt-9", "prompt": "x"}),
    ("/", {"model": "gpt-9", "prompt": "x"}),
    ("/v1/chat/render", {"model": "gpt-9", "messages": HI}),
])
def test_unknown_model_is_404(http: httpx.Client, path: str, body: dict[str, Any]) -> None:
    assert_error(http.post(path, json=body), 404, "model_not_found")


@pytest.mark.parametrize("setup", ["lora", "master"])
def test_render_refuses_the_models_completions_refuses(tokenizer: TextTokenizer, mock: MockBackendThread,
                                                       setup: str) -> None:
    """/v1/chat/render generates nothing, so it never heard the cluster's verdict on a model and rendered
    any name (200) where /v1/chat/completions is a 404: on a LoRA frontend, a name that is no adapter the
    backend holds (as `model` or extra_configs.adapter_name); behind a master, a model it does not know."""
    port = free_port_block(1)
    cfg = MockMasterConfig.from_env({"START_PORT": str(port), "MOCK_MASTER_BACKENDS": mock.address,
                                     "MOCK_MASTER_MODELS": "mock-model"})
    unknown = [{"model": "nope", "messages": HI}]
    if setup == "lora":  # the mock backend holds no adapters
        unknown.append({"messages": HI, "extra_configs": {"adapter_name": "nope"}})
    with AppThread(create_mock_master_app(cfg)) as master, \
            mock_frontend(tokenizer, mock.address, **({"LORA_MODULES": "sql=/adapters/sql"} if setup == "lora" else
                                                      {"MASTER_ADDRESS": f"127.0.0.1:{master.port}"})) as f, \
            httpx.Client(base_url=f.url) as c:
        for body in unknown:
            completions = assert_error(c.post("/v1/chat/completions", json=body), 404, "model_not_found")
            render = assert_error(c.post("/v1/chat/render", json=body), 404, "model_not_found")
            # (completions' param: "model" from the master; none from the backend, whose proto error has no param)
            assert render["type"] == completions["type"] and render["param"] == "model"
        for body in ({"messages": HI}, {"model": "mock-model", "messages": HI}):
            assert c.post("/v1/chat/render", json=body).status_code == 200
            assert c.post("/v1/chat/completions", json=body).status_code == 200


# ---- 413 ----------------------------------------------------------------------------------------

def test_body_too_large(tokenizer: TextTokenizer, mock: MockBackendThread) -> None:
    with mock_frontend(tokenizer, mock.address, MAX_BODY_BYTES="2048") as f, httpx.Client(base_url=f.url) as c:
        big = {"messages": [{"role": "user", "content": "x" * 3000}]}
        assert_error(c.post("/v1/chat/completions", json=big), 413, "payload_too_large")

        def chunked() -> Iterator[bytes]:   # no Content-Length: counted as it arrives
            yield json.dumps(big).encode()
        assert_error(c.post("/v1/chat/completions", content=chunked(),
                            headers={"content-type": "application/json"}), 413)
        small = c.post("/v1/chat/completions", content=iter([json.dumps({"messages": HI}).encode()]),
                       headers={"content-type": "application/json"})
        assert small.status_code == 200, small.text
        with pytest.raises(openai.APIStatusError) as exc:
            openai.OpenAI(base_url=f"{f.url}/v1", api_key="x", max_retries=0).chat.completions.create(
                model="mock-model", messages=big["messages"])
        assert exc.value.status_code == 413


# ---- 429 ----------------------------------------------------------------------------------------

def test_concurrency_limit(tokenizer: TextTokenizer, mock: MockBackendThread) -> None:
    with mock.scripted(slow_script(tokenizer, 40)), \
            mock_frontend(tokenizer, mock.address, CONCURRENCY_LIMIT="1") as f, httpx.Client(base_url=f.url) as c:
        result: dict[str, Any] = {}
        started = threading.Event()

        def first() -> None:
            with httpx.stream("POST", f"{f.url}/v1/chat/completions", json={"messages": HI, "stream": True}) as r:
                for line in r.iter_lines():
                    started.set()
                    result.setdefault("lines", []).append(line)
        t = threading.Thread(target=first)
        t.start()
        assert started.wait(10)
        err = assert_error(c.post("/v1/chat/completions", json={"messages": HI}), 429, "overloaded")
        assert "CONCURRENCY_LIMIT" in err["message"]
        for path, body in [("/v1/completions", {"prompt": "x"}), ("/v1/responses", {"input": "x"}),
                           ("/", {"prompt": "x"})]:   # every dialect frontend/dialect.py registers
            assert_error(c.post(path, json=body), 429)
        assert_error(c.post("/generate", content=b"x"), 429)
        assert c.post("/v1/chat/render", json={"messages": HI}).status_code == 200   # not a generation
        assert c.get("/").status_code == 200   # GET / is the health check, POST / a generation
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=f"{f.url}/v1", api_key="x", max_retries=0).chat.completions.create(
                model="mock-model", messages=HI)
        t.join(15)
        assert [line for line in result["lines"] if line][-1] == "data: [DONE]"
        assert c.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2}).status_code == 200


def test_stalled_bodies_hold_no_slot_and_time_out(tokenizer: TextTokenizer, mock: MockBackendThread,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Connections that send headers and then trickle (or never finish) their body used to count against
    CONCURRENCY_LIMIT while waiting, locking everyone out: now a request counts once its body is here,
    and a body that does not arrive within BODY_TIMEOUT_S is a 408."""
    monkeypatch.setattr(admission, "BODY_TIMEOUT_S", 1.5)
    with mock_frontend(tokenizer, mock.address, CONCURRENCY_LIMIT="1") as f, httpx.Client(base_url=f.url) as c:
        host, port = f.url.removeprefix("http://").split(":")
        stalled = []
        for _ in range(4):
            sock = socket.create_connection((host, int(port)))
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"messages\": ")
            stalled.append(sock)
        try:
            time.sleep(0.3)
            ok = c.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2})
            assert ok.status_code == 200, ok.text
            for sock in stalled:
                sock.settimeout(10)
                answer = b""
                while b"}}" not in answer and (chunk := sock.recv(4096)):
                    answer += chunk
                assert answer.startswith(b"HTTP/1.1 408"), answer
                assert b'"code":"request_timeout"' in answer.replace(b" ", b""), answer
        finally:
            for sock in stalled:
                sock.close()
        assert settles(lambda: f.app.state.admission.in_flight == 0)


def test_every_sequence_counts(tokenizer: TextTokenizer, mock: MockBackendThread) -> None:
    """n and prompt lists fan out: a request holds one slot per sequence; more than the whole limit is a
    400 (retrying cannot help), more than what is free a 429."""
    with mock_frontend(tokenizer, mock.address, CONCURRENCY_LIMIT="4") as f, httpx.Client(base_url=f.url) as c:
        err = assert_error(c.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2}), 400)
        assert "6 sequences" in err["message"] and "CONCURRENCY_LIMIT" in err["message"]
        assert_error(c.post("/v1/chat/completions", json={"messages": HI, "n": 5}), 400)
        assert_error(c.post("/", json={"prompt": ["a"] * 5}), 400)
        assert c.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 2}).status_code == 200
        with mock.scripted(slow_script(tokenizer, 40)):
            started = threading.Event()

            def hold_three() -> None:
                with httpx.stream("POST", f"{f.url}/v1/chat/completions",
                                  json={"messages": HI, "n": 3, "stream": True}) as r:
                    for _ in r.iter_lines():
                        started.set()
            t = threading.Thread(target=hold_three)
            t.start()
            assert started.wait(10)
            assert f.app.state.admission.in_flight == 3
            assert_error(c.post("/v1/chat/completions", json={"messages": HI, "n": 2}), 429, "overloaded")
            assert c.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2}).status_code == 200
            t.join(15)
        assert settles(lambda: f.app.state.admission.in_flight == 0)  # released just after the last byte


def test_backend_overloaded_is_429(http: httpx.Client, mock: MockBackendThread, tokenizer: TextTokenizer) -> None:
    with mock.scripted(MockScript(tuple(tokenizer.encode(TEXT)), error="OVERLOADED")):
        assert_error(http.post("/v1/chat/completions", json={"messages": HI}), 429, "overloaded")
        assert_error(http.post("/v1/completions", json={"prompt": "x"}), 429, "overloaded")


@pytest.mark.parametrize(("kind", "status"), [("overloaded", 429), ("model_not_found", 404)])
def test_master_refusals_reach_the_client(tokenizer: TextTokenizer, mock: MockBackendThread, kind: str,
                                          status: int) -> None:
    port = free_port_block(1)
    cfg = MockMasterConfig.from_env({"START_PORT": str(port), "MOCK_MASTER_BACKENDS": mock.address,
                                     "MOCK_MASTER_ERROR": kind})
    with AppThread(create_mock_master_app(cfg)) as master, \
            mock_frontend(tokenizer, mock.address, MASTER_ADDRESS=f"127.0.0.1:{master.port}") as f, \
            httpx.Client(base_url=f.url) as c:
        assert_error(c.post("/v1/chat/completions", json={"messages": HI}), status, kind)


# ---- 503 ----------------------------------------------------------------------------------------

def test_draining(tokenizer: TextTokenizer, mock: MockBackendThread) -> None:
    with mock_frontend(tokenizer, mock.address) as f, httpx.Client(base_url=f.url) as c:
        assert c.get("/health").status_code == 200
        f.app.state.admission.start_draining()
        for path, body in [("/v1/chat/completions", {"messages": HI}), ("/v1/completions", {"prompt": "x"}),
                           ("/", {"prompt": "x"})]:
            assert "draining" in assert_error(c.post(path, json=body), 503, "unavailable")["message"]
        assert_error(c.get("/health"), 503)
        assert c.post("/v1/chat/render", json={"messages": HI}).status_code == 200


def test_no_backend(tokenizer: TextTokenizer) -> None:
    dead = f"127.0.0.1:{free_port_block(1)}"
    with mock_frontend(tokenizer, dead) as f, httpx.Client(base_url=f.url, timeout=10) as c:
        for path, body in [("/v1/chat/completions", {"messages": HI}), ("/v1/completions", {"prompt": "x"}),
                           ("/", {"prompt": "x"})]:
            assert_error(c.post(path, json=body), 503, "unavailable")
        assert_error(c.get("/health"), 503)
