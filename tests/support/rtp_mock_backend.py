"""A backend that speaks only RTP-LLM's RpcService, as the "mock a backend server" script in RTP-LLM's frontend
debugging notes (the seed, /work/shared/seeds/) does: a synchronous grpc.server with an RpcServiceServicer
whose GenerateStreamCall yields one GenerateOutputsPB per token, each holding one GenerateOutputPB with the
token as an INT32 [[id]] tensor and an AuxInfoPB (iter_count, output_len), `finished` only on the last.

Written from those facts rather than copied. What differs from the seed's script: the imports are our
generated messages (proto.rtp_llm_rpc_pb2, RTP-LLM's field numbers) instead of rtp_llm.cpp.proto, and the two
names it took from RTP-LLM's generated _grpc module (RpcServiceServicer, add_RpcServiceServicer_to_server) are
defined here, as that module would define them (kvyard generates no _grpc module for this service); the
tensor is built with numpy as RTP-LLM's trans_from_tensor lays it out (int32_data, shape [1, 1]) instead of
from torch; the output ids are a parameter (the seed's are Qwen2 ids; tests pass ids of their own tokenizer);
it binds 127.0.0.1 on a given port and keeps the requests it got for tests to read.

Run by hand: python -m tests.support.rtp_mock_backend PORT [ID,ID,...]"""
from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from concurrent import futures

import grpc
import numpy as np

from proto.rtp_llm_rpc_pb2 import AuxInfoPB, GenerateInputPB, GenerateOutputPB, GenerateOutputsPB, TensorPB

SEED_OUTPUT_IDS = (91, 13013, 6213, 91, 1339, 151645)   # the seed's script's answer (Qwen2's vocabulary)


def int32_tensor(ids: Sequence[int]) -> TensorPB:
    """A [1, len(ids)] INT32 tensor, as trans_from_tensor lays out torch.tensor([ids], dtype=torch.int32)."""
    values = np.asarray([ids], dtype="<i4")
    return TensorPB(data_type=TensorPB.INT32, shape=list(values.shape), int32_data=values.tobytes())


class RpcServiceServicer:
    """The servicer base RTP-LLM's generated module gives: one method to override."""

    def GenerateStreamCall(self, request: GenerateInputPB, context: grpc.ServicerContext) -> Iterator[GenerateOutputsPB]:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "GenerateStreamCall")
        yield from ()


def add_RpcServiceServicer_to_server(servicer: RpcServiceServicer, server: grpc.Server) -> None:
    method = grpc.unary_stream_rpc_method_handler(servicer.GenerateStreamCall,
                                                  request_deserializer=GenerateInputPB.FromString,
                                                  response_serializer=GenerateOutputsPB.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("RpcService", {"GenerateStreamCall": method}),))


class MockRpcServer(RpcServiceServicer):
    def __init__(self, output_ids: Sequence[int] = SEED_OUTPUT_IDS) -> None:
        self.output_ids = tuple(output_ids)
        self.requests: list[GenerateInputPB] = []   # every call's input, for tests

    def GenerateStreamCall(self, request: GenerateInputPB, context: grpc.ServicerContext) -> Iterator[GenerateOutputsPB]:
        self.requests.append(request)
        last = len(self.output_ids) - 1
        for step, token in enumerate(self.output_ids):
            done = step == last
            out = GenerateOutputPB(finished=done, output_ids=int32_tensor([token]),
                                   aux_info=AuxInfoPB(iter_count=step + done, output_len=step + done))
            yield GenerateOutputsPB(generate_outputs=[out])


def start(port: int, output_ids: Sequence[int] = SEED_OUTPUT_IDS) -> tuple[grpc.Server, MockRpcServer]:
    servicer = MockRpcServer(output_ids)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    add_RpcServiceServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, servicer


if __name__ == "__main__":
    ids = [int(i) for i in sys.argv[2].split(",")] if len(sys.argv) > 2 else SEED_OUTPUT_IDS
    start(int(sys.argv[1]), ids)[0].wait_for_termination()
