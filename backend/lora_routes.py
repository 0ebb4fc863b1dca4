"""The backend's LoRA admin routes (its HTTP port, under the cluster token; the frontend forwards its own
routes here): vLLM's load and unload, RTP-LLM's `/update` with `peft_info`, and the list of adapters held.

Adapters are read off the engine thread and the event loop (a thread of their own); the engine sees a new
adapter from the next request that names it."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Body

from backend.lora import AdapterInfo, LoraRegistry
from backend.lora_weights import AdapterError
from kvyard.errors import ErrorCode, RequestError, refuse_unknown_fields

# /update's keys other than peft_info, and why kvyard refuses them.
_UPDATE_REFUSED = {
    "models_info": "kvyard loads one base model at start-up; restart the backend with the new CHECKPOINT_PATH",
    "sampler_info": "kvyard has no speculative sampler or draft model to update",
}


def adapter_json(info: AdapterInfo) -> dict[str, Any]:
    return {"name": info.name, "path": info.path, "rank": info.rank, "created": info.created}


def _str_field(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{key} must be a non-empty string", key)
    return value


def _runtime_path(registry: LoraRegistry, path: str) -> str:
    if registry.allowed_root is None:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, "loading adapters at run time is off: the operator sets "
                           "LORA_ROOT (the directory adapters may be loaded from) to allow it; --lora-modules loads "
                           "them at start-up", "lora_path")
    return path


async def load(registry: LoraRegistry, name: str, path: str) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        info = await asyncio.to_thread(registry.load, name, _runtime_path(registry, path))
    except AdapterError as exc:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, str(exc), "lora_path") from None
    return {"status": "ok", "adapter": adapter_json(info), "load_ms": round((time.monotonic() - t0) * 1e3, 1)}


async def apply_peft_info(registry: LoraRegistry, peft_info: Any) -> dict[str, Any]:
    """RTP-LLM's `peft_info: {"lora_info": {name: path}}`: the whole set of adapters to serve. Names not held
    (or held from another path) are read first, all of them; then they are served and held names it leaves
    out unloaded, in one step. An adapter that cannot be read changes nothing (the 400 names it)."""
    if not isinstance(peft_info, dict) or set(peft_info) - {"lora_info"}:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, "peft_info must be {\"lora_info\": {name: path}}",
                           "peft_info")
    wanted = peft_info.get("lora_info") or {}
    if not isinstance(wanted, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wanted.items()):
        raise RequestError(ErrorCode.INVALID_ARGUMENT, "peft_info.lora_info must map adapter names to paths",
                           "peft_info")
    held = {i.name: i.path for i in registry.infos()}
    adapters = []
    for name, path in wanted.items():
        try:
            if held.get(name) != str(registry.resolved_path(path)):
                adapters.append(await asyncio.to_thread(registry.read, name, _runtime_path(registry, path)))
        except AdapterError as exc:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"peft_info.lora_info[{name!r}]: {exc}; nothing was "
                               "changed", "peft_info") from None
    removed = [name for name in held if name not in wanted]
    loaded = registry.install(adapters, removed)
    return {"status": "ok", "loaded": [adapter_json(i) for i in loaded], "unloaded": removed}


def lora_routes(registry: LoraRegistry) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/load_lora_adapter")
    async def load_adapter(body: dict[str, Any] = Body(...)) -> dict[str, Any]:
        refuse_unknown_fields(body, {"lora_name", "lora_path", "load_inplace"})
        name = _str_field(body, "lora_name")
        # vLLM's load_inplace: false refuses a name already held; kvyard replaces it otherwise (absent or true)
        if body.get("load_inplace") is False and name in registry.names():
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"the LoRA adapter {name!r} is already loaded; give "
                               "load_inplace: true to replace it", "load_inplace")
        return await load(registry, name, _str_field(body, "lora_path"))

    @router.post("/v1/unload_lora_adapter")
    async def unload_adapter(body: dict[str, Any] = Body(...)) -> dict[str, Any]:
        refuse_unknown_fields(body, {"lora_name"})  # vLLM's lora_int_id too: kvyard names adapters, it numbers none
        name = _str_field(body, "lora_name")
        registry.unload(name)
        return {"status": "ok", "unloaded": name}

    @router.get("/v1/lora_adapters")
    async def adapters() -> dict[str, Any]:
        return {"object": "list", "data": [adapter_json(i) for i in registry.infos()]}

    @router.post("/update")
    async def update(body: dict[str, Any] = Body(...)) -> dict[str, Any]:
        for key, why in _UPDATE_REFUSED.items():
            if body.get(key):
                raise RequestError(ErrorCode.INVALID_ARGUMENT, f"/update {key} is not supported: {why}", key)
        unknown = sorted(set(body) - {"peft_info", *_UPDATE_REFUSED})
        if unknown:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"/update takes peft_info (and refuses models_info, "
                               f"sampler_info); unknown keys: {unknown}", unknown[0])
        if "peft_info" not in body:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "/update without peft_info changes nothing", "peft_info")
        return await apply_peft_info(registry, body["peft_info"])

    return router
