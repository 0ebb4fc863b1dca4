"""LMTP streams wait for a model that is not ready yet: while no backend of the model can be reached (still
loading its weights, not registered with the master yet), a GENERATE or SCORE stream is told so in one `MSG`
item (the LMTP document's system messages about delays) and tries again until LMTP_WAIT_S has passed;
then the stream's error item says why. Any other failure is not waited for."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from kvyard.errors import ErrorCode, RequestError

T = TypeVar("T")

RETRY_EVERY_S = 0.5   # between tries while the model is not reachable


class ModelWait:
    """One stream's wait: `announce(message)` is called once, when the first try finds no backend."""

    def __init__(self, wait_s: float, model: str, announce: Callable[[str], None]) -> None:
        self.deadline = time.monotonic() + wait_s
        self.wait_s = wait_s
        self.model = model
        self.announce = announce
        self.waited = False

    async def retry_after(self, exc: RequestError) -> None:
        """Returns once it is time to try again; raises `exc` when it is not a wait or the time is up."""
        left = self.deadline - time.monotonic()
        if exc.code is not ErrorCode.UNAVAILABLE or left <= 0:
            raise exc
        if not self.waited:
            self.waited = True
            self.announce(f"model '{self.model}' is not ready ({exc.message}); waiting up to {self.wait_s:g} s "
                          "for it to load")
        await asyncio.sleep(min(RETRY_EVERY_S, left))

    async def call(self, make: Callable[[], Awaitable[T]]) -> T:
        while True:
            try:
                return await make()
            except RequestError as exc:
                await self.retry_after(exc)

    async def stream(self, make: Callable[[], AsyncIterator[T]]) -> AsyncIterator[T]:
        """make()'s items, opened again while it fails before its first item."""
        while True:
            gen = make()
            try:
                first = await anext(gen)
            except StopAsyncIteration:
                return
            except RequestError as exc:
                await gen.aclose()
                await self.retry_after(exc)
                continue
            break
        try:
            yield first
            async for item in gen:
                yield item
        finally:
            await gen.aclose()
