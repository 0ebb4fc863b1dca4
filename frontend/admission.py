"""The frontend's door, before any route runs: the API key (401), the body size (413) and how long it may
take to arrive (408), draining (503) and the concurrency limit (429). Each refusal is a RequestError
answered through the one error table.

What counts against CONCURRENCY_LIMIT is sequences being generated, not connections: an HTTP request
counts once its whole body is here (a stalled upload holds nobody else out), and routes that fan out
(n, several prompts) take one slot per sequence (Admission.hold); an LMTP WebSocket counts each of
its streams, not itself."""
from __future__ import annotations

import asyncio
import hmac
import time
from typing import Any
from urllib.parse import parse_qs

from frontend.config import FrontendConfig
from kvyard.cluster_auth import bearer
from kvyard.errors import ErrorCode, RequestError
from kvyard.http_errors import request_error_response

# Always answered, key or not: probes and scrapers carry no key.
OPEN_PATHS = frozenset({"/health", "/status", "/health_check", "/GraphService/cm2_status",
                        "/SearchService/cm2_status", "/metrics"})
BODY_TIMEOUT_S = 30.0  # the whole request body must arrive within this
_HELD = "kvyard.held_slots"  # scope key: slots a request holds beyond its first (Admission.hold)


class Admission:
    """Owns the count of generation requests in flight and the draining flag (set once, by SIGTERM)."""

    def __init__(self, cfg: FrontendConfig) -> None:
        self.api_key = cfg.api_key
        self.limit = cfg.concurrency_limit
        self.max_body_bytes = cfg.max_body_bytes
        self.in_flight = 0
        self.draining = False

    def start_draining(self) -> None:
        self.draining = True

    def hold(self, scope: dict[str, Any], sequences: int) -> None:
        """A request that generates `sequences` at once holds one slot per sequence (it holds one already,
        from the middleware); released when the request ends. More than the whole limit is a 400."""
        if sequences > self.limit:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"this request asks for {sequences} sequences at "
                               f"once (prompts x n); this server runs at most {self.limit} (CONCURRENCY_LIMIT)",
                               "n")
        extra = sequences - 1 - scope.get(_HELD, 0)
        if extra <= 0:
            return
        if self.in_flight + extra > self.limit:
            raise RequestError(ErrorCode.OVERLOADED, f"{self.in_flight} sequences are in flight and this request "
                               f"asks for {sequences}; the limit of this server is {self.limit} "
                               "(CONCURRENCY_LIMIT); retry later")
        self.in_flight += extra
        scope[_HELD] = scope.get(_HELD, 0) + extra

    def take_stream(self) -> None:
        """One LMTP stream starts: a slot of its own, or OVERLOADED / UNAVAILABLE."""
        if self.draining:
            raise RequestError(ErrorCode.UNAVAILABLE, "this server is draining (shutting down); retry")
        if self.in_flight >= self.limit:
            raise RequestError(ErrorCode.OVERLOADED, f"{self.in_flight} sequences are in flight, the limit of "
                               "this server (CONCURRENCY_LIMIT); retry later")
        self.in_flight += 1

    def end_stream(self) -> None:
        self.in_flight -= 1

    def authorized(self, scope: dict[str, Any]) -> bool:
        if not self.api_key:
            return True
        given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        key = bearer(given)  # the scheme is case-insensitive (RFC 9110), as for the cluster token
        if not key and scope["type"] == "websocket":  # WebSocket clients often cannot set headers
            key = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key", [""])[0]
        return hmac.compare_digest(key.encode(), self.api_key.encode())


def _is_open(scope: dict[str, Any]) -> bool:
    return scope["path"] in OPEN_PATHS or (scope["path"] == "/" and scope.get("method") == "GET")


class AdmissionMiddleware:
    """ASGI middleware over Admission. It passes the scope on unchanged (HttpMetricsMiddleware reads the
    matched route from it), so add it before the metrics middleware."""

    def __init__(self, app: Any, admission: Admission, generation: frozenset[str]) -> None:
        self.app = app
        self.admission = admission
        self.generation = generation   # the paths that generate (frontend/dialect.py's Routes.generation)

    def _is_generation(self, scope: dict[str, Any]) -> bool:
        """A request that holds a backend: counted against the limit, refused while draining. A generation
        path's POST (GET / is the health check) or WebSocket (LMTP at /lmtp and /)."""
        return scope["path"] in self.generation and (scope["type"] == "websocket" or scope.get("method") == "POST")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        adm = self.admission
        refusal: RequestError | None = None
        generation = self._is_generation(scope)
        if not _is_open(scope) and not adm.authorized(scope):
            refusal = RequestError(ErrorCode.UNAUTHENTICATED, "Incorrect or missing API key: send it as "
                                   "'Authorization: Bearer <key>'")
        elif generation and adm.draining:
            refusal = RequestError(ErrorCode.UNAVAILABLE, "this server is draining (shutting down); retry")
        elif scope["type"] == "http":
            receive, refusal = await self._bounded_body(scope, receive)
        counted = generation and scope["type"] == "http"  # a WebSocket's streams count one by one (take_stream)
        if refusal is None and counted and adm.in_flight >= adm.limit:  # counted once the body is here
            refusal = RequestError(ErrorCode.OVERLOADED, f"{adm.in_flight} sequences are in flight, the limit "
                                   f"of this server (CONCURRENCY_LIMIT); retry later")
        if refusal is not None:
            await self._refuse(scope, receive, send, refusal)
            return
        if counted:
            adm.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            if counted:
                adm.in_flight -= 1 + scope.pop(_HELD, 0)

    async def _bounded_body(self, scope: dict[str, Any], receive: Any) -> tuple[Any, RequestError | None]:
        """Reads the whole body here (within MAX_BODY_BYTES and BODY_TIMEOUT_S) and hands the route the
        same bytes: a request that trickles its body in holds no slot and no route while it does."""
        limit = self.admission.max_body_bytes
        too_large = RequestError(ErrorCode.PAYLOAD_TOO_LARGE, f"the request body is over {limit} bytes "
                                 "(MAX_BODY_BYTES)")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return receive, too_large
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return receive, None
        chunks, size, more = [], 0, True
        deadline = time.monotonic() + BODY_TIMEOUT_S
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return receive, RequestError(ErrorCode.BODY_TIMEOUT, f"the request body did not arrive within "
                                             f"{BODY_TIMEOUT_S:g} s")
            if message["type"] != "http.request":
                return receive, None   # the client left; the route will see that
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > limit:
                return receive, too_large
        body = b"".join(chunks)
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()   # from here on: http.disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return replay, None

    async def _refuse(self, scope: dict[str, Any], receive: Any, send: Any, error: RequestError) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": error.message[:120]})
            return
        await request_error_response(error)(scope, receive, send)
