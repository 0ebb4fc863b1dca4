"""RTP-LLM's debug routes on the frontend's port, proxied to the backend paired with this frontend (the one
at BACKEND_ADDRESS, as in RTP-LLM where they work "only when locally paired with a Backend server"):
/cache_status and /worker_status (and their /rtp_llm/ names) answer what the backend's HTTP port answers;
/set_log_level changes this process's level, then the paired backend's. /update_eplb_config is refused
with a 400 that says why (/update, LoRA adapters: frontend/lora_routes.py)."""
from __future__ import annotations

import logging
from typing import Any

import httpx
from fastapi import APIRouter, Body
from fastapi.responses import JSONResponse

from frontend.config import FrontendConfig
from kvyard.cluster_auth import auth_headers
from kvyard.errors import ErrorCode, RequestError
from kvyard.logs import set_process_log_level
from kvyard.ports import backend_http_for_grpc

log = logging.getLogger("kvyard.frontend")
PROXIED = ("/cache_status", "/rtp_llm/cache_status", "/worker_status", "/rtp_llm/worker_status")
TIMEOUT_S = 5.0


def paired_backend_url(cfg: FrontendConfig) -> str:
    """The HTTP base of the backend at BACKEND_ADDRESS (its gRPC port - 1 + 5)."""
    host, _, port = cfg.backend_address.rpartition(":")
    return f"http://{host}:{backend_http_for_grpc(int(port))}"


async def call_paired(cfg: FrontendConfig, path: str, body: dict[str, Any] | None, method: str = "POST",
                      timeout_s: float = TIMEOUT_S) -> httpx.Response:
    """One call to the paired backend's HTTP port with the cluster token; UNAVAILABLE if it does not answer."""
    base = paired_backend_url(cfg)
    try:
        async with httpx.AsyncClient(timeout=timeout_s, headers=auth_headers(cfg.cluster_token)) as client:
            return await client.request(method, f"{base}{path}", json=body or {} if method == "POST" else None)
    except httpx.HTTPError as exc:
        raise RequestError(ErrorCode.UNAVAILABLE, f"the backend paired with this frontend ({base}) does not "
                           f"answer {path}: {type(exc).__name__} {exc}".rstrip()) from None


def debug_routes(cfg: FrontendConfig) -> APIRouter:
    router = APIRouter()

    async def call_backend(path: str, body: dict[str, Any] | None) -> httpx.Response:
        return await call_paired(cfg, path, body)

    def proxy(path: str) -> Any:
        async def proxied(body: dict[str, Any] | None = Body(default=None)) -> JSONResponse:
            resp = await call_backend(path, body)
            return JSONResponse(backend_json(resp), resp.status_code)
        return proxied

    for path in PROXIED:
        for method in ("GET", "POST"):  # one route per method: each gets its own OpenAPI operation id
            router.add_api_route(path, proxy(path), methods=[method])

    @router.post("/set_log_level")
    async def set_log_level(body: dict[str, Any] = Body(...)) -> JSONResponse:
        level = set_process_log_level(body.get("log_level"))
        log.info("log level set to %s", level)
        answers: dict[str, Any] = {"frontend": "ok"}
        try:
            resp = await call_backend("/set_log_level", {"log_level": level})
            answers["backend"] = "ok" if resp.status_code == 200 else backend_json(resp)
        except RequestError as exc:
            answers["backend"] = exc.message  # a FRONTEND role may have no paired backend: its own level stands
        return JSONResponse({"status": "ok", "log_level": level, "processes": answers})

    @router.post("/update_eplb_config")
    async def update_eplb_config(body: dict[str, Any] | None = Body(default=None)) -> None:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, "POST /update_eplb_config is not supported: kvyard serves "
                           "no mixture-of-experts model, so it has no expert load balancing to configure")

    return router


def backend_json(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        raise RequestError(ErrorCode.UNAVAILABLE, f"the paired backend answered {resp.status_code} without JSON: "
                           f"{resp.text[:200]!r}") from None
