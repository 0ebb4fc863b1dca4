"""How one request's tokens are drawn and when they stop: the one SamplingParams type. A dialect builds it
once (frontend/pipeline.py, from DIALECT_DEFAULTS below and the request's fields), it crosses gRPC as
GenerateConfigPB (to_wire / from_wire here name every field; frontend/backend_client.py and
backend/pb_convert.py, the only files that touch the message, copy them by these names) and the engine's
sequences and sampler read it."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from kvyard.constraint import Constraint
from kvyard.limits import LOGIT_BIAS_BOUND, MAX_TOP_LOGPROBS, PENALTY_BOUND, REPETITION_PENALTY_RANGE

GREEDY_BELOW = 1e-5   # temperatures under this sample greedily (as vLLM does): logits / t overflows float32


@dataclass(frozen=True)
class SamplingParams:
    """Field defaults are the engine's (what GenerateConfigPB's zero values mean to a direct gRPC caller:
    greedy, every filter off); each HTTP dialect starts from its own row of DIALECT_DEFAULTS instead."""
    # how many tokens
    max_new_tokens: int = 0          # output tokens at most; 0: up to the model's context
    min_new_tokens: int = 0          # eos and stop tokens are neither sampled nor stop before this many
    n: int = 1                       # sequences sampled from the prompt, each with its own RNG
    # how each token is drawn
    temperature: float = 0.0         # 0 → greedy
    top_p: float = 1.0               # nucleus: keep the smallest set holding this much mass; 1 → off
    top_k: int = 0                   # keep the k most likely tokens; 0 → off
    min_p: float = 0.0               # drop tokens under min_p × the top token's probability; 0 → off
    typical_p: float = 1.0           # locally typical sampling: keep this much mass nearest the entropy; 1 → off
    seed: int | None = None          # per-request RNG: same seed, same tokens, whatever the batch
    repetition_penalty: float = 1.0  # CTRL-style, over prompt and output tokens; 1 → off
    presence_penalty: float = 0.0    # OpenAI-style, once per token already generated
    frequency_penalty: float = 0.0   # OpenAI-style, per occurrence of a token already generated
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # token id → added to its logit
    allowed_token_ids: tuple[int, ...] = ()           # only these may be sampled; empty → any
    bad_words_ids: tuple[tuple[int, ...], ...] = ()   # token sequences never generated (last id banned after
                                                      # the rest; a one-token word always)
    # when to stop
    stop_token_ids: tuple[int, ...] = ()              # ids that end a sequence (kept in its output)
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # output ending with one of these ends it
    ignore_eos: bool = False                          # generate through the model's eos
    timeout_ms: int = 0                               # fail with TIMEOUT after this long; 0 → no limit
    # what comes back
    logprobs: bool = False           # each sampled token's logprob
    top_logprobs: int = 0            # and this many alternatives (<= MAX_TOP_LOGPROBS)
    constraint: Constraint | None = None  # a grammar every sequence's output follows (frontend/guided.py)
    # which weights
    adapter: str = ""                # a LoRA adapter's name (backend/lora.py); "" → the base model

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @classmethod
    def for_dialect(cls, dialect: Dialect, **given: Any) -> SamplingParams:
        """The dialect's defaults, overridden by every given value that is not None."""
        return cls(**{**DIALECT_DEFAULTS[dialect], **{k: v for k, v in given.items() if v is not None}})

    def to_wire(self) -> dict[str, Any]:
        """The fields GenerateConfigPB carries as plain values, under its names (the seed, word lists and
        constraint are messages of their own: frontend/backend_client.py writes those)."""
        return {_WIRE_NAMES.get(name, name): _plain(getattr(self, name)) for name in _WIRE_FIELDS}

    @classmethod
    def from_wire(cls, wire: Any, **rest: Any) -> SamplingParams:
        """From a GenerateConfigPB's plain fields (read by name: this module imports no protobuf) plus `rest`
        (seed, word lists, constraint). A zero means the field's off state, as the proto documents: top_p,
        typical_p and repetition_penalty 0 → 1, n 0 → 1; top_logprobs > 0 asks for logprobs too."""
        values = {name: _plain(getattr(wire, _WIRE_NAMES.get(name, name))) for name in _WIRE_FIELDS}
        for name in ("top_p", "typical_p", "repetition_penalty"):
            values[name] = values[name] or 1.0
        values["n"] = max(1, values["n"])
        values["logprobs"] = values["logprobs"] or values["top_logprobs"] > 0
        return cls(**values, **rest)

    def describe(self) -> dict[str, Any]:
        """As debug_info and /chat/render show it (JSON-ready)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["logit_bias"] = dict(self.logit_bias)
        out["constraint"] = self.constraint and {"kind": self.constraint.kind.value, "text": self.constraint.text}
        return out

    def validate(self, vocab_size: int) -> None:
        """Raises ValueError naming the bad field (the backend's check; the frontend's bounds are the same)."""
        for name in ("temperature", "top_p", "min_p", "typical_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        for name in ("top_p", "typical_p"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise ValueError(f"repetition_penalty must be in [{low}, {high}], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -PENALTY_BOUND <= getattr(self, name) <= PENALTY_BOUND:
                raise ValueError(f"{name} must be in [-{PENALTY_BOUND:g}, {PENALTY_BOUND:g}], got {getattr(self, name)}")
        if any(not (math.isfinite(v) and -LOGIT_BIAS_BOUND <= v <= LOGIT_BIAS_BOUND) for v in self.logit_bias.values()):
            raise ValueError(f"logit_bias values must be in [-{LOGIT_BIAS_BOUND:g}, {LOGIT_BIAS_BOUND:g}]")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        for name, ids in (("logit_bias", list(self.logit_bias)), ("allowed_token_ids", self.allowed_token_ids),
                          ("bad_words", [t for w in self.bad_words_ids for t in w])):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name} token ids out of the vocabulary (size {vocab_size}): {bad[:5]}")
        if any(not w for w in self.bad_words_ids):
            raise ValueError("bad_words must not contain an empty word")


# What crosses gRPC as GenerateConfigPB's plain fields (the rest: seed, stop_sequences, bad_words_ids and
# constraint are messages of their own), and the two fields the proto names otherwise.
_WIRE_FIELDS = ("max_new_tokens", "min_new_tokens", "n", "temperature", "top_p", "top_k", "min_p", "typical_p",
                "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "allowed_token_ids",
                "stop_token_ids", "ignore_eos", "timeout_ms", "logprobs", "top_logprobs", "adapter")
_WIRE_NAMES = {"n": "num_return_sequences", "logprobs": "return_logprobs", "adapter": "adapter_name"}


def _plain(value: Any) -> Any:
    """A map as a dict, a repeated field as a tuple (protobuf's containers are neither), else the value."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        return value
    return dict(value) if hasattr(value, "keys") else tuple(value)


class Dialect(Enum):
    OPENAI = "openai"      # /v1/chat/completions, /v1/completions, /v1/responses
    RTP = "rtp"            # RTP-LLM's POST / (generate_config)
    GENERATE = "generate"  # POST /generate (query parameters)
    LMTP = "lmtp"          # LMQL's LMTP GENERATE frames


# Each dialect's defaults, in one place: what a field the request leaves unset becomes.
_OPENAI = {"temperature": 1.0, "top_p": 1.0}
DIALECT_DEFAULTS: dict[Dialect, dict[str, Any]] = {
    Dialect.OPENAI: _OPENAI,
    Dialect.RTP: _OPENAI,                                   # RTP-LLM's GenerateConfig samples at 1.0 too
    Dialect.GENERATE: {**_OPENAI, "max_new_tokens": 128},
    Dialect.LMTP: {"temperature": 0.0, "max_new_tokens": 32,  # LMQL's own LMTP server: greedy, 32 tokens,
                   "logprobs": True, "top_logprobs": 1},       # one top logprob
}
