"""`kvyard cluster --backends 2` on a tiny model, hurt the way an operator's bad day would: `kill -9` of one
backend's engine process leaves the rest serving (every request answered by the other backend) and the
launcher restarts it, after which the master routes to it again; SIGSTOP of the other one's engine costs
its requests a first-token deadline and a health probe, then the other backend answers them; a double
SIGTERM then SIGKILL of the launcher leaves no process of the tree and no port held."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.proc_tree import descendants, wait_gone
from tests.support.procs import REPO, free_port_block, stop_groups

READY_TIMEOUT_S = 300  # a tiny model without C++ kernels: ~20 s idle, minutes on a loaded shared machine
DEADLINE_S = 2
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * READY_TIMEOUT_S + 120)]


@dataclass
class Cluster:
    proc: subprocess.Popen[bytes]
    log: Path
    base: int

    @property
    def frontend(self) -> str:
        return f"http://127.0.0.1:{self.base}"

    @property
    def master(self) -> str:
        return f"http://127.0.0.1:{self.base + 10}"

    def backend_grpc(self, k: int) -> str:
        return f"127.0.0.1:{self.base + 20 + 10 * k + 1}"

    @property
    def ports(self) -> list[int]:
        return [self.base, self.base + 10, *(self.base + 20 + 10 * k + d for k in (0, 1) for d in (1, 5))]

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, text: str, timeout_s: float, after: int = 0) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.output()[after:]:
            assert self.proc.poll() is None, f"the cluster exited ({self.proc.returncode}):\n{self.output()[-4000:]}"
            assert time.monotonic() < deadline, f"no {text!r} after {timeout_s} s:\n{self.output()[-4000:]}"
            time.sleep(0.3)

    def engine_pid(self, k: int) -> int:
        """The role process (the multiprocessing child of its part) of backend k."""
        for pid in descendants(self.proc.pid):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if f"START_PORT={self.base + 20 + 10 * k}".encode() in environ and b"spawn_main" in cmdline:
                return pid
        raise AssertionError(f"no engine process for backend {k + 1}")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.tiny_models import save_hf_dir, tiny_model
    return save_hf_dir(tiny_model("qwen2", tie=True, max_positions=512), tmp_path_factory.mktemp("m") / "tiny-qwen2")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[Cluster]:
    base = free_port_block(36)
    log = tmp_path_factory.mktemp("cluster") / "cluster.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLUSTER_TOKEN", "ROLE_TYPE", "START_PORT"))}
    env.update(PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), KVYARD_KERNELS="0",
               FIRST_TOKEN_TIMEOUT_S=str(DEADLINE_S), INTER_TOKEN_TIMEOUT_S=str(DEADLINE_S))
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvyard", "cluster", "--backends", "2", "--port", str(base),
                                 "--model", str(tiny_dir), "--kv-cache-mb", "16", "--drain-grace-s", "2",
                                 "--max-restarts", "2", "--ready-timeout-s", str(READY_TIMEOUT_S)],
                                env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    running = Cluster(proc, log, base)
    try:
        running.wait_for("kvyard cluster is serving", READY_TIMEOUT_S + 20)
        yield running
    finally:
        stop_groups([proc], grace_s=30)
        for pid in descendants(proc.pid):  # the launcher is gone: nothing of its tree may be left
            os.kill(pid, signal.SIGKILL)


def chat(frontend: str, text: str) -> int:
    resp = httpx.post(f"{frontend}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0})
    assert resp.status_code in (200, 503), resp.text
    return resp.status_code


def routed(cluster: Cluster, address: str) -> int:
    backends = httpx.get(f"{cluster.master}/dashboard/state").json()["backends"]
    return next((b["routed_requests"] for b in backends if b["name"] == address and b["healthy"]), -1)


def test_a_killed_backend_is_restarted_while_the_other_serves(cluster: Cluster) -> None:
    mark = len(cluster.output())
    os.kill(cluster.engine_pid(0), signal.SIGKILL)
    statuses = [chat(cluster.frontend, f"Question {i}: what is a loom?") for i in range(8)]
    assert statuses == [200] * 8  # the frontend retries on the other backend, the master routes around it
    cluster.wait_for("backend-1 exited with code 9; restarting it in 1 s", 10, after=mark)
    assert "stopping the cluster" not in cluster.output()[mark:]
    cluster.wait_for("backend-1 is serving again", READY_TIMEOUT_S, after=mark)
    address = cluster.backend_grpc(0)
    deadline = time.monotonic() + 60
    while routed(cluster, address) < 0:  # registered again and polled healthy
        assert time.monotonic() < deadline, httpx.get(f"{cluster.master}/backends").text
        time.sleep(0.3)
    before = routed(cluster, address)
    with ThreadPoolExecutor(4) as pool:  # distinct prompts: the idle, restarted backend takes some
        for round_ in range(10):
            assert list(pool.map(lambda i: chat(cluster.frontend, f"{round_}-{i}: name a dye " * (i + 1)),
                                 range(4))) == [200] * 4
            if routed(cluster, address) > before:
                break
    assert routed(cluster, address) > before, "the master never routed to the restarted backend"


def test_a_stopped_backend_costs_its_requests_a_deadline_not_an_answer(cluster: Cluster) -> None:
    """SIGSTOP: the backend's connections stay open and nothing answers (the issue's hung backend). Requests
    the frontend sent it before the master saw it stop are re-routed after the deadline; later ones go to
    the other backend (tests/frontend/test_deadlines.py pins the re-route itself down)."""
    engine = cluster.engine_pid(1)
    mark = len(cluster.output())
    os.kill(engine, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(4) as pool:
            def timed(i: int) -> tuple[int, float]:
                started = time.monotonic()
                return chat(cluster.frontend, f"Question {i}: what is a shuttle? " * (i + 1)), time.monotonic() - started
            try:
                results = list(pool.map(timed, range(8)))
            except AssertionError as exc:  # which backend each try went to is in the frontend's log lines
                raise AssertionError(f"{exc}\n--- the cluster's log since SIGSTOP ---\n{cluster.output()[mark:][-6000:]}") from None
        assert [status for status, _ in results] == [200] * 8, results
        assert max(took for _, took in results) < 2 * DEADLINE_S + 15, results  # hung 30 s and more before
    finally:
        os.kill(engine, signal.SIGCONT)


def test_double_sigterm_then_sigkill_leaves_no_process_and_no_port(cluster: Cluster) -> None:
    tree = descendants(cluster.proc.pid)
    assert len(tree) >= 6, tree  # master, frontend, two backend parts and their engines
    os.kill(cluster.proc.pid, signal.SIGTERM)
    time.sleep(0.3)
    os.kill(cluster.proc.pid, signal.SIGTERM)
    time.sleep(0.3)
    os.kill(cluster.proc.pid, signal.SIGKILL)
    cluster.proc.wait(timeout=10)
    left = wait_gone(tree, timeout_s=15)
    assert not left, f"outlived the launcher: {left}"
    for port in cluster.ports:
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
