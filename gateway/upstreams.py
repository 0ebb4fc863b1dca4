"""The gateway's upstreams: what each serves, whether it is healthy, what is in flight there. Pure state.

Mutated only from the gateway's event loop and only through UpstreamTable: the health loop
(`record_check`), the dispatcher (`dispatched`, `answering`, `finished`) and the proxy (`record_outcome`). An upstream takes requests while it is healthy and its circuit
breaker lets them through; a 5xx or connection error marks it unhealthy at once (the seed's rule) until
a health check passes, and also counts toward its breaker, which keeps it out longer if it keeps failing.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.breaker import CLOSED, HALF_OPEN, CircuitBreaker
from gateway.config import GatewayConfig
from gateway.prefix import PrefixIndex

log = logging.getLogger("kvyard.gateway")

# How one proxied exchange ended, for health and the breaker.
OK = "ok"                  # 1xx-4xx: the upstream works (a 4xx is the client's fault)
SERVER_ERROR = "5xx"       # it answered 5xx
CONNECTION = "connection"  # it could not be reached, or dropped the connection
TIMEOUT = "timeout"        # it did not finish within TIMEOUT


@dataclass
class Upstream:
    url: str                                  # base URL, no trailing /v1
    breaker: CircuitBreaker
    prefix: PrefixIndex                       # keys of prompts sent here (prefix routing)
    models: frozenset[str] = frozenset()      # from its last good GET /v1/models
    checked: bool = False                     # a health check has answered (or failed) at least once
    healthy: bool = False                     # its last check passed and no request failed since
    error: str | None = None                  # why it is unhealthy
    in_flight: int = 0                        # requests dispatched here and not finished
    in_flight_bytes: int = 0                  # uncached prompt bytes of those with no byte back yet (queued work)
    peak_in_flight: int = 0                   # the most it ever had at once
    served: int = 0                           # exchanges finished, any outcome
    failures: dict[str, int] = field(default_factory=dict)  # outcome → count (5xx, connection, timeout)
    last_chosen: float = 0.0                  # monotonic seconds; 0 = never

    def routable(self, now: float) -> bool:
        """Takes new requests: healthy and its breaker closed, or half-open with nothing in flight (one trial)."""
        state = self.breaker.state(now)
        return self.healthy and (state == CLOSED or (state == HALF_OPEN and self.in_flight == 0))

    def has_room(self, max_connect: int) -> bool:
        return self.in_flight < max_connect


class UpstreamTable:
    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.upstreams: dict[str, Upstream] = {
            url: Upstream(url, CircuitBreaker(cfg.breaker_failures, cfg.breaker_open_s),
                          PrefixIndex(cfg.prefix_cache_blocks)) for url in cfg.upstreams}

    def serving(self, model: str) -> list[Upstream]:
        return [u for u in self.upstreams.values() if model in u.models]

    def models(self) -> list[str]:
        """The union of every upstream's models (an unhealthy upstream's stay listed: it may come back)."""
        return sorted({m for u in self.upstreams.values() for m in u.models})

    def any_healthy(self) -> bool:
        return any(u.healthy for u in self.upstreams.values())

    # ---- requests in flight (the dispatcher's leases) ---------------------------------------------------

    def dispatched(self, url: str, keys: Sequence[int], work: int, now: float) -> None:
        """A request was leased this upstream: `work` uncached bytes queue there until its first byte."""
        u = self.upstreams[url]
        u.in_flight += 1
        u.in_flight_bytes += work
        u.peak_in_flight = max(u.peak_in_flight, u.in_flight)
        u.last_chosen = now
        u.prefix.insert(list(keys))

    def answering(self, url: str, work: int) -> None:
        """Its first byte came back: the prompt is computed, its work no longer queues there."""
        self.upstreams[url].in_flight_bytes -= work

    def finished(self, url: str, work: int) -> None:
        """Its exchange ended; `work`: what of it still counted as queued (0 once answering)."""
        u = self.upstreams[url]
        u.in_flight -= 1
        u.in_flight_bytes -= work

    # ---- health -----------------------------------------------------------------------------------

    def record_check(self, url: str, models: list[str] | None, error: str | None) -> None:
        """A health check's result: its models (None: it failed, with `error`)."""
        u = self.upstreams[url]
        u.checked = True
        if models is None:
            if u.healthy or u.error != error:
                log.warning("upstream %s unhealthy: %s", url, error)
            u.healthy, u.error = False, error
            return
        if not u.healthy:
            log.info("upstream %s healthy, serving %s", url, ", ".join(models) or "no models")
        u.healthy, u.error, u.models = True, None, frozenset(models)

    def record_outcome(self, url: str, outcome: str, now: float, detail: str = "") -> None:
        """How one proxied exchange ended: failures mark it unhealthy at once and count toward its breaker."""
        u = self.upstreams[url]
        u.served += 1
        if outcome == OK:
            u.breaker.record_success()
            return
        u.failures[outcome] = u.failures.get(outcome, 0) + 1
        u.breaker.record_failure(now)
        if u.healthy:
            log.warning("upstream %s unhealthy until its next health check: %s %s", url, outcome, detail)
        u.healthy, u.error = False, f"{outcome} {detail}".strip()

    # ---- the live view ----------------------------------------------------------------------------

    def view(self, now: float) -> list[dict[str, Any]]:
        return [{"url": u.url, "models": sorted(u.models), "healthy": u.healthy, "error": u.error,
                 "breaker": u.breaker.state(now), "consecutive_failures": u.breaker.failures,
                 "in_flight": u.in_flight, "peak_in_flight": u.peak_in_flight, "served": u.served,
                 "failures": dict(u.failures), "prefix_blocks": len(u.prefix)}
                for u in self.upstreams.values()]
