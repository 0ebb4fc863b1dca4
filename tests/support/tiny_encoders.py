"""Tiny random encoder checkpoints (BERT, XLM-RoBERTa, their cross-encoders, BGE-M3's extra heads), saved
with transformers' own save_pretrained plus the sentence-transformers files, and the embedded MiniLM's
tokenizer (a real WordPiece vocabulary: no model hub, no training)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from kvyard.pooling_model import embedded_embedding_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
VOCAB = 30522  # MiniLM's WordPiece vocabulary


def _write_st(path: Path, pooling: str | None, normalize: bool, prompts: dict[str, str] | None = None,
              max_seq_length: int | None = None) -> None:
    if pooling is None:
        return
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 32, **{f"pooling_mode_{m}": m == pooling for m in
                                           ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens")}}))
    if max_seq_length:
        (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    if prompts:
        (path / "config_sentence_transformers.json").write_text(json.dumps({"prompts": prompts,
                                                                           "default_prompt_name": None}))


def tiny_encoder(path: Path, arch: str = "BertModel", pooling: str | None = "mean_tokens", normalize: bool = True,
                 num_labels: int = 1, seed: int = 0, bge_m3: bool = False, prompts: dict[str, str] | None = None,
                 max_seq_length: int | None = None, id2label: dict[int, str] | None = None) -> Path:
    """arch: BertModel, XLMRobertaModel, BertForSequenceClassification, XLMRobertaForSequenceClassification."""
    import transformers
    torch.manual_seed(seed)
    xlmr = arch.startswith("XLMRoberta")
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=64 if not xlmr else 66, hidden_act="gelu")
    if xlmr:
        cfg = transformers.XLMRobertaConfig(**common, type_vocab_size=1, pad_token_id=0, bos_token_id=101,
                                            eos_token_id=102)
    else:
        cfg = transformers.BertConfig(**common, type_vocab_size=2, pad_token_id=0)
    if "ForSequenceClassification" in arch:
        cfg.num_labels = num_labels
        if id2label:
            cfg.id2label, cfg.label2id = id2label, {v: k for k, v in id2label.items()}
    model = getattr(transformers, arch)(cfg).eval()
    with torch.no_grad():  # LayerNorms start at 1/0: make them random too, so a wrong norm shows
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    src = embedded_embedding_path()
    for name in TOKENIZER_FILES:
        shutil.copy(src / name, path / name)
    _write_st(path, pooling if "ForSequenceClassification" not in arch else None, normalize, prompts, max_seq_length)
    if bge_m3:
        torch.save({"weight": torch.randn(1, 32) * 0.3, "bias": torch.randn(1) * 0.1}, path / "sparse_linear.pt")
        torch.save({"weight": torch.randn(32, 32) * 0.3, "bias": torch.randn(32) * 0.1}, path / "colbert_linear.pt")
    return path
