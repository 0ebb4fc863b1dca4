"""Frontend → a backend that speaks RTP-LLM's RpcService.GenerateStreamCall (proto/rtp_llm_rpc.proto: RTP-LLM's
own field numbers), chosen once with BACKEND_PROTOCOL=rtp_llm: the seed's mock backend, a real RTP-LLM
backend, or kvyard's own (which serves RpcService beside its service, backend/rtp_rpc.py). The same interface
as BackendClient: SamplingParams in, BackendOutput lists out. A sampling field RTP-LLM's GenerateConfigPB
cannot carry is the request's 400, naming it; finish reasons are inferred (the message has only `finished`):
"length" once max_new_tokens ids came back, else "stop"."""
from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import grpc
import numpy as np
from grpc_health.v1 import health_pb2

from frontend.backend_client import BackendClient, BackendOutput, _fits_the_proto, _rpc_error
from kvyard.aux_info import AuxInfo
from kvyard.errors import ErrorCode, RequestError
from kvyard.sampling_params import SamplingParams
from proto import rtp_llm_rpc_pb2 as rtp

METHOD = "/RpcService/GenerateStreamCall"   # RTP-LLM's service has no package (backend/rtp_rpc.py serves it)

# SamplingParams fields GenerateConfigPB has no field for: (the request's name for it, its off value)
_NOT_CARRIED = {"min_p": ("min_p", 0.0), "typical_p": ("typical_p", 1.0), "logit_bias": ("logit_bias", {}),
                "allowed_token_ids": ("allowed_token_ids", ()), "bad_words_ids": ("bad_words", ()),
                "logprobs": ("logprobs", False), "top_logprobs": ("top_logprobs", 0),
                "constraint": ("response_format", None), "n": ("n", 1)}
_AUX = ("cost_time_us", "iter_count", "input_len", "reuse_len", "output_len", "first_token_cost_time_us",
        "wait_time_us")   # AuxInfoPB's fields that AuxInfo has too

_REFUSED = {grpc.StatusCode.INVALID_ARGUMENT: ErrorCode.INVALID_ARGUMENT,   # the backend's refusals, as it words them
            grpc.StatusCode.RESOURCE_EXHAUSTED: ErrorCode.OVERLOADED}


def config_to_rtp(p: SamplingParams) -> rtp.GenerateConfigPB:
    """SamplingParams → RTP-LLM's GenerateConfigPB. stop_token_ids travel as one-id stop_words_list rows."""
    for name, (param, off) in _NOT_CARRIED.items():
        value = getattr(p, name)
        if (dict(value) if name == "logit_bias" else value) != off:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{param} is not supported: this frontend's backend speaks "
                               "RTP-LLM's RpcService (BACKEND_PROTOCOL=rtp_llm), whose GenerateConfigPB cannot "
                               "carry it", param)
    with _fits_the_proto():
        cfg = rtp.GenerateConfigPB(
            max_new_tokens=p.max_new_tokens, min_new_tokens=p.min_new_tokens, num_return_sequences=1, num_beams=1,
            top_k=p.top_k, top_p=p.top_p, temperature=p.temperature, repetition_penalty=p.repetition_penalty,
            presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty, ignore_eos=p.ignore_eos,
            timeout_ms=p.timeout_ms, is_streaming=True, return_incremental=True, do_sample=not p.greedy)
        if p.seed is not None:
            cfg.random_seed.value = p.seed
        for ids in (*p.stop_sequences, *((t,) for t in p.stop_token_ids)):
            cfg.stop_words_list.rows.add(values=ids)
    return cfg


def ids_from_tensor(t: rtp.TensorPB) -> list[int]:
    """An output ids TensorPB (INT32, [1, tokens]) as a list."""
    if t.data_type != rtp.TensorPB.INT32:
        raise RequestError(ErrorCode.INTERNAL, f"the backend sent output ids as {rtp.TensorPB.DataType.Name(t.data_type)}, "
                           "not INT32")
    return np.frombuffer(t.int32_data, dtype="<i4").tolist()


class RtpBackendClient(BackendClient):
    """BackendClient over RTP-LLM's RpcService: generate() calls GenerateStreamCall; score and pool stay
    kvyard's calls (a backend without them answers UNIMPLEMENTED: the request's 400)."""

    def __init__(self, address: str, token: str = "") -> None:
        super().__init__(address, token)
        self._rtp_call = self._channel.unary_stream(METHOD, request_serializer=rtp.GenerateInputPB.SerializeToString,
                                                    response_deserializer=rtp.GenerateOutputsPB.FromString)

    async def responsive(self, timeout_s: float) -> bool:
        return await self.healthy(timeout_s)

    async def healthy(self, timeout_s: float = 1.0) -> bool:
        """SERVING on gRPC's health service; a backend without that service (RTP-LLM's) counts when it answers."""
        try:
            resp = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return exc.code() == grpc.StatusCode.UNIMPLEMENTED
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    async def generate(self, request_id: str, input_ids: list[int], params: SamplingParams,
                       decode_address: str = "", images: list[bytes] | None = None
                       ) -> AsyncIterator[list[BackendOutput]]:
        """As BackendClient.generate. RTP-LLM's request id is a number (drawn here); kvyard's goes as client_id.
        RTP-LLM's backend fails a call with a gRPC status (kvyard's answers an error message instead)."""
        if images:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "images are not supported with BACKEND_PROTOCOL=rtp_llm",
                               "messages")
        if decode_address:
            raise RequestError(ErrorCode.INTERNAL, "a prefill/decode split cannot be driven over RTP-LLM's "
                               "RpcService (BACKEND_PROTOCOL=rtp_llm)")
        config = config_to_rtp(params)
        with _fits_the_proto():
            msg = rtp.GenerateInputPB(request_id=secrets.randbits(62), token_ids=input_ids, generate_config=config,
                                      client_id=request_id)
        call = self._rtp_call(msg, metadata=self._metadata)
        generated: dict[int, int] = {}
        try:
            async for outs in call:
                step = []
                for index, o in enumerate(outs.generate_outputs):
                    ids = ids_from_tensor(o.output_ids)
                    generated[index] = generated.get(index, 0) + len(ids)
                    length = 0 < params.max_new_tokens <= generated[index]
                    step.append(BackendOutput(index, ids, ("length" if length else "stop") if o.finished else None,
                                              [], AuxInfo(**{f: getattr(o.aux_info, f) for f in _AUX})))
                yield step
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _REFUSED:
                raise RequestError(_REFUSED[exc.code()], exc.details() or exc.code().name) from exc
            raise _rpc_error(exc, self.address) from exc
        finally:
            call.cancel()  # no-op when the stream already ended
