"""ASGI middleware shared by the HTTP roles: request bodies are JSON whatever curl says, and web pages
from other origins cannot drive the API."""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

_SAFE_METHODS = (b"GET", b"HEAD", b"OPTIONS")


class OriginCheck:
    """A request or WebSocket handshake that changes something and carries an `Origin` header (a web page
    on another site: a cross-site form or `text/plain` fetch needs no CORS preflight) is refused (403)
    unless that origin is allowed (`CORS_ALLOW_ORIGINS`). Browsers always send `Origin` on such
    requests; curl and the SDKs send none. Every HTTP role applies it: the gateway as it is, the others
    through JsonBodyByDefault."""

    def __init__(self, app: Any, allowed_origins: Iterable[str] = ()) -> None:
        self.app = app
        self.allowed = {o.rstrip("/").encode() for o in allowed_origins}
        self.any_origin = "*" in set(allowed_origins)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if not await self.refused(scope, send):
            await self.app(scope, receive, send)

    async def refused(self, scope: dict[str, Any], send: Any) -> bool:
        """Answers a foreign origin's request with the refusal; True when it did."""
        if scope["type"] not in ("http", "websocket"):
            return False
        origin = dict(scope["headers"]).get(b"origin")
        unsafe = scope["type"] == "websocket" or scope["method"].encode() not in _SAFE_METHODS
        if origin is None or not unsafe or self.any_origin or origin.rstrip(b"/") in self.allowed:
            return False
        await _refuse(scope, send, origin)
        return True


class JsonBodyByDefault(OriginCheck):
    """`curl -d '{...}'` sends a form content type; every body here is JSON, so read it as JSON. That
    leniency would let any web page POST to a local kvyard, hence the Origin check it comes with."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if await self.refused(scope, send):
            return
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            ctype = dict(scope["headers"]).get(b"content-type", b"")
            if not ctype or ctype.startswith(b"application/x-www-form-urlencoded"):
                scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


async def _refuse(scope: dict[str, Any], send: Any, origin: bytes) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})  # before accept: uvicorn answers 403
        return
    message = (f"requests from the web origin {origin.decode(errors='replace')!r} are refused; "
               "allow it with CORS_ALLOW_ORIGINS")
    body = json.dumps({"error": {"message": message, "type": "forbidden", "param": None,
                                 "code": "origin_not_allowed"}}).encode()
    await send({"type": "http.response.start", "status": 403,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
