"""A request's CPU work (rendering its chat template, tokenizing its prompts) runs on a small pool of
worker threads, never on the event loop: a big prompt or a slow template then delays only its own
request, while /health, streaming and every other request go on (a render is also bounded in time,
renderers/basic.py, so a worker always comes back).

Checking a constraint's grammar with llguidance (frontend/guided.py) has a pool of its own, smaller, with a
time budget: six 1 MB grammars once held all four preparation threads for seconds and a plain chat waited
behind them. Now they wait for each other, never for a chat."""
from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvyard.limits import GRAMMAR_BUDGET_S  # a grammar not checked by then (queued or running) fails its request

T = TypeVar("T")

_WORKERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="prepare")
_GRAMMAR_WORKERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")


async def off_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(_WORKERS, functools.partial(fn, *args, **kwargs))


async def off_loop_grammar(fn: Callable[[], T], budget_s: float | None = None) -> T:
    """fn() on the grammar pool within GRAMMAR_BUDGET_S: past it, a 429 when it never got a worker (retry
    later), a 400 when it ran that long (the thread finishes on its own; the pool stays bounded)."""
    from kvyard.errors import ErrorCode, RequestError

    budget = GRAMMAR_BUDGET_S if budget_s is None else budget_s
    future = _GRAMMAR_WORKERS.submit(fn)
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), budget)
    except asyncio.TimeoutError:
        if future.cancel():
            raise RequestError(ErrorCode.OVERLOADED, f"the grammar could not be checked within {budget:g} s: other "
                               "big grammars hold the grammar workers; retry later") from None
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"checking the grammar took more than {budget:g} s "
                           "(the grammar budget); simplify it") from None
