"""LoRA adapters on the frontend's port: which adapter a request names, the admin routes (vLLM's
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter`, RTP-LLM's `/update`, the list), forwarded to the paired
backend (the one at BACKEND_ADDRESS) with the cluster token, under this port's API key like every other
route; and the adapters' entries for `/v1/models` (their base model as `parent`). docs/lora.md."""
from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Body
from fastapi.responses import JSONResponse

from frontend.config import FrontendConfig
from frontend.debug_routes import backend_json, call_paired
from kvyard.errors import ErrorCode, RequestError

log = logging.getLogger("kvyard.frontend")
LOAD_TIMEOUT_S = 120.0  # reading an adapter of a large model from a slow disk


def adapter_of(cfg: FrontendConfig, model: str | None, named: str | None) -> str:
    """The LoRA adapter a request asks for ("" = the base model): its `model` when that names no model this
    frontend serves and LoRA is on (frontend.routing.model_to_route let it through), or
    extra_configs.adapter_name. Both, disagreeing, is a 400."""
    by_model = model if model and cfg.lora and not cfg.serves(model) else ""
    if named and by_model and named != by_model:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"model {model!r} and extra_configs.adapter_name {named!r} "
                           "name different adapters", "adapter_name")
    return named or by_model


def adapter_entry(cfg: FrontendConfig, name: str, created: int = 0, root: str | None = None) -> dict[str, Any]:
    """An adapter of this frontend's model as a /v1/models entry (vLLM's: its base model as `parent`)."""
    entry: dict[str, Any] = {"id": name, "object": "model", "created": created, "owned_by": "kvyard"}
    if root is not None:
        entry["root"] = root
    return {**entry, "parent": cfg.model_name, "max_model_len": cfg.max_seq_len}


async def adapter_models(cfg: FrontendConfig) -> list[dict[str, Any]]:
    """The paired backend's adapters as /v1/models entries; none when it has none or does not answer."""
    try:
        resp = await call_paired(cfg, "/v1/lora_adapters", None, "GET")
        held = resp.json()["data"] if resp.status_code == 200 else []
        return [adapter_entry(cfg, a["name"], a["created"], a["path"]) for a in held]
    except (RequestError, ValueError, KeyError, TypeError) as exc:
        log.debug("no adapters listed: %s", exc)
        return []


def _refuse_served_names(cfg: FrontendConfig, body: dict[str, Any] | None) -> None:
    """An adapter named as a model this frontend serves could never be asked for (`model` naming it is
    the base model), so loading one under that name is a 400, not an adapter silently out of reach."""
    body = body or {}
    names = [body.get("lora_name")]
    peft = body.get("peft_info")
    if isinstance(peft, dict) and isinstance(peft.get("lora_info"), dict):
        names += list(peft["lora_info"])
    for name in names:
        if isinstance(name, str) and cfg.serves(name):
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"adapter name {name!r} is a model served here, so a "
                               "request naming it gets that model, never the adapter: choose another name",
                               "lora_name")


def lora_routes(cfg: FrontendConfig) -> APIRouter:
    router = APIRouter()

    def forward(path: str, method: str = "POST") -> Any:
        async def forwarded(body: dict[str, Any] | None = Body(default=None)) -> JSONResponse:
            if path != "/v1/unload_lora_adapter":
                _refuse_served_names(cfg, body)
            resp = await call_paired(cfg, path, body, method, LOAD_TIMEOUT_S)
            return JSONResponse(backend_json(resp), resp.status_code)
        return forwarded

    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/update"):
        router.add_api_route(path, forward(path), methods=["POST"])
    router.add_api_route("/v1/lora_adapters", forward("/v1/lora_adapters", "GET"), methods=["GET"])
    return router
