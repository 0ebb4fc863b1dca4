"""The gateway's HTTP routes: any POST /v1/... is proxied by its `model`; /v1/models is every upstream's
models; /health, /upstreams, /dashboard (a page polling /upstreams) and /metrics describe the gateway itself.

Request path: this file reads the body and builds a Ticket (model, priority, prefix keys) →
gateway/dispatch.py leases an upstream (or queues) → gateway/proxy.py sends the request's bytes and
streams the response's bytes back.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response

from gateway.config import ROUTING_PREFIX, GatewayConfig
from gateway.dispatch import Dispatcher, Ticket
from gateway.health import HealthLoop
from gateway.metrics import GatewayMetrics
from gateway.prefix import prefix_keys, request_text
from gateway.proxy import Incoming, Proxy
from gateway.upstreams import UpstreamTable
from kvyard.disconnect import cancel_on_disconnect
from kvyard.errors import ErrorCode, RequestError
from kvyard.http_errors import error_body, install_error_handlers
from kvyard.http_json import OriginCheck
from kvyard.metrics import HttpMetricsMiddleware, add_metrics_route

PRIORITY_HEADER = "x-priority"
DASHBOARD = Path(__file__).with_name("dashboard.html")


def create_gateway_app(cfg: GatewayConfig, clock: Callable[[], float] = time.monotonic) -> FastAPI:
    table = UpstreamTable(cfg)
    dispatcher = Dispatcher(cfg, table, clock)
    metrics = GatewayMetrics()
    metrics.watch(lambda: table.upstreams.values(), lambda: len(dispatcher.queue))
    proxy = Proxy(cfg, table, dispatcher, metrics, clock)
    health = HealthLoop(table, dispatcher.pump)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await health.check_all()  # discover the models before the first request
        task = asyncio.create_task(health.run())
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await proxy.close()

    app = FastAPI(title="kvyard gateway", lifespan=lifespan)
    app.state.table = table
    app.state.dispatcher = dispatcher
    install_error_handlers(app)
    app.add_middleware(HttpMetricsMiddleware, metrics=metrics)
    # The frontend's rule: a browser on another site must not drive the upstreams through the gateway.
    app.add_middleware(OriginCheck, allowed_origins=cfg.cors_allow_origins)
    if cfg.cors_allow_origins:  # outermost: answers the browsers' preflights for the allowed origins
        app.add_middleware(CORSMiddleware, allow_origins=list(cfg.cors_allow_origins), allow_methods=["*"],
                           allow_headers=["*"])
    add_metrics_route(app, metrics.registry)

    @app.post("/v1/{endpoint:path}")
    async def proxied(endpoint: str, request: Request) -> Response:
        arrived = clock()
        body = await _read_body(request, cfg.max_body_bytes)
        ticket = _ticket(cfg, table, body, request.headers.get(PRIORITY_HEADER))
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        incoming = Incoming(request.method, target, list(request.headers.raw), body, ticket, arrived)
        # A client that leaves while queued or before the upstream answers frees its place at once.
        return await cancel_on_disconnect(request, proxy.handle(incoming))

    @app.get("/v1/models")
    @app.get("/models")
    async def models() -> dict[str, Any]:
        now = clock()
        return {"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "kvyard-gateway",
             "healthy_upstreams": sum(u.routable(now) for u in table.serving(m))} for m in table.models()]}

    @app.get("/upstreams")
    async def upstreams() -> dict[str, Any]:
        return {"upstreams": table.view(clock()), "queued": len(dispatcher.queue),
                "queued_models": [t.model for t in dispatcher.queue.items()]}

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(DASHBOARD.read_text())

    async def health_route() -> Response:
        if table.any_healthy():
            return PlainTextResponse("ok")
        return JSONResponse(error_body("no healthy upstream", "service_unavailable"), 503, headers={"Retry-After": "1"})

    for path in ("/health", "/status"):
        app.add_api_route(path, health_route, methods=["GET"])
    return app


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(ErrorCode.PAYLOAD_TOO_LARGE, f"the request body is over {limit} bytes (MAX_BODY_BYTES)")
        chunks.append(chunk)
    return b"".join(chunks)


def _ticket(cfg: GatewayConfig, table: UpstreamTable, raw: bytes, priority_header: str | None) -> Ticket:
    """What the dispatcher needs from the body; the body itself goes upstream untouched."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError(ErrorCode.INVALID_ARGUMENT, "the request body must be a JSON object")
    model = body.get("model")
    if model is None:
        known = table.models()
        if len(known) != 1:  # with one model there is only one place it can go
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "model is required: the upstreams serve "
                               f"{', '.join(known) or 'no models yet'}", "model")
        model = known[0]
    if not isinstance(model, str) or not model:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, "model must be a non-empty string", "model")
    priority = _priority(priority_header, body.get("priority"))
    if cfg.routing != ROUTING_PREFIX:
        return Ticket(model, priority=priority)
    text = request_text(body)
    keys = prefix_keys(text, model, cfg.prefix_block_bytes, cfg.prefix_max_bytes)
    return Ticket(model, tuple(keys), max(1, min(len(text.encode(errors="surrogatepass")), cfg.prefix_max_bytes)),
                  priority)


def _priority(header: str | None, field: Any) -> int:
    """X-Priority header, else the body's `priority` (vLLM's field): an integer, lower served first."""
    if header is not None:
        try:
            return int(header.strip())
        except ValueError:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"X-Priority must be an integer, got {header!r}",
                               "priority") from None
    if field is None:
        return 0
    if isinstance(field, bool) or not isinstance(field, int):
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"priority must be an integer, got {field!r}", "priority")
    return field
