"""RTP-LLM's debug routes on the frontend's port (frontend/debug_routes.py), proxied to the paired backend:
/worker_status with its task lists and versions, /cache_status in the seed's shape, /set_log_level; and the
rendered prompt in the DEBUG log unless private_request. The mock backend's gRPC on START_PORT+1 and the
backend HTTP app on START_PORT+5, as a frontend finds them; no model, no subprocess."""
from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import pytest

from kvyard.tokenizer import TextTokenizer
from tests.support.mock_stack import MOCK_MAX_CONCURRENCY, MockBackendThread, mock_frontend, script
from tests.support.procs import free_port_block

CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def mock(tokenizer: TextTokenizer) -> Iterator[MockBackendThread]:
    with MockBackendThread(script(tokenizer, "Hi!")) as backend:  # its HTTP app where the frontend looks
        yield backend


@pytest.fixture(autouse=True)
def keep_log_level() -> Iterator[None]:
    level = logging.getLogger().level
    yield
    logging.getLogger().setLevel(level)


@pytest.mark.parametrize("path", ["/worker_status", "/rtp_llm/worker_status"])
def test_worker_status_has_the_seeds_fields_and_finished_tasks(http: httpx.Client, path: str) -> None:
    before = http.post(path, json={}).json()
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
    st = http.get(path).json()
    for key in ("role", "server_port", "http_proto_port", "grpc_proto_port", "available_concurrency",
                "running_task_info", "finished_task_list", "step_latency_ms", "iterate_count", "dp_size", "tp_size",
                "alive", "version", "cache_status"):
        assert key in st, key
    assert st["dp_size"] == 1 and st["tp_size"] == 1 and st["alive"] is True
    assert st["http_proto_port"] == st["grpc_proto_port"] + 4 == st["server_port"] + 5
    assert st["available_concurrency"] == MOCK_MAX_CONCURRENCY and st["running_task_info"] == []
    assert st["version"] == before["version"] + 1
    task = st["finished_task_list"][-1]
    assert task["input_length"] > 0 and task["iterate_count"] >= 1 and task["status"] == "ok"
    assert task["end_time_ms"] >= task["start_time_ms"] > 0 and task["is_waiting"] is False
    # latest_finished_version (and the seed's spelling): only what finished since
    assert http.post(path, json={"latest_finised_version": st["version"]}).json()["finished_task_list"] == []
    newer = http.post(path, json={"latest_finished_version": st["version"] - 1}).json()["finished_task_list"]
    assert [t["inter_request_id"] for t in newer] == [task["inter_request_id"]]
    bad = http.post(path, json={"latest_finished_version": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "latest_finished_version"


@pytest.mark.parametrize("path", ["/cache_status", "/rtp_llm/cache_status"])
@pytest.mark.parametrize("key", ["latest_cache_version", "lastest_cache_version"])
def test_cache_status_in_the_seeds_shape(http: httpx.Client, path: str, key: str) -> None:
    full = http.get(path).json()
    assert full["total_kv_cache"] == full["total_blocks"] * full["block_size"] > 0
    assert 0 <= full["available_kv_cache"] <= full["total_kv_cache"]
    assert full["lastest_cache_version"] == full["latest_cache_version"] == full["version"]
    assert isinstance(full["cached_keys"], list)
    same = http.post(path, json={key: full["version"]}).json()
    assert same["cached_keys"] is None  # nothing moved since the version the caller holds
    assert http.post(path, json={key: 1.5}).status_code == 400


@pytest.mark.parametrize("path", ["/cache_status", "/rtp_llm/cache_status", "/worker_status", "/rtp_llm/worker_status"])
def test_unknown_debug_request_fields_are_a_400_naming_them(http: httpx.Client, path: str) -> None:
    """They were answered as if absent (a misspelt version key silently meant 'everything')."""
    resp = http.post(path, json={"latest_version": 3})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "latest_version", resp.text
    if "worker" in path:  # the seed's WorkerStatusRequest: both versions
        assert http.post(path, json={"lastest_cache_version": -1, "latest_finised_version": -1}).status_code == 200


def test_set_log_level_changes_the_frontend_and_its_backend(http: httpx.Client) -> None:
    resp = http.post("/set_log_level", json={"log_level": "TRACE"})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"status": "ok", "log_level": "DEBUG", "processes": {"frontend": "ok", "backend": "ok"}}
    assert logging.getLogger().level == logging.DEBUG
    bad = http.post("/set_log_level", json={"log_level": "LOUD"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "log_level"


def test_debug_log_has_the_rendered_prompt_unless_private(http: httpx.Client, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="kvyard.frontend"):
        secret = {**CHAT, "messages": [{"role": "user", "content": "my secret 7731"}]}
        assert http.post("/v1/chat/completions", json={**secret, "private_request": True}).status_code == 200
        assert "7731" not in caplog.text
        assert http.post("/v1/chat/completions", json={**CHAT, "private_request": False}).status_code == 200
        assert "rendered prompt" in caplog.text and "Hello there" in caplog.text


def test_without_a_paired_backend_the_debug_routes_are_503(tokenizer: TextTokenizer) -> None:
    start = free_port_block(6)
    with mock_frontend(tokenizer, f"127.0.0.1:{start + 1}") as front:
        resp = httpx.get(f"{front.url}/worker_status", timeout=10)
        assert resp.status_code == 503 and "paired with this frontend" in resp.json()["error"]["message"]
        level = httpx.post(f"{front.url}/set_log_level", json={"log_level": "warning"}, timeout=10).json()
        assert level["processes"]["frontend"] == "ok" and "does not answer" in level["processes"]["backend"]


def test_eplb_update_is_refused_with_a_reason(http: httpx.Client, mock: MockBackendThread) -> None:
    resp = http.post("/update_eplb_config", json={"mode": "ALL"})
    assert resp.status_code == 400 and "not supported" in resp.json()["error"]["message"], resp.text
    # the backend's own port too (the seed lists it among the backend's routes): it was a 404 "Not Found"
    backend = f"http://127.0.0.1:{mock.port - 1 + 5}/update_eplb_config"
    resp = httpx.post(backend, json={"mode": "ALL"}, timeout=10)
    assert resp.status_code == 400 and "mixture-of-experts" in resp.json()["error"]["message"], resp.text
