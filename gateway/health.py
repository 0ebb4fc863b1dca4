"""Discovery and health: every upstream's GET /v1/models, healthy or not, every health interval.

200 with a model list: healthy, serving those models. 503 (the seed's "all models unavailable"), any
other status, a malformed body or no answer in time: unhealthy. Each round ends by offering the
queue whatever became free.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx

from gateway.upstreams import UpstreamTable

log = logging.getLogger("kvyard.gateway")


async def check_upstream(client: httpx.AsyncClient, url: str) -> tuple[list[str] | None, str | None]:
    """→ (model ids, None) or (None, why it is unhealthy)."""
    try:
        resp = await client.get(f"{url}/v1/models")
    except httpx.HTTPError as exc:
        return None, f"GET /v1/models: {type(exc).__name__}: {exc}"
    if resp.status_code != 200:
        return None, f"GET /v1/models answered {resp.status_code}"
    try:
        data = resp.json()["data"]
        return [str(m["id"]) for m in data], None
    except (ValueError, KeyError, TypeError) as exc:
        return None, f"GET /v1/models: malformed list ({type(exc).__name__}: {exc})"


class HealthLoop:
    def __init__(self, table: UpstreamTable, on_change: Callable[[], object]) -> None:
        self.table = table
        self.on_change = on_change  # the dispatcher's pump
        cfg = table.cfg
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(cfg.health_timeout_s, connect=cfg.connect_timeout_s))

    async def check_all(self) -> None:
        urls = list(self.table.upstreams)
        results = await asyncio.gather(*(check_upstream(self.client, url) for url in urls))
        for url, (models, error) in zip(urls, results):
            self.table.record_check(url, models, error)
        self.on_change()

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.table.cfg.health_interval_s)
                await self.check_all()
        finally:
            await self.client.aclose()
