"""Processes a benchmark starts (kvyard roles, peer routers): each in its own session with its log in one
temporary folder, stopped by pid (SIGTERM to its process group, SIGKILL after a grace)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.procs import stop_groups, wait_healthy  # noqa: E402  (the tests' helpers, shared)

__all__ = ["ProcessGroup", "REPO", "settle", "stop_groups", "wait_healthy"]


class ProcessGroup:
    def __init__(self, prefix: str, cluster_token: str) -> None:
        self.logs = Path(tempfile.mkdtemp(prefix=prefix))
        self.token = cluster_token
        self.procs: list[subprocess.Popen[bytes]] = []
        self.names: list[str] = []

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        """argv with os.environ plus env, output into logs/<name>.log."""
        log = open(self.logs / f"{name}.log", "wb")
        proc = subprocess.Popen(argv, env={**os.environ, **env}, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        self.names.append(name)
        return proc

    def kvyard(self, name: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        """`python -m kvyard` on loopback with the cluster token, env choosing the role."""
        return self.spawn(name, [sys.executable, "-m", "kvyard"],
                          {"HOST": "127.0.0.1", "PYTHONPATH": str(REPO), "CLUSTER_TOKEN": self.token, **env})

    def stop(self, grace_s: float = 20.0) -> None:
        stop_groups(self.procs, grace_s)
        self.procs.clear()
        self.names.clear()


def settle(idle_below: float = 0.1, window_s: float = 0.1, cap_s: float = 3.0) -> None:
    """Wait (untimed) until the machine idles: the system that ran before may still hold a core. vLLM's
    worker measured one core busy for ~1 s after each request; OpenMP threads spin-wait after a parallel
    region. Either would be charged to the next system."""
    def busy_total() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
        return ticks[0] + ticks[1] + ticks[2], sum(ticks)
    deadline = time.monotonic() + cap_s
    while time.monotonic() < deadline:
        (b0, t0), _ = busy_total(), time.sleep(window_s)
        b1, t1 = busy_total()
        if (b1 - b0) <= idle_below * max(1, t1 - t0):
            return
