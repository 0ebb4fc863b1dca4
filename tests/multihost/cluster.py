"""The cluster the multi-host tests run: every role on a host of its own (tests/multihost/netns.py), set up the
way deploy/kubernetes sets it up (the same variables, ports and DNS names; tests/test_multihost_manifests.py
compares them), with the embedded model and a test-sized KV cache."""
from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.multihost.netns import Host, Network
from tests.support.procs import CLUSTER_TOKEN, RoleProcess, stop_groups

MASTER_PORT = 8090       # the master's HTTP (its Service's port)
START_PORT = 8088        # frontends' HTTP; a backend's base: gRPC 8089, HTTP 8093
BACKEND_GRPC = START_PORT + 1
BACKEND_HTTP = START_PORT + 5
MASTER_DNS = "kvyard-master"      # the master's Service
BACKENDS_DNS = "kvyard-backends"  # the backends' headless Service: one address per backend pod

# Per Deployment of deploy/kubernetes, the variables its container sets, as this harness sets them.
# CLUSTER_TOKEN comes from a Secret there; SIZED values differ (a 2-core test machine, not a 4-CPU pod).
MANIFEST_ENV: dict[str, dict[str, str]] = {
    "kvyard-master": {"ROLE_TYPE": "MASTER", "HOST": "0.0.0.0", "START_PORT": str(MASTER_PORT),
                      "CLUSTER_TOKEN": CLUSTER_TOKEN, "MASTER_BACKEND_DNS": f"{BACKENDS_DNS}:{BACKEND_GRPC}"},
    "kvyard-backend": {"ROLE_TYPE": "PDFUSION", "FRONTEND_SERVER_COUNT": "0", "HOST": "0.0.0.0",
                       "START_PORT": str(START_PORT), "CLUSTER_TOKEN": CLUSTER_TOKEN, "KV_CACHE_MB": "64",
                       "TORCH_NUM_THREADS": "1", "DRAIN_GRACE_S": "5"},
    "kvyard-prefill": {"ROLE_TYPE": "PREFILL", "HOST": "0.0.0.0", "START_PORT": str(START_PORT),
                       "CLUSTER_TOKEN": CLUSTER_TOKEN, "KV_CACHE_MB": "64", "TORCH_NUM_THREADS": "1",
                       "DRAIN_GRACE_S": "5"},
    "kvyard-decode": {"ROLE_TYPE": "DECODE", "HOST": "0.0.0.0", "START_PORT": str(START_PORT),
                      "CLUSTER_TOKEN": CLUSTER_TOKEN, "KV_CACHE_MB": "64", "TORCH_NUM_THREADS": "1",
                      "DRAIN_GRACE_S": "5"},
    "kvyard-frontend": {"ROLE_TYPE": "FRONTEND", "HOST": "0.0.0.0", "START_PORT": str(START_PORT),
                        "CLUSTER_TOKEN": CLUSTER_TOKEN, "MASTER_ADDRESS": f"{MASTER_DNS}:{MASTER_PORT}",
                        "BACKEND_ADDRESS": f"{BACKENDS_DNS}:{BACKEND_GRPC}", "DRAIN_GRACE_S": "5"},
}
SIZED = frozenset({"KV_CACHE_MB", "TORCH_NUM_THREADS", "DRAIN_GRACE_S"})

# host name → the Deployment whose pod it stands for
HOSTS = {"master": "kvyard-master", "pd1": "kvyard-backend", "pd2": "kvyard-backend",
         "prefill": "kvyard-prefill", "decode": "kvyard-decode",
         "fe1": "kvyard-frontend", "fe2": "kvyard-frontend"}
BACKENDS = ("pd1", "pd2", "prefill", "decode")
FRONTENDS = ("fe1", "fe2")
READY_TIMEOUT_S = 300  # five processes load at once on a shared 2-core machine


@dataclass
class MultiHostCluster:
    net: Network
    logs: Path
    procs: dict[str, RoleProcess] = field(default_factory=dict)

    def host(self, name: str) -> Host:
        return self.net.hosts[name]

    def frontend_url(self, name: str) -> str:
        return f"http://{self.host(name).address}:{START_PORT}"

    @property
    def master_url(self) -> str:
        return f"http://{self.host('master').address}:{MASTER_PORT}"

    def backend_http(self, name: str) -> str:
        return f"http://{self.host(name).address}:{BACKEND_HTTP}"

    def backend_grpc(self, name: str) -> str:
        return f"{self.host(name).address}:{BACKEND_GRPC}"

    def start(self, name: str, env: dict[str, str]) -> RoleProcess:
        """`python -m kvyard` on that host with `env` (HOST and the cluster token as env says)."""
        argv = self.host(name).argv(sys.executable, "-m", "kvyard")
        proc = RoleProcess(env, self.logs / f"{name}.log", argv=argv)
        self.procs[name] = proc
        return proc

    def backends_view(self) -> dict[str, dict[str, Any]]:
        """The master's view (its dashboard's: health, errors, routed requests and prefix hits), by host name."""
        view = httpx.get(f"{self.master_url}/dashboard/state", timeout=5).json()
        by_address = {h.address: n for n, h in self.net.hosts.items()}
        out = {}
        for b in view["backends"]:
            address = b["name"].rsplit(":", 1)[0]
            out[by_address.get(address, address)] = b
        return out

    def worker_status(self, name: str) -> dict[str, Any]:
        return httpx.get(f"{self.backend_http(name)}/worker_status", timeout=5).json()

    def wait_for(self, what: str, check: Any, timeout_s: float, interval_s: float = 0.2) -> float:
        """Polls check() until true; the seconds it took. An AssertionError naming `what` after timeout_s."""
        start = time.monotonic()
        last: Any = None
        while time.monotonic() - start < timeout_s:
            try:
                last = check()
                if last:
                    return time.monotonic() - start
            except httpx.HTTPError as exc:
                last = exc
            time.sleep(interval_s)
        raise AssertionError(f"{what}: not within {timeout_s} s (last: {last!r})")

    def stop(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None:
            proc.stop()

    def close(self) -> None:
        """Every process at once (one by one, each drain would add up)."""
        stop_groups([p.proc for p in self.procs.values()], grace_s=10)
        self.procs.clear()


@contextmanager
def multihost_cluster(logs: Path) -> Iterator[MultiHostCluster]:
    """Every host, every process, torn down whatever happens (processes first, then the network)."""
    net = Network()
    cluster = MultiHostCluster(net, logs)
    try:
        for name in HOSTS:
            net.add_host(name)
        net.add_host("intruder")  # no role: a process without the token runs there
        net.add_host("liar")      # a backend advertising an address nobody holds
        net.write_hosts({MASTER_DNS: ["master"], BACKENDS_DNS: list(BACKENDS)})
        started = time.monotonic()
        for name, deployment in HOSTS.items():
            cluster.start(name, dict(MANIFEST_ENV[deployment]))
        for name in BACKENDS:
            cluster.procs[name].wait_healthy(f"{cluster.backend_http(name)}/health", READY_TIMEOUT_S)
        cluster.procs["master"].wait_healthy(f"{cluster.master_url}/health", 60)
        for name in FRONTENDS:
            cluster.procs[name].wait_healthy(f"{cluster.frontend_url(name)}/health", 60)
        cluster.wait_for("every backend found by DNS and healthy",
                         lambda: all(b.get("healthy") for b in cluster.backends_view().values())
                         and set(cluster.backends_view()) == set(BACKENDS), 30)
        print(f"multi-host cluster up in {time.monotonic() - started:.1f} s; logs in {logs}")
        yield cluster
    finally:
        cluster.close()
        net.close()
