"""A real ROLE_TYPE=MASTER process polling scripted gRPC backends (no model), and a real FRONTEND routed
by it: bad input → 400, prefix routing with the frontend's own block keys, garbage status, no room → held,
then 429 (or 504 past the request's generate_timeout),
unknown model → 404, registration, a dead master → the direct backend list."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from kvyard.block_keys import block_cache_keys
from kvyard.tokenizer import TextTokenizer
from tests.support.procs import RoleProcess, cluster_headers, free_port_block
from tests.support.stub_backend import StubEngine, sane_load, stub_backend

MODEL = "stub-model"
EOS_ID = 2
SHARED = "You are a terse assistant for a hardware shop. " * 8  # ~80 tokens: several full blocks
HOLD_MS = 1500  # MASTER_QUEUE_WAIT_MS of the master and its frontend


@dataclass
class Cluster:
    master: str                         # http://127.0.0.1:PORT
    frontend: str                       # a frontend routed by the master
    orphan: str                         # a frontend whose master is down (direct list: stub a)
    lora: str                           # a frontend routed by the master, with LoRA on (LORA_ROOT)
    stubs: dict[str, StubEngine]        # "a", "b", "c" (c is not in the master's static list)
    addresses: dict[str, str]           # their gRPC addresses


def wait_until(pred: Callable[[], bool], timeout_s: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise TimeoutError(f"{what} not reached in {timeout_s} s")


@pytest.fixture(scope="module")
def cluster(tokenizer: TextTokenizer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    base = free_port_block(8)
    ports = {"a": base, "b": base + 1, "c": base + 2}
    master_port, fe_port, orphan_port, dead_port, lora_port = base + 3, base + 4, base + 5, base + 6, base + 7
    script = [*tokenizer.encode("Hello!"), EOS_ID]
    addresses = {n: f"127.0.0.1:{p}" for n, p in ports.items()}
    logs = tmp_path_factory.mktemp("master_role")
    common = {"MODEL_NAME": MODEL, "MAX_SEQ_LEN": "512", "MASTER_QUEUE_WAIT_MS": str(HOLD_MS)}
    procs: list[RoleProcess] = []
    with ExitStack() as stack:
        stubs = {name: stack.enter_context(stub_backend(lambda _req: script, port))[0]
                 for name, port in ports.items()}
        stack.callback(lambda: [p.stop() for p in procs])  # the role processes stop before the stubs
        procs.append(RoleProcess({**common, "ROLE_TYPE": "MASTER", "START_PORT": str(master_port),
                                  "MASTER_BACKENDS": f"{addresses['a']},{addresses['b']}"}, logs / "master.log"))
        procs.append(RoleProcess({**common, "ROLE_TYPE": "FRONTEND", "START_PORT": str(fe_port),
                                  "MASTER_ADDRESS": f"127.0.0.1:{master_port}",
                                  "BACKEND_ADDRESSES": f"{addresses['a']},{addresses['b']}"}, logs / "frontend.log"))
        procs.append(RoleProcess({**common, "ROLE_TYPE": "FRONTEND", "START_PORT": str(orphan_port),
                                  "MASTER_ADDRESS": f"127.0.0.1:{dead_port}",
                                  "BACKEND_ADDRESSES": addresses["a"]}, logs / "orphan.log"))
        procs.append(RoleProcess({**common, "ROLE_TYPE": "FRONTEND", "START_PORT": str(lora_port),
                                  "MASTER_ADDRESS": f"127.0.0.1:{master_port}", "LORA_ROOT": str(logs),
                                  "BACKEND_ADDRESSES": f"{addresses['a']},{addresses['b']}"}, logs / "lora.log"))
        master = f"http://127.0.0.1:{master_port}"
        procs[0].wait_healthy(f"{master}/health", timeout_s=60)
        procs[1].wait_healthy(f"http://127.0.0.1:{fe_port}/health", timeout_s=60)
        procs[2].wait_healthy(f"http://127.0.0.1:{orphan_port}/health", timeout_s=60)
        procs[3].wait_healthy(f"http://127.0.0.1:{lora_port}/health", timeout_s=60)
        yield Cluster(master, f"http://127.0.0.1:{fe_port}", f"http://127.0.0.1:{orphan_port}",
                      f"http://127.0.0.1:{lora_port}", stubs, addresses)


def backends(cluster: Cluster) -> dict[str, dict[str, Any]]:
    return {b["name"]: b for b in httpx.get(f"{cluster.master}/backends").json()["backends"]}


def healthy(cluster: Cluster, name: str) -> bool:
    view = backends(cluster).get(cluster.addresses[name])
    return bool(view and view["healthy"])


@pytest.fixture(autouse=True)
def fresh_stubs(cluster: Cluster) -> Iterator[None]:
    """Each test starts with idle, empty, healthy stubs the master has seen as such."""
    for stub in cluster.stubs.values():
        stub.status, stub.status_fails = sane_load(), False
        stub.cached_keys, stub.cache_version = set(), stub.cache_version + 1
        stub.generation_requests.clear()
    wait_until(lambda: all(b["healthy"] and b["cached_blocks"] == 0 for name, b in backends(cluster).items()
                           if name != cluster.addresses["c"]), what="stubs idle and healthy")
    yield


def messages(content: str, system: str = SHARED) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": content}]


def chat(url: str, content: str, system: str = SHARED, **extra: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=10,
                      json={"messages": messages(content, system), "max_tokens": 8, **extra})


def prompt_ids(cluster: Cluster, content: str, system: str = SHARED) -> list[int]:
    resp = httpx.post(f"{cluster.frontend}/v1/chat/render", json={"messages": messages(content, system)})
    return resp.json()["input_ids"]


def schedule(cluster: Cluster, body: Any) -> httpx.Response:
    return httpx.post(f"{cluster.master}/rtp_llm/schedule", json=body, timeout=5, headers=cluster_headers())


GOOD = {"model": MODEL, "block_cache_keys": [1, 2], "seq_len": 40}


@pytest.mark.parametrize("body, needle", [
    ({**GOOD, "colour": "red"}, "Unrecognized request argument supplied: colour"),
    ({**GOOD, "seq_len": "40"}, "seq_len: Input should be a valid integer"),
    ({**GOOD, "seq_len": 0}, "seq_len"),
    ({**GOOD, "debug": 1}, "debug: Input should be a valid boolean"),
    ({**GOOD, "block_cache_keys": [1, "x"]}, "block_cache_keys.1"),
    ({**GOOD, "block_cache_keys": [2**64]}, "block_cache_keys.0"),
    ({k: v for k, v in GOOD.items() if k != "seq_len"}, "seq_len: Field required"),
    ({**GOOD, "block_cache_keys": list(range(41))}, "41 blocks but seq_len is only 40"),
    ([GOOD], "valid dictionary"),
])
def test_schedule_rejects_bad_input_with_400(cluster: Cluster, body: Any, needle: str) -> None:
    resp = schedule(cluster, body)
    assert resp.status_code == 400, resp.text
    assert needle in resp.json()["error"]["message"]
    bad_json = httpx.post(f"{cluster.master}/rtp_llm/schedule", content=b'{"model": ', headers=cluster_headers())
    assert bad_json.status_code == 400 and "malformed JSON" in bad_json.json()["error"]["message"]


def test_schedule_answers_rtp_llm_shape_and_debug_scores(cluster: Cluster) -> None:
    ids = list(range(100, 164))
    cluster.stubs["b"].cache(block_cache_keys(ids, 16))
    wait_until(lambda: backends(cluster)[cluster.addresses["b"]]["cached_blocks"] == 4, what="b's keys polled")
    resp = schedule(cluster, {"model": MODEL, "block_cache_keys": block_cache_keys(ids, 16), "seq_len": 64,
                              "debug": True, "generate_timeout": 1000, "request_priority": 1})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    (server,) = body["server_status"]
    assert f"{server['server_ip']}:{server['grpc_port']}" == cluster.addresses["b"]
    assert server["role"] == 0 and server["http_port"] == server["grpc_port"] + 4
    assert set(server["debug_info"]) == {"running_batch_size", "queue_size", "waiting_time_ms",
                                         "available_kv_cache_len", "estimate_ttft_ms", "estimate_ttot_ms",
                                         "hit_cache_len"}
    assert server["debug_info"]["hit_cache_len"] == 63
    assert isinstance(body["inter_request_id"], int) and body["reason"] == "prefix_hit"
    scores = {c["name"]: c for c in body["candidates"]}
    assert set(scores) == {cluster.addresses["a"], cluster.addresses["b"]}
    assert scores[cluster.addresses["a"]]["hit_cache_len"] == 0 and scores[cluster.addresses["b"]]["chosen"]


def test_master_host_backends_and_models(cluster: Cluster) -> None:
    port = cluster.master.rsplit(":", 1)[1]
    assert httpx.post(f"{cluster.master}/rtp_llm/master").json() == {"real_master_host": f"127.0.0.1:{port}"}
    view = backends(cluster)[cluster.addresses["a"]]
    assert view["healthy"] and view["status"]["total_blocks"] == 1024 and view["sources"] == ["static"]
    models = httpx.get(f"{cluster.master}/v1/models").json()["data"]
    assert [(m["id"], m["healthy_backends"]) for m in models] == [(MODEL, 2)]


def test_self_registered_backend_serves_its_model(cluster: Cluster) -> None:
    c_port = int(cluster.addresses["c"].rsplit(":", 1)[1])
    resp = httpx.post(f"{cluster.master}/rtp_llm/register",
                      json={"model": "other-model", "grpc_port": c_port, "http_port": c_port + 4},
                      headers=cluster_headers())
    assert resp.status_code == 200, resp.text
    wait_until(lambda: healthy(cluster, "c"), what="c registered and polled")
    assert backends(cluster)[cluster.addresses["c"]]["sources"] == ["registered"]
    listed = [m["id"] for m in httpx.get(f"{cluster.frontend}/v1/models").json()["data"]]
    assert listed[0] == MODEL and "other-model" in listed
    resp = chat(cluster.frontend, "hi", model="other-model")
    assert resp.status_code == 200, resp.text
    assert len(cluster.stubs["c"].generation_requests) == 1 and not cluster.stubs["a"].generation_requests
    bad = httpx.post(f"{cluster.master}/rtp_llm/register", json={"model": "x", "grpc_port": "1"},
                     headers=cluster_headers())
    assert bad.status_code == 400


def test_frontend_sends_a_cached_prefix_to_the_backend_holding_it(cluster: Cluster) -> None:
    for holder, system in (("b", SHARED), ("a", "Answer in French, politely and briefly. " * 8)):
        question = "Do you sell soldering irons?"
        ids = prompt_ids(cluster, question, system)
        keys = block_cache_keys(ids, 16)  # the engine's own function on the exact ids sent
        assert len(keys) >= 4
        cluster.stubs[holder].cache(keys)
        wait_until(lambda: backends(cluster)[cluster.addresses[holder]]["cached_blocks"] >= len(keys),
                   what="keys polled")
        before = {n: len(s.generation_requests) for n, s in cluster.stubs.items()}
        for _ in range(3):
            resp = chat(cluster.frontend, question, system)
            assert resp.status_code == 200, resp.text
        after = {n: len(s.generation_requests) for n, s in cluster.stubs.items()}
        assert after[holder] - before[holder] == 3, (holder, before, after)
        assert cluster.stubs[holder].generation_requests[-1].prompt_ids == ids
    assert httpx.get(f"{cluster.master}/backends").json()["stats"]["hit_requests"] >= 6


def test_garbage_status_takes_a_backend_out_and_it_comes_back(cluster: Cluster) -> None:
    cluster.stubs["a"].status = sane_load(total_blocks=-3, step_latency_ms=float("nan"))
    wait_until(lambda: not healthy(cluster, "a"), what="a unhealthy")
    assert "garbage worker status" in backends(cluster)[cluster.addresses["a"]]["error"]
    for i in range(4):
        assert chat(cluster.frontend, f"question {i}").status_code == 200
    assert len(cluster.stubs["b"].generation_requests) == 4 and not cluster.stubs["a"].generation_requests
    assert httpx.get(f"{cluster.master}/health").status_code == 200
    cluster.stubs["a"].status = sane_load()
    wait_until(lambda: healthy(cluster, "a"), what="a healthy again")


def fill_every_backend(cluster: Cluster) -> None:
    for stub in (cluster.stubs["a"], cluster.stubs["b"]):
        stub.status = sane_load(free_blocks=0)
    wait_until(lambda: all(backends(cluster)[cluster.addresses[n]]["status"]["free_blocks"] == 0 for n in "ab"),
               what="full caches polled")


def test_no_backend_with_room_is_held_then_429_with_retry_after(cluster: Cluster) -> None:
    fill_every_backend(cluster)
    start = time.monotonic()
    resp = chat(cluster.frontend, "anything")
    assert resp.status_code == 429 and resp.headers["retry-after"] == "1", resp.text
    assert time.monotonic() - start >= HOLD_MS / 1000 * 0.9  # held for MASTER_QUEUE_WAIT_MS first
    assert resp.json()["error"]["code"] == "overloaded" and "MASTER_QUEUE_WAIT_MS" in resp.json()["error"]["message"]
    assert not cluster.stubs["a"].generation_requests and not cluster.stubs["b"].generation_requests


def test_a_held_request_goes_to_the_first_backend_with_room(cluster: Cluster) -> None:
    fill_every_backend(cluster)
    result: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: result.append(chat(cluster.frontend, "patience")))
    waiting.start()
    time.sleep(0.4)
    assert not result and not cluster.stubs["a"].generation_requests and not cluster.stubs["b"].generation_requests
    cluster.stubs["b"].status = sane_load()   # room appears on b
    waiting.join(10)
    assert result and result[0].status_code == 200, result
    assert len(cluster.stubs["b"].generation_requests) == 1 and not cluster.stubs["a"].generation_requests


def test_a_burst_into_a_full_cluster_is_held_and_every_request_answered_or_refused(cluster: Cluster) -> None:
    """Chaos: 40 chats at once while every backend is full; room appears on one backend half-way through
    the hold. Every request ends within the hold (plus slack): routed and answered, or a 429 with Retry-After
    and an error object. None is lost, none hangs."""
    from concurrent.futures import ThreadPoolExecutor

    fill_every_backend(cluster)
    start = time.monotonic()
    with ThreadPoolExecutor(40) as pool:
        futures = [pool.submit(chat, cluster.frontend, f"burst {i}") for i in range(40)]
        time.sleep(HOLD_MS / 2000)
        cluster.stubs["b"].status = sane_load()  # room on b
        results = [f.result(timeout=HOLD_MS / 1000 + 15) for f in futures]
    took = time.monotonic() - start
    statuses = [r.status_code for r in results]
    assert set(statuses) <= {200, 429} and statuses.count(200) >= 1, statuses
    for r in results:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "overloaded", r.text
        else:
            assert r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text
    assert len(cluster.stubs["b"].generation_requests) == statuses.count(200)  # the answered ones, on b
    assert not cluster.stubs["a"].generation_requests
    assert took < HOLD_MS / 1000 + 10, took


def test_held_past_its_generate_timeout_is_504(cluster: Cluster) -> None:
    fill_every_backend(cluster)
    start = time.monotonic()
    resp = schedule(cluster, {**GOOD, "generate_timeout": 300, "request_priority": -1})
    assert resp.status_code == 504 and resp.json()["error"]["code"] == "timeout", resp.text
    assert 0.25 <= time.monotonic() - start < HOLD_MS / 1000


def test_unknown_model_is_404(cluster: Cluster) -> None:
    resp = chat(cluster.frontend, "hi", model="no-such-model")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found", resp.text
    assert "no-such-model" in resp.json()["error"]["message"]


def test_an_adapter_another_backend_holds_is_listed_and_renders(cluster: Cluster) -> None:
    """The master lists the LoRA adapters its healthy backends hold (their base model as `parent`), and
    /v1/chat/render behind it takes an adapter that only a backend other than the frontend's paired one
    holds, as a completion naming it would be routed; one nobody holds is the completion's 404."""
    cluster.stubs["b"].status = sane_load(adapters=("sql-lora",))
    def adapters() -> list[tuple[str, str, int]]:
        return [(m["id"], m["parent"], m["healthy_backends"])
                for m in httpx.get(f"{cluster.master}/v1/models").json()["data"] if "parent" in m]

    wait_until(lambda: adapters() == [("sql-lora", MODEL, 1)], what="the adapter listed")
    body: dict[str, Any] = {"messages": messages("hi"), "extra_configs": {"adapter_name": "sql-lora"}}
    resp = httpx.post(f"{cluster.frontend}/v1/chat/render", json=body, timeout=10)
    assert resp.status_code == 200 and resp.json()["input_ids"] == prompt_ids(cluster, "hi"), resp.text
    assert "sql-lora" not in [m["id"] for m in httpx.get(f"{cluster.frontend}/v1/models").json()["data"]]  # models only
    # with LoRA on, the frontend lists it as a model of its own base model and a request's `model` may name it
    listed = {m["id"]: m for m in httpx.get(f"{cluster.lora}/v1/models").json()["data"]}
    assert listed["sql-lora"]["parent"] == MODEL and listed["sql-lora"]["max_model_len"] == 512
    resp = httpx.post(f"{cluster.lora}/v1/chat/render", json={"messages": messages("hi"), "model": "sql-lora"})
    assert resp.status_code == 200, resp.text
    body["extra_configs"]["adapter_name"] = "nobody-holds-this"
    for url in (cluster.frontend, cluster.orphan):  # the orphan's master is down: nothing vouches for it
        resp = httpx.post(f"{url}/v1/chat/render", json=body, timeout=10)
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found", resp.text
    cluster.stubs["b"].status = sane_load()
    wait_until(lambda: adapters() == [], what="the adapter gone")
    body["extra_configs"]["adapter_name"] = "sql-lora"
    assert httpx.post(f"{cluster.frontend}/v1/chat/render", json=body, timeout=10).status_code == 404


def test_status_rpc_failures_take_a_backend_out(cluster: Cluster) -> None:
    cluster.stubs["b"].status_fails = True
    wait_until(lambda: not healthy(cluster, "b"), what="b unhealthy")
    assert chat(cluster.frontend, "hello").status_code == 200
    assert len(cluster.stubs["a"].generation_requests) == 1 and not cluster.stubs["b"].generation_requests


def test_frontend_without_its_master_uses_the_direct_list(cluster: Cluster) -> None:
    for i in range(2):
        resp = chat(cluster.orphan, f"q{i}")
        assert resp.status_code == 200, resp.text
    assert len(cluster.stubs["a"].generation_requests) == 2
    assert httpx.get(f"{cluster.orphan}/v1/models").json()["data"][0]["id"] == MODEL


def test_an_endpoint_that_is_not_a_backend_never_crashes_the_master(cluster: Cluster) -> None:
    http_port = int(cluster.frontend.rsplit(":", 1)[1])  # an HTTP/1 server where gRPC is expected
    resp = httpx.post(f"{cluster.master}/rtp_llm/register",
                      json={"model": "junk-model", "grpc_port": http_port, "http_port": http_port},
                      headers=cluster_headers())
    assert resp.status_code == 200
    name = f"127.0.0.1:{http_port}"
    wait_until(lambda: name in backends(cluster) and backends(cluster)[name]["error"] is not None,
               what="junk endpoint polled")
    assert not backends(cluster)[name]["healthy"]
    again = httpx.post(f"{cluster.master}/rtp_llm/register", headers=cluster_headers(),
                       json={"model": "junk-model", "grpc_port": http_port, "http_port": http_port}).json()
    assert again["healthy"] is False and again["error"] and again["name"] == name  # the backend is told
    assert schedule(cluster, {"model": "junk-model", "block_cache_keys": [], "seq_len": 3}).status_code == 503
    assert httpx.get(f"{cluster.master}/health").status_code == 200
    assert chat(cluster.frontend, "still fine?").status_code == 200
