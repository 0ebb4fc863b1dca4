"""A real ROLE_TYPE=FRONTEND process against a scripted gRPC backend (the mock backend's servicer over a
StubEngine, no weights), and a second one whose backend address has nothing listening: started once for
tests/frontend (the `stack` fixture, through conftest.py) and shared by test_frontend_role*.py."""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

from backend.mock_backend import MockServicer
from kvyard.tokenizer import TextTokenizer
from tests.support.procs import RoleProcess, free_port_block
from tests.support.stub_backend import StubEngine, stub_backend

SCRIPT_TEXT = "Hello there, friend!"
EOS_ID = 2
MAX_SEQ_LEN = 64
MODEL = "stub-model"
HI = [{"role": "user", "content": "Hi"}]


@dataclass
class Frontend:
    url: str
    proc: RoleProcess


@dataclass
class Stack:
    url: str                    # the frontend backed by the stub
    engine: StubEngine
    servicer: MockServicer      # keeps every request as received
    script_ids: list[int]       # what the stub streams, one id per step, <|im_end|> last
    down: Frontend              # a frontend whose backend address has nothing listening


def _wait_answering(proc: RoleProcess, url: str, timeout_s: float = 60.0) -> None:
    """Until the HTTP server answers at all (a frontend without a backend says 503 on /health)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"frontend exited with {proc.proc.returncode}:\n{proc.log()}")
        try:
            httpx.get(url, timeout=1.0)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer in {timeout_s} s:\n{proc.log()}")


@pytest.fixture(scope="package")
def stack(tokenizer: TextTokenizer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    base = free_port_block(4)
    stub_port, port, down_port, dead_port = base, base + 1, base + 2, base + 3
    script_ids = [*tokenizer.encode(SCRIPT_TEXT), EOS_ID]
    logs = tmp_path_factory.mktemp("frontend_role")
    common = {"ROLE_TYPE": "FRONTEND", "MAX_SEQ_LEN": str(MAX_SEQ_LEN), "MODEL_NAME": MODEL}
    procs: list[RoleProcess] = []
    with stub_backend(lambda _req: script_ids, stub_port) as (engine, backend):
        try:
            # Both frontends start together: most of their start-up is imports and the tokenizer.
            procs.append(RoleProcess({**common, "START_PORT": str(port),
                                      "BACKEND_ADDRESS": f"127.0.0.1:{stub_port}"}, logs / "frontend.log"))
            procs.append(RoleProcess({**common, "START_PORT": str(down_port),
                                      "BACKEND_ADDRESS": f"127.0.0.1:{dead_port}"}, logs / "down.log"))
            url, down_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{down_port}"
            procs[0].wait_healthy(f"{url}/health", timeout_s=60)
            _wait_answering(procs[1], f"{down_url}/health")
            yield Stack(url, engine, backend.servicer, script_ids, Frontend(down_url, procs[1]))
        finally:
            for p in procs:
                p.stop()


# The two test modules import these (module scope: each its own clients on the shared stack).
@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=10)


@pytest.fixture(scope="module")
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=10) as c:
        yield c
