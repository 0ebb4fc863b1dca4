"""The master's dashboard without processes: the page is self-contained and open, its JSON state and SSE
feed show each backend and the routing decisions by reason, second by second."""
from __future__ import annotations

import json
import re
from dataclasses import replace

from fastapi.testclient import TestClient

from master.app import create_master_app
from master.backend_poller import worker_status_from_pb
from master.config import BackendEndpoint, MasterConfig
from master.dashboard import DecisionHistory, snapshot
from master.registry import SOURCE_STATIC, Registry
from tests.support.procs import CLUSTER_TOKEN
from tests.support.stub_backend import sane_status

CFG = MasterConfig.from_env({"CLUSTER_TOKEN": CLUSTER_TOKEN})
A = BackendEndpoint("10.0.0.1", 8089, 8093, "m")
B = BackendEndpoint("10.0.0.2", 8089, 8093, "m", role="DECODE")


def test_history_counts_decisions_per_second_by_reason() -> None:
    reg = Registry(CFG)
    history = DecisionHistory(reg, wall=iter(range(100, 200)).__next__)
    reg.stats.decisions.update(prefix_hit=3, shortest_ttft=1)
    history.sample()
    reg.stats.decisions.update(prefix_hit=5, all_busy=2)
    history.sample()
    history.sample()
    assert list(history.points) == [(100, {"prefix_hit": 3, "shortest_ttft": 1}),
                                    (101, {"prefix_hit": 2, "all_busy": 2}), (102, {})]


def test_snapshot_shows_each_backend() -> None:
    reg = Registry(CFG)
    for e in (A, B):
        reg.add(e, SOURCE_STATIC, 0.0)
    load = worker_status_from_pb(sane_status(cache_version=0))
    reg.apply_status(A.name, replace(load, running=3, waiting=1, free_blocks=load.total_blocks // 4,
                                     step_latency_ms=12.5, prefill_tokens_per_s=800.0), 0.0, 0.002)
    reg.record_choice(A.name, [1], 64, 48, 0.1)
    state = snapshot(reg, DecisionHistory(reg), 0.2)
    a, b = state["backends"]
    assert (a["name"], a["role"], a["healthy"], a["running"], a["waiting"]) == (A.name, "PDFUSION", True, 3, 1)
    assert a["kv_usage"] == 0.75 and a["prefix_hit_rate"] == 0.75 and a["prefix_hits"] == 48
    assert (a["step_latency_ms"], a["prefill_tokens_per_s"], a["poll_latency_ms"]) == (12.5, 800.0, 2.0)
    assert b["role"] == "DECODE" and not b["healthy"] and b["routed_requests"] == 0
    assert state["totals"]["routed"] == 1 and state["totals"]["prefix_hit_rate"] == 0.75
    json.dumps(state)


def test_the_page_and_its_feed_are_open_and_self_contained() -> None:
    client = TestClient(create_master_app(CFG))
    page = client.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert not re.search(r"(src|href)=\"(https?:)?//", page.text) and "https://" not in page.text
    assert client.get("/dashboard/state").json()["backends"] == []
    assert client.post("/rtp_llm/schedule", json={"model": "m", "block_cache_keys": [], "seq_len": 4}).status_code == 401
    resp = client.post("/rtp_llm/schedule", headers={"Authorization": f"Bearer {CLUSTER_TOKEN}"},
                       json={"model": "nope", "block_cache_keys": [], "seq_len": 4})
    assert resp.status_code == 503
    assert client.get("/dashboard/state").json()["decisions"] == {"no_backends": 1}
