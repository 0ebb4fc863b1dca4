"""The master's hold queue with a scripted policy: no backends, no server."""
from __future__ import annotations

import asyncio

from kvyard.errors import ErrorCode
from master.hold import HoldConfig, ScheduleQueue
from master.policy import Decision, RouteRequest


class Room:
    """A policy stand-in: `free` backends' worth of room; each decision that picks one uses it."""

    def __init__(self, free: int = 0) -> None:
        self.free = free
        self.decided: list[str] = []   # models of the requests that got a backend, in order

    def __call__(self, request: RouteRequest) -> Decision:
        if request.model == "gone":
            return Decision(None, "all_unhealthy", [], ErrorCode.UNAVAILABLE, "no healthy backend")
        if self.free <= 0:
            return Decision(None, "all_busy", [], ErrorCode.OVERLOADED, "busy")
        self.free -= 1
        self.decided.append(request.model)
        return Decision("b1", "shortest_ttft", [])


def req(model: str = "m") -> RouteRequest:
    return RouteRequest(model, [], 8)


def test_room_now_is_answered_at_once_and_other_verdicts_are_never_held() -> None:
    async def scenario() -> None:
        q = ScheduleQueue(HoldConfig(8, 5.0), Room(free=1))
        assert (await q.schedule(req())).chosen == "b1"
        d = await asyncio.wait_for(q.schedule(req("gone")), 0.5)
        assert d.error is ErrorCode.UNAVAILABLE and len(q.queue) == 0

    asyncio.run(scenario())


def test_a_held_request_gets_the_first_room_then_priority_then_arrival_order() -> None:
    async def scenario() -> None:
        room = Room()
        q = ScheduleQueue(HoldConfig(8, 5.0), room)
        tasks = []
        for name, priority in [("first", 0), ("urgent", -1), ("second", 0), ("lazy", 5)]:
            tasks.append(asyncio.ensure_future(q.schedule(req(name), priority)))
            await asyncio.sleep(0.005)
        assert len(q.queue) == 4 and q.pump() == 0   # still no room
        room.free = 3
        assert q.pump() == 3
        decisions = await asyncio.gather(*tasks[:3])
        assert all(d.chosen == "b1" for d in decisions)
        assert room.decided == ["urgent", "first", "second"] and not tasks[3].done()
        tasks[3].cancel()

    asyncio.run(scenario())


def test_held_past_the_wait_is_overloaded_and_past_its_own_timeout_is_504() -> None:
    async def scenario() -> None:
        q = ScheduleQueue(HoldConfig(8, 0.2), Room())
        loop = asyncio.get_running_loop()
        start = loop.time()
        d = await q.schedule(req())
        assert d.error is ErrorCode.OVERLOADED and "MASTER_QUEUE_WAIT_MS" in d.message
        assert 0.15 < loop.time() - start < 1.0
        start = loop.time()
        d = await q.schedule(req(), timeout_ms=50)   # generate_timeout shorter than the hold
        assert d.error is ErrorCode.TIMEOUT and "generate_timeout" in d.message and loop.time() - start < 0.15
        assert len(q.queue) == 0

    asyncio.run(scenario())


def test_a_full_hold_queue_refuses_at_once() -> None:
    async def scenario() -> None:
        q = ScheduleQueue(HoldConfig(1, 5.0), Room())
        held = asyncio.ensure_future(q.schedule(req()))
        await asyncio.sleep(0.01)
        d = await asyncio.wait_for(q.schedule(req()), 0.5)
        assert d.error is ErrorCode.OVERLOADED and "MASTER_QUEUE_MAX" in d.message
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        assert len(q.queue) == 0   # a caller that left is out of the queue

    asyncio.run(scenario())
