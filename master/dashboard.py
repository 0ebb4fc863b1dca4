"""The master's live dashboard: GET /dashboard (one self-contained HTML page, no CDN), fed by
GET /dashboard/state (a JSON snapshot) and GET /dashboard/events (the same snapshot as Server-Sent Events,
once a second). Read-only, like /backends: open without the cluster token."""
from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, StreamingResponse

from master.registry import Registry

PATHS = ("/dashboard", "/dashboard/state", "/dashboard/events")
HISTORY_S = 300          # routing decisions by reason, second by second, this far back
EVENT_INTERVAL_S = 1.0
PAGE = Path(__file__).with_name("dashboard.html")


class DecisionHistory:
    """Routing decisions per second by reason, from the registry's running counts. Owned by the task
    that calls `sample` once a second (the master's event loop)."""

    def __init__(self, registry: Registry, wall: Callable[[], float] = time.time) -> None:
        self.registry = registry
        self.wall = wall
        self.points: deque[tuple[float, dict[str, int]]] = deque(maxlen=HISTORY_S)
        self._last: dict[str, int] = {}

    def sample(self) -> None:
        now = dict(self.registry.stats.decisions)
        delta = {reason: n - self._last.get(reason, 0) for reason, n in now.items() if n != self._last.get(reason, 0)}
        self._last = now
        self.points.append((self.wall(), delta))

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(EVENT_INTERVAL_S)


def snapshot(registry: Registry, history: DecisionHistory, now: float) -> dict[str, Any]:
    """Everything the page shows, as plain JSON."""
    backends = []
    for b in registry.summaries(now):
        backends.append({
            "name": b.name, "model": b.model, "role": b.role, "healthy": b.healthy, "running": b.running,
            "waiting": b.waiting, "kv_usage": 1.0 - b.free_blocks / b.total_blocks if b.total_blocks else 0.0,
            "routed_requests": b.routed_requests, "prefix_queries": b.routed_prompt_tokens,
            "prefix_hits": b.routed_hit_tokens,
            "prefix_hit_rate": b.routed_hit_tokens / b.routed_prompt_tokens if b.routed_prompt_tokens else 0.0,
            "step_latency_ms": round(b.step_latency_ms, 2), "prefill_tokens_per_s": round(b.prefill_tokens_per_s, 1),
            "poll_latency_ms": round(b.poll_latency_ms, 2), "cached_blocks": b.cached_blocks, "error": b.error})
    st = registry.stats
    return {"time": history.wall(), "backends": backends,
            "totals": {"routed": st.requests, "rejected": st.rejected, "prompt_tokens": st.prompt_tokens,
                       "hit_tokens": st.hit_tokens,
                       "prefix_hit_rate": st.hit_tokens / st.prompt_tokens if st.prompt_tokens else 0.0},
            "decisions": dict(st.decisions),
            "history": [[round(t, 3), d] for t, d in history.points]}


def dashboard_routes(registry: Registry, history: DecisionHistory, clock: Callable[[], float]) -> APIRouter:
    router = APIRouter()
    page = PAGE.read_text(encoding="utf-8")

    @router.get("/dashboard", include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        # The page loads nothing from elsewhere; the policy keeps it that way in the browser too.
        return HTMLResponse(page, headers={"Content-Security-Policy": "default-src 'self'; style-src 'unsafe-inline'; "
                                           "script-src 'unsafe-inline'; img-src 'self' data:",
                                           "Cache-Control": "no-store"})

    @router.get("/dashboard/state")
    async def state() -> dict[str, Any]:
        return snapshot(registry, history, clock())

    @router.get("/dashboard/events")
    async def events(request: Request) -> StreamingResponse:
        async def stream() -> AsyncIterator[str]:
            while not await request.is_disconnected():
                yield f"event: state\ndata: {json.dumps(snapshot(registry, history, clock()))}\n\n"
                await asyncio.sleep(EVENT_INTERVAL_S)
        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    return router
