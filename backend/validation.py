"""Request checks before a request reaches the engine thread: what this engine can never serve."""
from __future__ import annotations

from backend.engine_types import GenerationRequest, ScoreRequest
from backend.scheduler import Scheduler
from kvyard.errors import ErrorCode, RequestError
from kvyard.limits import MAX_N, MAX_TOP_LOGPROBS


def validate_request(req: GenerationRequest | ScoreRequest, vocab_size: int, max_model_len: int,
                     scheduler: Scheduler) -> None:
    """Raises RequestError for input this engine can never serve. Pure (reads the scheduler's fixed
    capacity only): safe from any thread."""
    ids = req.prompt_ids + (req.scored_ids if isinstance(req, ScoreRequest) else [])
    if not req.prompt_ids:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, "the prompt has no tokens", "token_ids")
    check_token_ids(ids, vocab_size)
    if len(ids) >= max_model_len:
        raise RequestError(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                           f"the request has {len(ids)} tokens; this model's context is {max_model_len} tokens, "
                           f"so at most {max_model_len - 1} input tokens leave room for one more", "token_ids")
    if not scheduler.fits_ever(len(ids) + 1):
        raise RequestError(ErrorCode.OUT_OF_KV_CACHE,
                           f"{len(ids)} tokens can never fit this backend's KV cache "
                           f"({scheduler.token_capacity} tokens)", "token_ids")
    if isinstance(req, ScoreRequest):
        if not req.scored_ids:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "nothing to score", "scored_ids")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(ErrorCode.INVALID_ARGUMENT,
                               f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
        return
    if not 1 <= req.n <= MAX_N:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"n must be in [1, {MAX_N}], got {req.n}", "n")
    if req.constraint is not None and req.grammar is None:
        raise RequestError(ErrorCode.INTERNAL, "the request's constraint was never compiled")
    try:
        req.sampling.validate(vocab_size)
    except ValueError as exc:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, str(exc)) from exc


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    """Raises RequestError when an id is outside the vocabulary (the mock backend asks the same)."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(ErrorCode.INVALID_ARGUMENT,
                           f"token ids out of the vocabulary (size {vocab_size}): {bad[:5]}", "token_ids")
