"""The master's Prometheus metrics: its routing decisions, and each backend's last polled load, latency and
routed prefix hits (label `backend`), read from the registry at each scrape. Names and buckets as in
kvyard/metrics.py."""
from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvyard.metrics import MODEL, CallbackCollector, kv_usage
from master.registry import BackendSummary

UNKNOWN_MODEL = "unknown"  # the model_name of decisions for a model no backend serves (unbounded names)


class MasterMetrics:
    """The master's routing decisions, and each known backend's last polled load (label `backend`)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.requests = Counter("kvyard:requests", "Requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=self.registry)
        self.routing_decisions = Counter("kvyard:master_routing_decisions", "Schedule calls by the policy's "
                                         "reason (prefix_hit, shortest_ttft, imbalance, or why none)",
                                         ["reason", "model_name"], registry=self.registry)
        self.prefix_cache_queries = Counter("kvyard:prefix_cache_queries", "Prompt tokens of routed "
                                            "requests", MODEL, registry=self.registry)
        self.prefix_cache_hits = Counter("kvyard:prefix_cache_hits", "Of those, tokens the chosen backend "
                                         "was expected to have cached", MODEL, registry=self.registry)

    def count(self, endpoint: str, status: str | int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def record_decision(self, reason: str, model_name: str = UNKNOWN_MODEL, prompt_tokens: int = 0,
                        hit_tokens: int = 0) -> None:
        """One /rtp_llm/schedule answer; `model_name` only when the cluster serves it, tokens only when a
        backend was chosen."""
        self.routing_decisions.labels(reason, model_name).inc()
        if prompt_tokens:
            self.prefix_cache_queries.labels(model_name).inc(prompt_tokens)
            self.prefix_cache_hits.labels(model_name).inc(hit_tokens)

    def watch_backends(self, backends: Callable[[], Iterable[BackendSummary]]) -> None:
        """Publish every backend's load, latency, routed prefix hits and health, read at each scrape."""
        self.registry.register(CallbackCollector(lambda: _backend_families(backends())))

def _backend_families(backends: Iterable[BackendSummary]) -> list[Metric]:
    labels = ["backend", "model_name", "role"]
    gauges = {
        "running": GaugeMetricFamily("kvyard:num_requests_running", "Each backend's running sequences (last "
                                     "poll)", labels=labels),
        "waiting": GaugeMetricFamily("kvyard:num_requests_waiting", "Each backend's queued sequences (last "
                                     "poll)", labels=labels),
        "kv": GaugeMetricFamily("kvyard:kv_cache_usage_perc", "Each backend's KV use, 0..1 (last poll)",
                                labels=labels),
        "healthy": GaugeMetricFamily("kvyard:backend_healthy", "1 when the backend can be routed to",
                                     labels=labels),
        "step": GaugeMetricFamily("kvyard:backend_step_latency_seconds", "Each backend's recent engine step "
                                  "time (its moving average, last poll)", labels=labels),
        "prefill": GaugeMetricFamily("kvyard:backend_prefill_tokens_per_second", "Each backend's recent "
                                     "prefill throughput (last poll)", labels=labels),
        "poll": GaugeMetricFamily("kvyard:backend_poll_latency_seconds", "Round trip of the master's last "
                                  "status poll of each backend", labels=labels),
        "routed": CounterMetricFamily("kvyard:backend_routed_requests", "Requests the master routed to each "
                                      "backend", labels=labels),
        "queries": CounterMetricFamily("kvyard:backend_prefix_cache_queries", "Prompt tokens routed to each "
                                       "backend", labels=labels),
        "hits": CounterMetricFamily("kvyard:backend_prefix_cache_hits", "Of those, tokens its prefix cache "
                                    "held when routed", labels=labels),
    }
    for b in backends:
        key = [b.name, b.model, b.role]
        values = {"running": b.running, "waiting": b.waiting, "kv": kv_usage(b.free_blocks, b.total_blocks),
                  "healthy": 1.0 if b.healthy else 0.0, "step": b.step_latency_ms / 1000,
                  "prefill": b.prefill_tokens_per_s, "poll": b.poll_latency_ms / 1000,
                  "routed": b.routed_requests, "queries": b.routed_prompt_tokens, "hits": b.routed_hit_tokens}
        for name, family in gauges.items():
            family.add_metric(key, values[name])
    return list(gauges.values())
