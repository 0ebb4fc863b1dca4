"""Tiny random decoder pooling checkpoints as they ship: a Qwen3-Embedding-style embedder (the base model's
weights without the "model." prefix, config.json saying Qwen3ForCausalLM, sentence-transformers' modules.json
with last-token pooling and Normalize, a query prompt, a tokenizer that appends <|endoftext|>) and a
*ForSequenceClassification scorer, and an original Qwen3-Reranker (a causal LM whose config.json carries
vLLM's --hf-overrides keys). Tokenizers are trained here (tests/support/tiny_models.py): no hub."""
from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, processors

from tests.support.tiny_models import QWEN2_SPECIALS, byte_level_tokenizer, randomize

QUERY_PROMPT = "Instruct: find the passage\nQuery:"


@cache
def _tokenizer_json() -> str:
    spec = byte_level_tokenizer("qwen2", specials=QWEN2_SPECIALS)
    tok: Tokenizer = spec.reference
    eot = "<|endoftext|>"
    tok.post_processor = processors.TemplateProcessing(single=f"$A {eot}", pair=f"$A {eot} $B:1 {eot}:1",
                                                       special_tokens=[(eot, tok.token_to_id(eot))])
    return tok.to_str()


def decoder_config(family: str, vocab: int, pad: int, **extra: Any) -> Any:
    import transformers
    extra.setdefault("tie_word_embeddings", True)
    extra.setdefault("max_position_embeddings", 128)
    cls = {"qwen3": transformers.Qwen3Config, "qwen2": transformers.Qwen2Config,
           "llama": transformers.LlamaConfig}[family]
    return cls(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
               pad_token_id=pad, **extra)


def tiny_decoder_pooler(path: Path, family: str = "qwen3", num_labels: int = 0, seed: int = 0) -> Path:
    """num_labels 0: an embedder (last-token pooling, normalised); else a sequence classifier."""
    import transformers
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(_tokenizer_json())
    tok = Tokenizer.from_str(_tokenizer_json())
    pad = tok.token_to_id("<|endoftext|>")
    (path / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<|endoftext|>", "eos_token": "<|im_end|>"}))
    torch.manual_seed(seed)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if num_labels:
        cfg = decoder_config(family, vocab, pad, num_labels=num_labels)
        model = getattr(transformers, f"{cfg.__class__.__name__.removesuffix('Config')}ForSequenceClassification")(cfg)
        randomize(model)
        model.eval().save_pretrained(path)
        return path
    model = transformers.AutoModel.from_config(decoder_config(family, vocab, pad), dtype=torch.float32)
    randomize(model)
    model.eval().save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = [model.__class__.__name__.replace("Model", "ForCausalLM")]  # as Qwen3-Embedding's says
    (path / "config.json").write_text(json.dumps(cfg))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 128, "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False,
        "pooling_mode_cls_token": False, "include_prompt": True}))
    (path / "config_sentence_transformers.json").write_text(json.dumps({
        "prompts": {"query": QUERY_PROMPT, "document": ""}, "default_prompt_name": None}))
    return path


def tiny_qwen3_reranker(path: Path, tie_word_embeddings: bool = False, seed: int = 0) -> Path:
    """Qwen3ForCausalLM weights, a tokenizer with "yes" and "no" and no post-processor (Qwen's), and
    config.json saying Qwen3ForSequenceClassification, classifier_from_token ["no", "yes"],
    is_original_qwen3_reranker: what vLLM's documented --hf-overrides for Qwen3-Reranker sets."""
    import transformers
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_str(byte_level_tokenizer("qwen2", specials=QWEN2_SPECIALS).reference.to_str())  # a copy
    tok.add_tokens(["yes", "no"])
    tok.save(str(path / "tokenizer.json"))
    pad = tok.token_to_id("<|endoftext|>")
    (path / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<|endoftext|>", "eos_token": "<|im_end|>"}))
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(decoder_config("qwen3", tok.get_vocab_size(with_added_tokens=True), pad,
                                                         tie_word_embeddings=tie_word_embeddings,
                                                         max_position_embeddings=512))
    randomize(model)
    model.eval().save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(architectures=["Qwen3ForSequenceClassification"], classifier_from_token=["no", "yes"],
               is_original_qwen3_reranker=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return path
