"""The frontend's HTTP routes: OpenAI chat completions, models, render/tokenize debugging, health (LMTP,
/generate and /metrics are included from frontend/lmtp.py, frontend/generate_stream.py, kvyard/metrics.py)."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Body, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError

from frontend.backend_client import TokenLogprob
from frontend.chat import ChatService, PreparedRequest
from frontend.config import FrontendConfig
from frontend.errors import error_body, install_error_handlers, request_error_body
from frontend.generate_stream import generate_stream_routes
from frontend.lmtp import LmtpService, lmtp_routes
from frontend.metered_router import MeteredRouter
from frontend.protocol import ChatCompletionRequest
from kvyard.errors import ErrorCode, RequestError
from kvyard.http_json import JsonBodyByDefault
from kvyard.metrics import FrontendMetrics, HttpMetricsMiddleware, add_metrics_route
from kvyard.tokenizer import TextTokenizer
from renderers import get_renderer


def create_app(cfg: FrontendConfig, tokenizer: TextTokenizer) -> FastAPI:
    metrics = FrontendMetrics()
    client = MeteredRouter(cfg, metrics)
    chat = ChatService(cfg, tokenizer, get_renderer(cfg.model_type, tokenizer), client)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.close()

    app = FastAPI(title="kvyard frontend", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(HttpMetricsMiddleware, metrics=metrics)  # inside JsonBodyByDefault: sees the route
    app.add_middleware(JsonBodyByDefault)
    add_metrics_route(app, metrics.registry)
    app.include_router(lmtp_routes(LmtpService(cfg, tokenizer, client)))
    app.include_router(generate_stream_routes(cfg, tokenizer, client))

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        prep = chat.prepare(req)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_sse(chat, prep, prep.model or cfg.model_name, include_usage, tokenizer),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(await _complete(chat, prep, prep.model or cfg.model_name, tokenizer))

    @app.get("/v1/models")
    @app.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                            "owned_by": "kvyard", "max_model_len": cfg.max_seq_len}
                                           for name in await client.models()]}

    @app.post("/v1/chat/render")
    @app.post("/chat/render")
    async def chat_render(req: ChatCompletionRequest) -> dict[str, Any]:
        prep = chat.prepare(req)
        p = prep.params
        return {
            "input_prompt": prep.rendered.prompt,
            "input_ids": prep.rendered.input_ids,
            "input_urls": [],
            "tokenizer_info": f"{type(tokenizer).__name__}({cfg.tokenizer_path.name}, vocab={tokenizer.vocab_size})",
            "max_seq_len": cfg.max_seq_len,
            "eos_token_id": tokenizer.eos_token_id,
            "stop_words_list": prep.stop_strings,
            "stop_word_ids_list": p.stop_sequences,
            "renderer_info": {"class_name": prep.rendered.renderer, "template_source": prep.rendered.template_source,
                              "model_type": cfg.model_type},
            "generate_config": {k: v for k, v in p.__dict__.items()},
        }

    @app.post("/tokenizer/encode")
    async def tokenizer_encode(body: dict[str, Any] = Body(...)) -> dict[str, Any]:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "'prompt' must be a string", "prompt")
        parse_special = bool(body.get("parse_special", True))
        ids, pieces, offsets = tokenizer.encode_with_offsets(prompt, parse_special=parse_special)
        out: dict[str, Any] = {"token_ids": ids, "tokens": pieces, "error": ""}
        if body.get("return_offsets_mapping"):
            out["offset_mapping"] = [list(o) for o in offsets]
        return out

    @app.post("/tokenize")
    async def tokenize(body: dict[str, Any] = Body(...)) -> dict[str, Any]:
        if "messages" in body:
            try:
                req = ChatCompletionRequest.model_validate(body)
            except ValidationError as exc:  # the same 400 as a route's own body validation
                raise RequestValidationError(exc.errors()) from exc
            rendered = chat.render(req)
            return {"token_ids": rendered.input_ids, "prompt": rendered.prompt}
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "give 'prompt' (a string) or 'messages'", "prompt")
        return {"token_ids": tokenizer.encode(prompt, parse_special=bool(body.get("parse_special", True)))}

    async def health() -> Any:
        if await client.healthy():
            return PlainTextResponse("ok")
        where = cfg.master_address and f"master {cfg.master_address} or "
        return JSONResponse(error_body(f"{where}backend {', '.join(cfg.fallback_addresses)} is not serving",
                                       "service_unavailable"),
                            503, headers={"Retry-After": "1"})

    for path in ("/health", "/status", "/GraphService/cm2_status", "/SearchService/cm2_status"):
        app.add_api_route(path, health, methods=["GET", "POST"])
    app.add_api_route("/health_check", health, methods=["POST"])
    app.add_api_route("/", health, methods=["GET"])
    return app


async def _complete(chat: ChatService, prep: PreparedRequest, model: str,
                    tokenizer: TextTokenizer) -> dict[str, Any]:
    texts: dict[int, list[str]] = {i: [] for i in range(prep.params.n)}
    finish: dict[int, str] = {}
    tokens: dict[int, int] = {}
    logprobs: dict[int, list[dict[str, Any]]] = {i: [] for i in range(prep.params.n)}
    async for ev in chat.generate(prep):
        texts[ev.index].append(ev.text)
        tokens[ev.index] = ev.completion_tokens
        logprobs[ev.index].extend(_logprob_entries(ev.logprobs, tokenizer))
        if ev.finish_reason is not None:
            finish[ev.index] = ev.finish_reason
    choices = [{"index": i, "message": {"role": "assistant", "content": "".join(texts[i])},
                "logprobs": {"content": logprobs[i]} if prep.params.return_logprobs else None,
                "finish_reason": finish.get(i, "stop")} for i in range(prep.params.n)]
    return {"id": prep.request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": _usage(prep, sum(tokens.values()))}


async def _sse(chat: ChatService, prep: PreparedRequest, model: str, include_usage: bool,
               tokenizer: TextTokenizer) -> AsyncIterator[str]:
    created = int(time.time())
    base = {"id": prep.request_id, "object": "chat.completion.chunk", "created": created, "model": model}

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        body = {**base, "choices": choices}
        if include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for i in range(prep.params.n)])
    tokens: dict[int, int] = {}
    try:
        async for ev in chat.generate(prep):
            tokens[ev.index] = ev.completion_tokens
            if not ev.text and ev.finish_reason is None and not ev.logprobs:
                continue  # e.g. half a UTF-8 character held back: nothing to say yet
            choice: dict[str, Any] = {"index": ev.index, "delta": {"content": ev.text} if ev.text else {},
                                      "logprobs": None, "finish_reason": ev.finish_reason}
            if prep.params.return_logprobs:
                choice["logprobs"] = {"content": _logprob_entries(ev.logprobs, tokenizer)}
            yield chunk([choice])
    except RequestError as exc:
        # Headers are gone: the error travels as a data chunk, then [DONE].
        _, body = request_error_body(exc)
        yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
        return
    if include_usage:
        yield chunk([], _usage(prep, sum(tokens.values())))
    yield "data: [DONE]\n\n"


def _usage(prep: PreparedRequest, completion_tokens: int) -> dict[str, int]:
    n_prompt = len(prep.rendered.input_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": completion_tokens,
            "total_tokens": n_prompt + completion_tokens}


def _logprob_entries(items: list[TokenLogprob], tokenizer: TextTokenizer) -> list[dict[str, Any]]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in items]
