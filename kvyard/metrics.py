"""Prometheus metrics: one CollectorRegistry per app, vLLM's names, GET /metrics, the HTTP request counter.

Frontend and backend record the same request metrics (TTFT, inter-token and end-to-end latency, prompt
and generated tokens, prefix-cache queries/hits); the backend adds engine gauges read at scrape time
(running, waiting, KV use, preemptions, step latency) and its requests' queue time. The master's
(master/metrics.py) and the gateway's (gateway/metrics.py) build on the pieces here.

Every serving metric carries `model_name`, as vLLM's do: the name is `kvyard:` where vLLM has `vllm:`,
the rest of the name and its meaning the same (docs/operations.md, "Metrics", has the mapping), so a dashboard or
autoscaler written for vLLM reads these after replacing the prefix.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvyard.worker_status import WorkerStatus

# vLLM's buckets, so existing dashboards read these the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


MODEL = ["model_name"]

# kvyard's name → vLLM's (prefix aside, the same names and meanings; docs/operations.md "Metrics" shows this table).
VLLM_EQUIVALENTS = {
    "kvyard:num_requests_running": "vllm:num_requests_running",
    "kvyard:num_requests_waiting": "vllm:num_requests_waiting",
    "kvyard:kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "kvyard:time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "kvyard:inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "kvyard:e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "kvyard:request_queue_time_seconds": "vllm:request_queue_time_seconds",
    "kvyard:num_preemptions": "vllm:num_preemptions",
    "kvyard:prompt_tokens": "vllm:prompt_tokens",
    "kvyard:generation_tokens": "vllm:generation_tokens",
    "kvyard:prefix_cache_queries": "vllm:prefix_cache_queries",
    "kvyard:prefix_cache_hits": "vllm:prefix_cache_hits",
}
QUEUE_BUCKETS = E2E_BUCKETS  # vLLM uses its request-latency buckets for queue time


class ServingMetrics:
    """Request-level metrics of one app (frontend or backend) serving `model_name`, in a registry of its own."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry or CollectorRegistry()
        r, m = self.registry, model_name
        self.requests = Counter("kvyard:requests", "Requests by endpoint and status (frontend: the HTTP "
                                "status; backend: ok or the error kind)", ["endpoint", "status", "model_name"],
                                registry=r)
        self.ttft = Histogram("kvyard:time_to_first_token_seconds", "Time from request to its first token",
                              MODEL, buckets=TTFT_BUCKETS, registry=r).labels(m)
        self.itl = Histogram("kvyard:inter_token_latency_seconds", "Time between a request's output steps",
                             MODEL, buckets=ITL_BUCKETS, registry=r).labels(m)
        self.e2e = Histogram("kvyard:e2e_request_latency_seconds", "Time from request to its last token",
                             MODEL, buckets=E2E_BUCKETS, registry=r).labels(m)
        self.prompt_tokens = Counter("kvyard:prompt_tokens", "Prompt tokens of requests that started "
                                     "generating", MODEL, registry=r).labels(m)
        self.generation_tokens = Counter("kvyard:generation_tokens", "Tokens generated", MODEL,
                                         registry=r).labels(m)
        self.prefix_cache_queries = Counter("kvyard:prefix_cache_queries", "Prompt tokens looked up in the "
                                            "prefix cache", MODEL, registry=r).labels(m)
        self.prefix_cache_hits = Counter("kvyard:prefix_cache_hits", "Prompt tokens served from the prefix "
                                         "cache", MODEL, registry=r).labels(m)
        self._queried = 0
        self._hit = 0
        Gauge("kvyard:prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries since start", MODEL,
              registry=r).labels(m).set_function(lambda: self._hit / self._queried if self._queried else 0.0)

    def count(self, endpoint: str, status: str | int) -> None:
        self.requests.labels(endpoint, str(status), self.model_name).inc()

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


class BackendMetrics(ServingMetrics):
    """ServingMetrics plus the engine's gauges, read from `status()` at each scrape, its preemptions (a
    running count read from `preemptions()`), and each request's time in the queue."""

    def __init__(self, status: Callable[[], WorkerStatus], model_name: str,
                 preemptions: Callable[[], int] = lambda: 0, registry: CollectorRegistry | None = None) -> None:
        super().__init__(model_name, registry)
        self.queue_time = Histogram("kvyard:request_queue_time_seconds", "Time a request waited before its "
                                    "first engine step", MODEL, buckets=QUEUE_BUCKETS,
                                    registry=self.registry).labels(model_name)
        self.registry.register(CallbackCollector(lambda: _engine_families(status(), preemptions(), model_name)))


class FrontendMetrics(ServingMetrics):
    """ServingMetrics plus this frontend's requests in flight: waiting for a first token, or streaming."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        super().__init__(model_name, registry)
        self.running = Gauge("kvyard:num_requests_running", "Requests streaming tokens through this "
                             "frontend", MODEL, registry=self.registry).labels(model_name)
        self.waiting = Gauge("kvyard:num_requests_waiting", "Requests sent to a backend, waiting for "
                             "their first token", MODEL, registry=self.registry).labels(model_name)


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


class CallbackCollector(Collector):
    """Metric families computed at each scrape by `collect`."""

    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterator[Metric]:
        yield from self._collect()


def kv_usage(free_blocks: int, total_blocks: int) -> float:
    return 1.0 - free_blocks / total_blocks if total_blocks else 0.0


def _engine_families(st: WorkerStatus, preemptions: int, model: str) -> list[Metric]:
    families = [
        GaugeMetricFamily("kvyard:num_requests_running", "Sequences holding KV blocks", labels=MODEL),
        GaugeMetricFamily("kvyard:num_requests_waiting", "Sequences queued, new or preempted", labels=MODEL),
        GaugeMetricFamily("kvyard:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full; cached but "
                          "unreferenced blocks count as free)", labels=MODEL),
        CounterMetricFamily("kvyard:num_preemptions", "Sequences preempted (KV dropped, recomputed later) "
                            "to make room", labels=MODEL),
        GaugeMetricFamily("kvyard:step_latency_seconds", "Recent engine step time (moving average)",
                          labels=MODEL),
        GaugeMetricFamily("kvyard:prefill_tokens_per_second", "Recent prefill throughput (moving average)",
                          labels=MODEL)]
    values = (st.running, st.waiting, kv_usage(st.free_blocks, st.total_blocks), preemptions,
              st.step_latency_ms / 1000, st.prefill_tokens_per_s)
    for family, value in zip(families, values):
        family.add_metric([model], value)
    return families
