"""A scripted OpenAI-compatible upstream for gateway tests: no model, exact bytes, served on a thread.

Each POST /v1/... answers with the `Reply` its test set (status, headers, body chunks with pauses),
records what it received, and counts streams that ended early because the gateway closed them.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tests.support.app_thread import AppThread


@dataclass
class Reply:
    status: int = 200
    chunks: tuple[bytes, ...] = (b'{"ok":true}',)
    pause_s: float = 0.0                      # before each chunk after the first
    first_pause_s: float = 0.0                # before the response headers
    headers: tuple[tuple[str, str], ...] = (("content-type", "application/json"),)


@dataclass
class Received:
    path: str
    body: bytes
    headers: list[tuple[bytes, bytes]]


@dataclass
class FakeUpstream:
    models: list[str]
    models_status: int = 200
    reply: Reply = field(default_factory=Reply)
    received: list[Received] = field(default_factory=list)
    in_flight: int = 0
    closed_early: int = 0                     # streams the gateway closed before their end
    url: str = ""
    server: AppThread | None = None

    def stop(self) -> None:
        """Stop serving: connections to its port are refused from now on."""
        if self.server is not None:
            self.server.__exit__(None, None, None)
            self.server = None

    def die(self) -> None:
        """Die mid-work: streams in flight are cut and its port refuses connections from now on."""
        if self.server is not None:
            self.server.kill()
            self.server = None

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> Response:
            if self.models_status != 200:
                return JSONResponse({"error": {"message": "down"}}, self.models_status)
            return JSONResponse({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})

        @app.post("/v1/{endpoint:path}")
        async def generate(endpoint: str, request: Request) -> Response:
            self.received.append(Received(request.url.path, await request.body(), list(request.headers.raw)))
            reply = self.reply
            self.in_flight += 1
            try:
                await asyncio.sleep(reply.first_pause_s)
            except BaseException:
                self.in_flight -= 1
                raise
            return _Raw(self._stream(reply), reply.status, reply.headers)

        return app

    async def _stream(self, reply: Reply) -> AsyncIterator[bytes]:
        done = False
        try:
            for i, chunk in enumerate(reply.chunks):
                if i and reply.pause_s:
                    await asyncio.sleep(reply.pause_s)
                yield chunk
            done = True
        finally:
            self.in_flight -= 1
            if not done:
                self.closed_early += 1


class _Raw(StreamingResponse):
    def __init__(self, body: AsyncIterator[bytes], status: int, headers: tuple[tuple[str, str], ...]) -> None:
        super().__init__(body, status_code=status)
        self.raw_headers = [(k.encode(), v.encode()) for k, v in headers]


def sse_reply(events: list[dict[str, Any]], pause_s: float = 0.0) -> Reply:
    chunks = tuple(f"data: {json.dumps(e)}\n\n".encode() for e in events) + (b"data: [DONE]\n\n",)
    return Reply(chunks=chunks, pause_s=pause_s, headers=(("content-type", "text/event-stream"),))


@contextmanager
def fake_upstreams(*models: list[str]) -> Iterator[list[FakeUpstream]]:
    """One FakeUpstream per model list, each on its own loopback port."""
    fakes = [FakeUpstream(list(m)) for m in models]
    try:
        for fake in fakes:
            fake.server = AppThread(fake.app()).__enter__()
            fake.url = fake.server.url
        yield fakes
    finally:
        for fake in fakes:
            fake.stop()
