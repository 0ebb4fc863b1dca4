"""kvyard/parent_death.py: a process that called die_with_parent dies when its parent does, even by SIGKILL."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kvyard import parent_death
from tests.support.proc_tree import alive, descendants, wait_gone
from tests.support.procs import REPO

pytestmark = pytest.mark.skipif(not parent_death.supported(), reason="Linux only (prctl PR_SET_PDEATHSIG)")

# A parent that starts a child which ties itself to the parent, then sleeps.
PARENT = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
import os, sys, time
from kvyard.parent_death import die_with_parent
die_with_parent(int(sys.argv[1]))
print("tied", flush=True)
time.sleep(600)
''', str(os.getpid())])
time.sleep(600)
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_child_dies_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], env=_env(), stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "tied"
        (child,) = descendants(parent.pid)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        assert not wait_gone([child], timeout_s=10), "the child outlived its parent"
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.wait()


def test_a_parent_already_gone_kills_the_caller_at_once() -> None:
    """The parent died before the call (the kernel only signals deaths after it): the caller dies now."""
    child = subprocess.Popen([sys.executable, "-c", "from kvyard.parent_death import die_with_parent\n"
                              "import time; die_with_parent(1); time.sleep(600)"], env=_env())
    try:
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()


def test_alive_counts_a_zombie_as_gone() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(proc.pid)  # exited, not yet reaped
    proc.wait()
