"""A scripted gRPC backend for frontend and master tests: streams fixed token ids, reports a settable
load and prefix cache, no model."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvyard.block_keys import block_cache_keys
from proto import model_rpc_pb2 as pb
from proto import model_rpc_pb2_grpc as pb_grpc


def sane_status(**fields: object) -> pb.WorkerStatusPB:
    """An idle backend's report with 1024 free blocks of 16 tokens, overridden by `fields`."""
    base: dict[str, object] = dict(role="PDFUSION", running=0, waiting=0, queued_prefill_tokens=0,
                                   step_latency_ms=20.0, prefill_tokens_per_s=2000.0, free_blocks=1024,
                                   total_blocks=1024, block_size=16, version=1, iterate_count=1, alive=True)
    return pb.WorkerStatusPB(**{**base, **fields})


class StubServicer(pb_grpc.ModelRpcServiceServicer):
    def __init__(self, script: Callable[[pb.GenerateInputPB], list[list[int]]], delay_s: float = 0.0,
                 error: pb.ErrorDetailsPB | None = None) -> None:
        self.script = script        # request → list of steps, each a list of token ids
        self.delay_s = delay_s
        self.error = error
        self.requests: list[pb.GenerateInputPB] = []
        self.cancelled = 0
        self.cancelled_ids: list[str] = []  # request ids of the streams that stopped early
        # Load reports (GetWorkerStatus / GetCacheStatus); tests change them at any time.
        self.status: pb.WorkerStatusPB = sane_status()
        self.cached_keys: set[int] = set()
        self.cache_version = 0
        self.cache_prompts = False   # True: cache every served prompt's full blocks, like the engine
        self.status_error: grpc.StatusCode | None = None  # answer status RPCs with this error instead

    def cache(self, keys: list[int]) -> None:
        self.cached_keys.update(keys)
        self.cache_version += 1

    async def GenerateStreamCall(self, request: pb.GenerateInputPB, context: grpc.aio.ServicerContext):
        self.requests.append(request)
        if self.error is not None:
            yield pb.GenerateOutputsPB(request_id=request.request_id, error=self.error)
            return
        steps = self.script(request)
        keys = block_cache_keys(list(request.token_ids), self.status.block_size or 16)
        reuse = 0
        for key in keys:
            if key not in self.cached_keys:
                break
            reuse += self.status.block_size
        reuse = min(reuse, max(0, len(request.token_ids) - 1))
        if self.cache_prompts:
            self.cache(keys)
        finished = False
        try:
            for i, ids in enumerate(steps):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                last = i == len(steps) - 1
                out = pb.GenerateOutputsPB(request_id=request.request_id)
                out.generate_outputs.add(
                    index=0, output_ids=ids, finished=last,
                    finish_reason=pb.FINISH_REASON_STOP if last else pb.FINISH_REASON_UNSPECIFIED,
                    aux_info=pb.AuxInfoPB(input_len=len(request.token_ids), output_len=i + 1, reuse_len=reuse))
                yield out
            finished = True
        finally:
            # A cancelled call ends here by CancelledError (parked at an await) or by GeneratorExit
            # (parked at a yield): either way the stream stopped early.
            if not finished:
                self.cancelled += 1
                self.cancelled_ids.append(request.request_id)

    async def GetWorkerStatus(self, request: pb.WorkerStatusRequestPB,
                              context: grpc.aio.ServicerContext) -> pb.WorkerStatusPB:
        if self.status_error is not None:
            await context.abort(self.status_error, "scripted failure")
        out = pb.WorkerStatusPB()
        out.CopyFrom(self.status)
        out.cache_version = self.cache_version
        return out

    async def GetCacheStatus(self, request: pb.CacheStatusRequestPB,
                             context: grpc.aio.ServicerContext) -> pb.CacheStatusPB:
        if self.status_error is not None:
            await context.abort(self.status_error, "scripted failure")
        return pb.CacheStatusPB(version=self.cache_version, is_diff=False, cached_keys=sorted(self.cached_keys),
                                block_size=self.status.block_size)


class StubBackend:
    """Runs a grpc.aio server on its own thread and event loop."""

    def __init__(self, servicer: StubServicer, port: int) -> None:
        self.servicer = servicer
        self.port = port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: grpc.aio.Server | None = None

    def start(self) -> StubBackend:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    async def _start(self) -> None:
        self._server = grpc.aio.server()
        pb_grpc.add_ModelRpcServiceServicer_to_server(self.servicer, self._server)
        hs = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, self._server)
        self._server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self._server.start()
        await hs.set("", health_pb2.HealthCheckResponse.SERVING)

    def stop(self) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(0), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
