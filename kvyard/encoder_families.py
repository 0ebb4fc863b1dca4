"""What each encoder family's config.json must say for backend/encoder.py (BERT, XLM-R, Nomic BERT, ModernBERT, GTE)
or backend/gemma_encoder.py (EmbeddingGemma) to run it as its reference does; anything else is refused at load,
naming the key. kvyard/pooling_model.py asks here for the context the checkpoint's positions allow."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from kvyard.model_path import ModelFileError

# RoBERTa's architecture under its three names (all-distilroberta-v1 and the roberta cross-encoders, XLM-R/BGE-M3,
# CamemBERT): positions after the padding index, one segment type, the classifier's dense + out_proj head.
ROBERTA_TYPES = ("xlm-roberta", "roberta", "camembert")
# The activations a ModernBERT classifier's head may name (transformers' ACT2FN keys backend/encoder.py runs).
HEAD_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu", "tanh")
LAYER_TYPES = {"full_attention", "sliding_attention"}


def encoder_positions(path: Path, cfg: dict[str, Any], classify: bool) -> int:
    """The positions an encoder directory's model takes, once its config is one we run (classify: a
    *ForSequenceClassification, whose head is checked too)."""
    model_type = cfg["model_type"]
    if model_type == "modernbert":
        act = cfg.get("hidden_activation", "gelu")
        if act not in ("gelu", "silu"):
            raise ModelFileError(f"{path}: a ModernBERT with hidden_activation {act!r} is not supported")
        _check_layer_types(path, cfg, "ModernBERT")
        if classify:
            _check_modernbert_head(path, cfg)
        return int(cfg["max_position_embeddings"])
    if model_type == "nomic_bert":
        _check_nomic(path, cfg)
        # Rotary positions have no table; the context is the one it was trained for (v1/v1.5: 2048 of 8192).
        return int(cfg.get("max_trained_positions") or cfg.get("max_position_embeddings") or cfg["n_positions"])
    if model_type in ("gte", "new"):
        _check_gte(path, cfg)
        return int(cfg.get("max_position_embeddings", 8192))
    if model_type == "distilbert":
        if cfg.get("activation", "gelu") not in ("gelu", "relu"):
            raise ModelFileError(f"{path}: a DistilBERT with activation {cfg['activation']!r} is not supported")
        return int(cfg.get("max_position_embeddings", 512))
    if model_type == "gemma3_text":
        _check_gemma(path, cfg)
        return int(cfg.get("max_position_embeddings", 2048))
    act = cfg.get("hidden_act", "gelu")
    if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu"):
        raise ModelFileError(f"{path}: hidden_act {act!r} is not supported")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ModelFileError(f"{path}: position_embedding_type {cfg['position_embedding_type']!r} is not supported")
    positions = int(cfg["max_position_embeddings"])
    if model_type in ROBERTA_TYPES:  # positions start after the padding index
        positions -= int(cfg.get("pad_token_id", 1)) + 1
    if model_type == "mpnet":  # after transformers' fixed padding index, 1
        positions -= 2
    return positions


def _check_layer_types(path: Path, cfg: dict[str, Any], family: str) -> None:
    unknown = set(cfg.get("layer_types") or ()) - LAYER_TYPES
    if unknown:
        raise ModelFileError(f"{path}: {family} layer types {sorted(unknown)} are not supported")


def _check_modernbert_head(path: Path, cfg: dict[str, Any]) -> None:
    """ModernBertForSequenceClassification's head: [CLS] or the mean of the tokens, a dense layer, its
    activation and a norm, then the classifier; another pooling or activation is refused by name."""
    pooling, act = cfg.get("classifier_pooling", "cls"), cfg.get("classifier_activation", "gelu")
    if pooling not in ("cls", "mean"):
        raise ModelFileError(f"{path}: classifier_pooling {pooling!r} is not supported (cls or mean)")
    if act not in HEAD_ACTIVATIONS:
        raise ModelFileError(f"{path}: classifier_activation {act!r} is not supported ({', '.join(HEAD_ACTIVATIONS)})")


def _check_nomic(path: Path, cfg: dict[str, Any]) -> None:
    """What backend/encoder.py runs of Nomic BERT (the keys of nomic-embed-text's own config.json, or
    transformers' NomicBertConfig): post-norm layers, SwiGLU, rotary positions on the whole head in halves, no
    biases; anything else (v2's mixture of experts, a prenorm variant) is refused by name."""
    act = cfg.get("hidden_act") or cfg.get("activation_function", "silu")
    wanted = {"activation": (act in ("silu", "swiglu"), act), "prenorm": (not cfg.get("prenorm"), cfg.get("prenorm")),
              "rotary_emb_fraction": (cfg.get("rotary_emb_fraction", 1.0) == 1.0, cfg.get("rotary_emb_fraction")),
              "rotary_emb_interleaved": (not cfg.get("rotary_emb_interleaved"), cfg.get("rotary_emb_interleaved")),
              "qkv_proj_bias": (not cfg.get("qkv_proj_bias"), cfg.get("qkv_proj_bias")),
              "mlp_fc1_bias": (not cfg.get("mlp_fc1_bias"), cfg.get("mlp_fc1_bias")),
              "moe_every_n_layers": (not cfg.get("moe_every_n_layers"), cfg.get("moe_every_n_layers"))}
    for key, (ok, value) in wanted.items():
        if not ok:
            raise ModelFileError(f"{path}: a Nomic BERT with {key}={value!r} is not supported")


def _check_gemma(path: Path, cfg: dict[str, Any]) -> None:
    """EmbeddingGemma: Gemma 3's text layers attending both ways (use_bidirectional_attention), GeGLU (tanh),
    rotary positions without scaling, no biases and no logit soft-capping; a causal Gemma 3 is a chat model
    kvyard does not run."""
    rope = cfg.get("rope_parameters") or {}
    scaled = cfg.get("rope_scaling") or any((r or {}).get("rope_type", "default") != "default" for r in rope.values())
    wanted = {"use_bidirectional_attention": (cfg.get("use_bidirectional_attention") is True,
                                              cfg.get("use_bidirectional_attention")),
              "hidden_activation": (cfg.get("hidden_activation", "gelu_pytorch_tanh") == "gelu_pytorch_tanh",
                                    cfg.get("hidden_activation")),
              "attn_logit_softcapping": (cfg.get("attn_logit_softcapping") is None, cfg.get("attn_logit_softcapping")),
              "attention_bias": (not cfg.get("attention_bias"), cfg.get("attention_bias")),
              "rope_scaling": (not scaled, cfg.get("rope_scaling") or rope)}
    for key, (ok, value) in wanted.items():
        if not ok:
            raise ModelFileError(f"{path}: a Gemma 3 with {key}={value!r} is not supported (kvyard runs EmbeddingGemma's "
                                 "bidirectional encoder)")
    _check_layer_types(path, cfg, "Gemma 3")


def _check_gte(path: Path, cfg: dict[str, Any]) -> None:
    """GTE (gte-multilingual-base and its reranker, gte-*-en-v1.5): transformers' GteConfig (plain rotary
    positions) or Alibaba's own `new` config (rotary, fixed NTK scaling allowed), post-norm LayerNorms, a gated
    GELU or SiLU feed-forward; anything else refused by name."""
    scaling = cfg.get("rope_scaling") or {}
    kind = scaling.get("type") or scaling.get("rope_type")
    wanted = {"hidden_act": (cfg.get("hidden_act", "gelu") in ("gelu", "silu"), cfg.get("hidden_act")),
              "rope_parameters": ((cfg.get("rope_parameters") or {}).get("rope_type", "default") == "default",
                                  cfg.get("rope_parameters")),
              "rope_scaling": (not scaling or (kind == "ntk" and scaling.get("mixed_b") is None), scaling)}
    if cfg["model_type"] == "new":
        wanted.update({
            "position_embedding_type": (cfg.get("position_embedding_type", "rope") == "rope",
                                        cfg.get("position_embedding_type")),
            "layer_norm_type": (cfg.get("layer_norm_type", "layer_norm") == "layer_norm", cfg.get("layer_norm_type")),
            "logn_attention_scale": (not cfg.get("logn_attention_scale"), cfg.get("logn_attention_scale"))})
    for key, (ok, value) in wanted.items():
        if not ok:
            raise ModelFileError(f"{path}: a GTE model with {key}={value!r} is not supported")
