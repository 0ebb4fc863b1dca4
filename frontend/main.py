"""Frontend role start-up: tokenizer and renderer (no weights), then uvicorn on START_PORT."""
from __future__ import annotations

import logging

import uvicorn

from frontend.app import create_app
from frontend.config import FrontendConfig
from kvyard.tokenizer import TextTokenizer

log = logging.getLogger("kvyard.frontend")


async def serve_frontend(cfg: FrontendConfig) -> None:
    tokenizer = TextTokenizer.from_path(cfg.tokenizer_path)
    app = create_app(cfg, tokenizer)
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=5))
    log.info("frontend serving %s on http://%s:%d (backend %s)", cfg.model_name, cfg.host, cfg.port,
             cfg.backend_address)
    await server.serve()
