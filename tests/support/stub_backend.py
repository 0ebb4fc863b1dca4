"""The product mock backend's scripted engine (backend/mock_backend.py), steered the way frontend, master and
LMTP tests need: a script chosen per request, a load report and prefix-cache keys the test sets, an error
with its own message. The real gRPC servicer stays in front, so every answer is encoded as the real backend
encodes it; no test builds a backend's protobuf by hand."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from backend.engine_types import CacheStatus, GenerationRequest
from backend.mock_backend import MockScript, ScriptedEngine
from kvyard.roles import Role
from kvyard.tokenizer import TextTokenizer
from kvyard.worker_status import WorkerStatus
from proto import model_rpc_pb2 as pb
from tests.support.mock_stack import MockBackendThread, mock_frontend

VOCAB = 49152  # the embedded model's: ids outside it are refused, as the engine refuses them

Script = Callable[[GenerationRequest], list[int]]  # request → the token ids it streams, one per step


def sane_status(**fields: object) -> pb.WorkerStatusPB:
    """An idle backend's report as it arrives over gRPC (for tests of its parsing), overridden by `fields`."""
    base: dict[str, object] = dict(role="PDFUSION", running=0, waiting=0, queued_prefill_tokens=0,
                                   step_latency_ms=20.0, prefill_tokens_per_s=2000.0, free_blocks=1024,
                                   total_blocks=1024, block_size=16, version=1, iterate_count=1, alive=True)
    return pb.WorkerStatusPB(**{**base, **fields})


def sane_load(**fields: Any) -> WorkerStatus:
    """The same idle report as the engine hands it to the servicer, overridden by `fields` (which may be
    garbage: the servicer encodes whatever it is given)."""
    base = WorkerStatus(role=Role.PDFUSION, running=0, waiting=0, queued_prefill_tokens=0, step_latency_ms=20.0,
                        prefill_tokens_per_s=2000.0, free_blocks=1024, total_blocks=1024, block_size=16, version=1,
                        iterate_count=1, alive=True, cache_version=0)
    return replace(base, **fields)


class StubEngine(ScriptedEngine):
    """A ScriptedEngine whose attributes a test may change at any time:
    - `steps(request)` picks the tokens, `delay_s` waits before each, `error` (an ErrorCodePB name and a
      message) fails the request before the first;
    - `status` is the load report; `status_fails` makes the status calls fail;
    - `cache(keys)` puts prefix blocks in the cache it reports to a master."""

    def __init__(self, steps: Script, delay_s: float = 0.0, vocab_size: int | None = VOCAB) -> None:
        super().__init__(MockScript((0,)), vocab_size)
        self.steps = steps
        self.delay_s = delay_s
        self.error: tuple[str, str] | None = None
        self.status = sane_load()
        self.status_fails = False
        self.cached_keys: set[int] = set()
        self.cache_version = 0

    def script_for(self, req: GenerationRequest) -> MockScript:
        kind, message = self.error or (None, None)
        return MockScript(tuple(self.steps(req)), self.delay_s, error=kind, error_message=message)

    def cache(self, keys: list[int]) -> None:
        self.cached_keys.update(keys)
        self.cache_version += 1

    def worker_status(self) -> WorkerStatus:
        if self.status_fails:
            raise RuntimeError("scripted status failure")
        return replace(self.status, cache_version=self.cache_version)

    def cache_status(self, since_version: int) -> CacheStatus:
        if self.status_fails:
            raise RuntimeError("scripted status failure")
        return CacheStatus(version=self.cache_version, is_diff=False, cached_keys=sorted(self.cached_keys),
                           added_keys=[], removed_keys=[], block_size=self.status.block_size)


@contextmanager
def stub_backend(steps: Script, port: int | None = None, **attrs: Any) -> Iterator[tuple[StubEngine, MockBackendThread]]:
    """A StubEngine behind the real servicer on a thread (on `port` or a free one)."""
    engine = StubEngine(steps, **attrs)
    with MockBackendThread(engine, port) as backend:
        yield engine, backend


@contextmanager
def reconfigured(engine: StubEngine, **attrs: Any) -> Iterator[None]:
    """Change the stub's behaviour for one test (it reads its attributes on every call)."""
    old = {k: getattr(engine, k) for k in attrs}
    for k, v in attrs.items():
        setattr(engine, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(engine, k, v)


@dataclass
class StubFrontend:
    url: str                        # http://127.0.0.1:PORT of an in-process frontend app
    engine: StubEngine              # the scripted engine behind it
    backend: MockBackendThread      # its servicer keeps every request as received
    app: Any

    @property
    def ws_url(self) -> str:
        return "ws" + self.url[len("http"):]


@contextmanager
def stub_frontend(tokenizer: TextTokenizer, steps: Script, delay_s: float = 0.0, model: str = "stub-model",
                  **env: str) -> Iterator[StubFrontend]:
    """create_app() served on a thread in front of a StubEngine: no model, no subprocess."""
    with stub_backend(steps, delay_s=delay_s) as (engine, backend), \
            mock_frontend(tokenizer, backend.address, MAX_SEQ_LEN="256", MODEL_NAME=model, **env) as frontend:
        yield StubFrontend(frontend.url, engine, backend, frontend.app)

