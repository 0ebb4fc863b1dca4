"""The backend's HTTP port (START_PORT+5; a backend-only process also serves it on START_PORT, as RTP-LLM's
backends host the frontend's health and debug app): health probes, load reports for the master in RTP-LLM's
shapes (backend/debug_views.py), Prometheus /metrics, the log level."""
from __future__ import annotations

import logging
from typing import Any

from fastapi import Body, FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

from backend.debug_views import (CACHE_VERSION_KEYS, FINISHED_VERSION_KEYS, BackendFacts, cache_status_view,
                                 version_arg, worker_status_view)
from backend.engine_loop import EngineLoop
from backend.lora import LoraRegistry
from backend.lora_routes import lora_routes
from backend.task_log import TaskLog
from kvyard.cluster_auth import install_cluster_auth
from kvyard.errors import ErrorCode, RequestError
from kvyard.http_errors import install_error_handlers
from kvyard.http_json import JsonBodyByDefault
from kvyard.logs import set_process_log_level
from kvyard.metrics import add_metrics_route

HEALTH_PATHS = ("/health", "/status", "/GraphService/cm2_status", "/SearchService/cm2_status")
# Open without the cluster token: probes, Prometheus and the load report (the numbers /metrics shows).
# The cached block keys (which prompts were sent) and the log level need it.
OPEN_PATHS = (*HEALTH_PATHS, "/health_check", "/", "/metrics", "/worker_status", "/rtp_llm/worker_status")


def create_backend_http_app(engine_loop: EngineLoop, token: str = "", tasks: TaskLog | None = None,
                            facts: BackendFacts | None = None, loras: LoraRegistry | None = None) -> FastAPI:
    """loras: a generate model's adapters, managed through /v1/load_lora_adapter, /v1/unload_lora_adapter and
    /update (under the cluster token); None (a pooling model) leaves those routes out."""
    tasks = tasks or TaskLog()
    facts = facts or BackendFacts()
    app = FastAPI(title="kvyard backend")
    install_error_handlers(app)
    install_cluster_auth(app, token, OPEN_PATHS)
    app.add_middleware(JsonBodyByDefault)
    add_metrics_route(app, engine_loop.metrics.registry)
    if loras is not None:
        app.include_router(lora_routes(loras))

    async def worker_status(body: dict[str, Any] | None = Body(default=None)) -> dict[str, Any]:
        # the seed's WorkerStatusRequest carries the cache version too; this answer's cache_status has no keys
        since = version_arg(body, FINISHED_VERSION_KEYS, CACHE_VERSION_KEYS)
        return worker_status_view(engine_loop.worker_status(), tasks, facts, since)

    async def cache_status(body: dict[str, Any] | None = Body(default=None)) -> dict[str, Any]:
        since = version_arg(body, CACHE_VERSION_KEYS)
        diff = engine_loop.cache_status(since) if since >= 0 else None
        return cache_status_view(engine_loop.worker_status(), engine_loop.cache_status(-1), diff, since)

    for path in ("/worker_status", "/rtp_llm/worker_status"):
        app.add_api_route(path, worker_status, methods=["GET", "POST"])
    for path in ("/cache_status", "/rtp_llm/cache_status"):
        app.add_api_route(path, cache_status, methods=["GET", "POST"])

    @app.post("/set_log_level")
    async def set_log_level(body: dict[str, Any] = Body(...)) -> dict[str, Any]:
        return {"status": "ok", "log_level": set_process_log_level(body.get("log_level"))}

    @app.post("/update_eplb_config")  # the seed's backend route: refused with the frontend's reason
    async def update_eplb_config(body: dict[str, Any] | None = Body(default=None)) -> None:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, "POST /update_eplb_config is not supported: kvyard serves "
                           "no mixture-of-experts model, so it has no expert load balancing to configure")

    async def health() -> Any:
        if engine_loop.alive:
            return PlainTextResponse("ok")
        return JSONResponse({"error": {"message": "engine is not running", "type": "service_unavailable",
                                       "param": None, "code": "unavailable"}}, 503, headers={"Retry-After": "1"})

    for path in HEALTH_PATHS:
        app.add_api_route(path, health, methods=["GET", "POST"])
    app.add_api_route("/health_check", health, methods=["POST"])
    app.add_api_route("/", health, methods=["GET"])
    return app
