"""Prometheus /metrics on frontend, backend and master: the expected names, one registry per app, and
counters that move when requests run."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from websockets.sync.client import connect

from backend.http_server import create_backend_http_app
from kvyard.metrics import VLLM_EQUIVALENTS, BackendMetrics, FrontendMetrics, HttpMetricsMiddleware, add_metrics_route
from kvyard.tokenizer import TextTokenizer
from master.metrics import MasterMetrics
from tests.conftest import Cluster
from tests.support.stub_backend import stub_frontend

REQUEST_METRICS = ["kvyard:time_to_first_token_seconds", "kvyard:inter_token_latency_seconds",
                   "kvyard:e2e_request_latency_seconds", "kvyard:prompt_tokens", "kvyard:generation_tokens",
                   "kvyard:prefix_cache_queries", "kvyard:prefix_cache_hits", "kvyard:requests"]
ENGINE_GAUGES = ["kvyard:num_requests_running", "kvyard:num_requests_waiting", "kvyard:kv_cache_usage_perc"]


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text page, keyed by (name, sorted labels)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def families(text: str) -> set[str]:
    return {f.name for f in text_string_to_metric_families(text)}


def value(page: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return page.get((name, tuple(sorted(labels.items()))), 0.0)


@dataclass
class FakeStatus:
    running: int = 3
    waiting: int = 2
    free_blocks: int = 25
    total_blocks: int = 100
    step_latency_ms: float = 8.0
    prefill_tokens_per_s: float = 1500.0


def test_every_role_has_the_expected_names_in_its_own_registry() -> None:
    frontend, other = FrontendMetrics("m"), FrontendMetrics("m")  # two apps in one process do not collide
    frontend.prompt(10, 4)
    assert other.registry is not frontend.registry
    text = generate_latest(frontend.registry).decode()
    assert set(REQUEST_METRICS + ["kvyard:num_requests_running", "kvyard:num_requests_waiting",
                                  "kvyard:prefix_cache_hit_rate"]) <= families(text)
    page = samples(text)
    assert value(page, "kvyard:prefix_cache_hit_rate", model_name="m") == pytest.approx(0.4)
    assert value(samples(generate_latest(other.registry).decode()), "kvyard:prompt_tokens_total", model_name="m") == 0

    backend = samples(generate_latest(BackendMetrics(FakeStatus, "m").registry).decode())
    assert value(backend, "kvyard:num_requests_running", model_name="m") == 3
    assert value(backend, "kvyard:num_requests_waiting", model_name="m") == 2
    assert value(backend, "kvyard:kv_cache_usage_perc", model_name="m") == pytest.approx(0.75)


def test_every_serving_metric_carries_model_name_and_vllms_names_exist() -> None:
    """vLLM's dashboards filter on model_name and read these names (prefix swapped): every family a backend
    or a frontend serves has the label, and every name of the documented mapping is served."""
    backend = BackendMetrics(FakeStatus, "m", preemptions=lambda: 4)
    backend.queue_time.observe(0.25)
    backend.count("GenerateStreamCall", "ok")
    frontend = FrontendMetrics("m")
    frontend.count("/v1/chat/completions", 200)
    served: set[str] = set()
    for registry in (backend.registry, frontend.registry):
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            served.add(family.name)
            assert family.samples, family.name
            assert all(s.labels.get("model_name") == "m" for s in family.samples), family.name
    assert set(VLLM_EQUIVALENTS) <= served
    assert {v.removeprefix("vllm:") for v in VLLM_EQUIVALENTS.values()} == \
        {k.removeprefix("kvyard:") for k in VLLM_EQUIVALENTS}
    page = samples(generate_latest(backend.registry).decode())
    assert value(page, "kvyard:num_preemptions_total", model_name="m") == 4
    assert value(page, "kvyard:request_queue_time_seconds_count", model_name="m") == 1
    assert value(page, "kvyard:step_latency_seconds", model_name="m") == pytest.approx(0.008)
    assert value(page, "kvyard:prefill_tokens_per_second", model_name="m") == 1500
    doc = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    for ours, theirs in VLLM_EQUIVALENTS.items():
        assert f"`{ours}" in doc and f"`{theirs}" in doc, ours


def test_request_timer_observes_ttft_itl_e2e() -> None:
    m = FrontendMetrics("m")
    timer = m.timer()
    timer.step(1)
    timer.step(2)
    timer.step(0)  # a step without tokens is no inter-token gap
    timer.finish()
    page = samples(generate_latest(m.registry).decode())
    assert value(page, "kvyard:time_to_first_token_seconds_count", model_name="m") == 1
    assert value(page, "kvyard:inter_token_latency_seconds_count", model_name="m") == 1
    assert value(page, "kvyard:e2e_request_latency_seconds_count", model_name="m") == 1
    assert value(page, "kvyard:generation_tokens_total", model_name="m") == 3


def test_http_middleware_counts_route_templates_and_statuses() -> None:
    m = FrontendMetrics("m")
    app = FastAPI()
    router = APIRouter()

    @router.get("/items/{item_id}")
    async def item(item_id: int) -> dict[str, int]:
        return {"id": item_id}

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("boom")

    app.include_router(router)
    app.add_middleware(HttpMetricsMiddleware, metrics=m)
    add_metrics_route(app, m.registry)
    client = TestClient(app, raise_server_exceptions=False)
    client.get("/items/1")
    client.get("/items/2")
    client.get("/items/x")
    client.get("/nowhere")
    client.get("/boom")
    page = samples(client.get("/metrics").text)
    assert value(page, "kvyard:requests_total", endpoint="/items/{item_id}", status="200", model_name="m") == 2
    assert value(page, "kvyard:requests_total", endpoint="/items/{item_id}", status="422", model_name="m") == 1
    assert value(page, "kvyard:requests_total", endpoint="unmatched", status="404", model_name="m") == 1
    assert value(page, "kvyard:requests_total", endpoint="/boom", status="500", model_name="m") == 1


def test_backend_http_serves_engine_metrics() -> None:
    loop = SimpleNamespace(metrics=BackendMetrics(FakeStatus, "m"))
    loop.metrics.count("GenerateStreamCall", "ok")
    resp = TestClient(create_backend_http_app(loop)).get("/metrics")  # type: ignore[arg-type]
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    assert set(REQUEST_METRICS + ENGINE_GAUGES) <= families(resp.text)
    assert value(samples(resp.text), "kvyard:requests_total", endpoint="GenerateStreamCall", status="ok",
                 model_name="m") == 1


def test_master_metrics_count_decisions_and_show_backends() -> None:
    m = MasterMetrics()
    m.record_decision("prefix_hit", "m", 64, 48)
    m.record_decision("prefix_hit", "m", 32, 16)
    m.record_decision("all_busy", "m")
    loads = [SimpleNamespace(name="10.0.0.1:8089", model="m", role="PDFUSION", healthy=True, running=1, waiting=0,
                             free_blocks=10, total_blocks=40, step_latency_ms=12.0, prefill_tokens_per_s=900.0,
                             poll_latency_ms=2.0, routed_requests=3, routed_prompt_tokens=96, routed_hit_tokens=64)]
    m.watch_backends(lambda: loads)
    page = samples(generate_latest(m.registry).decode())
    assert value(page, "kvyard:master_routing_decisions_total", reason="prefix_hit", model_name="m") == 2
    assert value(page, "kvyard:master_routing_decisions_total", reason="all_busy", model_name="m") == 1
    assert value(page, "kvyard:prefix_cache_hits_total", model_name="m") == 64
    backend = {"backend": "10.0.0.1:8089", "model_name": "m", "role": "PDFUSION"}
    assert value(page, "kvyard:kv_cache_usage_perc", **backend) == pytest.approx(0.75)
    assert value(page, "kvyard:backend_healthy", **backend) == 1
    assert value(page, "kvyard:backend_step_latency_seconds", **backend) == pytest.approx(0.012)
    assert value(page, "kvyard:backend_prefill_tokens_per_second", **backend) == 900
    assert value(page, "kvyard:backend_poll_latency_seconds", **backend) == pytest.approx(0.002)
    assert value(page, "kvyard:backend_routed_requests_total", **backend) == 3
    assert value(page, "kvyard:backend_prefix_cache_queries_total", **backend) == 96
    assert value(page, "kvyard:backend_prefix_cache_hits_total", **backend) == 64


def test_master_app_serves_metrics() -> None:
    from master.app import create_master_app
    from master.config import MasterConfig

    client = TestClient(create_master_app(MasterConfig.from_env({})))  # no lifespan: nothing registered
    resp = client.post("/rtp_llm/schedule", json={"model": "m", "block_cache_keys": [], "seq_len": 4})
    assert resp.status_code == 503
    page = samples(client.get("/metrics").text)
    assert value(page, "kvyard:master_routing_decisions_total", reason="no_backends", model_name="unknown") == 1
    assert value(page, "kvyard:requests_total", endpoint="/rtp_llm/schedule", status="503") == 1


def test_frontend_counters_move(tokenizer: TextTokenizer) -> None:
    ids = [*tokenizer.encode("Hi there!"), 2]
    with stub_frontend(tokenizer, lambda _req: ids) as stub:
        before = samples(httpx.get(f"{stub.url}/metrics").text)
        chat = httpx.post(f"{stub.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
        assert chat.status_code == 200
        assert httpx.post(f"{stub.url}/generate", content="Hello").text == "Hi there!"
        assert httpx.post(f"{stub.url}/generate?model=nope", content="Hello").status_code == 404
        with connect(f"{stub.ws_url}/lmtp") as ws:
            ws.send("GENERATE " + json.dumps({"prompt": [1, 2, 3], "stream_id": 1}))
            while '"finish_reason":"stop"' not in ws.recv():
                pass
        after = samples(httpx.get(f"{stub.url}/metrics").text)
    m = {"model_name": "stub-model"}
    assert value(after, "kvyard:requests_total", endpoint="/v1/chat/completions", status="200", **m) == 1
    assert value(after, "kvyard:requests_total", endpoint="/generate", status="200", **m) == 1
    assert value(after, "kvyard:requests_total", endpoint="/generate", status="404", **m) == 1
    assert value(after, "kvyard:requests_total", endpoint="LMTP GENERATE", status="200", **m) == 1
    assert value(after, "kvyard:time_to_first_token_seconds_count", **m) == value(before, "kvyard:time_to_first_token_seconds_count", **m) + 3
    assert value(after, "kvyard:e2e_request_latency_seconds_count", **m) == 3  # LMTP stops reading at its finish
    assert value(after, "kvyard:generation_tokens_total", **m) == 3 * len(ids)
    assert value(after, "kvyard:prompt_tokens_total", **m) > 3
    assert value(after, "kvyard:num_requests_running", **m) == value(after, "kvyard:num_requests_waiting", **m) == 0


@pytest.mark.slow
def test_real_backend_and_frontend_metrics_move(pdfusion: Cluster) -> None:
    backend_url = pdfusion.base_url.rsplit(":", 1)[0] + f":{int(pdfusion.base_url.rsplit(':', 1)[1]) + 5}"
    prompt = "Repeat after me: " + "the quick brown fox jumps over the lazy dog " * 6
    before = samples(httpx.get(f"{backend_url}/metrics").text)
    for _ in range(2):  # the second time the prompt's full blocks come from the prefix cache
        resp = httpx.post(f"{pdfusion.base_url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "temperature": 0})
        assert resp.status_code == 200
    text = httpx.get(f"{backend_url}/metrics").text
    assert set(REQUEST_METRICS + ENGINE_GAUGES) <= families(text)
    after = samples(text)

    m = {"model_name": "SmolLM2-135M-Instruct"}

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels, **m) - value(before, name, **labels, **m)
    assert moved("kvyard:requests_total", endpoint="GenerateStreamCall", status="ok") == 2
    assert moved("kvyard:generation_tokens_total") == 8
    assert moved("kvyard:prompt_tokens_total") > 2 * 60
    assert moved("kvyard:prefix_cache_hits_total") >= 48
    assert moved("kvyard:time_to_first_token_seconds_count") == 2
    assert moved("kvyard:e2e_request_latency_seconds_count") == 2
    assert 0.0 <= value(after, "kvyard:kv_cache_usage_perc", **m) <= 1.0

    frontend = samples(httpx.get(f"{pdfusion.base_url}/metrics").text)
    assert value(frontend, "kvyard:requests_total", endpoint="/v1/chat/completions", status="200", **m) >= 2
    assert value(frontend, "kvyard:prefix_cache_hits_total", **m) >= 48
