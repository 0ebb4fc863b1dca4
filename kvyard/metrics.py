"""Prometheus metrics for every role: one CollectorRegistry per app, vLLM-style names, GET /metrics.

Frontend and backend record the same request metrics (TTFT, inter-token and end-to-end latency, prompt
and generated tokens, prefix-cache queries/hits); the backend adds engine gauges read at scrape time,
the master counts its routing decisions and shows each backend's load, the gateway times each upstream.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# vLLM's buckets, so existing dashboards read these the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServingMetrics:
    """Request-level metrics of one app (frontend or backend), in a registry of its own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvyard:requests", "Requests by endpoint and status (frontend: the HTTP "
                                "status; backend: ok or the error kind)", ["endpoint", "status"], registry=r)
        self.ttft = Histogram("kvyard:time_to_first_token_seconds", "Time from request to its first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("kvyard:inter_token_latency_seconds", "Time between a request's output steps",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("kvyard:e2e_request_latency_seconds", "Time from request to its last token",
                             buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvyard:prompt_tokens", "Prompt tokens of requests that started "
                                     "generating", registry=r)
        self.generation_tokens = Counter("kvyard:generation_tokens", "Tokens generated", registry=r)
        self.prefix_cache_queries = Counter("kvyard:prefix_cache_queries", "Prompt tokens looked up in the "
                                            "prefix cache", registry=r)
        self.prefix_cache_hits = Counter("kvyard:prefix_cache_hits", "Prompt tokens served from the prefix "
                                         "cache", registry=r)
        self._queried = 0
        self._hit = 0
        Gauge("kvyard:prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries since start",
              registry=r).set_function(lambda: self._hit / self._queried if self._queried else 0.0)

    def count(self, endpoint: str, status: str | int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def prompt(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A request's prompt was computed, `cached_tokens` of it from the prefix cache."""
        self.prompt_tokens.inc(prompt_tokens)
        self.prefix_cache_queries.inc(prompt_tokens)
        self.prefix_cache_hits.inc(cached_tokens)
        self._queried += prompt_tokens
        self._hit += cached_tokens

    def timer(self, start: float | None = None) -> RequestTimer:
        return RequestTimer(self, time.monotonic() if start is None else start)


class RequestTimer:
    """Times one streamed request: TTFT at its first tokens, ITL between later steps, E2E at the end."""

    def __init__(self, metrics: ServingMetrics, start: float) -> None:
        self.metrics = metrics
        self.start = start          # time.monotonic() when the request arrived
        self.last: float | None = None
        self.tokens = 0
        self.finished = False

    def step(self, new_tokens: int) -> None:
        """One output step of this request brought `new_tokens` tokens (all its sequences together)."""
        if new_tokens <= 0:
            return
        now = time.monotonic()
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now
        self.tokens += new_tokens
        self.metrics.generation_tokens.inc(new_tokens)

    def finish(self) -> None:
        """The request is done (observed once, however often called)."""
        if not self.finished:
            self.finished = True
            self.metrics.e2e.observe(time.monotonic() - self.start)


class EngineGauges(Protocol):
    """What the backend's engine reports (backend.engine_types.WorkerStatus has these fields)."""
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int


class BackendMetrics(ServingMetrics):
    """ServingMetrics plus the engine's running/waiting/KV gauges, read from `status()` at each scrape."""

    def __init__(self, status: Callable[[], EngineGauges], registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.registry.register(_CallbackCollector(lambda: _engine_families(status())))


class FrontendMetrics(ServingMetrics):
    """ServingMetrics plus this frontend's requests in flight: waiting for a first token, or streaming."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.running = Gauge("kvyard:num_requests_running", "Requests streaming tokens through this "
                             "frontend", registry=self.registry)
        self.waiting = Gauge("kvyard:num_requests_waiting", "Requests sent to a backend, waiting for "
                             "their first token", registry=self.registry)


class BackendView(Protocol):
    """One backend as the master sees it (master.policy.BackendLoad has these fields)."""
    name: str
    healthy: bool
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int


class MasterMetrics:
    """The master's routing decisions, and each known backend's last polled load (label `backend`)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.requests = Counter("kvyard:requests", "Requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=self.registry)
        self.routing_decisions = Counter("kvyard:master_routing_decisions", "Schedule calls by the policy's "
                                         "reason (prefix_hit, shortest_ttft, imbalance, or why none)",
                                         ["reason"], registry=self.registry)
        self.prefix_cache_queries = Counter("kvyard:prefix_cache_queries", "Prompt tokens of routed "
                                            "requests", registry=self.registry)
        self.prefix_cache_hits = Counter("kvyard:prefix_cache_hits", "Of those, tokens the chosen backend "
                                         "was expected to have cached", registry=self.registry)

    def count(self, endpoint: str, status: str | int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def record_decision(self, reason: str, prompt_tokens: int = 0, hit_tokens: int = 0) -> None:
        """One /rtp_llm/schedule answer; tokens only when a backend was chosen."""
        self.routing_decisions.labels(reason).inc()
        self.prefix_cache_queries.inc(prompt_tokens)
        self.prefix_cache_hits.inc(hit_tokens)

    def watch_backends(self, backends: Callable[[], Iterable[BackendView]]) -> None:
        """Publish every backend's running/waiting/KV gauges and health, read at each scrape."""
        self.registry.register(_CallbackCollector(lambda: _backend_families(backends())))


class UpstreamView(Protocol):
    """One gateway upstream (gateway.upstreams.Upstream has these fields)."""
    url: str
    healthy: bool
    in_flight: int


class GatewayMetrics:
    """The gateway's view of each upstream (label `upstream`, its URL): queue wait, time to first byte,
    exchange latency, responses by status, failures by kind, plus live in-flight/health/queue gauges."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.requests = Counter("kvyard:requests", "Requests by endpoint and HTTP status", ["endpoint", "status"],
                                registry=r)
        self.queue_wait = Histogram("kvyard:gateway_queue_wait_seconds", "From arrival to dispatch to an upstream",
                                    ["upstream"], buckets=TTFT_BUCKETS, registry=r)
        self.ttft = Histogram("kvyard:gateway_upstream_ttft_seconds", "From dispatch to the upstream's first "
                              "body byte (a streamed request's time to first token)", ["upstream"],
                              buckets=TTFT_BUCKETS, registry=r)
        self.latency = Histogram("kvyard:gateway_upstream_latency_seconds", "From dispatch to the end of the "
                                 "upstream's response", ["upstream"], buckets=E2E_BUCKETS, registry=r)
        self.responses = Counter("kvyard:gateway_upstream_responses", "Exchanges by upstream and HTTP status "
                                 "(none: no response)", ["upstream", "status"], registry=r)
        self.errors = Counter("kvyard:gateway_upstream_errors", "Failed exchanges by kind (5xx, connection, "
                              "timeout); 4xx are the client's and not counted", ["upstream", "kind"], registry=r)
        self.routing_decisions = Counter("kvyard:gateway_routing_decisions", "Dispatches by reason "
                                         "(least_connection, prefix_hit, shortest_ttft, imbalance)", ["reason"],
                                         registry=r)

    def count(self, endpoint: str, status: str | int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def dispatched(self, upstream: str, reason: str, waited_s: float) -> None:
        self.queue_wait.labels(upstream).observe(waited_s)
        self.routing_decisions.labels(reason).inc()

    def first_byte(self, upstream: str, seconds: float) -> None:
        self.ttft.labels(upstream).observe(seconds)

    def finished(self, upstream: str, outcome: str, status: int | None, seconds: float) -> None:
        """One exchange ended: `outcome` is ok, cancelled (the client left) or a failure kind."""
        self.latency.labels(upstream).observe(seconds)
        self.responses.labels(upstream, "none" if status is None else str(status)).inc()
        if outcome not in ("ok", "cancelled"):
            self.errors.labels(upstream, outcome).inc()

    def watch(self, upstreams: Callable[[], Iterable[UpstreamView]], queued: Callable[[], int]) -> None:
        """Publish each upstream's requests in flight and health, and the queue's length, at each scrape."""
        self.registry.register(_CallbackCollector(lambda: _upstream_families(upstreams(), queued())))


def add_metrics_route(app: FastAPI, registry: CollectorRegistry) -> None:
    """GET /metrics: the Prometheus text format of `registry`."""
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)


class Counting(Protocol):
    def count(self, endpoint: str, status: str | int) -> None: ...


class HttpMetricsMiddleware:
    """ASGI middleware: counts each HTTP request by its route template and response status. Add it
    before any middleware that copies the scope: the router records the matched route in the scope."""

    def __init__(self, app: Any, metrics: Counting) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # an exception with no response sent ends as a 500

        async def send_and_watch(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            # The template (`/v1/chat/completions`), never the raw path: one series per URL would explode.
            self.metrics.count(getattr(scope.get("route"), "path", "unmatched"), status)


class _CallbackCollector(Collector):
    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterator[Metric]:
        yield from self._collect()


def _kv_usage(free_blocks: int, total_blocks: int) -> float:
    return 1.0 - free_blocks / total_blocks if total_blocks else 0.0


def _engine_families(st: EngineGauges) -> list[Metric]:
    return [GaugeMetricFamily("kvyard:num_requests_running", "Sequences holding KV blocks", st.running),
            GaugeMetricFamily("kvyard:num_requests_waiting", "Sequences queued, new or preempted", st.waiting),
            GaugeMetricFamily("kvyard:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full; cached "
                              "but unreferenced blocks count as free)", _kv_usage(st.free_blocks, st.total_blocks))]


def _backend_families(backends: Iterable[BackendView]) -> list[Metric]:
    running = GaugeMetricFamily("kvyard:num_requests_running", "Each backend's running sequences (last poll)",
                                labels=["backend"])
    waiting = GaugeMetricFamily("kvyard:num_requests_waiting", "Each backend's queued sequences (last poll)",
                                labels=["backend"])
    kv = GaugeMetricFamily("kvyard:kv_cache_usage_perc", "Each backend's KV use, 0..1 (last poll)",
                           labels=["backend"])
    healthy = GaugeMetricFamily("kvyard:backend_healthy", "1 when the backend can be routed to",
                                labels=["backend"])
    for b in backends:
        running.add_metric([b.name], b.running)
        waiting.add_metric([b.name], b.waiting)
        kv.add_metric([b.name], _kv_usage(b.free_blocks, b.total_blocks))
        healthy.add_metric([b.name], 1.0 if b.healthy else 0.0)
    return [running, waiting, kv, healthy]


def _upstream_families(upstreams: Iterable[UpstreamView], queued: int) -> list[Metric]:
    in_flight = GaugeMetricFamily("kvyard:gateway_upstream_in_flight", "Requests dispatched to the upstream and "
                                  "not finished", labels=["upstream"])
    healthy = GaugeMetricFamily("kvyard:gateway_upstream_healthy", "1 when the upstream takes requests",
                                labels=["upstream"])
    for u in upstreams:
        in_flight.add_metric([u.url], u.in_flight)
        healthy.add_metric([u.url], 1.0 if u.healthy else 0.0)
    waiting = GaugeMetricFamily("kvyard:num_requests_waiting", "Requests queued for a free upstream", queued)
    return [in_flight, healthy, waiting]
