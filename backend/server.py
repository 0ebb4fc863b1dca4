"""The backend's gRPC edge: GenerateStreamCall → EngineLoop, plus grpc.health.v1."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health

from backend.constraints import GrammarCompiler, compile_constraint
from backend.engine_loop import EngineLoop
from backend.grpc_server import set_serving
from backend.pd_transfer import DecodeChannels, prefill_then_hand_over, remote_decode
from backend.task_log import TaskInfo, TaskLog
from backend.engine_types import ImageInput
from backend.image_preprocess import prompt_images
from backend.image_tower import ImageTower
from backend.vit_client import VitClient
from backend.pb_convert import (cache_status_to_pb, outputs_to_pb, pooling_request_from_pb, pooling_result_to_pb,
                                request_from_pb, score_request_from_pb, score_result_to_pb, worker_status_to_pb)
from kvyard.pb_errors import error_to_pb
from kvyard.errors import ErrorCode, RequestError
from kvyard.roles import Role
from kvyard.vision_config import ImageSide
from proto import model_rpc_pb2 as pb
from proto import model_rpc_pb2_grpc as pb_grpc

log = logging.getLogger("kvyard.backend")

class ModelRpcServicer(pb_grpc.ModelRpcServiceServicer):
    def __init__(self, engine_loop: EngineLoop, eos_token_ids: frozenset[int], max_model_len: int,
                 role: Role = Role.PDFUSION, decode_address: str = "", grammars: GrammarCompiler | None = None) -> None:
        self.engine_loop = engine_loop
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.role = role                      # PREFILL hands each request's KV over after the first token
        self.decode_address = decode_address  # PREFILL's default decode backend
        self.decode_channels = DecodeChannels()
        self.grammars = grammars              # compiles constraints off the engine thread; None: refuse them
        self.tasks = TaskLog()                # running and finished calls, for /worker_status
        self.vision: ImageSide | None = None  # a vision model's image side: decodes its requests' images
        self.vit: VitClient | None = None        # VIT_ADDRESSES: a VIT process embeds them instead of our tower
        self.tower: ImageTower | None = None     # our tower (the engine thread's): its `known` digests skip preprocessing

    async def GenerateStreamCall(self, request: pb.GenerateInputPB, context: grpc.aio.ServicerContext):
        """Each call is a task of /worker_status while it runs, then one of its finished tasks."""
        with self.tasks.track(request.request_id, len(request.token_ids)) as task:
            stream = self._generate_stream(request, context, task)
            try:
                async for out in stream:
                    yield out
            finally:
                await stream.aclose()

    async def _generate_stream(self, request: pb.GenerateInputPB, context: grpc.aio.ServicerContext,
                               task: TaskInfo) -> AsyncIterator[pb.GenerateOutputsPB]:
        request_id = request.request_id
        try:
            req = request_from_pb(request, self.eos_token_ids, self.max_model_len)
            timeout_s = request.generate_config.timeout_ms / 1000 or None
            async with asyncio.timeout(timeout_s):
                if request.images:
                    req.images = await self._images(request)
                req.grammar = await compile_constraint(self.grammars, req.constraint)
                address = request.decode_address or self.decode_address
                # A PREFILL backend asked with no decode side serves the request whole (it holds the whole
                # model): frontends call every backend behind a headless name while the master is away.
                if self.role is Role.PREFILL and address:
                    # However the call ends (a client that cancels while the hand-over generator waits at a
                    # yield leaves it unclosed until garbage collection), the held prompt KV is freed.
                    context.add_done_callback(lambda _: self.engine_loop.post(lambda e: e.release(request_id)))
                    async for out in prefill_then_hand_over(self.engine_loop, request, req,
                                                            self.decode_channels.stub(address), address):
                        yield out
                else:
                    async for outs in self.tasks.observe(task, self.engine_loop.generate(req)):
                        yield outputs_to_pb(request_id, outs)
        except RequestError as exc:
            log.info("request %s failed: %s", request_id, exc.message)
            self.tasks.mark_error(task)
            yield error_to_pb(request_id, exc)
        except TimeoutError:
            self.tasks.mark_error(task)
            yield error_to_pb(request_id, RequestError(
                ErrorCode.TIMEOUT, f"not finished within timeout_ms={request.generate_config.timeout_ms}"))
        except asyncio.CancelledError:
            log.info("request %s cancelled by the client", request_id)
            raise

    async def _images(self, request: pb.GenerateInputPB) -> list[ImageInput]:
        """The request's images, embedded by a VIT (VIT_ADDRESSES) or preprocessed for our own tower."""
        files = [im.data for im in request.images]
        if self.role is Role.DECODE:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "a DECODE backend runs no image tower: it takes an "
                               "image prompt's KV from a PREFILL backend, not the images", "images")
        if self.vit is not None and self.vision is not None:
            return await self.vit.prompt_images(request.request_id, files)
        cached = self.tower.known if self.tower is not None else frozenset()
        return await asyncio.to_thread(prompt_images, files, self.vision, cached)

    async def RemoteDecode(self, request_iterator: AsyncIterator[pb.KVTransferPB],
                           context: grpc.aio.ServicerContext) -> AsyncIterator[pb.RemoteDecodeReplyPB]:
        if self.role is Role.PREFILL:
            yield pb.RemoteDecodeReplyPB(outputs=error_to_pb("", RequestError(
                ErrorCode.INVALID_ARGUMENT, "a PREFILL backend does not decode hand-overs")))
            return
        async for reply in remote_decode(self.engine_loop, request_iterator, self.eos_token_ids,
                                         self.max_model_len, self.grammars):
            yield reply

    async def ScoreCall(self, request: pb.ScoreInputPB, context: grpc.aio.ServicerContext) -> pb.ScoreOutputPB:
        try:
            return score_result_to_pb(await self.engine_loop.score(score_request_from_pb(request)))
        except RequestError as exc:
            return pb.ScoreOutputPB(error=error_to_pb(request.request_id, exc).error)

    async def PoolCall(self, request: pb.PoolInputPB, context: grpc.aio.ServicerContext) -> pb.PoolOutputPB:
        """A cancelled call cancels this coroutine, which aborts the inputs not yet run (EngineLoop)."""
        try:
            async with asyncio.timeout(request.timeout_ms / 1000 or None):
                return pooling_result_to_pb(await self.engine_loop.pool(pooling_request_from_pb(request)))
        except RequestError as exc:
            return pb.PoolOutputPB(error=error_to_pb(request.request_id, exc).error)
        except TimeoutError:
            return pb.PoolOutputPB(error=error_to_pb(request.request_id, RequestError(
                ErrorCode.TIMEOUT, f"not finished within timeout_ms={request.timeout_ms}")).error)

    async def GetWorkerStatus(self, request: pb.WorkerStatusRequestPB,
                              context: grpc.aio.ServicerContext) -> pb.WorkerStatusPB:
        return worker_status_to_pb(self.engine_loop.worker_status())

    async def GetCacheStatus(self, request: pb.CacheStatusRequestPB,
                             context: grpc.aio.ServicerContext) -> pb.CacheStatusPB:
        return cache_status_to_pb(self.engine_loop.cache_status(request.since_version))


async def watch_engine(engine_loop: EngineLoop, health_servicer: health.aio.HealthServicer) -> None:
    """Health follows the engine thread: a dead engine must not look healthy to anyone."""
    serving = True
    while True:
        await asyncio.sleep(0.5)
        if engine_loop.alive != serving:
            serving = engine_loop.alive
            log.error("engine thread is %s", "running again" if serving else "DEAD: health is NOT_SERVING")
            await set_serving(health_servicer, serving)
