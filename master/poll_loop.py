"""Feeds the routing policy: polls every known backend's worker status and cache keys, every ~150 ms."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from master.backend_poller import BackendPoller, StatusError
from master.registry import Registry

log = logging.getLogger("kvyard.master")


class PollLoop:
    """One poll per backend at a time, so a hung backend delays nobody else."""

    def __init__(self, registry: Registry, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.cfg = registry.cfg
        self.clock = clock
        self._pollers: dict[str, BackendPoller] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    async def run(self) -> None:
        try:
            while True:
                await self.tick()
                await asyncio.sleep(self.cfg.poll_interval_s)
        finally:
            for task in self._tasks.values():
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
            await asyncio.gather(*(p.close() for p in self._pollers.values()), return_exceptions=True)

    async def tick(self) -> None:
        """Start a poll for every backend without one in flight; drop the channels of removed ones."""
        self.registry.forget_stale(self.clock())
        names = set(self.registry.backends)
        for name in names:
            task = self._tasks.get(name)
            if task is None or task.done():
                self._tasks[name] = asyncio.create_task(self.poll(name))
        for name in [n for n in self._pollers if n not in names]:
            log.info("backend %s removed", name)
            task = self._tasks.pop(name, None)
            if task is not None:
                task.cancel()
            await self._pollers.pop(name).close()

    async def poll(self, name: str) -> None:
        poller = self._pollers.get(name)
        if poller is None:
            poller = self._pollers[name] = BackendPoller(name, self.cfg.poll_timeout_s, self.cfg.cluster_token)
        was_healthy = self._healthy(name)
        sent = self.clock()
        try:
            status = await poller.worker_status()
            self.registry.apply_status(name, status, sent, self.clock())
            since = self.registry.needs_cache(name)
            if since is not None:
                self.registry.apply_cache(name, await poller.cache_status(since))
        except StatusError as exc:
            self.registry.mark_failed(name, str(exc), exc.definitive)
        except Exception as exc:  # a poll bug must never take the master down
            log.exception("polling %s failed", name)
            self.registry.mark_failed(name, f"poll error: {exc!r}", definitive=True)
        now_healthy = self._healthy(name)
        if now_healthy != was_healthy:
            state = self.registry.backends.get(name)
            log.info("backend %s is %s%s", name, "healthy" if now_healthy else "UNHEALTHY",
                     f" ({state.error})" if state is not None and state.error else "")

    def _healthy(self, name: str) -> bool:
        state = self.registry.backends.get(name)
        return state is not None and self.registry.healthy(state, self.clock())
