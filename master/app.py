"""The master's HTTP routes: /rtp_llm/schedule picks a backend for a frontend, plus registration and views."""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Body, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from kvyard.cluster_auth import install_cluster_auth
from kvyard.disconnect import cancel_on_disconnect
from kvyard.errors import ErrorCode, RequestError
from kvyard.http_errors import error_body, install_error_handlers
from kvyard.http_json import JsonBodyByDefault
from kvyard.logs import set_process_log_level
from kvyard.metrics import HttpMetricsMiddleware, add_metrics_route
from kvyard.roles import Role
from master.config import BackendEndpoint, MasterConfig
from master.dashboard import PATHS as DASHBOARD_PATHS
from master.dashboard import DecisionHistory, dashboard_routes
from master.discovery import add_static, watch_dns
from master.hold import ScheduleQueue
from master.metrics import UNKNOWN_MODEL, MasterMetrics
from master.policy import Decision, RouteRequest, cache_local, choose_backend
from master.poll_loop import PollLoop
from master.registry import SOURCE_REGISTERED, Registry
from master.schemas import RegisterRequest, ScheduleRequest, candidates_view, debug_info

log = logging.getLogger("kvyard.master")

# Open without the cluster token: probes, Prometheus, and read-only views a frontend or /metrics shows
# anyway. Everything else (schedule, whose answer reveals cache hits, and registration) needs it.
OPEN_PATHS = ("/health", "/status", "/metrics", "/backends", "/v1/models", "/rtp_llm/master", *DASHBOARD_PATHS)


def create_master_app(cfg: MasterConfig, registry: Registry | None = None,
                      clock: Callable[[], float] = time.monotonic) -> FastAPI:
    registry = registry or Registry(cfg)
    request_ids = itertools.count(1)
    metrics = MasterMetrics()
    metrics.watch_backends(lambda: registry.summaries(clock()))
    history = DecisionHistory(registry)

    def decide(route: RouteRequest) -> Decision:
        """The policy on the current loads; a chosen backend counts the request at once."""
        now = clock()
        decision = choose_backend(route, registry.loads(now), cfg.policy)
        if decision.chosen is not None:
            hit = decision.candidate(decision.chosen).hit_cache_len
            registry.record_choice(decision.chosen, list(route.block_cache_keys), route.seq_len, hit, now)
            if decision.decode is not None:
                registry.record_choice(decision.decode, [], route.seq_len, 0, now)  # its KV fills at hand-over
        return decision

    hold = ScheduleQueue(cfg.hold, decide)

    async def retry_held() -> None:
        while True:  # loads change with every poll round: held requests are decided again after each
            await asyncio.sleep(cfg.poll_interval_s)
            hold.pump()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        add_static(registry, cfg, clock())
        tasks = [asyncio.create_task(PollLoop(registry, clock).run()), asyncio.create_task(history.run()),
                 asyncio.create_task(retry_held())]
        if cfg.dns_targets:
            tasks.append(asyncio.create_task(watch_dns(registry, cfg, clock)))
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    app = FastAPI(title="kvyard master", lifespan=lifespan)
    app.state.registry = registry
    install_error_handlers(app)
    install_cluster_auth(app, cfg.cluster_token, OPEN_PATHS)  # inside the metrics: 401s are counted
    app.add_middleware(HttpMetricsMiddleware, metrics=metrics)  # inside JsonBodyByDefault: sees the route
    app.add_middleware(JsonBodyByDefault)
    add_metrics_route(app, metrics.registry)
    app.include_router(dashboard_routes(registry, history, clock))

    @app.post("/rtp_llm/schedule")
    async def schedule(req: ScheduleRequest, request: Request) -> dict[str, Any]:
        if len(req.block_cache_keys) > req.seq_len:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"block_cache_keys has {len(req.block_cache_keys)} "
                               f"blocks but seq_len is only {req.seq_len} tokens", "block_cache_keys")
        route = RouteRequest(req.model, req.block_cache_keys, req.seq_len, req.adapter)
        # Held while every backend is busy; a frontend that gives up meanwhile leaves the queue.
        decision = await cancel_on_disconnect(request, hold.schedule(route, req.request_priority,
                                                                     req.generate_timeout))
        model = req.model if req.model in registry.models() else UNKNOWN_MODEL  # names from clients: unbounded
        registry.stats.decisions[decision.reason] = registry.stats.decisions.get(decision.reason, 0) + 1
        if decision.chosen is None:
            metrics.record_decision(decision.reason, model)
            registry.stats.rejected += 1
            raise RequestError(decision.error or ErrorCode.INTERNAL, decision.message,
                               "model" if decision.error is ErrorCode.MODEL_NOT_FOUND else None)
        chosen = decision.candidate(decision.chosen)
        if log.isEnabledFor(logging.DEBUG):  # LOG_LEVEL=DEBUG: one line per decision, to replay routing offline
            log.debug("decision %s", json.dumps({
                "t": round(now, 3), "first_key": req.block_cache_keys[0] if req.block_cache_keys else None,
                "blocks": len(req.block_cache_keys), "seq_len": req.seq_len, "reason": decision.reason,
                "candidates": candidates_view(decision)}))
        metrics.record_decision(decision.reason, model, req.seq_len, chosen.hit_cache_len)
        state = registry.backends[decision.chosen]
        e, st = state.endpoint, state.status
        server = {"role": e.role.rtp_type, "server_ip": e.host, "http_port": e.http_port,
                  "grpc_port": e.grpc_port,
                  "debug_info": debug_info(chosen, st.running if st else 0, st.step_latency_ms if st else 0.0)}
        servers = [server]
        if decision.decode is not None:
            d = registry.backends[decision.decode].endpoint
            servers.append({"role": d.role.rtp_type, "server_ip": d.host, "http_port": d.http_port,
                            "grpc_port": d.grpc_port, "debug_info": None})
        out: dict[str, Any] = {"server_status": servers, "cache_local": cache_local(decision),
                               "inter_request_id": next(request_ids)}
        if req.debug:
            out["reason"] = decision.reason
            out["candidates"] = candidates_view(decision)
        return out

    @app.post("/rtp_llm/register")
    async def register(req: RegisterRequest, request: Request) -> dict[str, Any]:
        if not cfg.cluster_token:  # anyone who can reach the port could take the traffic (and prompts)
            raise RequestError(ErrorCode.UNAUTHENTICATED, "registration is refused: this master has no "
                               "CLUSTER_TOKEN; set the same CLUSTER_TOKEN (or CLUSTER_TOKEN_FILE) on the "
                               "master and every backend, or list backends in MASTER_BACKENDS")
        host = req.server_ip or (request.client.host if request.client else "")
        if not host:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "server_ip is empty and the peer address is unknown",
                               "server_ip")
        endpoint = BackendEndpoint(host, req.grpc_port, req.http_port, req.model, Role(req.role))
        now = clock()
        registry.add(endpoint, SOURCE_REGISTERED, now)
        # What the master's polls of that address found: a backend advertising an address nobody can dial
        # learns it here (its log says so) instead of only being missing from routing.
        state = registry.backends[endpoint.name]
        return {"name": endpoint.name, "registered": True, "healthy": registry.healthy(state, now),
                "error": state.error}

    async def master_host() -> dict[str, str]:
        return {"real_master_host": cfg.advertise_address}

    app.add_api_route("/rtp_llm/master", master_host, methods=["GET", "POST"])

    @app.post("/set_log_level")
    async def set_log_level(body: dict[str, Any] = Body(...)) -> dict[str, str]:
        """The master is one process: its level is the role's (needs the cluster token)."""
        return {"status": "ok", "log_level": set_process_log_level(body.get("log_level"))}

    @app.get("/backends")
    async def backends() -> dict[str, Any]:
        return registry.view(clock())

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        now = clock()
        healthy: dict[str, int] = {m: 0 for m in registry.models()}
        adapters: dict[tuple[str, str], int] = {}  # (adapter, its base model) -> healthy backends holding it
        for state in registry.backends.values():  # a VIT embeds images: it serves no request itself
            serving = registry.healthy(state, now) and state.endpoint.role is not Role.VIT
            healthy[state.endpoint.model] += serving
            for adapter in state.status.adapters if serving and state.status is not None else ():
                key = (adapter, state.endpoint.model)
                adapters[key] = adapters.get(key, 0) + 1
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "kvyard", "healthy_backends": n}
                for m, n in healthy.items()]
        # LoRA adapters as vLLM lists them (their base model as `parent`): what a schedule call may name
        data += [{"id": a, "object": "model", "created": 0, "owned_by": "kvyard", "parent": m, "healthy_backends": n}
                 for (a, m), n in sorted(adapters.items()) if a not in healthy]
        return {"object": "list", "data": data}

    async def health() -> Any:
        now = clock()
        if any(registry.healthy(s, now) and s.endpoint.role is not Role.VIT for s in registry.backends.values()):
            return PlainTextResponse("ok")
        return JSONResponse(error_body("no healthy backend", "service_unavailable"), 503,
                            headers={"Retry-After": "1"})

    for path in ("/health", "/status"):
        app.add_api_route(path, health, methods=["GET", "POST"])
    return app
