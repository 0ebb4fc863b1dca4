"""Chat request → rendered prompt → backend generation → per-choice text events (stop strings applied).

The sampling and budget helpers are shared with /v1/completions and `POST /` (frontend/completions.py)."""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from frontend.backend_client import BackendOutput, GenerateParams, TokenLogprob
from frontend.config import FrontendConfig
from frontend.guided import chat_constraint
from frontend.protocol import ChatCompletionRequest, GenerateConfig, SamplingRequest
from frontend.routing import Router, model_to_route
from frontend.stop_strings import StopStringMatcher
from kvyard.detokenize import IncrementalDetokenizer
from kvyard.errors import ErrorCode, RequestError
from kvyard.tokenizer import TextTokenizer
from renderers import ChatRenderer, RenderedPrompt, RenderRequest, ToolParser


@dataclass
class PreparedRequest:
    """Everything decided before the backend is called."""
    request_id: str
    rendered: RenderedPrompt
    params: GenerateParams
    stop_strings: list[str]
    model: str | None = None   # as the client asked (None: this frontend's own); the master routes by it
    tool_parser: type[ToolParser] | None = None  # parse the output for tool calls (the request has tools)


@dataclass
class ChoiceEvent:
    """New text for one choice (may be empty when only finish_reason or logprobs change)."""
    index: int
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    completion_tokens: int = 0     # this choice's total so far
    token_ids: list[int] = field(default_factory=list)  # the ids behind this event (before stop strings)
    backend: BackendOutput | None = None  # the backend's output, for its aux facts (timings, reuse)


class ChatService:
    def __init__(self, cfg: FrontendConfig, tokenizer: TextTokenizer, renderer: ChatRenderer,
                 client: Router) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.renderer = renderer
        self.client = client

    def model(self, requested: str | None) -> str | None:
        """The model to route to, None for this frontend's own (frontend.routing.model_to_route)."""
        return model_to_route(self.cfg, requested)

    def render(self, req: ChatCompletionRequest) -> RenderedPrompt:
        messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in req.messages]
        choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, BaseModel) else req.tool_choice
        return self.renderer.render(RenderRequest(
            messages=messages, add_generation_prompt=req.add_generation_prompt,
            tools=req.tools_in_use(), tool_choice=choice,
            template_key=req.template_key, user_template=req.user_template,
            chat_template_kwargs=req.template_kwargs()))

    def prepare(self, req: ChatCompletionRequest) -> PreparedRequest:
        model = self.model(req.model)
        rendered = self.render(req)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_new = self.budget(len(rendered.input_ids), req.requested_max_tokens(), param, "messages")
        params = self.params(req, max_new, req.logprobs, (req.top_logprobs or 0) if req.logprobs else 0)
        params.constraint = chat_constraint(req, self.renderer.tool_parser)
        return PreparedRequest(f"chatcmpl-{uuid.uuid4().hex}", rendered, params, self.stop_strings(req),
                               model, self.renderer.tool_parser if req.tools_in_use() else None)

    def budget(self, n_prompt: int, requested: int | None, param: str, prompt_param: str) -> int:
        """Tokens the completion may have: as requested, else the room left in the context."""
        limit = self.cfg.max_seq_len
        if n_prompt >= limit:
            raise RequestError(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                               f"This model's maximum context length is {limit} tokens. However, your "
                               f"{prompt_param} resulted in {n_prompt} tokens, leaving no room for a completion.",
                               prompt_param)
        if requested is None:
            return limit - n_prompt
        if requested <= 0:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{param} must be at least 1, got {requested}", param)
        if n_prompt + requested > limit:
            raise RequestError(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                               f"This model's maximum context length is {limit} tokens. However, you "
                               f"requested {n_prompt + requested} tokens ({n_prompt} in the {prompt_param}, "
                               f"{requested} in the completion).", param)
        return requested

    def params(self, req: SamplingRequest, max_new: int, logprobs: bool, top_logprobs: int) -> GenerateParams:
        """The request's sampling fields; `extra_configs` (RTP-LLM) fills what the request leaves unset."""
        extra = req.extra_configs or GenerateConfig()

        def pick(own: Any, rtp: Any, default: Any) -> Any:
            return own if own is not None else rtp if rtp is not None else default

        return GenerateParams(
            max_new_tokens=max_new,
            temperature=pick(req.temperature, extra.temperature, 1.0),
            top_p=pick(req.top_p, extra.top_p, 1.0),
            top_k=pick(req.top_k, extra.top_k, 0),
            min_p=pick(req.min_p, extra.min_p, 0.0),
            seed=pick(req.seed, extra.random_seed, None),
            stop_sequences=[list(ids) for ids in (*self.cfg.stop_word_ids, *(extra.stop_words_list or []))],
            return_logprobs=logprobs,
            top_logprobs=top_logprobs,
            n=req.n if req.n != 1 else max(1, extra.num_return_sequences or 1),
            repetition_penalty=pick(req.repetition_penalty, extra.repetition_penalty, 1.0),
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            logit_bias=self._logit_bias(req.logit_bias),
            min_new_tokens=extra.min_new_tokens or 0,
            ignore_eos=bool(extra.ignore_eos),
            timeout_ms=pick(extra.timeout_ms, None, int(self.cfg.request_timeout_s * 1000)),
        )

    def stop_strings(self, req: SamplingRequest) -> list[str]:
        return [*req.stop_list(), *self.cfg.stop_words]

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float]:
        out: dict[int, float] = {}
        for key, value in (bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise RequestError(ErrorCode.INVALID_ARGUMENT,
                                   f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
            if not 0 <= token < self.tokenizer.vocab_size or not -100 <= value <= 100:
                raise RequestError(ErrorCode.INVALID_ARGUMENT,
                                   f"logit_bias {key}: {value} is out of range (ids < "
                                   f"{self.tokenizer.vocab_size}, values in [-100, 100])", "logit_bias")
            out[token] = value
        return out

    async def generate(self, prep: PreparedRequest) -> AsyncIterator[ChoiceEvent]:
        """One event per choice per backend step; exactly one event per choice has finish_reason."""
        context = prep.rendered.input_ids
        choices = {i: _Choice(IncrementalDetokenizer(self.tokenizer, prompt_ids=context),
                              StopStringMatcher(prep.stop_strings)) for i in range(prep.params.n)}
        unfinished = len(choices)
        gen = self.client.generate(prep.request_id, prep.rendered.input_ids, prep.params, prep.model)
        try:
            async for outs in gen:
                for out in outs:
                    choice = choices[out.index]
                    if choice.done:
                        continue
                    choice.tokens += len(out.token_ids)
                    text = choice.stops.feed(choice.detok.push(out.token_ids))
                    finish = "stop" if choice.stops.stopped else None
                    if finish is None and out.finish_reason is not None:
                        text += choice.stops.feed(choice.detok.flush())
                        text += choice.stops.flush()
                        finish = "stop" if choice.stops.stopped else out.finish_reason
                    if finish is not None:
                        choice.done = True
                        unfinished -= 1
                    yield ChoiceEvent(out.index, text, finish, out.logprobs, choice.tokens, out.token_ids, out)
                if unfinished == 0:
                    break  # a stop string ended every choice: closing the stream aborts the backend side
        finally:
            await gen.aclose()


@dataclass
class _Choice:
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    tokens: int = 0
    done: bool = False
