"""FrontendConfig: built once from the environment by the role launcher, then passed down."""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvyard.env import env_int, env_str
from kvyard.model_config import load_model_config
from kvyard.model_path import EMBEDDED_MODEL_NAME, ModelFileError, embedded_model_path, is_gguf, resolve_model_path

DEFAULT_START_PORT = 8088


@dataclass(frozen=True)
class FrontendConfig:
    host: str                         # bind address
    port: int                         # START_PORT
    tokenizer_path: Path              # GGUF or HF directory: tokenizer + chat template (no weights read)
    model_name: str                   # the name clients pass as "model"
    model_type: str | None            # MODEL_TYPE: picks the renderer (None = the model's own template)
    backend_address: str              # host:port of the backend's gRPC server
    max_seq_len: int                  # context length: prompt + completion must fit
    stop_words: tuple[str, ...]       # STOP_WORDS_STR: extra stop strings for every request
    stop_word_ids: tuple[tuple[int, ...], ...]  # STOP_WORDS_LIST: extra stop token sequences
    request_timeout_s: float          # whole-request limit passed to the backend (0 = none)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> FrontendConfig:
        start_port = env_int(env, "START_PORT", DEFAULT_START_PORT, minimum=1)
        tokenizer = resolve_model_path(env.get("TOKENIZER_PATH") or env.get("CHECKPOINT_PATH"))
        default_name = EMBEDDED_MODEL_NAME if tokenizer == embedded_model_path_or_none() else \
            (tokenizer.stem.split(".")[0] if is_gguf(tokenizer) else tokenizer.name)
        return cls(
            host=env_str(env, "HOST", "0.0.0.0"),
            port=start_port,
            tokenizer_path=tokenizer,
            model_name=env_str(env, "MODEL_NAME", default_name),
            model_type=env.get("MODEL_TYPE") or None,
            backend_address=env_str(env, "BACKEND_ADDRESS", f"127.0.0.1:{start_port + 1}"),
            max_seq_len=env_int(env, "MAX_SEQ_LEN", 0, minimum=0) or _model_context(tokenizer),
            stop_words=tuple(_json_list(env, "STOP_WORDS_STR", str)),
            stop_word_ids=tuple(tuple(ids) for ids in _json_list(env, "STOP_WORDS_LIST", list)),
            request_timeout_s=float(env_int(env, "REQUEST_TIMEOUT_S", 600, minimum=0)),
        )


def embedded_model_path_or_none() -> Path | None:
    try:
        return embedded_model_path()
    except ModelFileError:
        return None


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
