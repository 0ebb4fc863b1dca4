"""Protobuf ⇄ engine types, at the gRPC edge only: nothing past backend/server.py sees protobuf."""
from __future__ import annotations

import dataclasses

import torch

from backend.engine_types import (CacheStatus, GenerationRequest, ImageInput, PoolingRequest, PoolingResult, PoolItem, PoolTask,
                                  ScoreRequest, ScoreResult, TokenOutput)
from backend.sequence import FinishReason, StopConditions
from kvyard.aux_info import AuxInfo
from kvyard.constraint import Constraint, ConstraintKind
from kvyard.errors import ErrorCode, RequestError
from kvyard.sampling_params import SamplingParams
from kvyard.worker_status import WorkerStatus
from proto import model_rpc_pb2 as pb

_KIND_FROM_PB = {
    pb.CONSTRAINT_KIND_JSON_SCHEMA: ConstraintKind.JSON_SCHEMA,
    pb.CONSTRAINT_KIND_REGEX: ConstraintKind.REGEX,
    pb.CONSTRAINT_KIND_LARK: ConstraintKind.LARK,
}

_FINISH_TO_PB = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_STOP,
}
def request_from_pb(msg: pb.GenerateInputPB, eos_token_ids: frozenset[int],
                    max_model_len: int) -> GenerationRequest:
    """Raises RequestError(INVALID_ARGUMENT) for values no engine could accept."""
    return _request(msg.request_id, list(msg.token_ids), msg.generate_config, eos_token_ids, max_model_len)


def handover_request_from_pb(h: pb.KVTransferHeaderPB, eos_token_ids: frozenset[int],
                             max_model_len: int) -> GenerationRequest:
    """The decode side's request: the prompt plus the prefill side's first token(s), whose share of the
    output budget (max_new_tokens, min_new_tokens) is already spent."""
    spent = h.first_token_output_len
    max_new = max(1, h.generate_config.max_new_tokens - spent) if h.generate_config.max_new_tokens else 0
    req = _request(h.request_id, [*h.prompt_ids, h.first_token], h.generate_config, eos_token_ids, max_model_len,
                   max_new, max(0, h.generate_config.min_new_tokens - spent))
    # digests only (the block keys' salts), and Qwen-VL's grids (its M-RoPE positions)
    grids = [tuple(h.image_grids[i:i + 3]) for i in range(0, len(h.image_grids), 3)]
    req.images = [ImageInput(bytes(d), None, grid=grids[k] if k < len(grids) else None)  # type: ignore[arg-type]
                  for k, d in enumerate(h.image_digests)]
    return req


def params_from_pb(cfg: pb.GenerateConfigPB) -> SamplingParams:
    """GenerateConfigPB → SamplingParams (frontend/backend_client.py writes it): the plain fields by
    SamplingParams.from_wire (a zero value means the field's off state, as the proto documents)."""
    return SamplingParams.from_wire(cfg, seed=cfg.seed if cfg.HasField("seed") else None,
                                    bad_words_ids=tuple(tuple(w.ids) for w in cfg.bad_words_ids),
                                    stop_sequences=tuple(tuple(s.ids) for s in cfg.stop_words_list if s.ids),
                                    constraint=constraint_from_pb(cfg))


def _request(request_id: str, prompt: list[int], cfg: pb.GenerateConfigPB, eos_token_ids: frozenset[int],
             max_model_len: int, max_new_tokens: int | None = None, min_new_tokens: int | None = None
             ) -> GenerationRequest:
    """max_new_tokens / min_new_tokens: the config's unless given; max_new_tokens 0 means up to the context."""
    sampling = params_from_pb(cfg)
    asked = sampling.max_new_tokens if max_new_tokens is None else max_new_tokens
    max_new = asked or max(1, max_model_len - len(prompt))
    try:
        if asked < 0:
            raise ValueError(f"max_new_tokens must be > 0, got {asked}")
        stop = StopConditions(
            max_new_tokens=max_new,
            eos_token_ids=eos_token_ids,
            stop_token_ids=frozenset(sampling.stop_token_ids),
            stop_sequences=sampling.stop_sequences,
            min_new_tokens=sampling.min_new_tokens if min_new_tokens is None else min_new_tokens,
            ignore_eos=sampling.ignore_eos,
            max_total_len=max_model_len,
        )
    except ValueError as exc:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, str(exc)) from exc
    return GenerationRequest(request_id=request_id, prompt_ids=prompt, sampling=sampling,
                             stop=stop, n=sampling.n, constraint=sampling.constraint)


def constraint_from_pb(cfg: pb.GenerateConfigPB) -> Constraint | None:
    if not cfg.HasField("constraint") or cfg.constraint.kind == pb.CONSTRAINT_KIND_UNSPECIFIED:
        return None
    kind = _KIND_FROM_PB.get(cfg.constraint.kind)
    if kind is None:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"unknown constraint kind {cfg.constraint.kind}", "constraint")
    return Constraint(kind, cfg.constraint.text)


def score_request_from_pb(msg: pb.ScoreInputPB) -> ScoreRequest:
    return ScoreRequest(request_id=msg.request_id, prompt_ids=list(msg.prompt_ids),
                        scored_ids=list(msg.scored_ids), top_logprobs=msg.top_logprobs,
                        adapter_name=msg.adapter_name)


def score_result_to_pb(result: ScoreResult) -> pb.ScoreOutputPB:
    msg = pb.ScoreOutputPB(aux_info=aux_to_pb(result.aux))
    for smp in result.logprobs:
        lp = msg.logprobs.add(token_id=smp.token_id, logprob=smp.logprob or 0.0)
        for tok, val in smp.top_logprobs or ():
            lp.top_logprobs.add(token_id=tok, logprob=val)
    return msg


_POOL_TASK_FROM_PB = {pb.POOL_TASK_EMBED: PoolTask.EMBED, pb.POOL_TASK_SPARSE: PoolTask.SPARSE,
                      pb.POOL_TASK_COLBERT: PoolTask.COLBERT, pb.POOL_TASK_CLASSIFY: PoolTask.CLASSIFY}


def pooling_request_from_pb(msg: pb.PoolInputPB) -> PoolingRequest:
    task = _POOL_TASK_FROM_PB.get(msg.task)
    if task is None:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"unknown pooling task {msg.task}", "task")
    return PoolingRequest(msg.request_id, [PoolItem(list(it.token_ids), it.pair_start) for it in msg.items], task)


def pooling_result_to_pb(result: PoolingResult) -> pb.PoolOutputPB:
    msg = pb.PoolOutputPB(aux_info=aux_to_pb(result.aux))
    for out in result.outputs:
        msg.outputs.add(values=out.values, token_ids=out.token_ids, rows=out.rows)
    return msg


def worker_status_to_pb(st: WorkerStatus) -> pb.WorkerStatusPB:
    return pb.WorkerStatusPB(**st.__dict__)


def cache_status_to_pb(st: CacheStatus) -> pb.CacheStatusPB:
    return pb.CacheStatusPB(**st.__dict__)


def aux_to_pb(a: AuxInfo) -> pb.AuxInfoPB:
    return pb.AuxInfoPB(**dataclasses.asdict(a))


def outputs_to_pb(request_id: str, outs: list[TokenOutput]) -> pb.GenerateOutputsPB:
    msg = pb.GenerateOutputsPB(request_id=request_id)
    for out in outs:
        item = msg.generate_outputs.add(index=out.index, output_ids=[out.token_id],
                                        finished=out.finish_reason is not None,
                                        finish_reason=_FINISH_TO_PB[out.finish_reason])
        if out.sample.logprob is not None:
            lp = item.logprobs.add(token_id=out.token_id, logprob=out.sample.logprob)
            for tok, val in out.sample.top_logprobs or ():
                lp.top_logprobs.add(token_id=tok, logprob=val)
        item.aux_info.CopyFrom(aux_to_pb(out.aux))
    return msg


_EMBED_DTYPES = ("float32", "bfloat16", "float16")


def embedding_to_pb(t: torch.Tensor) -> pb.ImageEmbeddingPB:
    """One image's embeddings [N, D] as raw bytes (a VIT's answer)."""
    t = t.detach().contiguous().cpu()
    return pb.ImageEmbeddingPB(data=t.view(torch.uint8).numpy().tobytes(), dtype=str(t.dtype).removeprefix("torch."),
                               shape=list(t.shape))


def embedding_from_pb(m: pb.ImageEmbeddingPB) -> torch.Tensor:
    """Raises RequestError (INTERNAL) for bytes that are not the tensor the message describes."""
    shape = tuple(m.shape)
    if m.dtype not in _EMBED_DTYPES or len(shape) != 2 or min(shape) <= 0:
        raise RequestError(ErrorCode.INTERNAL, f"the VIT sent an embedding of dtype {m.dtype!r}, shape {list(shape)}")
    dtype = getattr(torch, m.dtype)
    if len(m.data) != shape[0] * shape[1] * dtype.itemsize:
        raise RequestError(ErrorCode.INTERNAL, f"the VIT sent {len(m.data)} bytes for a {m.dtype}{list(shape)} embedding")
    return torch.frombuffer(bytearray(m.data), dtype=torch.uint8).view(dtype).view(shape)
