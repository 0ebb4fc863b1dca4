"""A scripted gRPC backend for frontend tests: streams fixed token ids, no model."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from proto import model_rpc_pb2 as pb
from proto import model_rpc_pb2_grpc as pb_grpc


class StubServicer(pb_grpc.ModelRpcServiceServicer):
    def __init__(self, script: Callable[[pb.GenerateInputPB], list[list[int]]], delay_s: float = 0.0,
                 error: pb.ErrorDetailsPB | None = None) -> None:
        self.script = script        # request → list of steps, each a list of token ids
        self.delay_s = delay_s
        self.error = error
        self.requests: list[pb.GenerateInputPB] = []
        self.cancelled = 0

    async def GenerateStreamCall(self, request: pb.GenerateInputPB, context: grpc.aio.ServicerContext):
        self.requests.append(request)
        if self.error is not None:
            yield pb.GenerateOutputsPB(request_id=request.request_id, error=self.error)
            return
        steps = self.script(request)
        try:
            for i, ids in enumerate(steps):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                last = i == len(steps) - 1
                out = pb.GenerateOutputsPB(request_id=request.request_id)
                out.generate_outputs.add(
                    index=0, output_ids=ids, finished=last,
                    finish_reason=pb.FINISH_REASON_STOP if last else pb.FINISH_REASON_UNSPECIFIED,
                    aux_info=pb.AuxInfoPB(input_len=len(request.token_ids), output_len=i + 1))
                yield out
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


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
