"""The product mock backend (backend/mock_backend.py) on a thread, and in-process frontends in front of it:
the OpenAI surface end to end over loopback with no model and no subprocess."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc

from backend.debug_views import BackendFacts
from backend.http_server import create_backend_http_app
from backend.mock_backend import MockScript, MockServicer, ScriptedEngine, start_mock_server
from kvyard.tokenizer import TextTokenizer
from tests.support.app_thread import AppThread
from tests.support.procs import free_port_block


EOS = 2  # the embedded model's <|im_end|>
MOCK_MAX_CONCURRENCY = 64  # what the mock's /worker_status counts available_concurrency from


def script(tok: TextTokenizer, text: str, per_char: bool = False, eos: bool = True, **kw: Any) -> MockScript:
    """A mock backend script that answers `text` (one token per character with per_char), then eos."""
    ids = [i for c in text for i in tok.encode(c)] if per_char else tok.encode(text)
    return MockScript(tuple([*ids, EOS] if eos else ids), **kw)


def slow_script(tok: TextTokenizer, n: int = 60, delay_s: float = 0.05) -> MockScript:
    """n tokens of " word", each after delay_s: a request still running when the test acts on it."""
    return MockScript(tuple((tok.encode(" word") * n)[:n]), delay_s=delay_s)


class MockBackendThread:
    """backend.mock_backend's server on its own thread and event loop, over a script or a scripted engine
    (tests/support/stub_backend.py's StubEngine), on `port` or a free one. On a free one it also serves the
    backend's HTTP app where a frontend looks for it (gRPC port - 1 + 5: health, /worker_status, ...)."""

    def __init__(self, script: MockScript | ScriptedEngine, port: int | None = None) -> None:
        self.servicer = MockServicer(script if isinstance(script, ScriptedEngine) else ScriptedEngine(script))
        self.port = port or free_port_block(6) + 1
        self.address = f"127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: grpc.aio.Server | None = None
        self._http: AppThread | None = None
        if port is None:
            start = self.port - 1
            facts = BackendFacts(start, self.port, start + 5, MOCK_MAX_CONCURRENCY)
            self._http = AppThread(create_backend_http_app(self.servicer.engine, "", self.servicer.tasks, facts),  # type: ignore[arg-type]
                                   port=start + 5)

    def __enter__(self) -> MockBackendThread:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            start_mock_server(self.servicer, "127.0.0.1", self.port), self._loop).result(10)
        if self._http is not None:
            self._http.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._http is not None:
            self._http.__exit__()
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(0), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    @contextmanager
    def scripted(self, script: MockScript) -> Iterator[MockServicer]:
        """Swap the script for one test."""
        old, self.servicer.script = self.servicer.script, script
        try:
            yield self.servicer
        finally:
            self.servicer.script = old


@dataclass
class MockFrontend:
    url: str      # http://127.0.0.1:PORT
    app: Any      # the FastAPI app (app.state.admission, ...)


@contextmanager
def mock_frontend(tokenizer: TextTokenizer, backend_address: str, **env: str) -> Iterator[MockFrontend]:
    """create_app() on a thread, configured from `env` as the FRONTEND role would be."""
    from frontend.app import create_app
    from frontend.config import FrontendConfig

    cfg = FrontendConfig.from_env({"BACKEND_ADDRESS": backend_address, "MAX_SEQ_LEN": "512",
                                   "MODEL_NAME": "mock-model", **env})
    app = create_app(cfg, tokenizer)
    with AppThread(app) as server:
        yield MockFrontend(server.url, app)
