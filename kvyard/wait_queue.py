"""A bounded priority queue of requests waiting for a server with room (the gateway's and the master's).

Lower `priority` goes first (vLLM's and LiteLLM's convention: 0 is the default, negative is urgent);
equal priorities go in arrival order. The queue never decides who fits where: its owner calls
`pump(assign)` whenever room may have appeared, and `assign` says for each waiter, in order, what it
gets (or None: it keeps waiting, and later waiters may still be served, so one model's backlog never
blocks another model's requests). Everything runs on one event loop; the owner is the only caller.
"""
from __future__ import annotations

import asyncio
import bisect
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")  # what a waiter asks for
R = TypeVar("R")  # what it is given


class QueueFull(Exception):
    """The queue already holds its maximum number of waiters."""


@dataclass(eq=False)
class Waiter(Generic[T, R]):
    item: T                               # the request, as the owner describes it
    priority: int                         # lower first
    seq: int                              # arrival order among equal priorities
    future: asyncio.Future[R] = field(repr=False)

    @property
    def order(self) -> tuple[int, int]:
        return (self.priority, self.seq)


class WaitQueue(Generic[T, R]):
    def __init__(self, max_size: int, give_back: Callable[[R], None]) -> None:
        """`give_back(result)` undoes an assignment whose waiter left at the same moment (a client
        that disconnected just as room was found must not hold that room)."""
        self.max_size = max_size
        self._give_back = give_back
        self._waiters: list[Waiter[T, R]] = []   # sorted by (priority, seq)
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._waiters)

    def items(self) -> list[T]:
        """What is waiting, first to be served first."""
        return [w.item for w in self._waiters]

    def push(self, item: T, priority: int = 0) -> Waiter[T, R]:
        if len(self._waiters) >= self.max_size:
            raise QueueFull(f"{len(self._waiters)} requests are already waiting, the limit")
        waiter: Waiter[T, R] = Waiter(item, priority, next(self._seq), asyncio.get_running_loop().create_future())
        bisect.insort(self._waiters, waiter, key=lambda w: w.order)
        return waiter

    def remove(self, waiter: Waiter[T, R]) -> None:
        if waiter in self._waiters:
            self._waiters.remove(waiter)

    def pump(self, assign: Callable[[T], R | None]) -> int:
        """Offer room to every waiter in order; each one `assign` serves leaves the queue. → how many."""
        served = 0
        for waiter in list(self._waiters):
            if waiter.future.done():  # cancelled, and its task has not run yet to leave
                self._waiters.remove(waiter)
                continue
            result = assign(waiter.item)
            if result is None:
                continue
            self._waiters.remove(waiter)
            waiter.future.set_result(result)
            served += 1
        return served

    async def wait(self, waiter: Waiter[T, R], timeout_s: float) -> R:
        """The waiter's assignment, or TimeoutError after `timeout_s`; either way it has left the queue.
        Cancelled (its client went away): it leaves the queue, and an assignment that raced in is given back."""
        timer = asyncio.get_running_loop().call_later(max(0.0, timeout_s), self._expire, waiter)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            self.remove(waiter)
            f = waiter.future
            if f.done() and not f.cancelled() and f.exception() is None:
                self._give_back(f.result())
            raise
        finally:
            timer.cancel()

    def _expire(self, waiter: Waiter[T, R]) -> None:
        if waiter in self._waiters and not waiter.future.done():
            self._waiters.remove(waiter)
            waiter.future.set_exception(TimeoutError("no room within the wait limit"))
