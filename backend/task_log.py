"""The backend's running and recently finished requests, for RTP-LLM's /worker_status task lists.

Kept at the gRPC edge (backend/server.py tracks each GenerateStreamCall), on the event loop, so the engine
thread is never asked: a task's numbers come from the AuxInfo its outputs already carry."""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from backend.engine_types import ScoreResult, TokenOutput

FINISHED_KEPT = 256  # finished tasks remembered; a poller that falls further behind gets the newest only


@dataclass
class TaskInfo:
    """One request as RTP-LLM's TaskInfo shows it (times in ms)."""
    request_id: str
    inter_request_id: int    # this backend's own number for it, in arrival order
    input_length: int        # prompt tokens
    prefix_length: int = 0   # of which came from the prefix cache (known after the first output)
    waiting_time_ms: float = 0.0   # queued before its first engine step
    iterate_count: int = 0   # engine steps it has taken part in
    output_length: int = 0   # tokens generated so far (the longest of its sequences)
    is_waiting: bool = True  # no output yet
    start_time_ms: float = 0.0     # wall clock (ms since the epoch) when it arrived
    end_time_ms: float = -1.0      # wall clock when it finished; -1 while running
    status: str = "running"  # running, ok, error or cancelled
    version: int = 0         # the task log's version when it finished: pollers ask for what is newer

    def view(self) -> dict[str, Any]:
        return asdict(self)


class TaskLog:
    """Owned by the event loop of the gRPC server (no locks: one thread touches it)."""

    def __init__(self) -> None:
        self._running: dict[int, TaskInfo] = {}
        self._finished: deque[TaskInfo] = deque(maxlen=FINISHED_KEPT)
        self._numbers = itertools.count(1)
        self.version = 0     # bumps when a task finishes

    @contextmanager
    def track(self, request_id: str, input_length: int) -> Iterator[TaskInfo]:
        task = TaskInfo(request_id, next(self._numbers), input_length, start_time_ms=time.time() * 1e3)
        self._running[task.inter_request_id] = task
        try:
            yield task
        except BaseException as exc:
            task.status = "cancelled" if isinstance(exc, (GeneratorExit, asyncio.CancelledError)) else "error"
            raise
        else:
            if task.status == "running":
                task.status = "ok"
        finally:
            del self._running[task.inter_request_id]
            self.version += 1
            task.version, task.end_time_ms = self.version, time.time() * 1e3
            self._finished.append(task)

    async def observe(self, task: TaskInfo,
                      stream: AsyncIterator[list[TokenOutput | ScoreResult]]
                      ) -> AsyncIterator[list[TokenOutput | ScoreResult]]:
        """Passes `stream` through, reading each step's AuxInfo into `task`."""
        async for outs in stream:
            if outs:
                aux = outs[0].aux
                task.is_waiting = False
                task.prefix_length = aux.reuse_len
                task.waiting_time_ms = aux.wait_time_us / 1e3
                task.iterate_count = max(task.iterate_count, aux.iter_count)
                task.output_length = max(task.output_length, aux.output_len)
            yield outs

    def mark_error(self, task: TaskInfo) -> None:
        """The stream ended with an error answered in-band (the call itself returned normally)."""
        task.status = "error"

    def running(self) -> list[TaskInfo]:
        return list(self._running.values())

    def finished_since(self, version: int) -> list[TaskInfo]:
        """Tasks that finished after `version` (-1 or less: every one still remembered), oldest first."""
        return [t for t in self._finished if t.version > version]
