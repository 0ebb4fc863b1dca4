"""The master's one owner of backend state: who exists, their polled load and cache keys, what was routed."""
from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from typing import Any

from kvyard.roles import Role
from kvyard.worker_status import WorkerStatus
from master.backend_poller import CacheUpdate
from master.config import BackendEndpoint, MasterConfig
from master.policy import BackendLoad

log = logging.getLogger("kvyard.master")

SOURCE_STATIC = "static"
SOURCE_REGISTERED = "registered"


@dataclass
class _Routed:
    at: float            # when the master chose this backend for it
    prefill_tokens: int  # its prompt tokens not covered by the cache
    kv_tokens: int       # KV tokens it will hold


@dataclass
class BackendState:
    endpoint: BackendEndpoint
    sources: set[str]                      # "static", "dns:<name>", "registered"
    last_seen: float                       # last registration or good poll (for forgetting)
    status: WorkerStatus | None = None       # last sane status
    last_ok: float = 0.0                   # when it arrived (0 = never)
    error: str | None = None               # last poll failure, None once a poll succeeds
    definitive_error: bool = False         # that failure takes it out of routing at once
    cache_keys: set[int] = field(default_factory=set)
    cache_version: int = -1                # the backend's cache version cache_keys reflect; -1 = none
    pending: dict[int, float] = field(default_factory=dict)  # key of a just-routed prompt → expiry
    routed: deque[_Routed] = field(default_factory=deque)    # routed since its last poll
    recent: OrderedDict[int, float] = field(default_factory=OrderedDict)  # working set: key of a prompt
                                           # routed here → when, oldest first; kept working_set_s
    last_chosen: float = 0.0
    poll_latency_ms: float = 0.0           # round trip of the last good status poll
    routed_requests: int = 0               # requests routed to it since the master started
    routed_prompt_tokens: int = 0          # their prompt tokens (not counted for DECODE backends)
    routed_hit_tokens: int = 0             # of those, tokens its cache held when routed


@dataclass(frozen=True)
class BackendSummary:
    """One backend for the dashboard and /metrics (master/metrics.py)."""
    name: str
    model: str
    role: str
    healthy: bool
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    step_latency_ms: float
    prefill_tokens_per_s: float
    poll_latency_ms: float
    routed_requests: int
    routed_prompt_tokens: int
    routed_hit_tokens: int
    cached_blocks: int
    error: str | None


@dataclass
class RoutingStats:
    """Counters that show whether prefix routing works (a hit rate of 0 means the keys disagree)."""
    requests: int = 0          # schedule calls that chose a backend
    hit_requests: int = 0      # ... whose chosen backend had some of the prompt cached
    prompt_tokens: int = 0
    hit_tokens: int = 0
    rejected: int = 0          # schedule calls answered with an error
    decisions: dict[str, int] = field(default_factory=dict)  # schedule calls by the policy's reason


class Registry:
    """Mutated only from the master's event loop (discovery, pollers, HTTP handlers)."""

    def __init__(self, cfg: MasterConfig) -> None:
        self.cfg = cfg
        self.backends: dict[str, BackendState] = {}
        self.stats = RoutingStats()

    # ---- membership -------------------------------------------------------------------------

    def add(self, endpoint: BackendEndpoint, source: str, now: float) -> bool:
        """True when the backend is new to the registry."""
        state = self.backends.get(endpoint.name)
        if state is None:
            self.backends[endpoint.name] = BackendState(endpoint, {source}, last_seen=now)
            log.info("backend %s (%s) added from %s", endpoint.name, endpoint.model, source)
            return True
        state.sources.add(source)
        if source != SOURCE_REGISTERED:  # only a registration names the role; else the last poll told it
            endpoint = replace(endpoint, role=state.endpoint.role)
        state.endpoint = endpoint  # a re-registration may carry a new model or port
        if source == SOURCE_REGISTERED:
            state.last_seen = max(state.last_seen, now)
        return False

    def sync_source(self, source: str, endpoints: list[BackendEndpoint], now: float) -> None:
        """Make `source` (a DNS name) name exactly these backends; drop the ones it named before."""
        names = {e.name for e in endpoints}
        for e in endpoints:
            self.add(e, source, now)
        for name, state in list(self.backends.items()):
            if source in state.sources and name not in names:
                state.sources.discard(source)
                if not state.sources:
                    del self.backends[name]

    def forget_stale(self, now: float) -> None:
        """Self-registered backends that stopped registering and answering are forgotten."""
        for name, state in list(self.backends.items()):
            if state.sources == {SOURCE_REGISTERED} and now - state.last_seen > self.cfg.forget_s:
                log.info("backend %s forgotten: silent and unregistered for %.0f s", name, self.cfg.forget_s)
                del self.backends[name]

    # ---- poll results -----------------------------------------------------------------------

    def apply_status(self, name: str, status: WorkerStatus, sent_at: float, now: float) -> None:
        state = self.backends.get(name)
        if state is None:
            return
        if state.status is not None and status.iterate_count < state.status.iterate_count:
            state.cache_keys.clear()  # it restarted: its old cache is gone, whatever the version says
            state.cache_version = -1
        state.status, state.last_ok, state.last_seen = status, now, now
        if status.role != state.endpoint.role:  # a backend found by DNS or a static list says what it is
            log.info("backend %s reports role %s", name, status.role)
            state.endpoint = replace(state.endpoint, role=status.role)
        state.poll_latency_ms = (now - sent_at) * 1000
        state.error, state.definitive_error = None, False
        # What was routed well before this poll was sent is in the reported queue by now.
        while state.routed and state.routed[0].at < sent_at - self.cfg.routed_grace_s:
            state.routed.popleft()
        for key in [k for k, expiry in state.pending.items() if expiry <= now]:
            del state.pending[key]
        while state.recent and next(iter(state.recent.values())) <= now - self.cfg.working_set_s:
            state.recent.popitem(last=False)

    def needs_cache(self, name: str) -> int | None:
        """The version to ask a cache diff from, or None when our keys are current."""
        state = self.backends.get(name)
        if state is None or state.status is None or state.status.cache_version == state.cache_version:
            return None
        return state.cache_version

    def apply_cache(self, name: str, update: CacheUpdate) -> None:
        state = self.backends.get(name)
        if state is None:
            return
        if update.is_diff:
            state.cache_keys |= update.added
            state.cache_keys -= update.removed
        else:
            state.cache_keys = set(update.keys)
        state.cache_version = update.version
        for key in update.added or update.keys:
            state.pending.pop(key, None)

    def mark_failed(self, name: str, message: str, definitive: bool) -> None:
        state = self.backends.get(name)
        if state is not None:
            state.error, state.definitive_error = message, definitive

    # ---- what the policy reads --------------------------------------------------------------

    def healthy(self, state: BackendState, now: float) -> bool:
        return (state.status is not None and state.status.alive and not state.definitive_error
                and now - state.last_ok < self.cfg.expire_s)

    def loads(self, now: float) -> list[BackendLoad]:
        """Views into the registry's sets: valid until the next await."""
        out = []
        for name, s in self.backends.items():
            st = s.status
            base: dict[str, Any] = {} if st is None else dict(
                running=st.running, waiting=st.waiting, queued_prefill_tokens=st.queued_prefill_tokens,
                step_latency_ms=st.step_latency_ms, prefill_tokens_per_s=st.prefill_tokens_per_s,
                free_blocks=st.free_blocks, total_blocks=st.total_blocks, block_size=st.block_size,
                adapters=frozenset(st.adapters))
            out.append(BackendLoad(
                name=name, model=s.endpoint.model, healthy=self.healthy(s, now), role=s.endpoint.role, **base,
                cached_keys=s.cache_keys, pending_keys=s.pending.keys(), recent_keys=s.recent.keys(),
                routed_requests=len(s.routed), routed_prefill_tokens=sum(r.prefill_tokens for r in s.routed),
                routed_kv_tokens=sum(r.kv_tokens for r in s.routed), last_chosen=s.last_chosen))
        return out

    def record_choice(self, name: str, keys: list[int], seq_len: int, hit: int, now: float) -> None:
        """The request counts as load and its prompt as cached there before the next poll says so, and as
        part of the backend's working set for working_set_s."""
        state = self.backends[name]
        state.last_chosen = now
        state.routed_requests += 1
        # A decode backend gets its KV handed over, not looked up, and its half of a PD choice is the same
        # request as the prefill half: its prompt and the request count once, on the prefill side.
        if state.endpoint.role != Role.DECODE:
            state.routed_prompt_tokens += seq_len
            state.routed_hit_tokens += hit
            self.stats.requests += 1
            self.stats.hit_requests += hit > 0
            self.stats.prompt_tokens += seq_len
            self.stats.hit_tokens += hit
        state.routed.append(_Routed(now, seq_len - hit, seq_len - hit))
        expiry = now + self.cfg.pending_keys_ttl_s
        for key in keys:
            if key not in state.cache_keys:
                state.pending[key] = expiry
            state.recent[key] = now
            state.recent.move_to_end(key)

    # ---- the live view ----------------------------------------------------------------------

    def models(self) -> list[str]:
        return sorted({s.endpoint.model for s in self.backends.values()})

    def summaries(self, now: float) -> list[BackendSummary]:
        out = []
        for name, s in sorted(self.backends.items()):
            st = s.status
            out.append(BackendSummary(
                name=name, model=s.endpoint.model, role=s.endpoint.role, healthy=self.healthy(s, now),
                running=st.running if st else 0, waiting=st.waiting if st else 0,
                free_blocks=st.free_blocks if st else 0, total_blocks=st.total_blocks if st else 0,
                step_latency_ms=st.step_latency_ms if st else 0.0,
                prefill_tokens_per_s=st.prefill_tokens_per_s if st else 0.0, poll_latency_ms=s.poll_latency_ms,
                routed_requests=s.routed_requests, routed_prompt_tokens=s.routed_prompt_tokens,
                routed_hit_tokens=s.routed_hit_tokens, cached_blocks=len(s.cache_keys), error=s.error))
        return out

    def view(self, now: float) -> dict[str, Any]:
        backends = []
        for name, s in sorted(self.backends.items()):
            e = s.endpoint
            backends.append({
                "name": name, "model": e.model, "role": e.role, "server_ip": e.host,
                "grpc_port": e.grpc_port, "http_port": e.http_port, "sources": sorted(s.sources),
                "healthy": self.healthy(s, now),
                "last_ok_ms_ago": round((now - s.last_ok) * 1000) if s.last_ok else None,
                "error": s.error, "status": None if s.status is None else s.status.__dict__,
                "cached_blocks": len(s.cache_keys), "cache_version": s.cache_version,
                "pending_blocks": len(s.pending), "routed_since_poll": len(s.routed),
            })
        st = self.stats
        hit_rate = st.hit_tokens / st.prompt_tokens if st.prompt_tokens else 0.0
        return {"backends": backends, "stats": {**st.__dict__, "prefix_hit_rate": round(hit_rate, 4)}}
