"""backend/task_log.py: /worker_status's running and finished tasks, with no engine."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from backend.engine_types import TokenOutput
from kvyard.aux_info import AuxInfo
from backend.sampler import Sample
from backend.task_log import FINISHED_KEPT, TaskLog


def _outs(step: int) -> list[TokenOutput]:
    aux = AuxInfo(input_len=5, output_len=step, iter_count=step, reuse_len=3, cost_time_us=0,
                  first_token_cost_time_us=0, wait_time_us=2500)
    return [TokenOutput("r", 0, 7, Sample(7, None, None), None, aux)]


async def _steps(n: int) -> AsyncIterator[list[TokenOutput]]:
    for i in range(1, n + 1):
        yield _outs(i)


def test_a_task_runs_then_finishes_with_its_numbers() -> None:
    log = TaskLog()

    async def run() -> None:
        with log.track("r", 5) as task:
            async for _ in log.observe(task, _steps(3)):
                assert [t.request_id for t in log.running()] == ["r"]
    asyncio.run(run())
    assert log.running() == [] and log.version == 1
    (done,) = log.finished_since(-1)
    assert (done.status, done.prefix_length, done.iterate_count, done.waiting_time_ms) == ("ok", 3, 3, 2.5)
    assert done.output_length == 3 and done.is_waiting is False and done.version == 1
    assert log.finished_since(1) == []


def test_errors_and_cancellations_are_told_apart() -> None:
    log = TaskLog()
    with pytest.raises(RuntimeError):
        with log.track("a", 1):
            raise RuntimeError("boom")
    with pytest.raises(asyncio.CancelledError):
        with log.track("b", 1):
            raise asyncio.CancelledError
    with log.track("c", 1) as task:
        log.mark_error(task)  # answered in-band: the call itself ended normally
    assert [t.status for t in log.finished_since(-1)] == ["error", "cancelled", "error"]


def test_only_the_newest_finished_tasks_are_kept() -> None:
    log = TaskLog()
    for i in range(FINISHED_KEPT + 5):
        with log.track(str(i), 1):
            pass
    kept = log.finished_since(-1)
    assert len(kept) == FINISHED_KEPT and kept[-1].request_id == str(FINISHED_KEPT + 4)
