"""Chaos: `kill -9` of the master under load. A real master process routes for an in-process frontend over
two scripted backends; mid-load the master is killed. Every request is counted: each is answered (the
frontend falls back to its direct backend list, as documented in docs/master-and-pd.md), none errors, none
hangs."""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from kvyard.tokenizer import TextTokenizer
from tests.support.mock_stack import mock_frontend
from tests.support.procs import CLUSTER_TOKEN, RoleProcess, free_port_block
from tests.support.stub_backend import stub_backend

pytestmark = pytest.mark.slow

REQUESTS = 30
BOUND_S = 20.0  # each request ends within this


def test_killing_the_master_under_load_loses_no_request(tokenizer: TextTokenizer, tmp_path: Path) -> None:
    ids = tokenizer.encode(" word") * 10
    with ExitStack() as stack:
        backends = [stack.enter_context(stub_backend(lambda _req: ids, delay_s=0.02))[1] for _ in range(2)]
        addresses = ",".join(b.address for b in backends)
        port = free_port_block(1)
        master = RoleProcess({"ROLE_TYPE": "MASTER", "START_PORT": str(port), "MODEL_NAME": "stub-model",
                              "MASTER_BACKENDS": addresses}, tmp_path / "master.log")
        stack.callback(master.stop)
        master.wait_healthy(f"http://127.0.0.1:{port}/health", timeout_s=120)  # healthy: it has a backend
        front = stack.enter_context(mock_frontend(
            tokenizer, backends[0].address, MASTER_ADDRESS=f"127.0.0.1:{port}", BACKEND_ADDRESSES=addresses,
            CLUSTER_TOKEN=CLUSTER_TOKEN, MODEL_NAME="stub-model", MAX_SEQ_LEN="256",
            # This frontend shares the test's process (and its GIL) with both stub backends and six client
            # threads: on a busy 2-core machine one schedule call can stall past the default 500 ms, and the
            # frontend then routes directly for a second (seen twice in fresh-clone runs: 1 and 5 of the first 8
            # routed). The master's death still fails every call at once (connections refused or reset).
            MASTER_TIMEOUT_MS="5000"))

        def chat(i: int) -> int:
            resp = httpx.post(f"{front.url}/v1/chat/completions", timeout=BOUND_S, json={
                "messages": [{"role": "user", "content": f"Question {i}"}], "max_tokens": 20})
            return resp.status_code if resp.status_code != 200 else 200 * (resp.json()["usage"]["completion_tokens"] == 10)

        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(chat, i) for i in range(REQUESTS)]
            deadline = time.monotonic() + BOUND_S
            while sum(f.done() for f in futures) < 8:  # the master is routing them
                assert time.monotonic() < deadline
                time.sleep(0.02)
            routed = int(httpx.get(f"http://127.0.0.1:{port}/dashboard/state").json()["totals"]["routed"])
            os.kill(master.proc.pid, signal.SIGKILL)
            statuses = [f.result(timeout=BOUND_S + 5) for f in futures]
        assert master.proc.wait(timeout=10) == -signal.SIGKILL
        assert routed >= 8  # the master routed the requests before it died
        assert statuses == [200] * REQUESTS, statuses  # answered, every one complete
        for i in range(4):  # and afterwards, with no master at all
            assert chat(100 + i) == 200
        served = [len(b.servicer.requests) for b in backends]
        assert sum(served) == REQUESTS + 4 and all(served), served  # direct calls spread over both
