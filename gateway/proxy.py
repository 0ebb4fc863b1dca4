"""Gateway lease → upstream exchange → the client: the request's bytes out, the response's bytes back.

The request goes out exactly as it came (body and headers, less hop-by-hop ones); the response comes back
byte for byte as the upstream sends it (raw chunks, content encoding untouched), SSE included, each chunk
forwarded the moment it arrives. Before any byte reached the client, a connection error or a 5xx is
retried once on another routable upstream; after that, the upstream's answer is the client's. TIMEOUT
covers one exchange from dispatch to its last byte: a 504 before the first byte, a cut stream after.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

import anyio
import httpx
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher, Lease, Ticket
from gateway.metrics import GatewayMetrics
from gateway.upstreams import CONNECTION, OK, SERVER_ERROR, TIMEOUT, UpstreamTable
from kvyard.errors import ErrorCode, RequestError

log = logging.getLogger("kvyard.gateway")

# Meaningful for one connection only (RFC 9110 §7.6.1), or recomputed by the next hop.
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                        b"trailer", b"transfer-encoding", b"upgrade", b"host", b"proxy-connection"})
ATTEMPTS = 2


@dataclass(frozen=True)
class Incoming:
    """One client request, as received."""
    method: str
    target: str                            # path and query, e.g. "/v1/chat/completions"
    headers: list[tuple[bytes, bytes]]     # the client's, in order
    body: bytes
    ticket: Ticket                         # what the dispatcher needs to know about it
    arrived: float                         # monotonic seconds


@dataclass
class _Exchange:
    lease: Lease
    response: httpx.Response               # headers in, body not yet read
    dispatched: float                      # monotonic seconds
    deadline: float                        # event-loop time TIMEOUT ends at


class _Failed(Exception):
    def __init__(self, outcome: str, detail: str) -> None:
        super().__init__(detail)
        self.outcome = outcome
        self.detail = detail


class Proxy:
    """Owns one HTTP connection pool per upstream."""

    def __init__(self, cfg: GatewayConfig, table: UpstreamTable, dispatcher: Dispatcher, metrics: GatewayMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.table = table
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.clock = clock
        pool = httpx.Limits(max_connections=None, max_keepalive_connections=cfg.max_connect_per_upstream)
        timeout = httpx.Timeout(None, connect=cfg.connect_timeout_s)  # the whole exchange: TIMEOUT, below
        self.clients = {url: httpx.AsyncClient(base_url=url, limits=pool, timeout=timeout) for url in table.upstreams}

    async def close(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients.values()), return_exceptions=True)

    async def handle(self, incoming: Incoming) -> StreamingResponse:
        exchange = await self._open(incoming)
        headers = [(k, v) for k, v in exchange.response.headers.raw if k.lower() not in HOP_BY_HOP]
        return _UpstreamResponse(self._body(exchange), exchange.response.status_code, headers)

    async def _open(self, incoming: Incoming) -> _Exchange:
        """A lease and the upstream's response headers, retrying once elsewhere before any byte is sent."""
        ticket = incoming.ticket
        for attempt in range(ATTEMPTS):
            wait_s = self.cfg.wait_for_s - (self.clock() - incoming.arrived)
            lease = await self.dispatcher.acquire(ticket, wait_s)
            dispatched = self.clock()
            self.metrics.dispatched(lease, dispatched - incoming.arrived)
            last = attempt == ATTEMPTS - 1 or not self._can_retry(ticket, lease.upstream)
            try:
                exchange = await self._send(lease, incoming, dispatched)
            except asyncio.CancelledError:  # the client went away while the upstream was thinking
                self.metrics.finished(lease, "cancelled", None, self.clock() - dispatched)
                self.dispatcher.release(lease)
                raise
            except _Failed as failed:
                self._finish(lease, failed.outcome, dispatched, failed.detail)
                if failed.outcome == TIMEOUT:
                    raise RequestError(ErrorCode.TIMEOUT, f"the upstream did not answer within "
                                       f"{self.cfg.timeout_s * 1000:.0f} ms (TIMEOUT)") from None
                if last:
                    raise RequestError(ErrorCode.UNAVAILABLE, f"no upstream serving '{ticket.model}' could be "
                                       f"reached ({failed.detail})") from None
            else:
                if exchange.response.status_code < 500 or last:
                    return exchange
                self._finish(lease, SERVER_ERROR, dispatched, f"HTTP {exchange.response.status_code}")
                await _close(exchange.response)
            log.info("retrying a %s request on another upstream than %s", ticket.model, lease.upstream)
            ticket = replace(ticket, exclude=ticket.exclude | {lease.upstream})
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _can_retry(self, ticket: Ticket, failed: str) -> bool:
        now = self.clock()
        return any(u.url != failed and u.url not in ticket.exclude and u.routable(now)
                   for u in self.table.serving(ticket.model))

    async def _send(self, lease: Lease, incoming: Incoming, dispatched: float) -> _Exchange:
        client = self.clients[lease.upstream]
        request = client.build_request(incoming.method, incoming.target, headers=forwardable(incoming.headers),
                                       content=incoming.body)
        deadline = asyncio.get_running_loop().time() + self.cfg.timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                response = await client.send(request, stream=True)
        except TimeoutError:
            raise _Failed(TIMEOUT, "no response headers within TIMEOUT") from None
        except httpx.HTTPError as exc:
            raise _Failed(CONNECTION, f"{type(exc).__name__}: {exc}") from None
        return _Exchange(lease, response, dispatched, deadline)

    async def _body(self, exchange: _Exchange) -> AsyncIterator[bytes]:
        """The upstream's raw bytes as they come; the lease is released the moment the stream ends,
        fails, or the client goes away (which closes the upstream request)."""
        response, lease = exchange.response, exchange.lease
        outcome, detail = (SERVER_ERROR if response.status_code >= 500 else OK), f"HTTP {response.status_code}"
        first = True
        try:
            chunks = response.aiter_raw()
            while True:
                # The deadline covers the wait for each chunk only: a timeout must never fire while the
                # client's send is running outside this generator.
                async with asyncio.timeout_at(exchange.deadline):
                    chunk = await anext(chunks, None)
                if chunk is None:
                    break
                if first:
                    self.metrics.first_byte(lease, self.clock() - exchange.dispatched)
                    self.dispatcher.started(lease)
                    first = False
                yield chunk
        except TimeoutError:
            outcome, detail = TIMEOUT, "response not finished within TIMEOUT; stream cut"
        except httpx.HTTPError as exc:
            outcome, detail = CONNECTION, f"mid-response: {type(exc).__name__}: {exc}"
        finally:
            with anyio.CancelScope(shield=True):
                await _close(response)
            self._finish(lease, outcome, exchange.dispatched, detail, response.status_code)

    def _finish(self, lease: Lease, outcome: str, dispatched: float, detail: str, status: int | None = None) -> None:
        self.table.record_outcome(lease.upstream, outcome, self.clock(), detail)
        self.metrics.finished(lease, outcome, status, self.clock() - dispatched)
        self.dispatcher.release(lease)


async def _close(response: httpx.Response) -> None:
    try:
        await response.aclose()
    except httpx.HTTPError:
        pass


class _UpstreamResponse(StreamingResponse):
    """The upstream's status and raw header list (duplicates kept), and its body closed however the
    response ends: Starlette cancels the send when the client disconnects but leaves the iterator open."""

    def __init__(self, body: AsyncIterator[bytes], status: int, headers: list[tuple[bytes, bytes]]) -> None:
        super().__init__(body, status_code=status)
        self.raw_headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


def forwardable(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The client's request headers as sent on: httpx sets Host and Content-Length for the upstream."""
    return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP and k.lower() != b"content-length"]
