"""The model's architecture numbers, read once from GGUF metadata or a Hugging Face config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvyard.gguf_meta import read_gguf_metadata
from kvyard.model_path import ModelFileError, is_gguf

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str          # "llama", "mistral" or "qwen2"
    vocab_size: int
    hidden_size: int           # D
    intermediate_size: int     # F, the SwiGLU width
    num_layers: int
    num_heads: int             # H, query heads
    num_kv_heads: int          # Hkv, key/value heads (GQA when < H)
    head_dim: int              # d = D / H unless the checkpoint says otherwise
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int  # the context length the model was trained for
    tie_word_embeddings: bool  # lm_head shares the embedding matrix
    attention_bias: bool       # q/k/v projections have a bias (Qwen2)


def load_model_config(path: Path) -> ModelConfig:
    return _from_gguf(path) if is_gguf(path) else _from_hf_dir(path)


def _from_gguf(path: Path) -> ModelConfig:
    meta = read_gguf_metadata(path)
    arch = str(meta.get("general.architecture", ""))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(f"{path}: GGUF architecture '{arch}' is not supported "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelFileError(f"{path}: GGUF metadata lacks '{arch}.{key}'")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    rope_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if rope_type not in ("none", None):
        raise ModelFileError(f"{path}: RoPE scaling '{rope_type}' is not supported yet")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings=False,  # decided by the weights: no `output` tensor means tied
        attention_bias=arch == "qwen2",
    )


def _from_hf_dir(path: Path) -> ModelConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelFileError(f"{path}: no config.json")
    cfg = json.loads(config_file.read_text())
    model_type = cfg.get("model_type", "")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(f"{path}: model_type '{model_type}' is not supported "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if cfg.get("rope_scaling"):
        raise ModelFileError(f"{path}: rope_scaling {cfg['rope_scaling']} is not supported yet")
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    return ModelConfig(
        architecture=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
    )
