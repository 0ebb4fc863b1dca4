"""RTP-LLM's RpcService.GenerateStreamCall on a backend's gRPC port (backend/rtp_rpc.py), beside kvyard's
own service: a client built from proto/rtp_llm_rpc.proto (RTP-LLM's field numbers) streams output ids as
INT32 tensors; what kvyard does not do is refused with INVALID_ARGUMENT, naming the field."""
from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from kvyard.tokenizer import TextTokenizer
from backend.rtp_rpc import METHOD
from proto import rtp_llm_rpc_pb2 as rtp
from tests.support.mock_stack import MockBackendThread, script


class RpcServiceStub:
    """What RTP-LLM's generated client stub does for this one method."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.GenerateStreamCall = channel.unary_stream(METHOD, request_serializer=rtp.GenerateInputPB.SerializeToString,
                                                       response_deserializer=rtp.GenerateOutputsPB.FromString)


@pytest.fixture(scope="module")
def stub(tokenizer: TextTokenizer) -> Iterator[RpcServiceStub]:
    with MockBackendThread(script(tokenizer, "Hi there")) as backend, \
            grpc.insecure_channel(backend.address) as channel:
        yield RpcServiceStub(channel)


def ids_of(tensor: rtp.TensorPB) -> list[int]:
    assert tensor.data_type == rtp.TensorPB.INT32 and tensor.shape[0] == 1
    ids = np.frombuffer(tensor.int32_data, dtype="<i4").tolist()
    assert list(tensor.shape) == [1, len(ids)]
    return ids


def test_generate_stream_call_streams_output_ids(stub: RpcServiceStub, tokenizer: TextTokenizer) -> None:
    config = rtp.GenerateConfigPB(max_new_tokens=16, temperature=0.0, is_streaming=True, return_incremental=True,
                                  num_beams=1, do_sample=True, reuse_cache=True)
    config.random_seed.value = 7
    outs = list(stub.GenerateStreamCall(rtp.GenerateInputPB(request_id=42, token_ids=[1, 2, 3],
                                                            generate_config=config, client_id="test"), timeout=30))
    assert {o.request_id for o in outs} == {42}
    steps = [o.generate_outputs[0] for o in outs]
    assert [i for s in steps for i in ids_of(s.output_ids)] == [*tokenizer.encode("Hi there"), 2]
    assert [s.finished for s in steps] == [False] * (len(steps) - 1) + [True]
    assert steps[-1].aux_info.input_len == 3 and steps[-1].aux_info.output_len == len(steps)


def test_max_new_tokens_stops_it(stub: RpcServiceStub) -> None:
    outs = list(stub.GenerateStreamCall(rtp.GenerateInputPB(
        request_id=1, token_ids=[1, 2], generate_config=rtp.GenerateConfigPB(max_new_tokens=2)), timeout=30))
    assert len(outs) == 2 and outs[-1].generate_outputs[0].finished


@pytest.mark.parametrize("config,needle", [
    (rtp.GenerateConfigPB(max_new_tokens=4, num_beams=4), "num_beams"),
    # field 18 (return_logits: true), which this proto leaves undeclared: as RTP-LLM's client sends it
    (rtp.GenerateConfigPB.FromString(rtp.GenerateConfigPB(max_new_tokens=4).SerializeToString() + b"\x90\x01\x01"),
     "GenerateConfigPB field 18"),
])
def test_what_kvyard_does_not_do_is_refused(stub: RpcServiceStub, config: rtp.GenerateConfigPB,
                                            needle: str) -> None:
    refused(stub, rtp.GenerateInputPB(request_id=3, token_ids=[1], generate_config=config), needle)


def test_multimodal_inputs_are_refused(stub: RpcServiceStub) -> None:
    plain = rtp.GenerateInputPB(request_id=4, token_ids=[1], generate_config=rtp.GenerateConfigPB(max_new_tokens=2))
    # field 3 (multimodal_inputs), an empty MultimodalInputPB: undeclared here
    refused(stub, rtp.GenerateInputPB.FromString(plain.SerializeToString() + b"\x1a\x00"), "GenerateInputPB field 3")


def refused(stub: RpcServiceStub, request: rtp.GenerateInputPB, needle: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(stub.GenerateStreamCall(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in info.value.details()
