"""ASGI middleware shared by the HTTP roles: request bodies are JSON whatever curl says."""
from __future__ import annotations

from typing import Any


class JsonBodyByDefault:
    """`curl -d '{...}'` sends a form content type; every body here is JSON, so read it as JSON."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            ctype = dict(scope["headers"]).get(b"content-type", b"")
            if not ctype or ctype.startswith(b"application/x-www-form-urlencoded"):
                scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)
