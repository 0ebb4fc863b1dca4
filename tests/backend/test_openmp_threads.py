"""backend/openmp_threads.py: the thread that steps the model stays the process's one OpenMP master.

The failure it prevents: a helper thread (asyncio's executor decoding an image, the event loop converting a
tensor) runs one torch op wide enough for OpenMP, its pool lives on, and from then on libgomp lets the
engine's workers sleep after every parallel region (a served LLaVA prompt 700-980 ms instead of 530-650, the
135M's decode 62 instead of 206 tokens/s). The check counts voluntary context switches (workers falling asleep),
not time, against a control that shows the slowdown's cause with a plain executor."""
from __future__ import annotations

import ast
import asyncio
import os
import resource
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from backend.openmp_threads import _openmp, helper_executor, in_passing_thread, one_openmp_master, serial_torch_here
from tests.support.procs import REPO

CORES = len(os.sched_getaffinity(0))
needs_openmp = pytest.mark.skipif(_openmp() is None or CORES < 2,
                                  reason="needs torch's OpenMP runtime (libgomp / Intel's) and two cores")
REGIONS = 200


@pytest.fixture
def every_core():
    before = torch.get_num_threads()
    torch.set_num_threads(CORES)
    yield
    torch.set_num_threads(before)


def wide_op() -> None:
    """One torch op OpenMP splits over the thread's pool (far past torch's grain of 32,768 elements)."""
    torch.ones(1 << 20).mul_(2.0)


def in_thread(fn):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def engine_like_switches() -> int:
    """Voluntary context switches of this process while a fresh thread runs REGIONS parallel regions back to
    back, as the engine thread runs a step's ops."""
    def run() -> int:
        wide_op()  # its pool exists before counting
        before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
        for _ in range(REGIONS):
            wide_op()
        return resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before
    return in_thread(run)


def test_a_serial_thread_has_width_one_and_others_keep_theirs(every_core: None) -> None:
    if _openmp() is None:
        pytest.skip("torch's OpenMP runtime is not libgomp or Intel's")
    assert in_thread(lambda: (serial_torch_here(), torch.get_num_threads())) == (True, 1)
    assert in_thread(torch.get_num_threads) == CORES  # the default a new thread takes is untouched
    assert torch.get_num_threads() == CORES


@needs_openmp
def test_a_serial_thread_starts_no_openmp_pool(every_core: None) -> None:
    def threads_after_wide_op(serial: bool) -> int:
        if serial:
            serial_torch_here()
        before = set(os.listdir("/proc/self/task"))
        wide_op()
        return len(set(os.listdir("/proc/self/task")) - before)  # threads born, not the net count: in the full
        # suite an earlier test's thread may exit meanwhile (a full run here saw -1)
    assert in_thread(lambda: threads_after_wide_op(False)) == CORES - 1  # the control: a pool of its own
    assert in_thread(lambda: threads_after_wide_op(True)) == 0


def switches_after_helper(kind: str) -> int:
    """In a fresh process set up as a serving backend (the main thread serial, every core for torch): a helper
    thread (`kind`: a plain executor's or helper_executor's) runs one wide op and lives on, then a new thread
    steps REGIONS regions. A process that already ran torch on other threads (this test process) would hide the
    difference, hence the subprocess."""
    script = f"""
import sys, torch
from concurrent.futures import ThreadPoolExecutor
from backend.openmp_threads import helper_executor, serial_torch_here
from tests.backend.test_openmp_threads import engine_like_switches, wide_op
torch.set_num_threads({CORES})
serial_torch_here()
with (ThreadPoolExecutor(1) if {kind!r} == "plain" else helper_executor()) as executor:
    executor.submit(wide_op).result()
    print(engine_like_switches())
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@needs_openmp
def test_helper_threads_leave_the_engine_threads_openmp_awake() -> None:
    """A plain executor thread that ran one wide op puts the next master's workers to sleep after nearly every
    region; helper_executor's threads do not."""
    plain, helper = switches_after_helper("plain"), switches_after_helper("helper")
    # Measured on 2 cores: plain ~800 (4 a region), helper 0-3 idle and 27-86 with two busy loops beside it.
    assert plain >= REGIONS, f"the control did not show sleeping workers ({plain} switches)"
    assert helper <= plain // 4, f"{helper} switches over {REGIONS} regions (a plain executor: {plain})"


def test_one_openmp_master_makes_the_loop_and_its_executor_serial(every_core: None) -> None:
    if _openmp() is None:
        pytest.skip("torch's OpenMP runtime is not libgomp or Intel's")

    async def scenario() -> tuple[int, int, int]:
        one_openmp_master()
        return (torch.get_num_threads(), await asyncio.to_thread(torch.get_num_threads),
                await in_passing_thread(torch.get_num_threads))
    # the loop's thread, an executor thread, the loading thread (every core)
    assert in_thread(lambda: asyncio.run(scenario())) == (1, 1, CORES)


@pytest.mark.parametrize("path,coroutine", [("backend/main.py", "serve_backend"), ("backend/vit_server.py", "serve_vit")])
def test_serving_roles_keep_one_openmp_master(path: str, coroutine: str) -> None:
    """The roles that step a model call one_openmp_master before their first await (loading) and load on a
    passing thread."""
    tree = ast.parse((Path(REPO) / path).read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef) and n.name == coroutine)
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    first_await = min(n.lineno for n in ast.walk(fn) if isinstance(n, ast.Await))
    assert any(c.func.id == "one_openmp_master" and c.lineno < first_await for c in calls)  # type: ignore[attr-defined]
    assert any(c.func.id == "in_passing_thread" for c in calls)  # type: ignore[attr-defined]


def test_in_passing_thread_returns_raises_and_ends() -> None:
    def fail() -> None:
        raise ValueError("no checkpoint")

    async def scenario() -> int:
        assert await in_passing_thread(lambda a, b: a + b, 2, 3) == 5
        with pytest.raises(ValueError, match="no checkpoint"):
            await in_passing_thread(fail)
        return sum(t.name == "load" for t in threading.enumerate())
    assert asyncio.run(scenario()) == 0
