"""Start role processes on free loopback ports and always clean them up. Benchmarks stop and wait for
their processes with the same two helpers (stop_groups, wait_healthy)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from kvyard import ports

REPO = Path(__file__).resolve().parents[2]

# Every role process gets this cluster token (as a deployment's Secret would), so the internal calls
# between them (registration, schedule, polls, gRPC) authenticate. Tests calling internal ports use it too.
CLUSTER_TOKEN = "test-cluster-token-0123456789"


def cluster_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {CLUSTER_TOKEN}"}


def cluster_metadata() -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {CLUSTER_TOKEN}"),)


def free_port_block(span: int = 6) -> int:
    """A port p such that p .. p+span-1 are all free on 127.0.0.1 right now (a role's ports)."""
    return ports.free_port_block(span)


def stop_groups(procs: Sequence[subprocess.Popen[Any]], grace_s: float = 15.0) -> None:
    """SIGTERM the process group of each process still running (each was started in a session of its own,
    so its children go too), all at once; SIGKILL a group still there after grace_s."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in running:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def wait_healthy(url: str, proc: subprocess.Popen[Any], timeout_s: float = 120.0,
                 log: Callable[[], str] = lambda: "") -> None:
    """Until GET url answers 200; an error (with the process's log) when the process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered:\n{log()}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s:\n{log()}")


class RoleProcess:
    """`python -m kvyard` (or `argv`, e.g. scripts/run_local.sh) with the given environment, in a session
    of its own (stop() ends its whole process group), its output kept in a log file. CLUSTER_TOKEN is the
    shared test token unless `env` sets CLUSTER_TOKEN ("" = none) or CLUSTER_TOKEN_FILE."""

    def __init__(self, env: Mapping[str, str], log_path: Path, argv: list[str] | None = None,
                 cwd: Path | str = REPO) -> None:
        token = {} if "CLUSTER_TOKEN_FILE" in env else {"CLUSTER_TOKEN": CLUSTER_TOKEN}
        full_env = {**os.environ, "HOST": "127.0.0.1", "PYTHONUNBUFFERED": "1", **token, **env}
        full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv or [sys.executable, "-m", "kvyard"], env=full_env, cwd=cwd,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, url: str, timeout_s: float = 120.0) -> None:
        wait_healthy(url, self.proc, timeout_s, self.log)

    def wait_for_log(self, text: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.log_path.read_text(errors="replace"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{text!r} not in the log after {timeout_s} s:\n{self.log()}")
            time.sleep(0.2)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        stop_groups([self.proc])
        self._log.close()


@contextmanager
def pdfusion(checkpoint: Path, model_name: str, log_path: Path, timeout_s: float = 180,
             env: Mapping[str, str] | None = None) -> Iterator[str]:
    """A PDFUSION launch (backend + frontend) serving checkpoint as model_name (env: more settings); yields its
    base URL."""
    port = free_port_block()
    proc = RoleProcess({"ROLE_TYPE": "PDFUSION", "START_PORT": str(port), "CHECKPOINT_PATH": str(checkpoint),
                        "MODEL_NAME": model_name, **(env or {})}, log_path)
    try:
        proc.wait_healthy(f"http://127.0.0.1:{port}/health", timeout_s=timeout_s)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()
