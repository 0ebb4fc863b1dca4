"""A scripted backend that also returns logprobs and answers ScoreCall, plus an app served on a thread.

For LMTP, /generate and metrics tests without a model: the logprobs are made up but fixed per token id
(fake_logprob), and ids outside VOCAB are refused the way the engine refuses them.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import uvicorn

from kvyard.tokenizer import TextTokenizer
from proto import model_rpc_pb2 as pb
from tests.support.procs import free_port_block
from tests.support.stub_backend import StubBackend, StubServicer

VOCAB = 49152


def fake_logprob(token_id: int) -> float:
    return -0.125 * (token_id % 9) - 0.5


class ScoringStubServicer(StubServicer):
    def _bad_ids(self, ids: list[int]) -> pb.ErrorDetailsPB | None:
        bad = [t for t in ids if not 0 <= t < VOCAB]
        if not bad:
            return None
        return pb.ErrorDetailsPB(code=pb.INVALID_ARGUMENT,
                                 message=f"token ids out of the vocabulary (size {VOCAB}): {bad[:5]}")

    async def GenerateStreamCall(self, request: pb.GenerateInputPB, context: grpc.aio.ServicerContext):
        error = self._bad_ids(list(request.token_ids))
        if error is not None:
            yield pb.GenerateOutputsPB(request_id=request.request_id, error=error)
            return
        cfg = request.generate_config
        inner = super().GenerateStreamCall(request, context)
        try:
            async for msg in inner:
                if cfg.return_logprobs:
                    for out in msg.generate_outputs:
                        for token in out.output_ids:
                            lp = out.logprobs.add(token_id=token, logprob=fake_logprob(token))
                            for alt in range(cfg.top_logprobs):
                                lp.top_logprobs.add(token_id=alt, logprob=fake_logprob(alt))
                yield msg
        finally:
            await inner.aclose()  # at once, so a cancelled call is counted now, not at garbage collection

    async def ScoreCall(self, request: pb.ScoreInputPB, context: grpc.aio.ServicerContext) -> pb.ScoreOutputPB:
        error = self._bad_ids([*request.prompt_ids, *request.scored_ids])
        if error is not None:
            return pb.ScoreOutputPB(error=error)
        out = pb.ScoreOutputPB(aux_info=pb.AuxInfoPB(input_len=len(request.prompt_ids) + len(request.scored_ids)))
        for token in request.scored_ids:
            out.logprobs.add(token_id=token, logprob=fake_logprob(token))
        return out


class AppThread:
    """Serves an ASGI app with uvicorn on a free loopback port, on its own thread."""

    def __init__(self, app: Any) -> None:
        self.port = free_port_block(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                     lifespan="on"))
        self._server.install_signal_handlers = lambda: None  # not the main thread
        self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve()), daemon=True)

    def __enter__(self) -> AppThread:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the app did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)


@dataclass
class StubFrontend:
    url: str                        # http://127.0.0.1:PORT of an in-process frontend app
    servicer: ScoringStubServicer   # the scripted backend behind it
    app: Any

    @property
    def ws_url(self) -> str:
        return "ws" + self.url[len("http"):]


@contextmanager
def stub_frontend(tokenizer: TextTokenizer, script: Callable[[pb.GenerateInputPB], list[list[int]]],
                  delay_s: float = 0.0, model: str = "stub-model", **env: str) -> Iterator[StubFrontend]:
    """create_app() served on a thread in front of a ScoringStubServicer: no model, no subprocess."""
    from frontend.app import create_app
    from frontend.config import FrontendConfig

    servicer = ScoringStubServicer(script, delay_s=delay_s)
    stub = StubBackend(servicer, free_port_block(1)).start()
    try:
        cfg = FrontendConfig.from_env({"BACKEND_ADDRESS": f"127.0.0.1:{stub.port}", "MAX_SEQ_LEN": "256",
                                       "MODEL_NAME": model, **env})
        app = create_app(cfg, tokenizer)
        with AppThread(app) as server:
            yield StubFrontend(server.url, servicer, app)
    finally:
        stub.stop()
