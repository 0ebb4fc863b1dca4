"""A request's CPU work (rendering its chat template, tokenizing its prompts) runs on a small pool of
worker threads, never on the event loop: a big prompt or a slow template then delays only its own
request, while /health, streaming and every other request go on (a render is also bounded in time,
renderers/basic.py, so a worker always comes back)."""
from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

_WORKERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="prepare")


async def off_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(_WORKERS, functools.partial(fn, *args, **kwargs))
