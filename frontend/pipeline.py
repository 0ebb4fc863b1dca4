"""The frontend's one generation pipeline, which every HTTP dialect calls: prepare (a rendered prompt, text
or token ids → tokens → the context-length budget → SamplingParams) → generate (route → backend →
detokenize → stop strings) → a stream of ChoiceEvents for the dialect to put on its wire.

The context-length check lives here only (Pipeline.budget); the engine keeps its own. Stop strings are
cut here too (StopStringMatcher), after detokenizing, so every dialect stops at the same text."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from frontend.backend_client import BackendOutput, TokenLogprob
from frontend.config import FrontendConfig
from frontend.images import CheckedImages, LoadedImage, load_images, with_images
from frontend.protocol import SamplingRequest
from frontend.lora_routes import adapter_models, adapter_of
from frontend.routing import Router, model_to_route, unknown_model
from kvyard.constraint import Constraint
from kvyard.detokenize import IncrementalDetokenizer
from kvyard.errors import ErrorCode, RequestError
from kvyard.limits import LOGIT_BIAS_BOUND
from kvyard.sampling_params import DIALECT_DEFAULTS, Dialect, SamplingParams
from kvyard.tokenizer import TextTokenizer
from renderers import RenderedPrompt, ToolParser


@dataclass
class PreparedRequest:
    """Everything decided before the backend is called."""
    request_id: str
    rendered: RenderedPrompt
    params: SamplingParams
    stop_strings: list[str]
    model: str | None = None   # as the client named it (None: this frontend's own; Pipeline.check_model);
                               # the master routes by it and the response echoes it
    tool_parser: type[ToolParser] | None = None  # parse the output for tool calls (the request has tools)
    include_stop: bool = False       # a matched stop string stays in the text (include_stop_str_in_output)
    skip_special: bool = True        # special tokens are left out of the text (skip_special_tokens)
    prompt_logprobs: int | None = None  # the prompt's own logprobs, with this many alternatives (None: not asked)
    images: tuple[LoadedImage, ...] = ()  # a vision model's images, in prompt order (frontend/images.py)


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
    stop_reason: int | str | None = None  # with finish_reason "stop": the stop_token_ids id or stop string that
                                          # ended the choice (None: eos, a stop sequence of ids, or not stopped)


@dataclass(frozen=True)
class Budget:
    """How many tokens a completion may have, and the request fields to name when it cannot."""
    requested: int | None      # None: the room left in the context
    param: str = "max_tokens"  # the field that asked for it
    prompt_param: str = "prompt"  # the field the prompt came from


class Pipeline:
    def __init__(self, cfg: FrontendConfig, tokenizer: TextTokenizer, client: Router) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.client = client
        self.checked = CheckedImages()  # images decoded lately: the same file again is only hashed

    # --- prepare ---

    def check_model(self, requested: str | None) -> str | None:
        """The model to route to and echo: as the client named it (an alias too), None for this frontend's
        own (no name, or SGLang's router's placeholder); an unknown name is a 404 unless a master answers
        for the cluster (frontend.routing.model_to_route). Dialects call it first, so a wrong model is
        refused before the prompt is tokenized; prepare applies it again (idempotent)."""
        return model_to_route(self.cfg, requested)

    async def check_served(self, model: str | None, adapter: str) -> None:
        """For the routes that generate nothing (/v1/chat/render, LMTP's MODEL_INFO): the 404
        model_not_found a generation of this model and LoRA adapter (check_model's and adapter_of's) would
        get once routed, asked of the same sources without generating: an adapter the paired backend does
        not hold (its registry, which the backend resolves a request's adapter in) nor any backend behind the
        master (Router.adapters), a model the master does not know (Router.models: the master's list, which
        its choose_backend routes by)."""
        if adapter:
            held = [*await adapter_models(self.cfg), *await self.client.adapters()]
            if adapter not in {m["id"] for m in held}:
                raise unknown_model(adapter, self.cfg.model_name)
        elif model is not None and model not in await self.client.models():
            raise unknown_model(model, self.cfg.model_name)

    async def images(self, sources: list[tuple[str, str]]) -> list[LoadedImage]:
        """A request's images, (its part, its URL) in prompt order → their checked bytes; a 400 naming the
        part for a text-only model or an image that cannot be had (frontend/images.py)."""
        if sources and self.cfg.vision is None:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{sources[0][0]}: this model takes no images (a "
                               "text-only model)", sources[0][0])
        return await load_images(sources, self.cfg.images, self.checked)

    @property
    def image_placeholder(self) -> str:
        """The text a template writes for one image (LLaVA: the image token; Qwen-VL: the image pad token
        between vision start and end), "" for a text-only model."""
        vision = self.cfg.vision
        return "" if vision is None else "".join(self.tokenizer.id_to_piece(i) for i in vision.placeholder_ids)

    def tokens(self, prompt: str | list[int]) -> RenderedPrompt:
        """A prompt given as text (special tokens parsed; BOS added when the model wants it and the text
        has none) or as token ids, as the backend will receive it."""
        tok = self.tokenizer
        if isinstance(prompt, str):
            ids = tok.encode(prompt, parse_special=True)
            if tok.add_bos_token and tok.bos_token_id is not None and ids[:1] != [tok.bos_token_id]:
                ids = [tok.bos_token_id, *ids]
            text = prompt
        else:
            try:
                tok.check_ids(prompt)
            except ValueError as exc:
                raise RequestError(ErrorCode.INVALID_ARGUMENT, str(exc), "prompt") from None
            ids, text = list(prompt), tok.decode(prompt)
        if not ids:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "the prompt is empty", "prompt")
        return RenderedPrompt(prompt=text, input_ids=ids, stop_words=[], renderer="none", template_source="none")

    def prepare(self, request_id: str, rendered: RenderedPrompt, req: SamplingRequest, budget: Budget, *,
                logprobs: bool = False, top_logprobs: int = 0, constraint: Constraint | None = None,
                tool_parser: type[ToolParser] | None = None, dialect: Dialect = Dialect.OPENAI,
                images: Sequence[LoadedImage] = ()) -> PreparedRequest:
        """The prompt's tokens within budget, and the request's sampling fields as SamplingParams. images:
        one for each image placeholder token of the prompt, in order."""
        rendered = with_images(rendered, images, self.cfg.vision, budget.prompt_param)
        if budget.requested is None and "max_new_tokens" in DIALECT_DEFAULTS[dialect]:
            budget = replace(budget, requested=DIALECT_DEFAULTS[dialect]["max_new_tokens"])
        rendered = self._truncated(rendered, req.truncate_prompt_tokens)
        if not rendered.input_ids:  # e.g. a user_template that renders nothing: the engine needs one token
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "the prompt is empty (the template rendered no tokens)",
                               "messages")
        max_new = self.budget(len(rendered.input_ids), budget)
        model = self.check_model(req.model)
        adapter = adapter_of(self.cfg, model, req.extra_configs and req.extra_configs.adapter_name)
        params = replace(self._params(req, dialect, max_new, logprobs, top_logprobs, constraint), adapter=adapter)
        stops = [*req.stop_list(), *self.cfg.stop_words, *rendered.format_stops]
        return PreparedRequest(request_id, rendered, params, stops,
                               model, tool_parser, req.include_stop, req.skip_special_tokens,
                               req.prompt_logprobs, tuple(images))

    def _truncated(self, rendered: RenderedPrompt, keep: int | None) -> RenderedPrompt:
        """truncate_prompt_tokens: the prompt's last `keep` tokens (-1: all the context holds, leaving room
        for one more), as vLLM truncates: from the left."""
        if keep is None:
            return rendered
        keep = self.cfg.max_seq_len - 1 if keep == -1 else keep
        if keep < 1:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "truncate_prompt_tokens must be at least 1 (or -1)",
                               "truncate_prompt_tokens")
        if len(rendered.input_ids) <= keep:
            return rendered
        ids = rendered.input_ids[-keep:]
        return replace(rendered, prompt=self.tokenizer.decode(ids), input_ids=ids)

    def _bad_words(self, words: list[str] | None) -> tuple[tuple[int, ...], ...]:
        """Each bad word's tokens as written and after a space (how it appears mid-text), as vLLM bans them."""
        out: dict[tuple[int, ...], None] = {}
        for word in words or []:
            for text in (word, " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text))
                if ids:
                    out[ids] = None
        return tuple(out)

    def budget(self, n_prompt: int, budget: Budget) -> int:
        """Tokens the completion may have: as requested, else the room left in the context."""
        limit, requested, param = self.cfg.max_seq_len, budget.requested, budget.param
        if n_prompt >= limit:
            raise RequestError(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                               f"This model's maximum context length is {limit} tokens. However, your "
                               f"{budget.prompt_param} resulted in {n_prompt} tokens, leaving no room for a "
                               "completion.", budget.prompt_param)
        if requested is None:
            return limit - n_prompt
        if requested <= 0:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{param} must be at least 1, got {requested}", param)
        if n_prompt + requested > limit:
            raise RequestError(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                               f"This model's maximum context length is {limit} tokens. However, you "
                               f"requested {n_prompt + requested} tokens ({n_prompt} in the "
                               f"{budget.prompt_param}, {requested} in the completion).", param)
        return requested

    def _params(self, req: SamplingRequest, dialect: Dialect, max_new: int, logprobs: bool, top_logprobs: int,
                constraint: Constraint | None) -> SamplingParams:
        """The request's sampling fields over its dialect's defaults (kvyard/sampling_params.py)."""
        given = req.sampling_fields()
        for name in ("allowed_token_ids", "stop_token_ids"):
            try:
                self.tokenizer.check_ids(list(given.get(name) or ()))
            except ValueError as exc:
                raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{name}: {exc}", name) from None
        stop_ids = (*self.cfg.stop_word_ids, *(given.pop("stop_sequences", None) or ()))
        timeout_ms = given.pop("timeout_ms", None)
        return SamplingParams.for_dialect(
            dialect, **given, max_new_tokens=max_new, logprobs=logprobs, top_logprobs=top_logprobs,
            stop_sequences=tuple(tuple(ids) for ids in stop_ids), logit_bias=self._logit_bias(req.logit_bias),
            bad_words_ids=self._bad_words(req.bad_words) or None,
            timeout_ms=int(self.cfg.request_timeout_s * 1000) if timeout_ms is None else timeout_ms,
            constraint=constraint)

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float]:
        out: dict[int, float] = {}
        for key, value in (bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise RequestError(ErrorCode.INVALID_ARGUMENT,
                                   f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
            if not 0 <= token < self.tokenizer.vocab_size or not -LOGIT_BIAS_BOUND <= value <= LOGIT_BIAS_BOUND:
                raise RequestError(ErrorCode.INVALID_ARGUMENT,
                                   f"logit_bias {key}: {value} is out of range (ids < {self.tokenizer.vocab_size}, "
                                   f"values in [-{LOGIT_BIAS_BOUND:g}, {LOGIT_BIAS_BOUND:g}])", "logit_bias")
            out[token] = value
        return out

    async def prompt_logprobs(self, request_id: str, ids: list[int], model: str | None, top: int,
                              adapter: str = "") -> list[TokenLogprob | None]:
        """Each prompt token's logprob after the ones before it (the backend's ScoreCall; the first has none),
        with the request's LoRA adapter (adapter_of) when it names one."""
        if len(ids) == 1:
            return [None]
        score = await self.client.score(request_id, ids[:1], ids[1:], model, top, adapter)
        return [None, *score.logprobs]

    # --- generate ---

    async def generate(self, prep: PreparedRequest) -> AsyncIterator[ChoiceEvent]:
        """One event per choice per backend step; exactly one event per choice has finish_reason.
        Closing this closes the backend call, which aborts the request there."""
        context = prep.rendered.input_ids
        choices = {i: _Choice(IncrementalDetokenizer(self.tokenizer, prep.skip_special, prompt_ids=context),
                              StopStringMatcher(prep.stop_strings, prep.include_stop)) for i in range(prep.params.n)}
        unfinished = len(choices)
        gen = self.client.generate(prep.request_id, prep.rendered.input_ids, prep.params, prep.model, prep.images)
        try:
            async for outs in gen:
                for out in outs:
                    choice = choices[out.index]
                    if choice.done:
                        continue
                    choice.tokens += len(out.token_ids)
                    text = choice.stops.feed(_detokenized(choice.detok, out.token_ids))
                    finish = "stop" if choice.stops.stopped else None
                    if finish is None and out.finish_reason is not None:
                        text += choice.stops.feed(choice.detok.flush())
                        text += choice.stops.flush()
                        finish = "stop" if choice.stops.stopped else out.finish_reason
                    stop_reason = None
                    if finish is not None:
                        choice.done = True
                        unfinished -= 1
                        stop_reason = _stop_reason(choice.stops, out.token_ids, prep.params.stop_token_ids, finish)
                    yield ChoiceEvent(out.index, text, finish, out.logprobs, choice.tokens, out.token_ids, out,
                                      stop_reason)
                if unfinished == 0:
                    break  # a stop string ended every choice: closing the stream aborts the backend side
        finally:
            await gen.aclose()

    async def generate_many(self, preps: list[PreparedRequest]) -> AsyncIterator[tuple[int, ChoiceEvent]]:
        """generate() of several requests at once (a batch of prompts), events tagged with the request's
        position. Closing this closes every one of them (and so aborts their backend calls)."""
        if len(preps) == 1:
            gen = self.generate(preps[0])
            try:
                async for ev in gen:
                    yield 0, ev
            finally:
                await gen.aclose()
            return
        queue: asyncio.Queue[tuple[int, ChoiceEvent | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, prep: PreparedRequest) -> None:
            try:
                async for ev in self.generate(prep):
                    await queue.put((i, ev))
                await queue.put((i, None))
            except Exception as exc:  # noqa: BLE001 (handed to the consumer, which raises it)
                await queue.put((i, exc))

        tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(preps)]
        try:
            running = len(tasks)
            while running:
                i, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _stop_reason(stops: StopStringMatcher, ids: list[int], stop_ids: tuple[int, ...], finish: str
                 ) -> int | str | None:
    """vLLM's stop_reason: the stop string matched, else the request's stop token the choice ended on."""
    if stops.matched is not None:
        return stops.matched
    return ids[-1] if finish == "stop" and ids and ids[-1] in stop_ids else None


def _detokenized(detok: IncrementalDetokenizer, token_ids: list[int]) -> str:
    """The text of a step's ids; ids outside this frontend's vocabulary mean the backend serves another model
    (a misconfigured BACKEND_ADDRESS, another server's tokenizer): the request fails saying so."""
    try:
        return detok.push(token_ids)
    except ValueError as exc:
        raise RequestError(ErrorCode.INTERNAL, f"the backend answered with {exc}: it serves a model with "
                           "another vocabulary than this frontend's tokenizer") from None


@dataclass
class _Choice:
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    tokens: int = 0
    done: bool = False


class StopStringMatcher:
    """Feed text pieces; get back what is safe to emit. Once a stop string appears, the text before
    it is released and `stopped` turns True; nothing after it is ever released."""

    def __init__(self, stop: list[str], include: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include = include   # release the stop string itself too (include_stop_str_in_output)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None   # the stop string that stopped it

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stop:
            return text
        buf = self._held + text
        # The stop string that completes first wins (ties: the one that starts first), so the result
        # is the same however the text is split into pieces (e.g. stops "abcd" and "bc" in "abcd").
        found = [(i + len(s), i) for s, i in ((s, buf.find(s)) for s in self.stop) if i >= 0]
        if found:
            end, start = min(found)
            self.stopped = True
            self.matched = buf[start:end]
            self._held = ""
            return buf[:end if self.include else start]
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """At the end of generation the held-back text is not a stop string after all."""
        out, self._held = self._held, ""
        return "" if self.stopped else out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
