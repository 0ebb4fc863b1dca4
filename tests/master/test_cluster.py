"""A master and two real backend processes (embedded model) that register themselves, driven through the
frontend's own Router: a shared prefix returns to the backend that cached it, and a killed backend is
routed around with no request failing."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from kvyard.sampling_params import SamplingParams
from frontend.config import FrontendConfig
from frontend.routing import Router
from kvyard.tokenizer import TextTokenizer
from tests.support.procs import CLUSTER_TOKEN, RoleProcess, free_port_block

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(max_new_tokens=3, temperature=0.0)
PREFIX_TEXT = ("The history of the printing press begins in the fifteenth century, when movable metal type, "
               "oil-based ink and a wooden screw press were combined into one working system. ") * 12


@dataclass
class Cluster:
    master: str                       # http://127.0.0.1:PORT
    backends: dict[str, RoleProcess]  # gRPC address → its process


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    base = free_port_block(13)  # master: base; backends: base+1 .. base+6 and base+7 .. base+12
    logs = tmp_path_factory.mktemp("master_cluster")
    master_port, starts = base, (base + 1, base + 7)
    procs: list[RoleProcess] = []
    try:
        procs.append(RoleProcess({"ROLE_TYPE": "MASTER", "START_PORT": str(master_port)}, logs / "master.log"))
        for i, start in enumerate(starts):
            procs.append(RoleProcess({"ROLE_TYPE": "PDFUSION", "FRONTEND_SERVER_COUNT": "0",
                                      "START_PORT": str(start), "KV_CACHE_MB": "128", "TORCH_NUM_THREADS": "1",
                                      "MASTER_ADDRESS": f"127.0.0.1:{master_port}"}, logs / f"backend{i}.log"))
        for start, proc in zip(starts, procs[1:]):
            proc.wait_healthy(f"http://127.0.0.1:{start + 5}/health", timeout_s=180)
        master = f"http://127.0.0.1:{master_port}"
        procs[0].wait_healthy(f"{master}/health", timeout_s=30)
        addresses = [f"127.0.0.1:{s + 1}" for s in starts]
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # both registered and polled
            view = httpx.get(f"{master}/backends").json()["backends"]
            if sorted(b["name"] for b in view if b["healthy"]) == sorted(addresses):
                break
            time.sleep(0.2)
        else:
            raise TimeoutError(f"backends not healthy in the master: {view}")
        yield Cluster(master, dict(zip(addresses, procs[1:])))
    finally:
        for p in procs:
            p.stop()


def router_for(cluster: Cluster) -> Router:
    return Router(FrontendConfig.from_env({"MASTER_ADDRESS": cluster.master.removeprefix("http://"),
                                           "BACKEND_ADDRESSES": ",".join(cluster.backends),
                                           "CLUSTER_TOKEN": CLUSTER_TOKEN}))


async def run_once(router: Router, ids: list[int], request_id: str) -> tuple[str, int]:
    """Route as the frontend does, generate; → (backend address, reuse_len)."""
    route = await router.route(router.cfg.model_name, ids)
    reuse = -1
    async for outs in router.client(route.address).generate(request_id, ids, PARAMS):
        reuse = outs[-1].aux.reuse_len
    return route.address, reuse


async def explain(cluster: Cluster) -> object:
    """The master's live view, for failure messages."""
    async with httpx.AsyncClient(base_url=cluster.master) as client:
        return (await client.get("/backends")).json()


def test_shared_prefix_returns_to_the_backend_that_cached_it(cluster: Cluster, tokenizer: TextTokenizer) -> None:
    prefix = tokenizer.encode(PREFIX_TEXT)[:320]
    assert len(prefix) == 320

    async def scenario() -> None:
        router = router_for(cluster)
        try:
            first, cold = await run_once(router, prefix + tokenizer.encode(" Who built it?"), "p-1")
            await asyncio.sleep(0.6)  # a few polls: the master now holds the new cache keys
            for i, question in enumerate((" When was that?", " Why did it matter?")):
                ids = prefix + tokenizer.encode(question)
                view = await explain(cluster)
                again, reuse = await run_once(router, ids, f"p-{i + 2}")
                assert again == first, json.dumps(view)
                assert reuse >= 320, reuse  # the 20 full blocks of the shared prefix (block 16)
            assert cold < 320
        finally:
            await router.close()

    asyncio.run(scenario())
    stats = httpx.get(f"{cluster.master}/backends").json()["stats"]
    assert stats["hit_requests"] >= 2 and stats["prefix_hit_rate"] > 0


def test_killed_backend_is_routed_around_within_3s(cluster: Cluster, tokenizer: TextTokenizer) -> None:
    victim, survivor = list(cluster.backends)
    results: list[tuple[float, str | None, str | None]] = []  # (seconds after the kill, routed to, error)

    async def scenario() -> None:
        router = router_for(cluster)
        try:
            await run_once(router, tokenizer.encode("Warm up."), "warm")
            os.killpg(cluster.backends[victim].proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            i = 0
            while time.monotonic() - killed < 5.0:
                i += 1
                ids = tokenizer.encode(f"Request number {i}: say something short.")
                t = time.monotonic() - killed
                try:
                    route = await router.route(router.cfg.model_name, ids)
                    async for _ in router.generate(f"k-{i}", ids, PARAMS):  # the frontend's path, retry included
                        pass
                    results.append((t, route.address, None))
                except Exception as exc:  # noqa: BLE001 - record, assert below
                    results.append((t, None, repr(exc)))
        finally:
            await router.close()

    asyncio.run(scenario())
    late = [r for r in results if r[0] >= 3.0]
    assert late, results
    assert all(err is None for _, _, err in results), results  # none failed, thanks to the retry
    assert all(addr == survivor for _, addr, _ in late), late
    view = {b["name"]: b for b in httpx.get(f"{cluster.master}/backends").json()["backends"]}
    assert not view[victim]["healthy"] and view[survivor]["healthy"]


def test_a_backend_alone_hosts_the_health_and_debug_app_on_start_port(cluster: Cluster,
                                                                      tokenizer: TextTokenizer) -> None:
    """PDFUSION with FRONTEND_SERVER_COUNT=0 answers the health routes and RTP-LLM's /worker_status on
    START_PORT (as RTP-LLM's backends host the frontend's app), with the real engine's task numbers."""
    address = list(cluster.backends)[-1]  # the other one is killed above
    start = int(address.rpartition(":")[2]) - 1
    base = f"http://127.0.0.1:{start}"
    for path in ("/health", "/status", "/GraphService/cm2_status", "/SearchService/cm2_status"):
        assert httpx.get(f"{base}{path}").text == "ok", path
    assert httpx.post(f"{base}/health_check").text == "ok"

    async def one() -> None:
        router = router_for(cluster)
        try:
            async for _ in router.client(address).generate("alone-1", tokenizer.encode("Hello there."), PARAMS):
                pass
        finally:
            await router.close()

    asyncio.run(one())
    st = httpx.post(f"{base}/rtp_llm/worker_status", json={}).json()
    assert (st["server_port"], st["grpc_proto_port"], st["http_proto_port"]) == (start, start + 1, start + 5)
    assert st["role"] == "PDFUSION" and st["alive"] and st["available_concurrency"] > 0
    task = next(t for t in st["finished_task_list"] if t["request_id"] == "alone-1")
    assert task["status"] == "ok" and task["input_length"] > 0 and task["iterate_count"] == 3
