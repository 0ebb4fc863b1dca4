"""Gateway role start-up: the upstream table, its health loop and uvicorn on TIB_PORT."""
from __future__ import annotations

import logging

import uvicorn

from gateway.app import create_gateway_app
from gateway.config import GatewayConfig

log = logging.getLogger("kvyard.gateway")


async def serve_gateway(cfg: GatewayConfig) -> None:
    if cfg.debug:
        logging.getLogger("kvyard").setLevel(logging.DEBUG)
    server = uvicorn.Server(uvicorn.Config(create_gateway_app(cfg), host=cfg.host, port=cfg.port,
                                           log_level="debug" if cfg.debug else "warning",
                                           access_log=cfg.debug, timeout_graceful_shutdown=5,
                                           # the upstream's Date and Server pass through instead
                                           server_header=False, date_header=False))
    log.info("gateway on http://%s:%d over %d upstreams (%s routing, %d in flight each, WAIT_FOR %.0f ms, "
             "TIMEOUT %.0f ms)", cfg.host, cfg.port, len(cfg.upstreams), cfg.routing, cfg.max_connect_per_upstream,
             cfg.wait_for_s * 1000, cfg.timeout_s * 1000)
    await server.serve()
