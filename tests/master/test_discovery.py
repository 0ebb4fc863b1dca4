"""DNS discovery: every address of a name becomes a backend; a failed lookup keeps the last answer."""
from __future__ import annotations

import asyncio

import pytest

from master import discovery
from master.config import BackendEndpoint, DnsTarget, MasterConfig
from master.registry import Registry


def test_resolve_returns_every_address() -> None:
    endpoints = asyncio.run(discovery.resolve(DnsTarget("localhost", 8089, "m")))
    assert BackendEndpoint("127.0.0.1", 8089, 8093, "m") in endpoints


def test_watch_dns_follows_the_answers_and_survives_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = MasterConfig.from_env({"MASTER_BACKEND_DNS": "svc.ns:8089", "MASTER_DNS_INTERVAL_S": "1"})
    answers: list[list[str] | OSError] = [["10.0.0.1", "10.0.0.2"], OSError("SERVFAIL"), ["10.0.0.2"]]
    seen: list[set[str]] = []
    registry = Registry(cfg)

    async def fake_resolve(target: DnsTarget) -> list[BackendEndpoint]:
        answer = answers.pop(0) if answers else ["10.0.0.2"]
        if isinstance(answer, OSError):
            raise answer
        return [BackendEndpoint(h, target.grpc_port, target.grpc_port + 4, target.model) for h in answer]

    async def fast_sleep(_: float) -> None:
        seen.append(set(registry.backends))
        if len(seen) == 3:
            raise asyncio.CancelledError

    monkeypatch.setattr(discovery, "resolve", fake_resolve)
    monkeypatch.setattr(discovery.asyncio, "sleep", fast_sleep)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(discovery.watch_dns(registry, cfg, clock=lambda: 0.0))
    assert seen == [{"10.0.0.1:8089", "10.0.0.2:8089"}, {"10.0.0.1:8089", "10.0.0.2:8089"}, {"10.0.0.2:8089"}]
