"""The gateway's Prometheus metrics. Per exchange, labelled `upstream` (its URL) and `model_name` (the model
the request asked for; only names some upstream serves get this far): queue wait, time to first byte,
exchange latency, responses by status, failures by kind, routing decisions. Per upstream, whatever models it
serves: live in-flight and health gauges; and the queue's length."""
from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from gateway.dispatch import Lease
from gateway.upstreams import Upstream
from kvyard.metrics import E2E_BUCKETS, TTFT_BUCKETS, CallbackCollector

EXCHANGE = ["upstream", "model_name"]  # the labels of every per-exchange series

class GatewayMetrics:
    """One registry for the gateway app (module docstring: what is labelled how)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.requests = Counter("kvyard:requests", "Requests by endpoint and HTTP status", ["endpoint", "status"],
                                registry=r)
        self.queue_wait = Histogram("kvyard:gateway_queue_wait_seconds", "From arrival to dispatch to an upstream",
                                    EXCHANGE, buckets=TTFT_BUCKETS, registry=r)
        self.ttft = Histogram("kvyard:gateway_upstream_ttft_seconds", "From dispatch to the upstream's first "
                              "body byte (a streamed request's time to first token)", EXCHANGE,
                              buckets=TTFT_BUCKETS, registry=r)
        self.latency = Histogram("kvyard:gateway_upstream_latency_seconds", "From dispatch to the end of the "
                                 "upstream's response", EXCHANGE, buckets=E2E_BUCKETS, registry=r)
        self.responses = Counter("kvyard:gateway_upstream_responses", "Exchanges by upstream and HTTP status "
                                 "(none: no response)", [*EXCHANGE, "status"], registry=r)
        self.errors = Counter("kvyard:gateway_upstream_errors", "Failed exchanges by kind (5xx, connection, "
                              "timeout); 4xx are the client's and not counted", [*EXCHANGE, "kind"], registry=r)
        self.routing_decisions = Counter("kvyard:gateway_routing_decisions", "Dispatches by reason "
                                         "(least_connection, prefix_hit, shortest_ttft, imbalance)", ["reason", "model_name"],
                                         registry=r)

    def count(self, endpoint: str, status: str | int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def dispatched(self, lease: Lease, waited_s: float) -> None:
        self.queue_wait.labels(lease.upstream, lease.ticket.model).observe(waited_s)
        self.routing_decisions.labels(lease.reason, lease.ticket.model).inc()

    def first_byte(self, lease: Lease, seconds: float) -> None:
        self.ttft.labels(lease.upstream, lease.ticket.model).observe(seconds)

    def finished(self, lease: Lease, outcome: str, status: int | None, seconds: float) -> None:
        """One exchange ended: `outcome` is ok, cancelled (the client left) or a failure kind."""
        exchange = (lease.upstream, lease.ticket.model)
        self.latency.labels(*exchange).observe(seconds)
        self.responses.labels(*exchange, "none" if status is None else str(status)).inc()
        if outcome not in ("ok", "cancelled"):
            self.errors.labels(*exchange, outcome).inc()

    def watch(self, upstreams: Callable[[], Iterable[Upstream]], queued: Callable[[], int]) -> None:
        """Publish each upstream's requests in flight and health, and the queue's length, at each scrape."""
        self.registry.register(CallbackCollector(lambda: _upstream_families(upstreams(), queued())))


def _upstream_families(upstreams: Iterable[Upstream], queued: int) -> list[Metric]:
    in_flight = GaugeMetricFamily("kvyard:gateway_upstream_in_flight", "Requests dispatched to the upstream and "
                                  "not finished", labels=["upstream"])
    healthy = GaugeMetricFamily("kvyard:gateway_upstream_healthy", "1 when the upstream takes requests",
                                labels=["upstream"])
    for u in upstreams:
        in_flight.add_metric([u.url], u.in_flight)
        healthy.add_metric([u.url], 1.0 if u.healthy else 0.0)
    waiting = GaugeMetricFamily("kvyard:num_requests_waiting", "Requests queued for a free upstream", queued)
    return [in_flight, healthy, waiting]
