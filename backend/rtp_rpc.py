"""RTP-LLM's RpcService.GenerateStreamCall (proto/rtp_llm_rpc.proto) on the backend's gRPC port, beside
kvyard's own service: each call is translated into kvyard's GenerateInputPB, run by the same servicer
(validation, constraints, task list, cancellation), and its outputs translated back (output ids as an
INT32 TensorPB of shape [1, tokens]). A failure ends the call with a gRPC status, as RTP-LLM's backend does.
A GenerateConfigPB / GenerateInputPB field kvyard does not declare is refused when set, naming its number."""
from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import numpy as np
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from proto import model_rpc_pb2 as pb
from proto import model_rpc_pb2_grpc as pb_grpc
from proto import rtp_llm_rpc_pb2 as rtp

METHOD = "/RpcService/GenerateStreamCall"   # RTP-LLM's service has no package

# kvyard's ErrorCodePB → the gRPC status an RTP-LLM client sees
_STATUS = {
    pb.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT, pb.CONTEXT_LENGTH_EXCEEDED: grpc.StatusCode.INVALID_ARGUMENT,
    pb.OUT_OF_KV_CACHE: grpc.StatusCode.RESOURCE_EXHAUSTED, pb.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    pb.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED, pb.CANCELLED: grpc.StatusCode.CANCELLED,
    pb.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}


class RtpRpcServicer:
    def __init__(self, kvyard: pb_grpc.ModelRpcServiceServicer) -> None:
        self.kvyard = kvyard   # the backend's own servicer, which does the work

    def handler(self) -> grpc.GenericRpcHandler:
        """RpcService with its one method, for grpc.aio.Server.add_generic_rpc_handlers."""
        method = grpc.unary_stream_rpc_method_handler(self.GenerateStreamCall,
                                                      request_deserializer=rtp.GenerateInputPB.FromString,
                                                      response_serializer=rtp.GenerateOutputsPB.SerializeToString)
        return grpc.method_handlers_generic_handler("RpcService", {"GenerateStreamCall": method})

    async def GenerateStreamCall(self, request: rtp.GenerateInputPB, context: grpc.aio.ServicerContext
                                 ) -> AsyncIterator[rtp.GenerateOutputsPB]:
        refused = _undeclared(request, request.generate_config) or _refused(request.generate_config)
        if refused:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused)
        stream = self.kvyard.GenerateStreamCall(input_from_rtp(request), context)
        try:
            async for outs in stream:
                if outs.HasField("error"):
                    await context.abort(_STATUS.get(outs.error.code, grpc.StatusCode.INTERNAL), outs.error.message)
                yield outputs_to_rtp(request.request_id, outs)
        finally:
            await stream.aclose()


def input_from_rtp(request: rtp.GenerateInputPB) -> pb.GenerateInputPB:
    c = request.generate_config
    config = pb.GenerateConfigPB(
        max_new_tokens=c.max_new_tokens, num_return_sequences=c.num_return_sequences, min_new_tokens=c.min_new_tokens,
        top_k=c.top_k, top_p=c.top_p, temperature=c.temperature, repetition_penalty=c.repetition_penalty,
        timeout_ms=c.timeout_ms, ignore_eos=c.ignore_eos, presence_penalty=c.presence_penalty,
        frequency_penalty=c.frequency_penalty,
        stop_words_list=[pb.TokenIdsPB(ids=row.values) for row in c.stop_words_list.rows if row.values])
    if c.HasField("random_seed"):
        config.seed = c.random_seed.value
    return pb.GenerateInputPB(request_id=f"rtp-{request.request_id}", token_ids=request.token_ids,
                              generate_config=config)


def outputs_to_rtp(request_id: int, outs: pb.GenerateOutputsPB) -> rtp.GenerateOutputsPB:
    msg = rtp.GenerateOutputsPB(request_id=request_id)
    for out in sorted(outs.generate_outputs, key=lambda o: o.index):
        a = out.aux_info
        ids = np.asarray(out.output_ids, dtype="<i4")
        msg.generate_outputs.add(
            finished=out.finished,
            output_ids=rtp.TensorPB(data_type=rtp.TensorPB.INT32, shape=[1, len(ids)], int32_data=ids.tobytes()),
            aux_info=rtp.AuxInfoPB(cost_time_us=_int32(a.cost_time_us), iter_count=a.iter_count,
                                   input_len=a.input_len, reuse_len=a.reuse_len, output_len=a.output_len,
                                   step_output_len=len(ids), wait_time_us=_int32(a.wait_time_us),
                                   first_token_cost_time_us=_int32(a.first_token_cost_time_us)))
    return msg


def _int32(us: int) -> int:
    return min(us, 2**31 - 1)   # RTP-LLM's microsecond fields are int32 (about 36 minutes)


def _undeclared(*messages: Message) -> str:
    """The first field set that this proto does not declare (RTP-LLM's others: multimodal inputs, beams'
    settings, logits, hidden states, adapters, think mode, ...)."""
    for message in messages:
        for field in UnknownFieldSet(message):
            return (f"{type(message).__name__} field {field.field_number} is not supported by kvyard's backend "
                    "(see docs/rtp_llm_compat.md)")
    return ""


def _refused(config: rtp.GenerateConfigPB) -> str:
    if config.num_beams > 1:
        return "num_beams: kvyard samples; it has no beam search (num_beams 0 or 1)"
    return ""
