"""Chat request → rendered prompt → backend generation → per-choice text events (stop strings applied)."""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from frontend.backend_client import GenerateParams, TokenLogprob
from frontend.config import FrontendConfig
from frontend.protocol import ChatCompletionRequest
from frontend.routing import Router
from frontend.stop_strings import StopStringMatcher
from kvyard.detokenize import IncrementalDetokenizer
from kvyard.errors import ErrorCode, RequestError
from kvyard.tokenizer import TextTokenizer
from renderers import ChatRenderer, RenderedPrompt, RenderRequest


@dataclass
class PreparedRequest:
    """Everything decided before the backend is called."""
    request_id: str
    rendered: RenderedPrompt
    params: GenerateParams
    stop_strings: list[str]
    model: str | None = None   # as the client asked (None: this frontend's own); the master routes by it


@dataclass
class ChoiceEvent:
    """New text for one choice (may be empty when only finish_reason or logprobs change)."""
    index: int
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    completion_tokens: int = 0     # this choice's total so far


class ChatService:
    def __init__(self, cfg: FrontendConfig, tokenizer: TextTokenizer, renderer: ChatRenderer,
                 client: Router) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.renderer = renderer
        self.client = client

    def check_model(self, model: str | None) -> None:
        # With a master, it knows every model the cluster serves and answers 404 for the rest.
        if model and model != self.cfg.model_name and not self.cfg.master_address:
            raise RequestError(ErrorCode.MODEL_NOT_FOUND,
                               f"The model '{model}' does not exist; this server serves "
                               f"'{self.cfg.model_name}'", "model")

    def render(self, req: ChatCompletionRequest) -> RenderedPrompt:
        messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in req.messages]
        return self.renderer.render(RenderRequest(
            messages=messages, add_generation_prompt=req.add_generation_prompt,
            template_key=req.template_key, user_template=req.user_template,
            chat_template_kwargs=req.chat_template_kwargs or {}))

    def prepare(self, req: ChatCompletionRequest) -> PreparedRequest:
        self.check_model(req.model)
        rendered = self.render(req)
        n_prompt = len(rendered.input_ids)
        limit = self.cfg.max_seq_len
        if n_prompt >= limit:
            raise RequestError(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                               f"This model's maximum context length is {limit} tokens. However, your "
                               f"messages resulted in {n_prompt} tokens, leaving no room for a completion.",
                               "messages")
        max_new = req.requested_max_tokens()
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if max_new is None:
            max_new = limit - n_prompt
        elif max_new <= 0:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{param} must be at least 1, got {max_new}", param)
        elif n_prompt + max_new > limit:
            raise RequestError(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                               f"This model's maximum context length is {limit} tokens. However, you "
                               f"requested {n_prompt + max_new} tokens ({n_prompt} in the messages, "
                               f"{max_new} in the completion).", param)
        params = GenerateParams(
            max_new_tokens=max_new,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            min_p=req.min_p or 0.0,
            seed=req.seed,
            stop_sequences=[list(ids) for ids in self.cfg.stop_word_ids],
            return_logprobs=req.logprobs,
            top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
            n=req.n,
            repetition_penalty=req.repetition_penalty or 1.0,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            logit_bias=self._logit_bias(req.logit_bias),
            timeout_ms=int(self.cfg.request_timeout_s * 1000),
        )
        stops = [*req.stop_list(), *self.cfg.stop_words]
        return PreparedRequest(f"chatcmpl-{uuid.uuid4().hex}", rendered, params, stops, req.model or None)

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
        choices = {i: _Choice(IncrementalDetokenizer(self.tokenizer), StopStringMatcher(prep.stop_strings))
                   for i in range(prep.params.n)}
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
                    yield ChoiceEvent(out.index, text, finish, out.logprobs, choice.tokens)
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
