"""RTP-LLM's GenerateConfig (`extra_configs` of chat and completions, `generate_config` of `POST /`), the
query options of `POST /generate` (GenerateQuery), and the bounded number types every request body shares
(frontend/protocol.py, responses.py, lmtp_frames.py)."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator

from kvyard.limits import MAX_N, REPETITION_PENALTY_RANGE, TEMPERATURE_MAX

# Integers travel in the backend proto's int32/int64 fields: a larger one is the client's 400 here,
# never an encoding error (a 500) further down.
INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1
Int32 = Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]
Int64 = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]
# A token id: JSON's true or 1.0 is not one (a lax int would take them as 1).
TokenId = Annotated[StrictInt, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]
RepetitionPenalty = Annotated[float, Field(ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])]


def valid_text(v: Any, what: str = "stop strings") -> Any:
    """A lone UTF-16 surrogate (JSON's \\ud800) is valid JSON but not text: refuse it."""
    for s in [v] if isinstance(v, str) else v or []:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{what} must be valid Unicode (a lone UTF-16 surrogate is not)") from None
    return v


# RTP-LLM GenerateConfig keys kvyard refuses: (values that ask for nothing, why any other is refused).
_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "num_beams": ((1,), "kvyard samples; it has no beam search (num_beams 1 is taken)"),
    "return_logits": ((False,), "the full logits are not returned; ask for logprobs / top_logprobs"),
    "return_hidden_states": ((False,), "hidden states are not returned; the pooling routes (/v1/embeddings) give "
                                       "embeddings"),
    "top_p_decay": ((), "top_p does not decay over the answer in kvyard; give a fixed top_p"),
    "top_p_min": ((), "top_p does not decay over the answer in kvyard; give a fixed top_p"),
    "no_repeat_ngram_size": ((0,), "n-gram blocking is not implemented; repetition_penalty, presence_penalty and "
                                   "frequency_penalty are"),
    "bad_words_list": (([],), "give the words as text in the request's bad_words"),
}


class GenerateConfig(BaseModel):
    """RTP-LLM's GenerateConfig, the subset kvyard honours: `extra_configs` of a chat or completion
    request, `generate_config` of `POST /`. Unknown keys are a 400 rather than silently ignored."""
    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    min_new_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=TEMPERATURE_MAX)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: RepetitionPenalty | None = None
    random_seed: Int64 | None = None
    stop_words_str: list[str] | None = None        # extra stop strings
    stop_words_list: list[list[TokenId]] | None = None  # extra stop token-id sequences
    num_return_sequences: int | None = Field(default=None, ge=0, le=MAX_N)  # 0 or 1: one
    ignore_eos: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # chat only; wins over the request's own
    timeout_ms: int | None = Field(default=None, ge=0, le=INT64_MAX)
    # POST / only
    is_streaming: bool | None = None
    return_output_ids: bool | None = None
    return_input_ids: bool | None = None
    return_incremental: bool | None = None  # POST /: as the top-level `incremental`; chat/completions: true only
    # RTP-LLM keys kvyard does not implement, declared so that a request asking for one gets a 400 saying why
    # (their neutral values, e.g. num_beams=1, are taken): see _UNSUPPORTED.
    num_beams: int | None = None
    return_logits: bool | None = None
    return_hidden_states: bool | None = None
    top_p_decay: float | None = None
    top_p_min: float | None = None
    no_repeat_ngram_size: int | None = None
    bad_words_list: Any = None
    adapter_name: str | None = None  # a LoRA adapter (docs/lora.md); as the request's `model` naming it

    @field_validator(*_UNSUPPORTED, mode="before")
    @classmethod
    def _unsupported(cls, v: Any, info: ValidationInfo) -> None:
        neutral, why = _UNSUPPORTED[info.field_name]
        if v is not None and v not in neutral:
            raise ValueError(f"{info.field_name} is not supported: {why}")
        return None

    @field_validator("stop_words_str")
    @classmethod
    def _no_empty(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return valid_text(v)

    def sampling_fields(self) -> dict[str, Any]:
        """The keys SamplingParams takes, under its names (None: unset)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "seed": self.random_seed, "repetition_penalty": self.repetition_penalty,
                "min_new_tokens": self.min_new_tokens, "ignore_eos": self.ignore_eos, "timeout_ms": self.timeout_ms,
                "n": self.num_return_sequences or None,
                "stop_sequences": self.stop_words_list and tuple(tuple(ids) for ids in self.stop_words_list)}


class GenerateQuery(BaseModel):
    """`POST /generate`'s options, as query parameters (frontend/generate_stream.py); temperature has no
    upper bound here, as before."""
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX)
    model: str | None = None

    def sampling_fields(self) -> dict[str, Any]:
        """The options SamplingRequest takes under the same names (all but max_tokens and model)."""
        return self.model_dump(exclude={"max_tokens", "model"})
