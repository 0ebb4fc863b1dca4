"""How the master learns its backends: a static list, DNS names re-resolved periodically, self-registration."""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable

from kvyard.ports import backend_http_for_grpc
from master.config import BackendEndpoint, DnsTarget, MasterConfig
from master.registry import SOURCE_STATIC, Registry

log = logging.getLogger("kvyard.master")


def add_static(registry: Registry, cfg: MasterConfig, now: float) -> None:
    for endpoint in cfg.static_backends:
        registry.add(endpoint, SOURCE_STATIC, now)


async def resolve(target: DnsTarget) -> list[BackendEndpoint]:
    """Every address the name resolves to (a k8s headless Service has one per ready pod)."""
    infos = await asyncio.get_running_loop().getaddrinfo(target.host, target.grpc_port,
                                                         type=socket.SOCK_STREAM)
    hosts = sorted({info[4][0] for info in infos})
    return [BackendEndpoint(h, target.grpc_port, backend_http_for_grpc(target.grpc_port), target.model)
            for h in hosts]


async def watch_dns(registry: Registry, cfg: MasterConfig,
                    clock: Callable[[], float] = time.monotonic) -> None:
    """Re-resolve every DNS target forever. A failed lookup keeps the last answer: a DNS hiccup must
    not empty the cluster; backends that really went away fail their polls anyway."""
    failing: set[str] = set()
    while True:
        for target in cfg.dns_targets:
            source = f"dns:{target.host}:{target.grpc_port}"
            try:
                endpoints = await resolve(target)
            except OSError as exc:
                if source not in failing:
                    log.warning("cannot resolve %s: %s (keeping its last addresses)", source, exc)
                    failing.add(source)
                continue
            failing.discard(source)
            registry.sync_source(source, endpoints, clock())
        await asyncio.sleep(cfg.dns_interval_s)
