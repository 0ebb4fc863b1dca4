"""ROLE_TYPE=MOCK_MASTER: answers `POST /rtp_llm/schedule` with configured backends, round-robin, with no
polling and no policy, for debugging a frontend's routing path (RTP-LLM's mock master).

MOCK_MASTER_BACKENDS: `host:grpc_port,...` (required). MOCK_MASTER_DECODE_BACKENDS: DECODE backends; when
set, each answer is a PREFILL + DECODE pair (the seed's commented-out DECODE entry), the frontend's PD path.
MOCK_MASTER_MODELS: the model names it knows (default: any; others are a 404 `model_not_found`).
MOCK_MASTER_ERROR: answer every schedule call with this error kind instead (`overloaded` → 429, `unavailable`
→ 503, `model_not_found` → 404, ...). MOCK_MASTER_PORT: its HTTP port (RTP-LLM's mock master's variable;
START_PORT otherwise).
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import Body, FastAPI
from fastapi.responses import PlainTextResponse

from kvyard.env import INTERNAL_HOST, env_int, env_str
from kvyard.errors import ErrorCode, RequestError
from kvyard.http_errors import install_error_handlers
from kvyard.http_json import JsonBodyByDefault
from kvyard.ports import backend_http_for_grpc, start_port
from kvyard.roles import Role

log = logging.getLogger("kvyard.mock_master")


@dataclass(frozen=True)
class MockMasterConfig:
    host: str                      # bind address
    port: int                      # START_PORT: HTTP
    backends: tuple[str, ...]      # host:grpc_port of each backend, answered round-robin
    models: tuple[str, ...] = ()   # known model names; () = any
    error: ErrorCode | None = None  # answer every schedule call with this error
    decode_backends: tuple[str, ...] = ()  # host:grpc_port of DECODE backends: answer PREFILL + DECODE pairs

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> MockMasterConfig:
        backends = _addresses(env, "MOCK_MASTER_BACKENDS")
        if not backends:
            raise ValueError("MOCK_MASTER_BACKENDS must list host:grpc_port,..., got ''")
        decode = _addresses(env, "MOCK_MASTER_DECODE_BACKENDS")
        error = None
        if env.get("MOCK_MASTER_ERROR"):
            try:
                error = ErrorCode(env["MOCK_MASTER_ERROR"].lower())
            except ValueError:
                raise ValueError(f"MOCK_MASTER_ERROR must be one of {', '.join(c.value for c in ErrorCode)}, "
                                 f"got {env['MOCK_MASTER_ERROR']!r}") from None
        models = tuple(m.strip() for m in env.get("MOCK_MASTER_MODELS", "").split(",") if m.strip())
        port = env_int(env, "MOCK_MASTER_PORT", 0, minimum=1) or start_port(env)
        return cls(env_str(env, "HOST", INTERNAL_HOST), port, backends, models, error, decode)


def _addresses(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    addresses = tuple(b.strip() for b in env.get(name, "").split(",") if b.strip())
    if any(not a.rpartition(":")[2].isdigit() for a in addresses):
        raise ValueError(f"{name} must list host:grpc_port,..., got {env.get(name, '')!r}")
    return addresses


def _server(address: str, role: Role) -> dict[str, Any]:
    host, _, port = address.rpartition(":")
    return {"role": role.rtp_type, "server_ip": host, "http_port": backend_http_for_grpc(int(port)),
            "grpc_port": int(port), "debug_info": None}


def create_mock_master_app(cfg: MockMasterConfig) -> FastAPI:
    app = FastAPI(title="kvyard mock master")
    install_error_handlers(app)
    app.add_middleware(JsonBodyByDefault)
    turn = itertools.count()
    app.state.schedule_requests = []   # every schedule body, for tests and for looking at

    @app.post("/rtp_llm/schedule")
    async def schedule(body: dict[str, Any] = Body(...)) -> dict[str, Any]:
        app.state.schedule_requests.append(body)
        model = body.get("model")
        if cfg.error is not None:
            raise RequestError(cfg.error, f"mock master: scripted {cfg.error.value}")
        if cfg.models and model not in cfg.models:
            raise RequestError(ErrorCode.MODEL_NOT_FOUND, f"The model '{model}' does not exist", "model")
        n = next(turn)
        backend = cfg.backends[n % len(cfg.backends)]
        servers = [_server(backend, Role.PREFILL if cfg.decode_backends else Role.PDFUSION)]
        if cfg.decode_backends:
            servers.append(_server(cfg.decode_backends[n % len(cfg.decode_backends)], Role.DECODE))
        return {"server_status": servers, "cache_local": 0, "inter_request_id": len(app.state.schedule_requests)}

    @app.post("/rtp_llm/master")
    async def master() -> dict[str, str]:
        return {"real_master_host": f"{cfg.host}:{cfg.port}"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "kvyard"} for m in cfg.models]}

    for path in ("/health", "/status"):
        app.add_api_route(path, lambda: PlainTextResponse("ok"), methods=["GET", "POST"])
    return app


async def serve_mock_master(cfg: MockMasterConfig) -> None:
    server = uvicorn.Server(uvicorn.Config(create_mock_master_app(cfg), host=cfg.host, port=cfg.port,
                                           log_level="warning", access_log=False))
    log.info("mock master on http://%s:%d routing to %s", cfg.host, cfg.port, ", ".join(cfg.backends))
    await server.serve()
