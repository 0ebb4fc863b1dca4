"""LMTP frames (`TYPE <json>` WebSocket text): the client's GENERATE / SCORE / MODEL_INFO in, TOKEN / MSG out.

Field names and defaults follow LMQL's own LMTP server (lmql.models.lmtp): greedy unless a temperature
is given, 32 tokens unless max_tokens is given, one top logprob unless top_logprobs is given.
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from frontend.backend_client import TokenLogprob
from frontend.guided import refuse_constraints
from frontend.generate_config import RepetitionPenalty
from kvyard.errors import ErrorCode, RequestError
from kvyard.limits import MAX_TOP_LOGPROBS
from kvyard.sampling_params import Dialect, SamplingParams

COMMANDS = ("GENERATE", "SCORE", "MODEL_INFO")

StreamId = StrictInt | str  # LMQL counts from 1 per connection; echoed back as given


class _Frame(BaseModel):
    # Unknown keys are ignored: LMQL passes model-specific decoder arguments through.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    stream_id: StreamId
    model: str | None = None          # None or "": this frontend's model


class ModelInfoFrame(_Frame):
    pass


class ScoreFrame(_Frame):
    prompt: list[StrictInt] = Field(min_length=1)   # the context, token ids
    scored: list[StrictInt] = Field(min_length=1)   # the tokens to score after it


class GenerateFrame(_Frame):
    prompt: list[StrictInt] = Field(min_length=1)
    # Unset (None): Dialect.LMTP's default (kvyard/sampling_params.py).
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    repetition_penalty: RepetitionPenalty | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    logit_bias: dict[int, float] | None = None   # {"<token id>": bias}, e.g. ±100 to force or ban a token

    def params(self, timeout_s: float) -> SamplingParams:
        return SamplingParams.for_dialect(
            Dialect.LMTP, max_new_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, min_p=self.min_p, seed=self.seed, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias, top_logprobs=self.top_logprobs, timeout_ms=int(timeout_s * 1000))


_FRAMES: dict[str, type[_Frame]] = {"GENERATE": GenerateFrame, "SCORE": ScoreFrame, "MODEL_INFO": ModelInfoFrame}


class FrameError(Exception):
    """A frame that cannot be served; stream_id is None when even that could not be read."""

    def __init__(self, message: str, stream_id: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.stream_id = stream_id


def parse_frame(text: str) -> tuple[str, _Frame]:
    """`GENERATE {...}` → ("GENERATE", GenerateFrame). Raises FrameError naming what is wrong."""
    command, _, body = text.strip().partition(" ")
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as exc:
        raise FrameError(f"{command or 'frame'}: the payload is not JSON ({exc})") from None
    stream_id = payload.get("stream_id") if isinstance(payload, dict) else None
    frame_type = _FRAMES.get(command)
    if frame_type is None:
        raise FrameError(f"unknown command {command[:40]!r}; one of {', '.join(COMMANDS)}", stream_id)
    if not isinstance(payload, dict):
        raise FrameError(f"{command}: the payload must be a JSON object", stream_id)
    try:
        refuse_constraints((k for k, v in payload.items() if v is not None), "LMTP")
    except RequestError as exc:  # LMQL constrains on its side, with logit_bias
        raise FrameError(f"{command}: {exc.message}", stream_id) from None
    try:
        return command, frame_type.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "payload"
        raise FrameError(f"{command}: {where}: {first['msg']}", stream_id) from None


def token_item(stream_id: Any, lp: TokenLogprob, finish_reason: str | None) -> dict[str, Any]:
    """A GENERATE item: top_logprobs holds the sampled token and the most likely alternatives."""
    top = {str(lp.token_id): lp.logprob}
    top.update((str(t), v) for t, v in lp.top if str(t) not in top)
    return {"token": lp.token_id, "stream_id": stream_id, "logprob": lp.logprob, "finish_reason": finish_reason,
            "top_logprobs": top}


def score_items(stream_id: Any, logprobs: list[TokenLogprob]) -> list[dict[str, Any]]:
    """One SCORE item per scored token, no top_logprobs, "stop" on the last."""
    last = len(logprobs) - 1
    return [{"token": lp.token_id, "stream_id": stream_id, "logprob": lp.logprob,
             "finish_reason": "stop" if i == last else None} for i, lp in enumerate(logprobs)]


def error_item(stream_id: Any, error: RequestError | FrameError | str) -> dict[str, Any]:
    message = error if isinstance(error, str) else error.message
    if isinstance(error, RequestError):
        message = f"{error.code.value}: {message}"
    return {"stream_id": stream_id, "error": message}


def encode(command: str, items: list[dict[str, Any]]) -> str:
    """`TOKEN [...]` / `MSG [...]`: one line of JSON after the type."""
    return f"{command} {json.dumps(items, separators=(',', ':'))}"
