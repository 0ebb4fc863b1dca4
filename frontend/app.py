"""The frontend's HTTP app: the door (admission), then every dialect's routes, registered in one place
(frontend/dialect.py's Routes: chat.py, responses.py, completions.py for /v1/completions, raw_generate.py
for `POST /`, generate_stream.py for /generate, each a thin adapter over frontend/pipeline.py; lmtp.py's
WebSocket; embeddings.py's pooling routes), what a router asks a worker (worker_info.py: SGLang's
/server_info, /model_info), and models, tokenize, health here."""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Body, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from frontend.admission import Admission, AdmissionMiddleware
from frontend.chat import ChatDialect
from frontend.completions import CompletionsDialect
from frontend.config import FrontendConfig
from frontend.debug_routes import debug_routes
from frontend.dialect import Routes
from frontend.embeddings import embedding_routes
from frontend.generate_stream import GenerateDialect
from frontend.lmtp import LMTP_PATHS, LmtpService, lmtp_routes
from frontend.lora_routes import adapter_entry, adapter_models, lora_routes
from frontend.metered_router import MeteredRouter
from frontend.off_loop import off_loop
from frontend.openapi_doc import install_openapi
from frontend.pipeline import Pipeline
from frontend.pooling import PoolingPipeline
from frontend.protocol import ChatCompletionRequest
from frontend.raw_generate import RawDialect
from frontend.responses import ResponsesDialect
from frontend.worker_info import worker_info_routes
from kvyard.errors import ErrorCode, RequestError, refuse_unknown_fields
from kvyard.http_errors import error_body, install_error_handlers
from kvyard.http_json import JsonBodyByDefault
from kvyard.metrics import FrontendMetrics, HttpMetricsMiddleware, add_metrics_route
from kvyard.tokenizer import TextTokenizer
from renderers import get_renderer


def create_app(cfg: FrontendConfig, tokenizer: TextTokenizer, admission: Admission | None = None) -> FastAPI:
    tokenizer = tokenizer.bounded(cfg.max_seq_len)  # huge texts refused by size before tokenizing
    metrics = FrontendMetrics(cfg.model_name)
    client = MeteredRouter(cfg, metrics)
    pipeline = Pipeline(cfg, tokenizer, client)
    chat = ChatDialect(pipeline, get_renderer(cfg.model_type, tokenizer, cfg.tool_call_parser))
    admission = admission or Admission(cfg)
    routes = Routes()
    routes.include(lmtp_routes(LmtpService(cfg, tokenizer, client, admission, pipeline)), LMTP_PATHS)
    for dialect in (GenerateDialect(pipeline), CompletionsDialect(pipeline), RawDialect(pipeline), chat,
                    ResponsesDialect(chat)):
        routes.add(dialect)
    routes.include(embedding_routes(PoolingPipeline(cfg, client)))  # the pooling model's routes

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.close()

    app = FastAPI(title="kvyard frontend", lifespan=lifespan)
    app.state.admission = admission
    install_error_handlers(app)
    # innermost: 401/413/429/503 before routes
    app.add_middleware(AdmissionMiddleware, admission=admission, generation=frozenset(routes.generation))
    app.add_middleware(HttpMetricsMiddleware, metrics=metrics)  # inside JsonBodyByDefault: sees the route
    app.add_middleware(JsonBodyByDefault, allowed_origins=cfg.cors_allow_origins)
    if cfg.cors_allow_origins:  # outermost: answers the browsers' preflights for the allowed origins
        app.add_middleware(CORSMiddleware, allow_origins=list(cfg.cors_allow_origins), allow_methods=["*"],
                           allow_headers=["*"])
    add_metrics_route(app, metrics.registry)
    app.include_router(routes.router)
    app.include_router(worker_info_routes(cfg))  # SGLang's router asks these of every worker
    app.include_router(debug_routes(cfg))  # RTP-LLM's /cache_status, /worker_status, /set_log_level
    app.include_router(lora_routes(cfg))  # LoRA adapters: vLLM's load/unload, RTP-LLM's /update

    @app.get("/v1/models")
    @app.get("/models")
    async def models() -> dict[str, Any]:
        names = await client.models()
        pooling = cfg.embedding_model_name if cfg.embedding is not None else ""
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "kvyard", "max_model_len": cfg.max_seq_len}
                for name in names if name != pooling and (cfg.generates or not cfg.serves(name))]
        if cfg.embedding is not None:
            data.append({"id": pooling, "object": "model", "created": 0, "owned_by": "kvyard",
                         "max_model_len": cfg.embedding.max_len, "kind": str(cfg.embedding.kind)})
        if cfg.lora:  # the paired backend's adapters, then those only other backends behind the master hold
            listed = {d["id"] for d in data}
            for m in [*await adapter_models(cfg), *(adapter_entry(cfg, a["id"]) for a in await client.adapters())]:
                if m["id"] not in listed:
                    listed.add(m["id"])
                    data.append(m)
        return {"object": "list", "data": data}

    @app.post("/tokenizer/encode")
    async def tokenizer_encode(body: dict[str, Any] = Body(...)) -> dict[str, Any]:
        refuse_unknown_fields(body, ("prompt", "return_offsets_mapping", "parse_special"))
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "'prompt' must be a string", "prompt")
        parse_special = bool(body.get("parse_special", True))
        ids, pieces, offsets = await off_loop(tokenizer.encode_with_offsets, prompt,
                                              parse_special=parse_special)
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
            rendered = await chat.tokens(req)  # images too: the ids a request is billed
            return {"token_ids": rendered.input_ids, "prompt": rendered.prompt}
        refuse_unknown_fields(body, ("prompt", "parse_special", "model"))
        pipeline.check_model(body.get("model"))
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "give 'prompt' (a string) or 'messages'", "prompt")
        return {"token_ids": await off_loop(tokenizer.encode, prompt,
                                            parse_special=bool(body.get("parse_special", True)))}

    async def pooling_healthy() -> bool:
        """Without a master, the pooling model's own backend must serve too (a master answers for the cluster)."""
        if cfg.embedding is None or cfg.master_address:
            return True
        return await client.client(cfg.embedding_backend_address).healthy()

    async def health() -> Any:
        if admission.draining:
            return JSONResponse(error_body("this server is draining (shutting down)", "service_unavailable"),
                                503, headers={"Retry-After": "1"})
        if await client.healthy() and await pooling_healthy():
            return PlainTextResponse("ok")
        where = cfg.master_address and f"master {cfg.master_address} or "
        backends = [*cfg.fallback_addresses, *([cfg.embedding_backend_address] if cfg.embedding else [])]
        return JSONResponse(error_body(f"{where}backend {', '.join(backends)} is not serving",
                                       "service_unavailable"),
                            503, headers={"Retry-After": "1"})

    for path in ("/health", "/status", "/GraphService/cm2_status", "/SearchService/cm2_status"):
        for method in ("GET", "POST"):  # one route per method: each gets its own OpenAPI operation id
            app.add_api_route(path, health, methods=[method])
    app.add_api_route("/health_check", health, methods=["POST"])

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> RedirectResponse:
        """The link to the cluster's live dashboard, which the master serves."""
        if not cfg.master_address:
            raise StarletteHTTPException(404, "no dashboard: this frontend has no master (MASTER_ADDRESS); the "
                                              "live dashboard is the master's GET /dashboard")
        base = cfg.master_address if "://" in cfg.master_address else f"http://{cfg.master_address}"
        return RedirectResponse(f"{base.rstrip('/')}/dashboard", 307)
    app.add_api_route("/", health, methods=["GET"])
    install_openapi(app)
    return app
