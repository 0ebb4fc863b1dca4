"""A non-streaming answer whose client went away is cancelled, like a stream is: cancelling the work closes
the backend call, which aborts the request there and frees its KV. (Starlette already cancels a
StreamingResponse whose client disconnects; a plain handler it lets run to the end.)"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from kvyard.errors import ErrorCode, RequestError

T = TypeVar("T")


async def _disconnected(request: Request) -> None:
    # The body has been read: the next ASGI message is http.disconnect, whenever the client leaves.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`await work`, unless the client disconnects first: then cancel it and raise CANCELLED."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        task.cancel()  # a no-op when it finished
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        raise RequestError(ErrorCode.CANCELLED, "the client disconnected")
    return task.result()
