"""The cluster token on the HTTP internal ports: the master's registration and schedule (debug scores
included), the backend's cache keys and log level. Open: health, /metrics and the load views. No processes."""
from __future__ import annotations

import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from backend.engine_types import CacheStatus
from backend.http_server import create_backend_http_app
from kvyard.metrics import BackendMetrics
from kvyard.roles import Role
from kvyard.worker_status import WorkerStatus
from master.app import create_master_app
from master.backend_poller import worker_status_from_pb
from master.config import BackendEndpoint, MasterConfig
from master.registry import SOURCE_STATIC, Registry
from tests.support.stub_backend import sane_status

TOKEN = "cluster-secret-for-tests-0123"
GOOD = {"Authorization": f"Bearer {TOKEN}"}
WRONG = {"Authorization": "Bearer cluster-secret-for-tests-0124"}
BACKEND = BackendEndpoint("10.0.0.1", 8089, 8093, "m")
SCHEDULE = {"model": "m", "block_cache_keys": [], "seq_len": 4}
REGISTER = {"model": "m", "server_ip": "10.6.6.6", "grpc_port": 9001, "http_port": 9005}


def master(token: str) -> tuple[TestClient, Registry]:
    """A master app (no lifespan: no polling) with one healthy static backend, on a frozen clock."""
    cfg = MasterConfig.from_env({"CLUSTER_TOKEN": token} if token else {})
    registry = Registry(cfg)
    registry.add(BACKEND, SOURCE_STATIC, 0.0)
    registry.apply_status(BACKEND.name, worker_status_from_pb(sane_status(cache_version=0)), 0.0, 0.0)
    return TestClient(create_master_app(cfg, registry, clock=lambda: 0.5)), registry


def assert_401(resp: Any, needle: str = "cluster token") -> None:
    assert resp.status_code == 401, resp.text
    err = resp.json()["error"]
    assert err["type"] == "authentication_error" and needle in err["message"], err


@pytest.mark.parametrize("headers", [{}, WRONG, {"Authorization": TOKEN}], ids=["none", "wrong", "no-bearer"])
def test_master_internal_routes_need_the_token(headers: dict[str, str]) -> None:
    client, registry = master(TOKEN)
    assert_401(client.post("/rtp_llm/register", json=REGISTER, headers=headers))
    assert "10.6.6.6:9001" not in registry.backends  # a fake backend cannot take the traffic
    assert_401(client.post("/rtp_llm/schedule", json=SCHEDULE, headers=headers))
    assert_401(client.post("/rtp_llm/schedule", json={**SCHEDULE, "debug": True}, headers=headers))
    assert_401(client.get("/no/such/route", headers=headers))  # deny by default


def test_master_internal_routes_work_with_the_token() -> None:
    client, registry = master(TOKEN)
    resp = client.post("/rtp_llm/schedule", json=SCHEDULE, headers=GOOD)
    assert resp.status_code == 200 and resp.json()["server_status"][0]["server_ip"] == "10.0.0.1", resp.text
    debug = client.post("/rtp_llm/schedule", json={**SCHEDULE, "debug": True}, headers=GOOD)
    assert debug.status_code == 200 and debug.json()["candidates"][0]["name"] == BACKEND.name, debug.text
    assert client.post("/rtp_llm/register", json=REGISTER, headers=GOOD).status_code == 200
    assert "10.6.6.6:9001" in registry.backends


def test_master_probes_and_views_stay_open() -> None:
    client, _ = master(TOKEN)
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
    assert client.get("/backends").status_code == 200
    assert client.get("/v1/models").status_code == 200


def test_master_without_a_token_refuses_every_registration() -> None:
    client, registry = master("")
    for headers in ({}, GOOD):
        resp = client.post("/rtp_llm/register", json=REGISTER, headers=headers)
        assert_401(resp, "no CLUSTER_TOKEN")
    assert list(registry.backends) == [BACKEND.name]


# ---- the backend's HTTP port ------------------------------------------------------------------

@pytest.fixture
def backend_http() -> Iterator[TestClient]:
    def status() -> WorkerStatus:
        return WorkerStatus(role=Role.PDFUSION, running=0, waiting=0, queued_prefill_tokens=0, step_latency_ms=0.0,
                            prefill_tokens_per_s=0.0, free_blocks=8, total_blocks=8, block_size=16, version=1,
                            iterate_count=0, alive=True, cache_version=3)

    loop = SimpleNamespace(metrics=BackendMetrics(status, "m"), alive=True, worker_status=status,
                           cache_status=lambda since: CacheStatus(3, False, [11, 12], [], [], 16))
    level = logging.getLogger().level
    try:
        yield TestClient(create_backend_http_app(loop, TOKEN))  # type: ignore[arg-type]
    finally:
        logging.getLogger().setLevel(level)


@pytest.mark.parametrize("path", ["/cache_status", "/rtp_llm/cache_status"])
def test_backend_cache_keys_need_the_token(backend_http: TestClient, path: str) -> None:
    assert_401(backend_http.post(path, json={}))
    assert_401(backend_http.post(path, json={}, headers=WRONG))
    resp = backend_http.post(path, json={}, headers=GOOD)
    assert resp.status_code == 200 and resp.json()["cached_keys"] == [11, 12], resp.text


def test_backend_log_level_needs_the_token(backend_http: TestClient) -> None:
    assert_401(backend_http.post("/set_log_level", json={"log_level": "DEBUG"}))
    assert logging.getLogger().level != logging.DEBUG
    resp = backend_http.post("/set_log_level", json={"log_level": "DEBUG"}, headers=GOOD)
    assert resp.status_code == 200 and logging.getLogger().level == logging.DEBUG


def test_backend_probes_stay_open(backend_http: TestClient) -> None:
    for path in ("/health", "/status", "/GraphService/cm2_status", "/SearchService/cm2_status"):
        assert backend_http.get(path).status_code == 200 and backend_http.post(path).text == "ok", path
    assert backend_http.post("/health_check").text == "ok" and backend_http.get("/").text == "ok"
    assert backend_http.get("/metrics").status_code == 200
    assert backend_http.get("/worker_status").status_code == 200  # load numbers, as /metrics shows them


def test_master_log_level_needs_the_token() -> None:
    client, _ = master(TOKEN)
    level = logging.getLogger().level
    try:
        assert_401(client.post("/set_log_level", json={"log_level": "DEBUG"}))
        resp = client.post("/set_log_level", json={"log_level": "debug"}, headers=GOOD)
        assert resp.status_code == 200 and logging.getLogger().level == logging.DEBUG, resp.text
        bad = client.post("/set_log_level", json={"log_level": "LOUD"}, headers=GOOD)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "log_level"
    finally:
        logging.getLogger().setLevel(level)
