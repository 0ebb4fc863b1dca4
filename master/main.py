"""Master role start-up: the registry, its poll and discovery loops, and uvicorn on START_PORT."""
from __future__ import annotations

import logging

import uvicorn

from master.app import create_master_app
from master.config import MasterConfig

log = logging.getLogger("kvyard.master")


async def serve_master(cfg: MasterConfig) -> None:
    server = uvicorn.Server(uvicorn.Config(create_master_app(cfg), host=cfg.host, port=cfg.port,
                                           log_level="warning", access_log=False, timeout_graceful_shutdown=2))
    log.info("master on http://%s:%d: %d static backends, %d DNS names, polling every %.0f ms",
             cfg.host, cfg.port, len(cfg.static_backends), len(cfg.dns_targets), cfg.poll_interval_s * 1000)
    await server.serve()
