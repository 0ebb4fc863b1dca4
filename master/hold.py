"""Master schedule call → a decision, holding the request while no backend has room (instead of a 429).

A request the policy finds "all busy" waits (kvyard.wait_queue: at most MASTER_QUEUE_MAX, lower
request_priority first, then arrival order) and is decided again after every poll round, as the
backends' loads change. It is answered as soon as a backend can take it; when MASTER_QUEUE_WAIT_MS
passes it gets the 429 it would have had, and when its own generate_timeout passes first, a 504.
Any other verdict on a later try (the model's backends went unhealthy) is its answer at once.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvyard.errors import ErrorCode
from kvyard.wait_queue import QueueFull, WaitQueue
from master.policy import Decision, RouteRequest


@dataclass(frozen=True)
class HoldConfig:
    max_waiting: int      # MASTER_QUEUE_MAX: requests held at once; more get the 429 at once
    wait_s: float         # MASTER_QUEUE_WAIT_MS: longest a request is held


class ScheduleQueue:
    """Owned by the master's event loop. `decide(request)` runs the policy on the current loads and
    records the choice when there is one (so the next waiter of the same round sees that load)."""

    def __init__(self, cfg: HoldConfig, decide: Callable[[RouteRequest], Decision]) -> None:
        self.cfg = cfg
        self.decide = decide
        # A choice that raced its waiter's cancel needs no undoing: the routed load it added expires at
        # the backend's next poll, which reports what really arrived.
        self.queue: WaitQueue[RouteRequest, Decision] = WaitQueue(cfg.max_waiting, lambda _: None)

    async def schedule(self, request: RouteRequest, priority: int = 0, timeout_ms: int = 0) -> Decision:
        """The policy's decision now, or after holding the request while every backend is busy."""
        if not any(r.model == request.model for r in self.queue.items()):  # no jumping the queue
            decision = self.decide(request)
            if not _busy(decision):
                return decision
        own_deadline = 0 < timeout_ms / 1000 < self.cfg.wait_s
        wait_s = timeout_ms / 1000 if own_deadline else self.cfg.wait_s
        try:
            waiter = self.queue.push(request, priority)
        except QueueFull as exc:
            return _refusal("queue_full", ErrorCode.OVERLOADED, f"every backend serving '{request.model}' is busy "
                            f"and {exc} (MASTER_QUEUE_MAX); retry shortly")
        try:
            return await self.queue.wait(waiter, wait_s)
        except TimeoutError:
            if own_deadline:
                return _refusal("generate_timeout", ErrorCode.TIMEOUT, f"no backend serving '{request.model}' had room "
                                f"within the request's generate_timeout of {timeout_ms} ms")
            return _refusal("held_too_long", ErrorCode.OVERLOADED, f"no backend serving '{request.model}' had room "
                            f"within {self.cfg.wait_s * 1000:.0f} ms (MASTER_QUEUE_WAIT_MS); retry shortly")

    def pump(self) -> int:
        """Decide again for every held request, in order (after a poll round)."""
        return self.queue.pump(lambda request: None if _busy(d := self.decide(request)) else d)


def _busy(decision: Decision) -> bool:
    return decision.chosen is None and decision.error is ErrorCode.OVERLOADED


def _refusal(reason: str, code: ErrorCode, message: str) -> Decision:
    return Decision(None, reason, [], code, message)
