"""Gateway request → an upstream lease: pick a free healthy upstream, or wait in the queue for one.

The seed's batching algorithm: an upstream is busy from dispatch until its response ends
(MAX_CONNECT_PER_UPSTREAM requests at once); among free healthy upstreams serving the model the
choice is least-connection, or (GATEWAY_ROUTING=prefix, the default) the master's own policy for
servers that report nothing (master.policy.choose_server) fed with what the gateway sent each upstream:
its approximate prefix tree, its requests in flight, and the uncached prompt bytes of those with no byte
back yet (by then their prompt is computed) as its queued work. So with no prefix hit anywhere it is
least-work, a long shared prefix wins a slightly busier upstream, and the master's imbalance guard
overrides the cache when loads drift apart. When nothing is free the request waits (kvyard.wait_queue:
bounded, by priority, then FIFO) and is dispatched the moment a lease is released or an upstream turns
healthy; past WAIT_FOR or the bound it is a 429.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from gateway.config import ROUTING_LEAST_CONNECTION, GatewayConfig
from gateway.upstreams import Upstream, UpstreamTable
from kvyard.errors import ErrorCode, RequestError
from kvyard.wait_queue import QueueFull, WaitQueue
from master.policy import ServerLoad, choose_server


@dataclass(frozen=True)
class Ticket:
    """One request asking for an upstream."""
    model: str                             # routes the request
    keys: tuple[int, ...] = ()             # prefix keys of its rendered text (gateway.prefix)
    size: int = 1                          # bytes of that text the keys cover (≥ 1)
    priority: int = 0                      # lower is served first
    exclude: frozenset[str] = frozenset()  # upstreams that already failed it (a retry)


@dataclass
class Lease:
    """An upstream slot held by one request until `Dispatcher.release`."""
    upstream: str          # its URL
    ticket: Ticket
    reason: str            # least_connection, or the policy's: prefix_hit, shortest_ttft, imbalance
    hit_bytes: int         # prefix the upstream likely has cached
    work: int              # uncached bytes counted as queued work there until its first byte
    released: bool = False


class Dispatcher:
    """Owns the leases and the wait queue (one event loop)."""

    def __init__(self, cfg: GatewayConfig, table: UpstreamTable, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.table = table
        self.clock = clock
        self.policy = replace(cfg.policy, max_waiting=cfg.max_connect_per_upstream)
        self.queue: WaitQueue[Ticket, Lease] = WaitQueue(cfg.queue_max, self.release)

    async def acquire(self, ticket: Ticket, wait_s: float) -> Lease:
        """A lease now, or after waiting at most `wait_s`; else OVERLOADED (a 429). Unknown model: 404."""
        if not self.table.serving(ticket.model):
            models = ", ".join(self.table.models()) or "none yet"
            raise RequestError(ErrorCode.MODEL_NOT_FOUND, f"The model '{ticket.model}' does not exist; the "
                               f"upstreams serve: {models}", "model")
        if not any(t.model == ticket.model for t in self.queue.items()):  # no jumping the queue
            lease = self.choose(ticket)
            if lease is not None:
                return lease
        try:
            waiter = self.queue.push(ticket, ticket.priority)
        except QueueFull as exc:
            raise RequestError(ErrorCode.OVERLOADED, f"every upstream serving '{ticket.model}' is busy and {exc}; "
                               "retry shortly") from None
        try:
            return await self.queue.wait(waiter, wait_s)
        except TimeoutError:
            raise RequestError(ErrorCode.OVERLOADED, f"no upstream serving '{ticket.model}' was free within "
                               f"{wait_s * 1000:.0f} ms (WAIT_FOR); retry shortly") from None

    def choose(self, ticket: Ticket) -> Lease | None:
        """Lease the best free healthy upstream for the ticket, or None when none is free."""
        now = self.clock()
        free = [u for u in self.table.serving(ticket.model) if u.url not in ticket.exclude
                and u.routable(now) and u.has_room(self.cfg.max_connect_per_upstream)]
        if not free:
            return None
        if self.cfg.routing == ROUTING_LEAST_CONNECTION:
            chosen = min(free, key=lambda u: (u.in_flight, u.last_chosen, u.url))
            return self._lease(chosen, ticket, "least_connection", 0, now)
        servers = [ServerLoad(u.url, ticket.model, u.in_flight, u.in_flight_bytes, self.cfg.prefix_block_bytes,
                              u.prefix, u.last_chosen) for u in free]
        decision = choose_server(ticket.model, ticket.keys, ticket.size, servers, self.policy)
        if decision.chosen is None:  # cannot happen with every candidate free; never strand the request
            return None
        hit = decision.candidate(decision.chosen).hit_cache_len
        return self._lease(self.table.upstreams[decision.chosen], ticket, decision.reason, hit, now)

    def _lease(self, u: Upstream, ticket: Ticket, reason: str, hit: int, now: float) -> Lease:
        work = max(0, ticket.size - hit)
        self.table.dispatched(u.url, ticket.keys, work, now)
        return Lease(u.url, ticket, reason, hit, work)

    def started(self, lease: Lease) -> None:
        """The upstream sent its first byte: its prompt is computed, so it no longer counts as queued work."""
        self.table.answering(lease.upstream, lease.work)
        lease.work = 0

    def release(self, lease: Lease) -> None:
        """The lease's response or stream ended (or it was never used): the upstream is free for the
        next waiter at once. Releasing twice is a no-op."""
        if lease.released:
            return
        lease.released = True
        self.table.finished(lease.upstream, lease.work)
        self.pump()

    def pump(self) -> int:
        """Dispatch waiting requests to whatever is free now (after a release or a health change)."""
        return self.queue.pump(self.choose)

