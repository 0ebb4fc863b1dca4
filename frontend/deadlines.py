"""Frontend ← backend stream: the first-token and inter-token deadlines (Router.generate wraps every call).

A backend quiet past a deadline is asked whether it is alive (the gRPC health check, answered by its event
loop even while the engine runs a long prefill or the request waits in its queue). A backend that answers
is busy, not hung: the wait goes on, checked again each deadline, up to REQUEST_TIMEOUT_S. One that does
not answer within PROBE_TIMEOUT_S went silent (stopped, wedged, its host gone): `BackendSilent` ends the
wait, and the router re-routes the request when nothing was streamed yet, or ends it with a timeout error.
So a deadline costs a long prompt on a slow CPU nothing, and a hung backend holds a request for about a
deadline plus a probe.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

PROBE_TIMEOUT_S = 3.0  # a live backend answers its health check well within this, even on a loaded CPU


class BackendSilent(Exception):
    """The backend produced nothing for a deadline and then did not answer its health check."""

    def __init__(self, address: str, waited_s: float, first: bool) -> None:
        what = "before its first output" if first else "between outputs"
        super().__init__(f"backend {address} went silent: nothing for {waited_s:.0f} s {what} and no answer "
                         "to a health check")
        self.address = address
        self.first = first      # nothing was streamed yet: the request may go to another backend


async def watched(stream: AsyncIterator[T], address: str, first_s: float, next_s: float,
                  probe: Callable[[float], Awaitable[bool]]) -> AsyncIterator[T]:
    """`stream`'s items, raising BackendSilent when it stays quiet past a deadline (first_s before the
    first item, next_s between items; 0 = no deadline) and `probe(timeout)` says it is not alive.
    Closing this closes `stream` (which cancels its gRPC call)."""
    first = True
    try:
        while True:
            limit = first_s if first else next_s
            try:
                item = await (_next_watched(stream, address, limit, first, probe) if limit > 0 else anext(stream))
            except StopAsyncIteration:
                return
            first = False
            yield item
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


async def _next_watched(stream: AsyncIterator[T], address: str, limit: float, first: bool,
                        probe: Callable[[float], Awaitable[bool]]) -> T:
    pending = asyncio.ensure_future(anext(stream))
    waited = 0.0
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=limit)
            if done:
                return pending.result()
            waited += limit
            if not await probe(min(PROBE_TIMEOUT_S, limit)):
                if pending.done():  # it spoke while we probed
                    return pending.result()
                raise BackendSilent(address, waited, first)
    finally:
        if not pending.done():
            pending.cancel()
            await asyncio.wait({pending})  # let the stream unwind (its gRPC call cancelled) before it is closed
        if pending.done() and not pending.cancelled():
            pending.exception()  # retrieved: it is either returned above or superseded by ours
