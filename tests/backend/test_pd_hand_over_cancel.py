"""PREFILL side of the hand-over, in one process: a client that leaves mid-hand-over frees the held KV."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from backend.engine_loop import EngineLoop
from backend.pb_convert import request_from_pb
from backend.pd_transfer import prefill_then_hand_over
from proto import model_rpc_pb2 as pb
from proto import model_rpc_pb2_grpc as pb_grpc
from tests.backend.conftest import EngineFactory, run_on_loop

pytestmark = pytest.mark.slow

NUM_BLOCKS = 16


class _SilentDecode(pb_grpc.ModelRpcServiceServicer):
    """A decode backend that takes the hand-over stream and never answers (busy, or slow to start)."""

    async def RemoteDecode(self, request_iterator, context) -> None:  # reader/writer style: never writes
        async for _ in request_iterator:
            pass


class _ClientLeavesAsCallStarts(grpc.aio.StreamStreamClientInterceptor):
    """Cancels `victim` (the gRPC handler's task) as the RemoteDecode call is set up: scheduled before the
    interceptors task finishes, the cancel runs before the handler wakes up from awaiting it, which is
    where a client's cancel lands now and then. grpc's write() turns that cancellation into
    asyncio.InvalidStateError, while the decode call itself stays open."""

    victim: asyncio.Task | None = None

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        call = await continuation(client_call_details, request_iterator)
        if self.victim is not None:
            asyncio.get_running_loop().call_soon(self.victim.cancel)
        return call


def test_client_cancel_as_the_decode_call_starts_frees_the_held_kv(make_engine: EngineFactory) -> None:
    """Before the fix the cancellation was swallowed and the hand-over waited for the status of a decode
    call nobody would ever finish, holding the prompt's blocks until the process stopped."""
    loop = EngineLoop(make_engine(num_blocks=NUM_BLOCKS))
    msg = pb.GenerateInputPB(request_id="leaves", token_ids=list(range(1000, 1040)),
                             generate_config=pb.GenerateConfigPB(max_new_tokens=8, ignore_eos=True))
    req = request_from_pb(msg, frozenset(), 2048)

    async def scenario() -> tuple[int, list[pb.GenerateOutputsPB]]:
        server = grpc.aio.server()
        pb_grpc.add_ModelRpcServiceServicer_to_server(_SilentDecode(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        interceptor = _ClientLeavesAsCallStarts()
        outs: list[pb.GenerateOutputsPB] = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=[interceptor]) as channel:
                decode = pb_grpc.ModelRpcServiceStub(channel)

                async def handler() -> None:  # GenerateStreamCall's part: relay what the hand-over yields
                    async for out in prefill_then_hand_over(loop, msg, req, decode, f"127.0.0.1:{port}"):
                        outs.append(out)

                task = asyncio.ensure_future(handler())
                interceptor.victim = task
                done, _ = await asyncio.wait([task], timeout=10)
                assert done, "the hand-over hung after its client left"
                with pytest.raises(asyncio.CancelledError):
                    task.result()  # the client's cancel reaches the handler, not an error answer
        finally:
            await server.stop(0)
        await loop.call(lambda engine: None)  # the release was posted before: FIFO
        return await loop.call(lambda engine: engine.scheduler.block_pool.num_free_blocks), outs

    free, outs = run_on_loop(loop, scenario)
    assert len(outs) == 1 and len(outs[0].generate_outputs[0].output_ids) == 1  # the first token came
    assert free == NUM_BLOCKS
