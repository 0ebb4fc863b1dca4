"""LMTP over WebSocket (`/lmtp`, and `/` where LMQL connects): token ids in, token ids and logprobs out.

One connection carries many streams at once. Each GENERATE / SCORE runs as its own task that puts
items on the connection's one outbox; one writer task sends whatever is queued as a single `TOKEN [...]`
frame, so items of different streams interleave while each stream keeps its order. A stream ends with
exactly one item whose finish_reason is set, or with one `{"stream_id", "error"}` item; a failing
stream never ends the connection. A stream whose model no backend can serve yet waits for it (LMTP_WAIT_S),
saying so in a `MSG {"stream_id", "message"}` item (frontend/lmtp_wait.py). Closing the socket cancels every stream (and so its backend call).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketState

from frontend.admission import Admission
from frontend.config import FrontendConfig
from frontend.lmtp_frames import (COMMANDS, FrameError, GenerateFrame, ModelInfoFrame, ScoreFrame, encode, error_item,
                                  parse_frame, score_items, token_item)
from frontend.lmtp_wait import ModelWait
from frontend.lora_routes import adapter_of
from frontend.metered_router import MeteredRouter
from frontend.pipeline import Budget, Pipeline
from frontend.routing import model_to_route
from kvyard.errors import ErrorCode, RequestError
from kvyard.http_errors import ERROR_TABLE
from kvyard.sampling_params import DIALECT_DEFAULTS, Dialect
from kvyard.tokenizer import TextTokenizer

log = logging.getLogger("kvyard.frontend")

Outgoing = tuple[str, dict[str, Any]]  # ("TOKEN" | "MSG", item)


AUTO_MODEL = "auto"  # a client that names no model in particular


class LmtpService:
    """What every LMTP connection shares: config, tokenizer facts for MODEL_INFO, the backend router, the
    frontend's admission (each GENERATE/SCORE stream takes a slot of CONCURRENCY_LIMIT) and its pipeline's
    context-length budget (the token ids themselves go straight to the router: no text to detokenize)."""

    def __init__(self, cfg: FrontendConfig, tokenizer: TextTokenizer, client: MeteredRouter,
                 admission: Admission | None = None, pipeline: Pipeline | None = None) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.client = client
        self.admission = admission or Admission(cfg)
        self.pipeline = pipeline or Pipeline(cfg, tokenizer, client)

    def model(self, name: str | None) -> str | None:
        """The model to route to (None: ours; also for "auto"). Without a master only our own name exists;
        with one, the master knows every served model and answers unknown ones with MODEL_NOT_FOUND."""
        if name == AUTO_MODEL:  # LMQL's "auto": whatever this endpoint serves
            return None
        model = model_to_route(self.cfg, name)
        return None if model is None or self.cfg.serves(model) else model

    def adapter(self, model: str | None) -> str:
        """The LoRA adapter a stream's model names ("" = the base model), as the HTTP dialects resolve it;
        the backend answers a name that is neither a model nor an adapter with MODEL_NOT_FOUND."""
        return adapter_of(self.cfg, model, None)

    async def model_info(self, name: str | None) -> dict[str, Any]:
        model = self.model(name)
        adapter = self.adapter(model)
        await self.pipeline.check_served(model, adapter)  # a name GENERATE would get a 404 for
        info: dict[str, Any] = {"model": model or self.cfg.model_name, "model_type": "kvyard",
                                "max_seq_len": self.cfg.max_seq_len}
        if model is None or adapter:  # tokenizer facts are known for our own model (and its adapters) only
            info.update(vocab_size=self.tokenizer.vocab_size, bos_token_id=self.tokenizer.bos_token_id,
                        eos_token_id=self.tokenizer.eos_token_id)
        return info


class LmtpSession:
    """One WebSocket connection: reads frames, runs one task per stream, batches what they send."""

    def __init__(self, ws: WebSocket, service: LmtpService) -> None:
        self.ws = ws
        self.service = service
        self.metrics = service.client.metrics
        self.conn_id = uuid.uuid4().hex[:12]
        self.outbox: asyncio.Queue[Outgoing] = asyncio.Queue()
        self.streams: dict[Any, asyncio.Task[None]] = {}  # GENERATE / SCORE streams still running
        self.tasks: set[asyncio.Task[None]] = set()        # those and MODEL_INFO answers

    async def run(self) -> None:
        await self.ws.accept()
        writer = asyncio.create_task(self._write_loop())
        try:
            while True:
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                text = msg.get("text")
                if text is None and msg.get("bytes") is not None:
                    text = msg["bytes"].decode("utf-8", errors="replace")
                if text:
                    self._handle(text)
        finally:
            tasks = [*self.tasks, writer]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _handle(self, text: str) -> None:
        try:
            command, frame = parse_frame(text)
        except FrameError as exc:
            command = text.partition(" ")[0]
            self._count(command, ErrorCode.INVALID_ARGUMENT)
            kind = "TOKEN" if command in ("GENERATE", "SCORE") and exc.stream_id is not None else "MSG"
            self.outbox.put_nowait((kind, error_item(exc.stream_id, exc)))
            return
        if isinstance(frame, ModelInfoFrame):
            self._start(self._model_info(frame))
            return
        if frame.stream_id in self.streams:
            self._count(command, ErrorCode.INVALID_ARGUMENT)
            self.outbox.put_nowait(("TOKEN", error_item(frame.stream_id, f"stream_id {frame.stream_id!r} is "
                                                        "still running on this connection")))
            return
        run = self._generate(frame) if isinstance(frame, GenerateFrame) else self._score(frame)
        task = self._start(self._guard(command, frame.stream_id, run))
        self.streams[frame.stream_id] = task
        task.add_done_callback(lambda _: self.streams.pop(frame.stream_id, None))

    def _start(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _guard(self, command: str, stream_id: Any, run: Coroutine[Any, Any, None]) -> None:
        """Runs one stream within its admission slot; any failure becomes that stream's error item."""
        admission = self.service.admission
        try:
            admission.take_stream()
        except RequestError as exc:
            run.close()
            self._count(command, exc.code)
            self.outbox.put_nowait(("TOKEN", error_item(stream_id, exc)))
            return
        try:
            await run
        except RequestError as exc:
            self._count(command, exc.code)
            self.outbox.put_nowait(("TOKEN", error_item(stream_id, exc)))
        except asyncio.CancelledError:
            self._count(command, ErrorCode.CANCELLED)
            raise
        except Exception:  # a bug must cost one stream, not the connection
            log.exception("LMTP %s stream %r failed", command, stream_id)
            self._count(command, ErrorCode.INTERNAL)
            self.outbox.put_nowait(("TOKEN", error_item(stream_id, "internal error; see the frontend log")))
        else:
            self._count(command, None)
        finally:
            admission.end_stream()

    async def _generate(self, frame: GenerateFrame) -> None:
        svc = self.service
        request_id = f"lmtp-{self.conn_id}-{frame.stream_id}"
        requested = frame.max_tokens or DIALECT_DEFAULTS[Dialect.LMTP]["max_new_tokens"]
        svc.pipeline.budget(len(frame.prompt), Budget(requested))   # the context-length check every dialect has
        model = svc.model(frame.model)
        params = replace(frame.params(svc.cfg.request_timeout_s), adapter=svc.adapter(model))
        gen = self._wait(frame.stream_id, model).stream(lambda: svc.client.generate(request_id, frame.prompt, params,
                                                                                    model))
        try:
            async for outs in gen:
                for out in outs:
                    if len(out.logprobs) != len(out.token_ids):
                        raise RequestError(ErrorCode.INTERNAL, "the backend sent tokens without logprobs")
                    last = len(out.logprobs) - 1
                    for i, lp in enumerate(out.logprobs):
                        finish = out.finish_reason if i == last else None
                        self.outbox.put_nowait(("TOKEN", token_item(frame.stream_id, lp, finish)))
                    if out.finish_reason is not None:
                        if not out.logprobs:
                            raise RequestError(ErrorCode.INTERNAL, "the backend finished without a token")
                        return
        finally:
            await gen.aclose()
        raise RequestError(ErrorCode.INTERNAL, "the backend stream ended without a finish reason")

    async def _score(self, frame: ScoreFrame) -> None:
        request_id = f"lmtp-{self.conn_id}-{frame.stream_id}"
        model = self.service.model(frame.model)
        adapter = self.service.adapter(model)
        out = await self._wait(frame.stream_id, model).call(
            lambda: self.service.client.score(request_id, frame.prompt, frame.scored, model, 0, adapter))
        if len(out.logprobs) != len(frame.scored):
            raise RequestError(ErrorCode.INTERNAL, f"the backend scored {len(out.logprobs)} of "
                               f"{len(frame.scored)} tokens")
        for item in score_items(frame.stream_id, out.logprobs):
            self.outbox.put_nowait(("TOKEN", item))

    def _wait(self, stream_id: Any, model: str | None) -> ModelWait:
        """A stream's wait for its model (frontend/lmtp_wait.py), announced in a MSG item."""
        return ModelWait(self.service.cfg.lmtp_wait_s, model or self.service.cfg.model_name,
                         lambda message: self.outbox.put_nowait(("MSG", {"stream_id": stream_id, "message": message})))

    async def _model_info(self, frame: ModelInfoFrame) -> None:
        try:
            info = await self.service.model_info(frame.model)
        except RequestError as exc:
            self._count("MODEL_INFO", exc.code)
            self.outbox.put_nowait(("MSG", error_item(frame.stream_id, exc)))
            return
        self._count("MODEL_INFO", None)
        self.outbox.put_nowait(("MSG", {"stream_id": frame.stream_id, "model_info": info}))

    async def _write_loop(self) -> None:
        """Everything queued goes out at once: consecutive items of one type share a frame."""
        while True:
            batch = [await self.outbox.get()]
            await asyncio.sleep(0)  # let streams that finished the same backend step add theirs
            while not self.outbox.empty():
                batch.append(self.outbox.get_nowait())
            for kind, group in itertools.groupby(batch, key=lambda o: o[0]):
                if self.ws.application_state is not WebSocketState.CONNECTED:
                    return
                await self.ws.send_text(encode(kind, [item for _, item in group]))

    def _count(self, command: str, code: ErrorCode | None) -> None:
        status = 200 if code is None else ERROR_TABLE[code][0]
        self.metrics.count(f"LMTP {command if command in COMMANDS else 'other'}", status)


# "/" too: LMQL's client connects to the endpoint's root (lmql.model(..., endpoint="host:port")).
LMTP_PATHS = ("/lmtp", "/")


def lmtp_routes(service: LmtpService) -> APIRouter:
    router = APIRouter()

    async def lmtp(ws: WebSocket) -> None:
        await LmtpSession(ws, service).run()

    for path in LMTP_PATHS:
        router.add_api_websocket_route(path, lmtp)
    return router
