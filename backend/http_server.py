"""The backend's HTTP port (START_PORT+5): load reports for the master, Prometheus /metrics, debug switches."""
from __future__ import annotations

import logging
from typing import Any

from fastapi import Body, FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

from backend.engine_loop import EngineLoop
from kvyard.cluster_auth import install_cluster_auth
from kvyard.http_json import JsonBodyByDefault
from kvyard.metrics import add_metrics_route

_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")
# Open without the cluster token: probes, Prometheus and the load report (the numbers /metrics shows).
# The cached block keys (which prompts were sent) and the log level need it.
OPEN_PATHS = ("/health", "/metrics", "/worker_status", "/rtp_llm/worker_status")


def create_backend_http_app(engine_loop: EngineLoop, token: str = "") -> FastAPI:
    app = FastAPI(title="kvyard backend")
    install_cluster_auth(app, token, OPEN_PATHS)
    app.add_middleware(JsonBodyByDefault)
    add_metrics_route(app, engine_loop.metrics.registry)

    async def worker_status(body: dict[str, Any] | None = Body(default=None)) -> dict[str, Any]:
        return engine_loop.worker_status().__dict__

    async def cache_status(body: dict[str, Any] | None = Body(default=None)) -> Any:
        since = (body or {}).get("latest_cache_version", -1)
        if not isinstance(since, int):
            return _bad("latest_cache_version must be an integer")
        return engine_loop.cache_status(since).__dict__

    for path in ("/worker_status", "/rtp_llm/worker_status"):
        app.add_api_route(path, worker_status, methods=["GET", "POST"])
    for path in ("/cache_status", "/rtp_llm/cache_status"):
        app.add_api_route(path, cache_status, methods=["GET", "POST"])

    @app.post("/set_log_level")
    async def set_log_level(body: dict[str, Any] = Body(...)) -> Any:
        level = str(body.get("log_level", "")).upper()
        if level == "TRACE":
            level = "DEBUG"
        if level not in _LEVELS:
            return _bad(f"log_level must be one of {', '.join(_LEVELS)} or TRACE")
        logging.getLogger().setLevel(level)
        return {"status": "ok", "log_level": level}

    @app.get("/health")
    async def health() -> Any:
        if engine_loop.alive:
            return PlainTextResponse("ok")
        return JSONResponse({"error": {"message": "engine is not running", "type": "service_unavailable",
                                       "param": None, "code": None}}, 503)

    return app


def _bad(message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                   "code": "invalid_value"}}, 400)
