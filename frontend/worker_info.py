"""What a router asks a worker about itself: SGLang's /server_info and /model_info (and the /get_* names).

SGLang's router (`sglang-router`) calls them when a worker joins and names the worker's model after
`served_model_name`, else `model_path`; without them it lists the model as "unknown". Names only: the
public port does not tell the file system's paths.
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter

from frontend.config import FrontendConfig


def _version() -> str:
    try:
        return version("kvyard")
    except PackageNotFoundError:
        return "unknown"


def worker_info_routes(cfg: FrontendConfig) -> APIRouter:
    router = APIRouter()
    server = {"served_model_name": cfg.model_name, "model_path": cfg.model_name,
              "tokenizer_path": cfg.model_name, "context_length": cfg.max_seq_len,
              "max_running_requests": cfg.concurrency_limit, "version": _version(), "engine": "kvyard",
              "service_id": cfg.service_id}
    model = {"model_path": cfg.model_name, "tokenizer_path": cfg.model_name, "served_model_name": cfg.model_name,
             "is_generation": True, "context_length": cfg.max_seq_len}

    async def server_info() -> dict[str, Any]:
        return server

    async def model_info() -> dict[str, Any]:
        return model

    for path in ("/server_info", "/get_server_info"):
        router.add_api_route(path, server_info, methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        router.add_api_route(path, model_info, methods=["GET"])
    return router
