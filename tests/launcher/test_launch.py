"""The launcher (`python -m kvyard`) refuses bad configuration with one line and exit code 2."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procs import REPO


@pytest.mark.parametrize("env", [{"ROLE_TYPE": "NOPE"}, {"CHECKPOINT_PATH": "/does/not/exist"},
                                 {"ROLE_TYPE": "FRONTEND", "CHECKPOINT_PATH": "/does/not/exist"}],
                         ids=["role", "checkpoint", "frontend-checkpoint"])
def test_launcher_bad_config_exits_2(env: dict[str, str]) -> None:
    full = {k: v for k, v in os.environ.items() if k not in ("ROLE_TYPE", "CHECKPOINT_PATH", "TOKENIZER_PATH")}
    full["PYTHONPATH"] = str(REPO) + os.pathsep + full.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "kvyard"], env={**full, **env}, cwd=Path(REPO),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvyard: error:")
    assert ("NOPE" if env.get("ROLE_TYPE") == "NOPE" else "/does/not/exist") in lines[0]


@pytest.mark.slow
def test_pdfusion_launch_makes_its_own_cluster_token(tmp_path: Path) -> None:
    """No CLUSTER_TOKEN configured: the launcher generates one for its backend and frontend, so chat
    works while nothing else on the machine can call the backend's gRPC or its cache keys."""
    import grpc
    import httpx

    from proto import model_rpc_pb2 as pb
    from proto import model_rpc_pb2_grpc as pb_grpc
    from tests.support.procs import RoleProcess, free_port_block

    port = free_port_block()
    proc = RoleProcess({"ROLE_TYPE": "PDFUSION", "START_PORT": str(port), "KV_CACHE_MB": "64",
                        "TORCH_NUM_THREADS": "1", "CLUSTER_TOKEN": ""}, tmp_path / "pdfusion.log")
    try:
        proc.wait_healthy(f"http://127.0.0.1:{port}/health", timeout_s=180)
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1, resp.text
        with grpc.insecure_channel(f"127.0.0.1:{port + 1}") as channel:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.ModelRpcServiceStub(channel).GetWorkerStatus(pb.WorkerStatusRequestPB(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert httpx.post(f"http://127.0.0.1:{port + 5}/cache_status", json={}).status_code == 401
        assert httpx.get(f"http://127.0.0.1:{port + 5}/health").status_code == 200
    finally:
        proc.stop()
    assert "cluster token generated" in proc.log_path.read_text()


@pytest.mark.slow
def test_pdfusion_stops_frontend_first_and_lets_each_drain_its_grace(tmp_path: Path) -> None:
    """SIGTERM to a PDFUSION launch: the frontend drains while the backend still serves, then the backend
    drains; neither is killed before DRAIN_GRACE_S (the launcher used to kill after 10 s)."""
    import signal
    import threading
    import time

    from launcher import launch
    from tests.support.fake_roles import fake_backend, fake_frontend

    events = tmp_path / "events"
    env = {"DRAIN_GRACE_S": "30", "EVENTS": str(events), "FRONTEND_DRAIN_S": "2", "BACKEND_DRAIN_S": "11"}

    def send_sigterm_when_up() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not events.exists() or events.read_text().count(" up ") < 2):
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)  # process-directed: the main thread, blocked in wait(), gets it

    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    threading.Thread(target=send_sigterm_when_up, daemon=True).start()
    try:
        code = launch._supervise({"backend": fake_backend, "frontend": fake_frontend}, env)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert code == 0
    log = {" ".join(line.split()[:2]): float(line.split()[2]) for line in events.read_text().splitlines()}
    assert log["frontend term"] < log["frontend exit"] < log["backend term"] < log["backend exit"]
    assert log["backend exit"] - log["backend term"] >= 11  # not killed at 10 s


def test_gateway_without_upstreams_exits_2_naming_the_setting() -> None:
    full = {k: v for k, v in os.environ.items() if k not in ("UPSTREAMS",)}
    full["PYTHONPATH"] = str(REPO) + os.pathsep + full.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "kvyard"], env={**full, "ROLE_TYPE": "GATEWAY"}, cwd=Path(REPO),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith("kvyard: error:") and "UPSTREAMS" in proc.stderr


SUPERVISE = """
import sys
from launcher import launch
from tests.support.fake_roles import stubborn_backend, stubborn_frontend
sys.exit(launch._supervise({"backend": stubborn_backend, "frontend": stubborn_frontend},
                           {"DRAIN_GRACE_S": "60", "EVENTS": sys.argv[1]}))
"""


def _stubborn_launch(tmp_path: Path) -> tuple[subprocess.Popen[bytes], list[list[int]]]:
    """A launcher supervising two roles that ignore SIGTERM; per role [its pid, a tied child, an untied one]."""
    import time

    events = tmp_path / "events"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISE, str(events)], env=env, cwd=REPO, start_new_session=True)
    deadline = time.monotonic() + 60
    while not events.exists() or events.read_text().count(" pids ") < 2:
        assert time.monotonic() < deadline and proc.poll() is None, "the roles did not start"
        time.sleep(0.1)
    return proc, [[int(p) for p in line.split()[2:]] for line in events.read_text().splitlines()]


def test_a_second_signal_kills_every_role_and_what_it_started(tmp_path: Path) -> None:
    """The roles ignore SIGTERM (a hung drain): the second signal kills each role's process group at once."""
    import signal
    import time

    from tests.support.proc_tree import wait_gone

    proc, roles = _stubborn_launch(tmp_path)
    pids = [pid for role in roles for pid in role]
    try:
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
        assert not wait_gone(pids, timeout_s=10)  # the untied children too: their role's group was killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_roles_die_with_a_killed_launcher(tmp_path: Path) -> None:
    """SIGKILL of the launcher, which can do nothing about it: its role processes die too (parent-death
    signal), and the children they tied to themselves (no role is left holding ports under PID 1)."""
    import signal

    from tests.support.proc_tree import wait_gone

    proc, roles = _stubborn_launch(tmp_path)
    pids = [pid for role in roles for pid in role[:2]]
    untied = [role[2] for role in roles]
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        left = wait_gone(pids, timeout_s=10)
        assert not left, f"outlived the launcher: {left}"
    finally:
        for pid in pids + untied:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
