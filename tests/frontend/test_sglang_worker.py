"""The frontend as a worker behind SGLang's router (`sglang-router`): what the router asks a worker when it
joins (/server_info, /model_info, or the /get_* names), and the body it forwards for a request that named
no model ("model": "unknown", its placeholder). The router itself is no dependency: these replay its calls,
as observed from sglang-router 0.3.2 against a recording worker."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from backend.mock_backend import MockScript
from frontend.config import FrontendConfig
from frontend.routing import ROUTER_PLACEHOLDER_MODEL, model_to_route
from kvyard.errors import ErrorCode, RequestError
from kvyard.tokenizer import TextTokenizer
from master.mock_master import MockMasterConfig, create_mock_master_app
from tests.support.mock_stack import MockBackendThread, mock_frontend
from tests.support.procs import free_port_block
from tests.support.app_thread import AppThread
from tests.support.sse import sse_data

TEXT = "Hello there, friend!"
MODEL = "mock-model"  # what mock_frontend serves
HI = [{"role": "user", "content": "Hi"}]
# A chat request without `model`, as sglang-router 0.3.2 forwards it to a worker.
FORWARDED = {"messages": HI, "model": "unknown", "logprobs": False, "max_completion_tokens": 5, "stream": False,
             "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
             "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
             "return_hidden_states": False}


@pytest.fixture(scope="module")
def mock(tokenizer: TextTokenizer) -> Iterator[MockBackendThread]:
    with MockBackendThread(MockScript((*tokenizer.encode(TEXT), 2))) as backend:
        yield backend


def discovered_model_id(http: httpx.Client) -> str:
    """The router's worker discovery: /server_info (else /get_server_info), then /model_info (else
    /get_model_info); the worker's model is served_model_name, else model_path, else "unknown"."""
    labels: dict[str, Any] = {}
    for path in ("/server_info", "/model_info"):
        resp = http.get(path)
        if resp.status_code == 404:
            resp = http.get("/get_" + path[1:])
        if resp.status_code == 200:
            labels.update({k: v for k, v in resp.json().items() if v})
    return labels.get("served_model_name") or labels.get("model_path") or "unknown"


def test_worker_info_names_the_served_model(http: httpx.Client, tokenizer: TextTokenizer) -> None:
    assert discovered_model_id(http) == MODEL
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        resp = http.get(path)
        assert resp.status_code == 200, path
        info = resp.json()
        assert info["served_model_name"] == MODEL and info["model_path"] == MODEL, info
        assert info["context_length"] == 512
    assert http.get("/model_info").json()["is_generation"] is True
    # Names only: the public port does not tell where the model's files are.
    cfg = FrontendConfig.from_env({"MAX_SEQ_LEN": "512"})
    assert str(cfg.tokenizer_path) not in http.get("/server_info").text
    assert str(cfg.tokenizer_path.parent) not in http.get("/model_info").text


def test_request_without_model_through_the_router_is_served(http: httpx.Client) -> None:
    resp = http.post("/v1/chat/completions", json=FORWARDED)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["model"] == MODEL
    content = body["choices"][0]["message"]["content"]
    assert content and TEXT.startswith(content)  # max_completion_tokens 5 cuts the script short
    stream = http.post("/v1/chat/completions", json={**FORWARDED, "stream": True})
    assert stream.status_code == 200, stream.text
    assert sse_data(stream.text)[-1] == "[DONE]"
    completion = http.post("/v1/completions", json={"model": "unknown", "prompt": "Hi", "max_tokens": 3})
    assert completion.status_code == 200, completion.text
    assert completion.json()["model"] == MODEL
    raw = http.post("/", json={"model": "unknown", "prompt": "Hi", "generate_config": {"max_new_tokens": 3}})
    assert raw.status_code == 200, raw.text
    assert http.post("/generate?model=unknown&max_tokens=3", content=b"Hi").status_code == 200


def test_other_unknown_models_stay_404(http: httpx.Client) -> None:
    for name in ("gpt-9", "Unknown", "unknown-model"):
        resp = http.post("/v1/chat/completions", json={**FORWARDED, "model": name})
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found", (name, resp.text)


def test_placeholder_routes_to_our_model_through_a_master(tokenizer: TextTokenizer, mock: MockBackendThread) -> None:
    # The master knows only MODEL: asked for "unknown" it would say 404, so the frontend must ask for MODEL.
    port = free_port_block(1)
    cfg = MockMasterConfig.from_env({"START_PORT": str(port), "MOCK_MASTER_BACKENDS": mock.address,
                                     "MOCK_MASTER_MODELS": MODEL})
    with AppThread(create_mock_master_app(cfg)) as master, \
            mock_frontend(tokenizer, mock.address, MASTER_ADDRESS=f"127.0.0.1:{master.port}") as f, \
            httpx.Client(base_url=f.url, timeout=10) as c:
        resp = c.post("/v1/chat/completions", json=FORWARDED)
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == MODEL
        other = c.post("/v1/chat/completions", json={**FORWARDED, "model": "gpt-9"})
        assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"


def test_model_to_route() -> None:
    alone = FrontendConfig.from_env({"MODEL_NAME": MODEL, "MAX_SEQ_LEN": "64"})
    routed = FrontendConfig.from_env({"MODEL_NAME": MODEL, "MAX_SEQ_LEN": "64", "MASTER_ADDRESS": "127.0.0.1:9"})
    aliased = FrontendConfig.from_env({"MODEL_NAME": f"{MODEL},small", "MAX_SEQ_LEN": "64"})
    for cfg in (alone, routed, aliased):
        for name in (None, "", ROUTER_PLACEHOLDER_MODEL):
            assert model_to_route(cfg, name) is None, name
        assert model_to_route(cfg, MODEL) == MODEL  # named: kept, so the answer echoes it
    assert model_to_route(aliased, "small") == "small"
    assert model_to_route(routed, "other") == "other"  # the master knows the cluster's other models
    with pytest.raises(RequestError) as err:
        model_to_route(alone, "other")
    assert err.value.code is ErrorCode.MODEL_NOT_FOUND and err.value.param == "model"
