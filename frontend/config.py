"""FrontendConfig: built once from the environment by the role launcher, then passed down."""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from frontend.images import ImageLimits
from kvyard.cluster_auth import read_cluster_token
from kvyard.env import env_choice, env_int, env_names, env_str
from kvyard.model_config import load_model_config
from kvyard.model_path import ModelFileError, default_model_name, resolve_model_path
from kvyard.pooling_model import (ModelKind, PoolingSpec, embedding_model_name, load_pooling_spec, model_kind,
                                  resolve_embedding_path)
from kvyard.ports import backend_grpc_port, embedding_start_port, start_port
from kvyard.tokenizer import TextTokenizer
from kvyard.vision_config import ImageSide, load_vision_config



@dataclass(frozen=True)
class FrontendConfig:
    host: str                         # bind address
    port: int                         # START_PORT
    tokenizer_path: Path              # GGUF or HF directory: tokenizer + chat template (no weights read)
    model_name: str                   # the name clients pass as "model" (MODEL_NAME's first)
    model_type: str | None            # MODEL_TYPE: picks the renderer (None = the model's own template)
    backend_address: str              # host:port of the backend's gRPC server
    max_seq_len: int                  # context length: prompt + completion must fit
    stop_words: tuple[str, ...]       # STOP_WORDS_STR: extra stop strings for every request
    stop_word_ids: tuple[tuple[int, ...], ...]  # STOP_WORDS_LIST: extra stop token sequences
    request_timeout_s: float          # whole-request limit passed to the backend (0 = none)
    first_token_timeout_s: float = 10.0  # FIRST_TOKEN_TIMEOUT_S: quiet this long before the first output, the
                                      # backend is health-checked; silent: re-routed once (0 = no deadline)
    inter_token_timeout_s: float = 10.0  # INTER_TOKEN_TIMEOUT_S: the same between outputs; silent: a timeout error
    backend_protocol: str = "kvyard"  # BACKEND_PROTOCOL: kvyard's ModelRpcService, or rtp_llm (RTP-LLM's RpcService)
    master_address: str = ""          # host:port of the master's HTTP; "" = call backend_address directly
    fallback_addresses: tuple[str, ...] = ()  # backends called round-robin while the master is unreachable
    block_size: int = 16              # tokens per KV block: must equal the backends' BLOCK_SIZE
    master_timeout_s: float = 0.5     # one schedule call's limit before falling back
    master_queue_wait_s: float = 5.0  # MASTER_QUEUE_WAIT_MS: how long the master may hold it while all are busy
    api_key: str = ""                 # API_KEY: required as `Authorization: Bearer <key>` ("" = open)
    max_body_bytes: int = 8 << 20     # MAX_BODY_BYTES: larger request bodies are a 413
    concurrency_limit: int = 1024     # CONCURRENCY_LIMIT: generation requests in flight; more are a 429
    drain_grace_s: float = 30.0       # DRAIN_GRACE_S: after SIGTERM, how long requests in flight may run
    lmtp_wait_s: float = 30.0         # LMTP_WAIT_S: how long an LMTP stream waits for its model to be reachable
    tool_call_parser: str | None = None  # TOOL_CALL_PARSER: overrides the renderer's tool-call format
    cors_allow_origins: tuple[str, ...] = ()  # CORS_ALLOW_ORIGINS: web origins that may call the API ("*": any)
    cluster_token: str = ""          # CLUSTER_TOKEN(_FILE): carried on every call to the master and backends
    model_aliases: tuple[str, ...] = ()  # MODEL_NAME's other names: clients may pass them for model_name
    service_id: str = ""             # MODEL_SERVICE_CONFIG.service_id: this frontend's service name (/server_info)
    trust_request_chat_template: bool = False  # TRUST_REQUEST_CHAT_TEMPLATE=1: a request's chat_template runs
    embedding: PoolingSpec | None = None  # EMBEDDING_MODEL_PATH: the pooling model served beside the chat model
    embedding_model_name: str = ""       # EMBEDDING_MODEL_NAME: its name (default: all-MiniLM-L6-v2 / the directory's)
    embedding_backend_address: str = ""  # EMBEDDING_BACKEND_ADDRESS: its backend without a master
    vision: ImageSide | None = None      # the chat model's image side (LLaVA, Qwen-VL); None: text only
    images: ImageLimits = ImageLimits()  # IMAGE_*: where images may come from, how many, how large
    lora: bool = False               # LORA_MODULES or LORA_ROOT set: a `model` this frontend does not serve
                                     # names a LoRA adapter (the backend answers 404 if it holds none of that name)

    def serves(self, name: str) -> bool:
        """`name` is this frontend's own model (its name or an alias)."""
        return name == self.model_name or name in self.model_aliases

    @property
    def generates(self) -> bool:
        """False when CHECKPOINT_PATH itself is a pooling model: no chat model here, only the pooling routes."""
        return self.embedding is None or self.embedding_model_name != self.model_name

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> FrontendConfig:
        port = start_port(env)
        tokenizer = resolve_model_path(env.get("TOKENIZER_PATH") or env.get("CHECKPOINT_PATH"))
        TextTokenizer.check_path(tokenizer)  # an unsupported tokenizer fails the launch, by name
        backend = env_str(env, "BACKEND_ADDRESS", f"127.0.0.1:{backend_grpc_port(port)}")
        service = _model_service_config(env)
        fallbacks = [a.strip() for a in env.get("BACKEND_ADDRESSES", "").split(",") if a.strip()]
        pools = model_kind(tokenizer) is not ModelKind.GENERATE  # CHECKPOINT_PATH is a pooling model
        names = env_names(env, "MODEL_NAME", embedding_model_name(tokenizer) if pools else default_model_name(tokenizer))
        pooling = _embedding(env, port, tokenizer if pools else None, names[0], backend)
        return cls(
            host=env_str(env, "HOST", "0.0.0.0"),
            port=port,
            tokenizer_path=tokenizer,
            model_name=names[0],
            model_aliases=names[1:],
            model_type=env.get("MODEL_TYPE") or None,
            backend_address=backend,
            backend_protocol=env_choice(env, "BACKEND_PROTOCOL", "kvyard", ("kvyard", "rtp_llm")),
            max_seq_len=env_int(env, "MAX_SEQ_LEN", 0, minimum=0) or (pooling["embedding"].max_len if pools
                                                                       else _model_context(tokenizer)),
            stop_words=tuple(_json_list(env, "STOP_WORDS_STR", str)),
            stop_word_ids=tuple(tuple(ids) for ids in _json_list(env, "STOP_WORDS_LIST", list)),
            request_timeout_s=float(env_int(env, "REQUEST_TIMEOUT_S", 600, minimum=0)),
            first_token_timeout_s=float(env_int(env, "FIRST_TOKEN_TIMEOUT_S", 10, minimum=0)),
            inter_token_timeout_s=float(env_int(env, "INTER_TOKEN_TIMEOUT_S", 10, minimum=0)),
            master_address=env_str(env, "MASTER_ADDRESS", service.get("master_address", "")),
            fallback_addresses=tuple(fallbacks or service.get("backend_addresses", []) or [backend])
            if service.get("use_local", True) else (),
            service_id=service.get("service_id", ""),
            block_size=env_int(env, "BLOCK_SIZE", 16, minimum=1),
            master_timeout_s=env_int(env, "MASTER_TIMEOUT_MS", 500, minimum=1) / 1000,
            master_queue_wait_s=env_int(env, "MASTER_QUEUE_WAIT_MS", 5000, minimum=0) / 1000,
            api_key=env.get("API_KEY", ""),
            max_body_bytes=env_int(env, "MAX_BODY_BYTES", 8 << 20, minimum=1024),
            concurrency_limit=env_int(env, "CONCURRENCY_LIMIT", 1024, minimum=1),
            drain_grace_s=float(env_int(env, "DRAIN_GRACE_S", 30, minimum=0)),
            lmtp_wait_s=float(env_int(env, "LMTP_WAIT_S", 30, minimum=0)),
            tool_call_parser=_tool_parser(env.get("TOOL_CALL_PARSER") or None),
            cors_allow_origins=tuple(o.strip() for o in env.get("CORS_ALLOW_ORIGINS", "").split(",") if o.strip()),
            cluster_token=read_cluster_token(env),
            trust_request_chat_template=env_choice(env, "TRUST_REQUEST_CHAT_TEMPLATE", "0", ("0", "1")) == "1",
            vision=load_vision_config(tokenizer) if tokenizer.is_dir() else None,
            images=ImageLimits.from_env(env),
            lora=bool(env.get("LORA_MODULES") or env.get("LORA_ROOT")),
            **pooling,
        )


def _embedding(env: Mapping[str, str], port: int, main: Path | None, main_name: str, backend: str) -> dict[str, Any]:
    """EMBEDDING_MODEL_PATH (a Hugging Face pooling model's directory, or `embedded`): its files are read here
    (the frontend tokenizes for it); its backend is EMBEDDING_BACKEND_ADDRESS, else the one a PDFUSION launch
    starts beside the chat backend. A pooling model as CHECKPOINT_PATH is served the same way, under
    MODEL_NAME on the main backend, and the chat routes answer 400 (FrontendConfig.generates)."""
    value = env.get("EMBEDDING_MODEL_PATH", "")
    if main is not None:  # CHECKPOINT_PATH pools
        spec = _matryoshka(env, load_pooling_spec(main))
        if value:
            raise ValueError(f"CHECKPOINT_PATH {main} is itself {spec.kind.a}; a frontend serves one pooling "
                             "model, so EMBEDDING_MODEL_PATH cannot add another (give a chat model as CHECKPOINT_PATH)")
        return {"embedding": spec, "embedding_model_name": main_name, "embedding_backend_address": backend}
    if not value:
        return {}
    path = resolve_embedding_path(value)
    return {"embedding": _matryoshka(env, load_pooling_spec(path)),
            "embedding_model_name": env_str(env, "EMBEDDING_MODEL_NAME", embedding_model_name(path)),
            "embedding_backend_address": env_str(env, "EMBEDDING_BACKEND_ADDRESS",
                                                 f"127.0.0.1:{backend_grpc_port(embedding_start_port(port))}")}


def _matryoshka(env: Mapping[str, str], spec: PoolingSpec) -> PoolingSpec:
    """MATRYOSHKA_DIMENSIONS: the shorter sizes `dimensions` may ask of an embed model whose files do not say
    (EmbeddingGemma: 512,256,128; vLLM's `--hf-overrides '{"matryoshka_dimensions": [...]}'`): a comma-separated
    list, or `any`; unset, the checkpoint's `matryoshka_dimensions` / `is_matryoshka`."""
    value = env.get("MATRYOSHKA_DIMENSIONS", "").strip()
    if not value:
        return spec
    if spec.kind is not ModelKind.EMBED:
        raise ValueError(f"MATRYOSHKA_DIMENSIONS is for an embed model; {spec.path} is {spec.kind.a}")
    if value == "any":
        return replace(spec, matryoshka_dimensions=())
    try:
        sizes = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise ValueError(f"MATRYOSHKA_DIMENSIONS must be `any` or sizes like 512,256,128, not {value!r}") from None
    if any(not 0 < d <= spec.dimensions for d in sizes):
        raise ValueError(f"MATRYOSHKA_DIMENSIONS {value!r}: each size must be 1..{spec.dimensions} (the model's)")
    return replace(spec, matryoshka_dimensions=sizes)


def _tool_parser(name: str | None) -> str | None:
    from renderers import get_tool_parser
    if name is not None:
        get_tool_parser(name)  # ValueError naming the known ones
    return name


def _model_context(path: Path) -> int:
    try:
        return load_model_config(path).max_position_embeddings
    except (ModelFileError, KeyError) as exc:
        raise ValueError(f"cannot read the context length from {path} ({exc}); set MAX_SEQ_LEN") from exc


def _json_list(env: Mapping[str, str], name: str, item_type: type) -> list:
    raw = env.get(name, "")
    if not raw:
        return []
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} must be a JSON list, got {raw!r}") from exc
    if not isinstance(value, list) or not all(isinstance(v, item_type) for v in value):
        raise ValueError(f"{name} must be a JSON list of {item_type.__name__}, got {raw!r}")
    return value


def _model_service_config(env: Mapping[str, str]) -> dict[str, Any]:
    """MODEL_SERVICE_CONFIG (RTP-LLM's JSON), every key with an effect or refused by name, e.g.
    {"service_id": "test", "master_endpoint": {"type": "VipServer", "address": "127.0.0.1:16000",
    "protocol": "http", "path": "/"}, "use_local": true, "backend_addresses": ["10.0.0.7:8089"]}.
    master_endpoint: the master at protocol://address + path (`type` says how to find it: kvyard has no name
    service, so "VipServer" and "direct" both dial `address`). use_local: false sends requests only through
    the master (a 503 while it cannot route) instead of falling back to the direct backends.
    backend_addresses (ours): those direct backends. service_id: this frontend's service name (/server_info)."""
    raw = env.get("MODEL_SERVICE_CONFIG", "")
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"MODEL_SERVICE_CONFIG must be a JSON object, got {raw!r}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"MODEL_SERVICE_CONFIG must be a JSON object, got {raw!r}")
    _refuse_unknown_keys(value, ("service_id", "master_endpoint", "use_local", "backend_addresses"),
                         "MODEL_SERVICE_CONFIG")
    out: dict[str, Any] = {}
    endpoint = value.get("master_endpoint")
    if endpoint is not None:
        out["master_address"] = _master_endpoint(endpoint)
    backends = value.get("backend_addresses", [])
    if not isinstance(backends, list) or not all(isinstance(b, str) and ":" in b for b in backends):
        raise ValueError(f"MODEL_SERVICE_CONFIG.backend_addresses must be a list of \"host:port\", got {backends!r}")
    out["backend_addresses"] = backends
    use_local = value.get("use_local", True)
    if not isinstance(use_local, bool):
        raise ValueError(f"MODEL_SERVICE_CONFIG.use_local must be true or false, got {use_local!r}")
    if not use_local and endpoint is None:
        raise ValueError("MODEL_SERVICE_CONFIG.use_local=false needs a master_endpoint: with neither, no request "
                         "could be routed")
    out["use_local"] = use_local
    service_id = value.get("service_id", "")
    if not isinstance(service_id, str):
        raise ValueError(f"MODEL_SERVICE_CONFIG.service_id must be a string, got {service_id!r}")
    out["service_id"] = service_id
    return out


def _refuse_unknown_keys(value: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    """Every key of a config object takes effect or is refused by name."""
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"{where}.{unknown[0]} is not supported; the keys are {', '.join(known)}")


def _master_endpoint(endpoint: Any) -> str:
    """protocol://address/path of MODEL_SERVICE_CONFIG.master_endpoint (plain host:port for http at /)."""
    if not isinstance(endpoint, dict):
        raise ValueError(f"MODEL_SERVICE_CONFIG.master_endpoint must be an object, got {endpoint!r}")
    _refuse_unknown_keys(endpoint, ("type", "address", "protocol", "path"), "MODEL_SERVICE_CONFIG.master_endpoint")
    address = endpoint.get("address")
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"MODEL_SERVICE_CONFIG.master_endpoint.address must be \"host:port\", got {address!r}")
    kind = endpoint.get("type", "direct")
    if not isinstance(kind, str) or kind.lower() not in ("vipserver", "direct"):
        raise ValueError(f"MODEL_SERVICE_CONFIG.master_endpoint.type must be VipServer or direct (both dial the "
                         f"address), got {kind!r}")
    protocol = endpoint.get("protocol", "http")
    if protocol not in ("http", "https"):
        raise ValueError(f"MODEL_SERVICE_CONFIG.master_endpoint.protocol must be http or https, got {protocol!r}")
    path = endpoint.get("path", "/")
    if not isinstance(path, str) or not path.startswith("/"):
        raise ValueError(f"MODEL_SERVICE_CONFIG.master_endpoint.path must start with '/', got {path!r}")
    if protocol == "http" and path == "/":
        return address
    return f"{protocol}://{address}{path.rstrip('/')}"
