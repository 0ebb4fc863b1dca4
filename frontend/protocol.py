"""OpenAI-shaped request bodies (pydantic), as the HTTP layer parses them: chat, completions, RTP-LLM's raw
`POST /`, and the RTP-LLM extensions they share (`extra_configs` / `generate_config`)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from frontend.chat_messages import (  # noqa: F401 (re-exported: the request types live together)
    ChatMessage, FunctionCall, FunctionDefinition, ImagePart, ImageURL, NamedToolChoice, TextPart, ToolCall,
    ToolDefinition, _Lenient)
from frontend.generate_config import (INT32_MAX, GenerateConfig, Int32, Int64, RepetitionPenalty, TokenId,
                                      valid_text)
from frontend.rtp_fields import RtpRequestFields
from kvyard.errors import ErrorCode, RequestError
from kvyard.limits import MAX_N, MAX_TOP_LOGPROBS, PENALTY_BOUND, TEMPERATURE_MAX


def _refuse_unless(ok: bool, field: str, why: str) -> None:
    if not ok:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{field}: {why}", field)


def _streams_deltas(extra: GenerateConfig | None, stream: bool) -> None:
    """The GenerateConfig keys of POST /'s answer: chat and completions answer by their own fields, so a key
    asking for something else is a 400 naming it, never ignored."""
    if extra is None:
        return
    if extra.return_incremental is False:
        raise ValueError("extra_configs.return_incremental=false is for POST /: chat and completions stream only "
                         "the new text")
    _refuse_unless(extra.is_streaming in (None, stream), "extra_configs.is_streaming",
                   f"is {extra.is_streaming} but stream is {stream}: chat and completions stream by the request's "
                   "stream field")
    for key in ("return_output_ids", "return_input_ids"):
        _refuse_unless(not getattr(extra, key), f"extra_configs.{key}",
                       "is for POST /: chat and completions do not return ids (chat's debug_info: true does)")


class StreamOptions(_Lenient):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI: padding against length side channels (none is added)


class JsonSchemaFormat(_Lenient):
    """response_format.json_schema: OpenAI's structured outputs."""
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None   # true: objects without "additionalProperties" are closed, as OpenAI's are


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # llama.cpp: json_object with a schema

    @model_validator(mode="after")
    def _checks(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"response_format of type {self.type} takes no json_schema")
        return self


class GuidedDecoding(BaseModel):
    """What the output must follow (frontend/guided.py turns these into one constraint; at most one may be
    given): OpenAI's response_format, vLLM's guided_* extensions, llama.cpp's grammar and json_schema."""
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None   # a JSON schema (object or its JSON text)
    guided_regex: str | None = None                   # the whole output matches this regex
    guided_choice: list[str] | None = Field(default=None, min_length=1)  # the output is one of these
    guided_grammar: str | None = None                 # a Lark grammar (llguidance's dialect) or GBNF
    grammar: str | None = None                        # llama.cpp: a GBNF grammar (Lark is taken too)
    json_schema: dict[str, Any] | None = None         # llama.cpp: a JSON schema

    @field_validator("guided_regex", "guided_grammar", "grammar")
    @classmethod
    def _grammar_text(cls, v: str | None) -> str | None:
        return valid_text(v, "grammars and regexes")

    @field_validator("guided_choice")
    @classmethod
    def _choices(cls, v: list[str] | None) -> list[str] | None:
        return valid_text(v, "choices")


class SamplingRequest(_Lenient, GuidedDecoding):
    """The sampling fields chat and completions share."""
    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=TEMPERATURE_MAX)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=INT32_MAX)  # extension
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)    # extension
    max_tokens: Int32 | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-PENALTY_BOUND, le=PENALTY_BOUND)
    frequency_penalty: float | None = Field(default=None, ge=-PENALTY_BOUND, le=PENALTY_BOUND)
    repetition_penalty: RepetitionPenalty | None = None  # extension
    logit_bias: dict[str, float] | None = None
    extra_configs: GenerateConfig | None = None                  # RTP-LLM extension
    # Descriptive only (no effect on the answer, by design; OpenAI uses them for monitoring and stored outputs)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None                 # true (keep the output for later) is refused: nothing is kept
    service_tier: str | None = None           # "auto" / "default" (the only tier); others are refused
    # vLLM's extensions
    ignore_eos: bool | None = None            # generate through eos (stop tokens and strings still stop)
    min_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)  # no eos or stop token before this many
    stop_token_ids: list[TokenId] | None = None  # token ids that end a choice (kept in its tokens, not its text)
    include_stop_str_in_output: bool = False  # a matched stop string stays at the end of the text
    skip_special_tokens: bool = True          # false: special tokens (e.g. <|im_end|>) appear in the text
    spaces_between_special_tokens: bool | None = None  # only false (or with skip_special_tokens) is served
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=INT32_MAX)  # keep the prompt's last k
                                              # tokens (-1: as many as the context holds with room for one)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # each prompt token's logprob
    allowed_token_ids: list[TokenId] | None = Field(default=None, min_length=1)  # only these may be sampled
    bad_words: list[str] | None = None        # words never generated (their tokens, with and without a space)
    typical_p: float | None = Field(default=None, gt=0.0, le=1.0)  # locally typical sampling (also llama.cpp's)
    priority: int = 0                         # only 0: requests are served first come, first served
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>"
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)  # completions: generate this many, return the n
                                              # likeliest (not streamed); chat: only = n
    guided_decoding_backend: str | None = None  # "auto", "guidance" or "llguidance": the one there is
    guided_whitespace_pattern: str | None = None  # refused: llguidance's JSON whitespace is fixed
    structural_tag: str | dict[str, Any] | None = None  # refused: not served
    # llama.cpp's extensions
    n_predict: int | None = Field(default=None, ge=-1, le=INT32_MAX)  # max_tokens (-1: up to the context)
    n_probs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # top logprobs per token
    cache_prompt: bool | None = None          # only true: cached prefixes are always reused
    mirostat: int | None = None               # only 0 (off): mirostat sampling is not served
    mirostat_tau: float | None = None         # mirostat's parameters (meaningful only with mirostat)
    mirostat_eta: float | None = None
    samplers: list[str] | str | None = None   # refused: the sampler order is fixed
    # SGLang's router forwards these with its defaults
    no_stop_trim: bool | None = None          # SGLang's include_stop_str_in_output
    separate_reasoning: bool | None = None    # no reasoning parser here: nothing to separate either way
    stream_reasoning: bool | None = None
    return_hidden_states: bool | None = None  # only false

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and any(s == "" for s in v) or v == "":
            raise ValueError("stop strings must not be empty")
        return valid_text(v)

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(not w.strip() for w in v):
            raise ValueError("bad words must not be empty")
        return valid_text(v, "bad words")

    @model_validator(mode="after")
    def _served(self) -> SamplingRequest:
        """Fields kvyard knows but serves only in part: anything else is a 400 naming the field."""
        _refuse_unless(self.store is not True, "store", "kvyard keeps no outputs (store must be false)")
        _refuse_unless(self.service_tier in (None, "auto", "default"), "service_tier",
                       f"{self.service_tier!r} is not offered (one tier: 'default')")
        _refuse_unless(self.priority == 0, "priority", "priority scheduling is not enabled (requests are "
                       "served first come, first served)")
        _refuse_unless(not (self.spaces_between_special_tokens and not self.skip_special_tokens),
                       "spaces_between_special_tokens", "special tokens are joined without spaces")
        _refuse_unless(self.guided_decoding_backend in (None, "auto", "guidance", "llguidance"),
                       "guided_decoding_backend", "the one backend is llguidance ('guidance')")
        _refuse_unless(self.guided_whitespace_pattern is None, "guided_whitespace_pattern",
                       "not supported (llguidance's JSON whitespace is fixed)")
        _refuse_unless(self.structural_tag is None, "structural_tag", "not supported")
        _refuse_unless(self.cache_prompt is not False, "cache_prompt", "cached prefixes are always reused")
        _refuse_unless(not self.mirostat, "mirostat", "mirostat sampling is not supported (use 0)")
        _refuse_unless(self.samplers is None, "samplers", "the sampler order is fixed (penalties, bias, "
                       "temperature, top_k, min_p, typical_p, top_p)")
        _refuse_unless(not self.return_hidden_states, "return_hidden_states", "hidden states are not returned")
        _refuse_unless(self.best_of is None or self.best_of >= self.n, "best_of", "best_of must be at least n")
        _refuse_unless(self.n_predict is None or "max_tokens" not in self.model_fields_set
                       or self.max_tokens == self.n_predict, "n_predict", "give max_tokens or n_predict, not both")
        return self

    @property
    def include_stop(self) -> bool:
        return self.include_stop_str_in_output or bool(self.no_stop_trim)

    def max_tokens_asked(self) -> int | None:
        """max_tokens, else llama.cpp's n_predict (-1: up to the context), else the dialect's default."""
        if self.n_predict is not None and "max_tokens" not in self.model_fields_set:
            return None if self.n_predict < 0 else self.n_predict
        return self.max_tokens

    def stop_list(self) -> list[str]:
        own = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)
        extra = (self.extra_configs and self.extra_configs.stop_words_str) or []
        return [*own, *extra]

    def sampling_fields(self) -> dict[str, Any]:
        """The request's own sampling fields under SamplingParams' names; `extra_configs` (RTP-LLM) fills what
        the request leaves unset. None: unset (the dialect's default)."""
        extra = self.extra_configs or GenerateConfig()
        own = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
               "typical_p": self.typical_p, "seed": self.seed, "repetition_penalty": self.repetition_penalty,
               "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
               "n": self.n if self.n != 1 else None, "ignore_eos": self.ignore_eos,
               "min_new_tokens": self.min_tokens,
               "stop_token_ids": self.stop_token_ids and tuple(self.stop_token_ids),
               "allowed_token_ids": self.allowed_token_ids and tuple(self.allowed_token_ids)}
        return {**extra.sampling_fields(), **{k: v for k, v in own.items() if v is not None}}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingRequest, RtpRequestFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[FunctionDefinition] | None = None   # the deprecated form of tools
    _legacy_functions: bool = PrivateAttr(default=False)  # tools came from `functions`: answer with function_call
    # RTP-LLM extensions
    template_key: str | None = None
    user_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    # vLLM's chat extensions
    chat_template: str | None = None          # a jinja template for this request: 400 unless the operator
                                              # trusts request templates (TRUST_REQUEST_CHAT_TEMPLATE=1)
    continue_final_message: bool = False      # the prompt ends inside the last (assistant) message
    documents: list[dict[str, str]] | None = None  # RAG documents, handed to the template as `documents`
    modalities: list[Literal["text"]] | None = None  # text only
    debug_info: bool = False   # the rendered prompt, ids and generate config in the response
    aux_info: bool = False     # the backend's timings and cache facts in the response
    # private_request, trace_id, chat_id, extend_fields, master_info: frontend/rtp_fields.py

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        _streams_deltas(self.extra_configs, self.stream)
        _refuse_unless(self.best_of is None or self.best_of == self.n, "best_of",
                       "chat returns every choice it makes: best_of must equal n (rank candidates with completions)")
        if self.continue_final_message:
            _refuse_unless(not self.add_generation_prompt, "continue_final_message",
                           "cannot be combined with add_generation_prompt: true")
            _refuse_unless(self.messages[-1].role == "assistant", "continue_final_message",
                           "the last message must be the assistant's")
        if self.n_probs is not None and not self.logprobs:
            self.logprobs, self.top_logprobs = True, self.n_probs
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        if self.tools is None and self.functions:
            self.tools = [ToolDefinition(function=f) for f in self.functions]
            self._legacy_functions = True
        names = {t.function.name for t in self.tools or []}
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.get("name")
            if name not in names:
                raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        elif self.tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        return self

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        if self.max_tokens_asked() is not None:
            return self.max_tokens_asked()
        return self.extra_configs.max_new_tokens if self.extra_configs else None

    def template_kwargs(self) -> dict[str, Any]:
        extra = (self.extra_configs and self.extra_configs.chat_template_kwargs) or {}
        docs = {"documents": self.documents} if self.documents is not None else {}
        return {**docs, **(self.chat_template_kwargs or {}), **extra}

    @property
    def legacy_functions(self) -> bool:
        """The request gave `functions` (no `tools`): OpenAI's legacy API answers with one `function_call`."""
        return self._legacy_functions

    def tools_in_use(self) -> list[dict[str, Any]] | None:
        """The tool definitions the model should see (none when tool_choice is "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


class CompletionRequest(SamplingRequest, RtpRequestFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Int32 | None = 16
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None

    @model_validator(mode="after")
    def _checks(self) -> CompletionRequest:
        _streams_deltas(self.extra_configs, self.stream)
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.n_probs is not None and self.logprobs is None:
            self.logprobs = self.n_probs
        _refuse_unless(not (self.stream and self.best_of and self.best_of > self.n), "best_of",
                       "best_of > n cannot be streamed (the best are known only at the end)")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self


class RawRequest(GuidedDecoding, RtpRequestFields):
    """RTP-LLM's `POST /`: a prompt (or a batch of prompts) and a generate_config (constraints beside it)."""
    model_config = ConfigDict(extra="forbid")

    prompt: str | list[str]
    generate_config: GenerateConfig = Field(default_factory=GenerateConfig)
    stream: bool = False        # as generate_config.is_streaming
    incremental: bool = False   # streamed events carry only the new text (default: the text so far)
    urls: list[str] | None = None
    model: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _top_level_config(cls, data: Any) -> Any:
        # RTP-LLM also takes generate_config's keys at the top level: {"prompt": ..., "max_new_tokens": 8}.
        if isinstance(data, dict) and isinstance(data.get("generate_config", {}), dict):
            moved = {k: v for k, v in data.items() if k in GenerateConfig.model_fields and k not in cls.model_fields}
            if moved:
                data = {k: v for k, v in data.items() if k not in moved}
                data["generate_config"] = {**moved, **data.get("generate_config", {})}
        return data

    @model_validator(mode="after")
    def _checks(self) -> RawRequest:
        if self.generate_config.return_incremental:
            self.incremental = True
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self

    @property
    def streaming(self) -> bool:
        return self.stream or bool(self.generate_config.is_streaming)

