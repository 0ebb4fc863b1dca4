"""ROLE_TYPE=GATEWAY as a real process in front of real upstreams: two kvyard PDFUSION servers serving
different model names (the session's, and one more) and two kvyard frontends over one mock backend
(`mock-model`), driven with the official openai client and raw HTTP."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvyard.tokenizer import TextTokenizer
from tests.conftest import Cluster
from tests.support.procs import RoleProcess, free_port_block

pytestmark = pytest.mark.slow

MODEL_A = "SmolLM2-135M-Instruct"  # the session's PDFUSION server
MODEL_B = "smol-b"                 # a second PDFUSION server, same weights, another name
MOCK = "mock-model"                # two frontends over one mock backend
MOCK_STEP_MS = 10                  # the mock backend's pause before each token
HEALTH_MS = 500
HI = [{"role": "user", "content": "Say hi."}]


@dataclass
class Stack:
    gateway: str                       # http://127.0.0.1:PORT
    mock_fronts: list[str]             # the two mock-model upstreams
    pdfusion_b: str
    mock_backend: str                  # host:grpc_port
    logs: Path


def start(env: dict[str, str], log: Path, procs: list[RoleProcess]) -> RoleProcess:
    proc = RoleProcess(env, log)
    procs.append(proc)
    return proc


def start_gateway(upstreams: list[str], log: Path, procs: list[RoleProcess], **env: str) -> str:
    port = free_port_block(1)
    proc = start({"ROLE_TYPE": "GATEWAY", "TIB_PORT": str(port), "UPSTREAMS": ",".join(upstreams),
                  "GATEWAY_HEALTH_INTERVAL_MS": str(HEALTH_MS), **env}, log, procs)
    url = f"http://127.0.0.1:{port}"
    proc.wait_healthy(f"{url}/health", timeout_s=60)
    return url


def start_mock_front(backend: str, log: Path, procs: list[RoleProcess]) -> tuple[str, RoleProcess]:
    port = free_port_block(1)
    proc = start({"ROLE_TYPE": "FRONTEND", "START_PORT": str(port), "BACKEND_ADDRESS": backend,
                  "MODEL_NAME": MOCK, "MAX_SEQ_LEN": "1024"}, log, procs)
    return f"http://127.0.0.1:{port}", proc


@pytest.fixture(scope="module")
def stack(pdfusion: Cluster, tokenizer: TextTokenizer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("gateway")
    procs: list[RoleProcess] = []
    try:
        b_port, mock_port = free_port_block(), free_port_block(2)
        pdf_b = start({"ROLE_TYPE": "PDFUSION", "START_PORT": str(b_port), "MODEL_NAME": MODEL_B, "KV_CACHE_MB": "64",
                       "TORCH_NUM_THREADS": "1"}, logs / "pdfusion_b.log", procs)
        script = tokenizer.encode(" The mock backend says hello, slowly and steadily." * 40) + [2]  # ~4 s of tokens
        mock = start({"ROLE_TYPE": "MOCK_BACKEND", "START_PORT": str(mock_port), "MOCK_TOKEN_IDS": json.dumps(script),
                      "MOCK_DELAY_MS": str(MOCK_STEP_MS)}, logs / "mock_backend.log", procs)
        backend = f"127.0.0.1:{mock_port + 1}"
        fronts = [start_mock_front(backend, logs / f"mock_front{i}.log", procs) for i in range(2)]
        for url, proc in fronts:
            proc.wait_healthy(f"{url}/health", timeout_s=60)
        assert mock.proc.poll() is None, mock.log()
        pdf_b.wait_healthy(f"http://127.0.0.1:{b_port}/health", timeout_s=180)
        upstreams = [pdfusion.base_url, f"http://127.0.0.1:{b_port}", *(url for url, _ in fronts)]
        gateway = start_gateway(upstreams, logs / "gateway.log", procs, MAX_CONNECT_PER_UPSTREAM="1", WAIT_FOR="60000")
        yield Stack(gateway, [url for url, _ in fronts], f"http://127.0.0.1:{b_port}", backend, logs)
    finally:
        for p in procs:
            p.stop()


def upstream_view(gateway: str) -> dict[str, dict[str, Any]]:
    return {u["url"]: u for u in httpx.get(f"{gateway}/upstreams").json()["upstreams"]}


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples at `url`/metrics whose labels include `labels`."""
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    return sum(sample.value for family in families for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def chat_requests(front: str) -> float:
    """The upstream frontend's own count of chat requests it answered (any status)."""
    return metric(front, "kvyard:requests_total", endpoint="/v1/chat/completions")


def wait_until(predicate: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.05)


def test_models_are_the_union_of_the_upstreams(stack: Stack) -> None:
    ids = sorted(m["id"] for m in httpx.get(f"{stack.gateway}/v1/models").json()["data"])
    assert ids == sorted([MODEL_A, MODEL_B, MOCK])
    resp = httpx.post(f"{stack.gateway}/v1/chat/completions", json={"model": "nope", "messages": HI})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("model", [MODEL_A, MODEL_B, MOCK])
def test_openai_client_through_the_gateway_streaming_and_not(stack: Stack, model: str) -> None:
    client = openai.OpenAI(base_url=f"{stack.gateway}/v1", api_key="unused", max_retries=0, timeout=60)
    full = client.chat.completions.create(model=model, messages=HI, temperature=0, max_tokens=8)
    assert full.model == model and full.choices[0].message.content
    chunks = list(client.chat.completions.create(model=model, messages=HI, temperature=0, max_tokens=8, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content  # greedy (the real models) or scripted (the mock)


def test_thirty_two_at_once_with_one_connection_per_upstream_all_complete(stack: Stack) -> None:
    models = [MOCK] * 20 + [MODEL_A] * 6 + [MODEL_B] * 6

    def one(model: str) -> int:
        resp = httpx.post(f"{stack.gateway}/v1/chat/completions", timeout=60,
                          json={"model": model, "messages": HI, "max_tokens": 4, "temperature": 0})
        return resp.status_code

    with ThreadPoolExecutor(32) as pool:
        statuses = list(pool.map(one, models))
    assert statuses == [200] * 32, statuses
    view = upstream_view(stack.gateway)
    assert all(u["peak_in_flight"] == 1 for u in view.values()), view
    assert sum(view[f]["served"] for f in stack.mock_fronts) >= 20
    assert all(view[f]["served"] > 0 for f in stack.mock_fronts)  # both mock upstreams took a share
    assert metric(stack.gateway, "kvyard:gateway_queue_wait_seconds_sum") > 0.1  # they queued, not refused


def test_an_upstream_4xx_passes_through_untouched_and_is_no_failure(stack: Stack) -> None:
    bad = {"model": MOCK, "messages": HI, "temperature": 7}
    direct = httpx.post(f"{stack.mock_fronts[0]}/v1/chat/completions", json=bad)
    via = httpx.post(f"{stack.gateway}/v1/chat/completions", json=bad)
    assert direct.status_code == 400 and via.status_code == 400
    assert via.content == direct.content
    for f in stack.mock_fronts:
        u = upstream_view(stack.gateway)[f]
        assert u["healthy"] and u["failures"] == {} and u["consecutive_failures"] == 0


def long_stream(gateway: str, stop: threading.Event, got_first: threading.Event) -> None:
    """A streamed request on a mock upstream for ~3 s, or until `stop` is set."""
    body = {"model": MOCK, "messages": HI, "stream": True, "max_tokens": 300}
    with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=body, timeout=30) as resp:
        for _ in resp.iter_raw():
            got_first.set()
            if stop.is_set():
                return


def test_queued_client_that_leaves_never_reaches_an_upstream(stack: Stack) -> None:
    before = sum(chat_requests(f) for f in stack.mock_fronts)
    stop = threading.Event()
    firsts = [threading.Event(), threading.Event()]
    holders = [threading.Thread(target=long_stream, args=(stack.gateway, stop, e)) for e in firsts]
    for t in holders:
        t.start()
    try:
        for e in firsts:
            assert e.wait(20)
        assert all(upstream_view(stack.gateway)[f]["in_flight"] == 1 for f in stack.mock_fronts)
        with pytest.raises(httpx.ReadTimeout):  # both mock upstreams are busy: it queues, then gives up
            httpx.post(f"{stack.gateway}/v1/chat/completions", json={"model": MOCK, "messages": HI}, timeout=0.5)
        wait_until(lambda: httpx.get(f"{stack.gateway}/upstreams").json()["queued"] == 0, 3)
    finally:
        stop.set()
        for t in holders:
            t.join(30)
    wait_until(lambda: all(upstream_view(stack.gateway)[f]["in_flight"] == 0 for f in stack.mock_fronts), 5)
    time.sleep(0.3)
    assert sum(chat_requests(f) for f in stack.mock_fronts) == before + 2  # the two holders only


def test_leaving_mid_stream_closes_the_upstream_request(stack: Stack) -> None:
    body = {"model": MOCK, "messages": HI, "stream": True, "max_tokens": 300}  # ~3 s of tokens
    with httpx.stream("POST", f"{stack.gateway}/v1/chat/completions", json=body, timeout=30) as resp:
        chunks = resp.iter_raw()
        next(chunks)
        next(chunks)
        busy = [f for f in stack.mock_fronts if upstream_view(stack.gateway)[f]["in_flight"] == 1]
        assert len(busy) == 1
        assert metric(busy[0], "kvyard:num_requests_running") == 1  # the upstream is streaming it
    left = time.monotonic()

    def idle() -> bool:
        return metric(busy[0], "kvyard:num_requests_running") == 0 and \
            upstream_view(stack.gateway)[busy[0]]["in_flight"] == 0

    wait_until(idle, 2.0)
    assert time.monotonic() - left < 2.0  # the upstream stopped streaming, well before its 3 s


def test_killed_upstream_traffic_moves_within_one_health_period(stack: Stack) -> None:
    procs: list[RoleProcess] = []
    try:
        victim_url, victim = start_mock_front(stack.mock_backend, stack.logs / "victim.log", procs)
        victim.wait_healthy(f"{victim_url}/health", timeout_s=60)
        survivor = stack.mock_fronts[0]
        gateway = start_gateway([survivor, victim_url], stack.logs / "gateway_kill.log", procs,
                                MAX_CONNECT_PER_UPSTREAM="2", WAIT_FOR="20000")
        results: list[tuple[float, int | str]] = []  # (seconds since the kill, status or error)
        killed_at: list[float] = []
        done = threading.Event()

        def client() -> None:
            while not done.is_set():
                t = time.monotonic()
                try:
                    status: int | str = httpx.post(f"{gateway}/v1/chat/completions", timeout=30,
                                                   json={"model": MOCK, "messages": HI, "max_tokens": 6}).status_code
                except httpx.HTTPError as exc:
                    status = repr(exc)
                results.append((t - killed_at[0] if killed_at else -1.0, status))

        threads = [threading.Thread(target=client) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        assert upstream_view(gateway)[victim_url]["served"] > 0  # it had its share before the kill
        os.killpg(victim.proc.pid, signal.SIGKILL)
        killed_at.append(time.monotonic())
        time.sleep(HEALTH_MS / 1000)
        served_then = upstream_view(gateway)[victim_url]["served"]
        time.sleep(2.0)
        done.set()
        for t in threads:
            t.join(30)
        after = [status for since, status in results if since >= HEALTH_MS / 1000]
        assert after and all(s == 200 for s in after), results
        assert all(s == 200 for _, s in results), results  # in flight at the kill: retried before any byte
        view = upstream_view(gateway)
        assert view[victim_url]["served"] == served_then and not view[victim_url]["healthy"], view
    finally:
        for p in procs:
            p.stop()
