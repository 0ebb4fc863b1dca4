"""Role processes never import from the directory kvyard was started in (launcher/safe_path.py): with a
poisoned `resource.py` and `json.py` there (the master's metrics import `resource`, every role `json`),
`python -m kvyard` and the roles a launcher spawns start as usual. PYTHONPATH (the worktree, in tests)
keeps working."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support.procs import REPO, RoleProcess, free_port_block

POISON = "raise SystemExit('poisoned {name}.py from the start directory was imported')\n"
SUPERVISE = """
import sys
from launcher import launch
from tests.support.fake_roles import fake_backend, fake_frontend
if __name__ == "__main__":
    sys.exit(launch._supervise({"backend": fake_backend, "frontend": fake_frontend},
                               {"DRAIN_GRACE_S": "5", "EVENTS": sys.argv[1], "BACKEND_DRAIN_S": "0",
                                "FRONTEND_DRAIN_S": "0"}))
"""


def poisoned(tmp_path: Path) -> Path:
    start = tmp_path / "shared"
    start.mkdir()
    for name in ("resource", "json", "threading", "socket"):
        (start / f"{name}.py").write_text(POISON.format(name=name))
    return start


def test_a_role_started_from_a_poisoned_directory_imports_nothing_from_it(tmp_path: Path) -> None:
    port = free_port_block()
    proc = RoleProcess({"ROLE_TYPE": "MASTER", "START_PORT": str(port)}, tmp_path / "master.log",
                       cwd=poisoned(tmp_path))
    try:
        # /health is a 503 while the master has no backend
        proc.wait_healthy(f"http://127.0.0.1:{port}/metrics", timeout_s=120)
        assert httpx.get(f"http://127.0.0.1:{port}/backends").status_code == 200
    finally:
        proc.stop()
    assert "poisoned" not in proc.log_path.read_text()


def test_the_roles_a_launcher_spawns_import_nothing_from_it(tmp_path: Path) -> None:
    """multiprocessing starts each role with `python -c`, which would put the start directory first."""
    events = tmp_path / "events"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # A script elsewhere, as the `kvyard` console script is: its own directory, not the start one, on sys.path.
    script = tmp_path / "bin" / "launch.py"
    script.parent.mkdir()
    script.write_text(SUPERVISE)
    proc = subprocess.Popen([sys.executable, str(script), str(events)], env=env, cwd=poisoned(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not events.exists() or events.read_text().count(" up ") < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout and proc.stdout.read().decode()
            time.sleep(0.1)
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0].decode()
    assert "poisoned" not in out, out
