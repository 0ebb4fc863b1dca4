"""Frontend → backend gRPC edge: plain dataclasses in, plain dataclasses out (no protobuf past here)."""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvyard.aux_info import AuxInfo
from kvyard.cluster_auth import grpc_metadata
from kvyard.constraint import ConstraintKind
from kvyard.grpc_keepalive import CLIENT_OPTIONS
from kvyard.errors import ErrorCode, RequestError
from kvyard.pb_errors import error_from_pb
from kvyard.sampling_params import SamplingParams
from proto import model_rpc_pb2 as pb
from proto import model_rpc_pb2_grpc as pb_grpc

log = logging.getLogger("kvyard.frontend")

_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}
_CONSTRAINT_KIND = {ConstraintKind.JSON_SCHEMA: pb.CONSTRAINT_KIND_JSON_SCHEMA, ConstraintKind.REGEX: pb.CONSTRAINT_KIND_REGEX,
                    ConstraintKind.LARK: pb.CONSTRAINT_KIND_LARK}


def params_to_pb(p: SamplingParams) -> pb.GenerateConfigPB:
    """SamplingParams → GenerateConfigPB (backend/pb_convert.py reads it back): every field, none defaulted here;
    the plain ones by SamplingParams.to_wire's names."""
    cfg = pb.GenerateConfigPB(**p.to_wire())
    if p.seed is not None:
        cfg.seed = p.seed
    for ids in p.stop_sequences:
        cfg.stop_words_list.add(ids=ids)
    for ids in p.bad_words_ids:
        cfg.bad_words_ids.add(ids=ids)
    if p.constraint is not None:
        cfg.constraint.kind = _CONSTRAINT_KIND[p.constraint.kind]
        cfg.constraint.text = p.constraint.text
    return cfg


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def aux_from_pb(aux: pb.AuxInfoPB) -> AuxInfo:
    return AuxInfo(**{f.name: getattr(aux, f.name) for f in fields(AuxInfo)})


@dataclass
class BackendOutput:
    """New tokens for one sequence of a request, from one backend step."""
    index: int
    token_ids: list[int]
    finish_reason: str | None       # "stop" / "length" once finished
    logprobs: list[TokenLogprob]    # one per token id when asked
    aux: AuxInfo = field(default_factory=AuxInfo)


@dataclass
class ScoreOutput:
    """Log-probabilities of the scored tokens, one per token in order."""
    logprobs: list[TokenLogprob]    # log P(scored_i | prompt, scored_<i), with alternatives when asked
    input_len: int                  # prompt + scored tokens
    reuse_len: int                  # of those, served from the prefix cache


@dataclass(frozen=True)
class PoolInput:
    """One input of a PoolCall, tokenized with the model's special tokens."""
    token_ids: list[int]
    pair_start: int = 0     # a cross-encoder pair: where the second text starts; 0 = one text


@dataclass
class Pooled:
    """One input's answer (PooledPB): values; SPARSE adds token_ids; COLBERT holds `rows` vectors."""
    values: list[float]
    token_ids: list[int]
    rows: int


@dataclass
class PoolOutput:
    outputs: list[Pooled]   # one per input, in order
    input_len: int          # tokens over every input


_POOL_TASKS = {"embed": pb.POOL_TASK_EMBED, "sparse": pb.POOL_TASK_SPARSE, "colbert": pb.POOL_TASK_COLBERT,
               "classify": pb.POOL_TASK_CLASSIFY}


@contextmanager
def _fits_the_proto() -> Iterator[None]:
    """The last line behind each dialect's own bounds: a number past an int32/int64 field of the proto is
    the client's 400 (INVALID_ARGUMENT), never an encoding error that surfaces as a 500."""
    try:
        yield
    except (ValueError, TypeError) as exc:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"a value does not fit the backend protocol: {exc}"
                           ) from None


class BackendClient:
    def __init__(self, address: str, token: str = "") -> None:
        self.address = address
        self._metadata = grpc_metadata(token)  # the cluster token, on every call but the health check
        self._channel = grpc.aio.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", 256 * 1024 * 1024),
            # A name with many addresses (a k8s headless Service) is spread over, not pinned to its first.
            ("grpc.lb_policy_name", "round_robin"),
            # A backend that was down when first dialled (still loading) is tried again within a second once
            # up, not after gRPC's default backoff, which grows to two minutes.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            *CLIENT_OPTIONS,  # a backend cut off mid-stream ends the stream with an error, not a hang
        ])
        self._stub = pb_grpc.ModelRpcServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def healthy(self, timeout_s: float = 1.0) -> bool:
        try:
            resp = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    async def responsive(self, timeout_s: float) -> bool:
        """Whether the backend answers a health check at all (SERVING or draining): alive, maybe busy."""
        try:
            await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return True

    async def generate(self, request_id: str, input_ids: list[int], params: SamplingParams,
                       decode_address: str = "", images: list[bytes] | None = None
                       ) -> AsyncIterator[list[BackendOutput]]:
        """Yields each backend step's outputs. Raises RequestError. Closing the iterator early
        cancels the gRPC call, which aborts the request in the backend and frees its KV.
        decode_address: this is a PREFILL backend; it hands the KV over to that DECODE backend.
        images: the files of a vision prompt's images, in prompt order."""
        with _fits_the_proto():
            msg = pb.GenerateInputPB(request_id=request_id, token_ids=input_ids,
                                     generate_config=params_to_pb(params), decode_address=decode_address,
                                     images=[pb.ImagePB(data=d) for d in images or ()])
        call = self._stub.GenerateStreamCall(msg, metadata=self._metadata)
        try:
            async for out in call:
                if out.HasField("error"):
                    raise error_from_pb(out.error)
                yield [_from_pb(o) for o in out.generate_outputs]
        except grpc.aio.AioRpcError as exc:
            raise _rpc_error(exc, self.address) from exc
        finally:
            call.cancel()  # no-op when the stream already ended

    async def score(self, request_id: str, prompt_ids: list[int], scored_ids: list[int],
                    top_logprobs: int = 0, timeout_s: float | None = None, adapter: str = "") -> ScoreOutput:
        """The backend's ScoreCall: one prefill over prompt + scored (with a LoRA adapter when given). Raises
        RequestError."""
        with _fits_the_proto():
            msg = pb.ScoreInputPB(request_id=request_id, prompt_ids=prompt_ids, scored_ids=scored_ids,
                                  top_logprobs=top_logprobs, adapter_name=adapter)
        try:
            out = await self._stub.ScoreCall(msg, timeout=timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise _rpc_error(exc, self.address) from exc
        if out.HasField("error"):
            raise error_from_pb(out.error)
        return ScoreOutput([_logprob_from_pb(lp) for lp in out.logprobs], out.aux_info.input_len,
                           out.aux_info.reuse_len)


    async def pool(self, request_id: str, items: list[PoolInput], task: str,
                   timeout_s: float | None = None) -> PoolOutput:
        """The backend's PoolCall (task: embed, sparse, colbert or classify). Raises RequestError; a
        cancelled caller cancels the call, which aborts its inputs there."""
        with _fits_the_proto():
            msg = pb.PoolInputPB(request_id=request_id, task=_POOL_TASKS[task],
                                 timeout_ms=int((timeout_s or 0) * 1000))
            for it in items:
                msg.items.add(token_ids=it.token_ids, pair_start=it.pair_start)
        try:
            out = await self._stub.PoolCall(msg, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise _rpc_error(exc, self.address) from exc
        if out.HasField("error"):
            raise error_from_pb(out.error)
        return PoolOutput([Pooled(list(o.values), list(o.token_ids), o.rows) for o in out.outputs],
                          out.aux_info.input_len)


def _from_pb(o: pb.GenerateOutputPB) -> BackendOutput:
    return BackendOutput(
        index=o.index, token_ids=list(o.output_ids),
        finish_reason=_FINISH.get(o.finish_reason) if o.finished else None,
        logprobs=[_logprob_from_pb(lp) for lp in o.logprobs], aux=aux_from_pb(o.aux_info))


def _logprob_from_pb(lp: pb.TokenLogprobPB) -> TokenLogprob:
    return TokenLogprob(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top_logprobs])


def _rpc_error(exc: grpc.aio.AioRpcError, address: str) -> RequestError:
    code = exc.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return RequestError(ErrorCode.UNAVAILABLE, f"backend {address} is unreachable")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return RequestError(ErrorCode.TIMEOUT, "the backend did not answer in time")
    if code == grpc.StatusCode.CANCELLED:
        return RequestError(ErrorCode.CANCELLED, "the backend call was cancelled")
    if code == grpc.StatusCode.UNIMPLEMENTED:  # an RTP-LLM backend (BACKEND_PROTOCOL=rtp_llm) has no ScoreCall
        return RequestError(ErrorCode.INVALID_ARGUMENT, f"backend {address} does not serve this call, which the "
                            "request needs (prompt logprobs, scoring or pooling)")
    log.error("backend %s failed: %s %s", address, code, exc.details())
    return RequestError(ErrorCode.INTERNAL, f"backend error: {code.name}")
