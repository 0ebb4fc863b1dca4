"""Tiny random encoder checkpoints (BERT, XLM-RoBERTa, their cross-encoders, BGE-M3's extra heads), saved
with transformers' own save_pretrained plus the sentence-transformers files, and the embedded MiniLM's
tokenizer (a real WordPiece vocabulary: no model hub, no training) or, for XLM-R's own kind, a SentencePiece
Unigram vocabulary trained here on a few sentences (sentencepiece, the test extra)."""
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


# What the Unigram vocabulary is trained on: a few languages, NFKC-mapped characters, digits and punctuation.
_CORPUS = ["The quick brown fox jumps over the lazy dog.", "A man is eating food.", "Café naïve résumé — ÉCOLE!",
           "東京は日本の首都です。", "Berlin ist die Hauptstadt von Deutschland.", "Paris est la capitale de la France.",
           "x=3.14, y=[1,2]; z?", "what is the capital of france?", "Retrieval needs embeddings and rerankers."]


def unigram_tokenizer(path: Path) -> int:
    """XLM-RoBERTa's tokenizer over a SentencePiece Unigram model trained here (its pieces and scores, NFKC's
    precompiled map, <unk> <s> </s> first as XLM-R's model has them), laid out as transformers lays out
    XLM-R's (<s> <pad> </s> <unk>, the pieces, <mask>): saved into path. Returns its size."""
    import io

    import sentencepiece
    import transformers
    from sentencepiece import sentencepiece_model_pb2

    buf = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS * 20), model_writer=buf, vocab_size=200, hard_vocab_limit=False,
        model_type="unigram", character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1,
        minloglevel=2)
    spm = sentencepiece_model_pb2.ModelProto()
    spm.ParseFromString(buf.getvalue())
    vocab = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0),
             *((p.piece, p.score) for p in spm.pieces[3:]), ("<mask>", 0.0)]
    tok = transformers.XLMRobertaTokenizer(vocab=vocab, _spm_precompiled_charsmap=spm.normalizer_spec.precompiled_charsmap)
    tok.save_pretrained(path)
    return len(vocab)


def bpe_tokenizer(path: Path) -> int:
    """ModernBERT's kind of vocabulary: a byte-level BPE (GPT-2's split) trained here, [CLS] $A [SEP] around each
    text ([CLS] [SEP] [PAD] [UNK] [MASK] first). Saved into path; returns its size."""
    from tokenizers import processors

    from tests.support.tiny_tokenizers import byte_level_tokenizer
    specials = ("[CLS]", "[SEP]", "[PAD]", "[UNK]", "[MASK]")
    tok = byte_level_tokenizer("gpt-2", vocab_size=400, specials=specials).reference
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", 0), ("[SEP]", 1)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": "[MASK]",
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return tok.get_vocab_size()


def tiny_encoder(path: Path, arch: str = "BertModel", pooling: str | None = "mean_tokens", normalize: bool = True,
                 num_labels: int = 1, seed: int = 0, bge_m3: bool = False, prompts: dict[str, str] | None = None,
                 max_seq_length: int | None = None, id2label: dict[int, str] | None = None,
                 unigram: bool = False, classifier_pooling: str = "cls") -> Path:
    """arch: BertModel, XLMRobertaModel, BertForSequenceClassification, XLMRobertaForSequenceClassification,
    NomicBertModel (transformers' own: rotary positions at base 1000, SwiGLU, no biases), ModernBertModel (pre-norm,
    rotary, layers 1 and 2 of every 3 attending within 4 positions, GeGLU), GteModel / GteForSequenceClassification
    (post-norm, rotary at base 1000, GeGLU; saved in Alibaba's `new` names), DistilBertModel /
    DistilBertForSequenceClassification (BERT's layers under other names, no segments; a ReLU pre-classifier),
    ModernBertForSequenceClassification (that,
    with its head over [CLS] or, classifier_pooling "mean", the mean of the tokens).
    unigram: XLM-R's own kind of vocabulary (unigram_tokenizer), one embedding row more than it has pieces (as
    a real checkpoint may pad its matrix); else the embedded MiniLM's WordPiece one."""
    import transformers
    torch.manual_seed(seed)
    xlmr = arch.startswith(("XLMRoberta", "Roberta", "Camembert"))  # one architecture under three names
    path.mkdir(parents=True, exist_ok=True)
    modern = arch.startswith("ModernBert")
    vocab_size = unigram_tokenizer(path) + 1 if unigram else bpe_tokenizer(path) if modern else VOCAB
    common = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=258 if unigram else 64 if not xlmr else 66, hidden_act="gelu")
    if modern:
        cfg = transformers.ModernBertConfig(classifier_pooling=classifier_pooling,
            vocab_size=vocab_size, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=256, local_attention=8, global_attn_every_n_layers=3, pad_token_id=2,
            bos_token_id=0, eos_token_id=1, cls_token_id=0, sep_token_id=1)
    elif arch.startswith("MPNet"):  # all-mpnet-base-v2's kind (MiniLM's WordPiece vocabulary stands in for its own)
        cfg = transformers.MPNetConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=64, max_position_embeddings=258, relative_attention_num_buckets=32)
    elif arch.startswith("DistilBert"):  # msmarco-distilbert's kind: MiniLM's WordPiece vocabulary, no segments
        cfg = transformers.DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                            max_position_embeddings=256, pad_token_id=0)
    elif arch.startswith("Gte"):  # gte-multilingual's kind: XLM-R's vocabulary and pad id, one segment type
        cfg = transformers.GteConfig(**{k: v for k, v in common.items() if k != "hidden_act"}, type_vocab_size=1,
                                     pad_token_id=1 if unigram else 0, rope_parameters={"rope_type": "default",
                                                                                        "rope_theta": 1000.0})
    elif arch == "NomicBertModel":
        cfg = transformers.NomicBertConfig(**{k: v for k, v in common.items() if k != "hidden_act"}, type_vocab_size=2,
                                           pad_token_id=0)
    elif xlmr:
        family = "XLMRoberta" if arch.startswith("XLMRoberta") else "Roberta" if arch.startswith("Roberta") else "Camembert"
        cfg = getattr(transformers, f"{family}Config")(**common, type_vocab_size=1, pad_token_id=1 if unigram else 0,
                                            bos_token_id=0 if unigram else 101, eos_token_id=2 if unigram else 102)
    else:
        cfg = transformers.BertConfig(**common, type_vocab_size=2, pad_token_id=0)
    if "ForSequenceClassification" in arch:
        cfg.num_labels = num_labels
        if id2label:
            cfg.id2label, cfg.label2id = id2label, {v: k for k, v in id2label.items()}
    model = getattr(transformers, arch)(cfg).eval()
    with torch.no_grad():  # LayerNorms start at 1/0: make them random too, so a wrong norm shows
        for name, p in model.named_parameters():
            if "LayerNorm" in name or "layernorm" in name or "layer_norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if arch.startswith(("NomicBert", "Gte")) and name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(10)  # attention far from uniform, so positions (rotary only) change every output
            if name.endswith("relative_attention_bias.weight"):
                p.normal_(0.0, 2.0)  # MPNet's: far from its near-zero initialisation, so a wrong bucket shows
            if modern and "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if modern and name.endswith("Wqkv.weight"):
                p[:64].mul_(10)  # q and k rows, as above: the window and the rotary bases then show
    model.save_pretrained(path)
    if not (unigram or modern):
        for name in TOKENIZER_FILES:
            shutil.copy(embedded_embedding_path() / name, path / name)
    _write_st(path, pooling if "ForSequenceClassification" not in arch else None, normalize, prompts, max_seq_length)
    if bge_m3:
        torch.save({"weight": torch.randn(1, 32) * 0.3, "bias": torch.randn(1) * 0.1}, path / "sparse_linear.pt")
        torch.save({"weight": torch.randn(32, 32) * 0.3, "bias": torch.randn(32) * 0.1}, path / "colbert_linear.pt")
    return path


# llama.cpp's `bert` tensor names for a Hugging Face BERT's (a layer's part after `encoder.layer.N.`).
_GGUF_TOP = {"embeddings.word_embeddings": "token_embd", "embeddings.token_type_embeddings": "token_types",
             "embeddings.position_embeddings": "position_embd", "embeddings.LayerNorm": "token_embd_norm",
             "final_norm": "output_norm"}  # ModernBERT's
_GGUF_LAYER = {"attention.self.query": "attn_q", "attention.self.key": "attn_k", "attention.self.value": "attn_v",
               "attention.output.dense": "attn_output", "attention.output.LayerNorm": "attn_output_norm",
               "intermediate.dense": "ffn_up", "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm",
               "qkv": "attn_qkv", "intermediate.gate": "ffn_gate",  # Nomic BERT's
               "attention.norm": "attn_norm", "ffn.norm": "ffn_norm"}  # ModernBERT's pre-norms
# A cross-encoder's head: BERT's pooler and classifier, the converter's `cls` and `cls.output`.
# XLM-R's (RobertaClassificationHead: dense, tanh, out_proj) are the same two steps under other names.
_GGUF_HEAD = {"pooler.dense": "cls", "classifier": "cls.output", "classifier.dense": "cls",
              "classifier.out_proj": "cls.output"}


def write_bert_gguf(hf_dir: Path, path: Path, qtype: str = "F32") -> Path:
    """A BERT directory (config.json, model.safetensors, tokenizer.json, 1_Pooling) as llama.cpp's converter
    writes it: the `bert` architecture's metadata and tensor names, the pooling type from 1_Pooling, the
    WordPiece vocabulary in its spelling (a word's first piece gains a leading U+2581, a continuation loses
    its "##", control tokens stay), [CLS] as BOS, [SEP] as the separator and EOS, both added. An XLM-R directory as the converter
    writes one: the Unigram vocabulary as `t5` (pieces, scores, token types, the precompiled normalization map,
    padded to the embedding's rows with unused "[PADn]" entries scored -10000), <s> A </s></s> B </s> as
    add_bos / add_eos / add_sep, and the position embeddings cut to start at position 0 (XLM-R's start at
    pad_token_id + 1). Matrices in `qtype` (F32, F16, Q8_0), vectors in F32. A *ForSequenceClassification:
    pooling type rank, its pooler and classifier as `cls` and `cls.output`, its labels when id2label names
    them."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    offset = cfg["pad_token_id"] + 1 if cfg["model_type"] == "xlm-roberta" else 0
    nomic, modern = cfg["model_type"] == "nomic_bert", cfg["model_type"] == "modernbert"
    w = gguf.GGUFWriter(str(path), "nomic-bert" if nomic else "modern-bert" if modern else "bert")
    if nomic:
        w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    if modern:  # as the converter writes ModernBERT's (transformers 5 keys)
        w.add_rope_freq_base(cfg["rope_parameters"]["full_attention"]["rope_theta"])
        w.add_rope_freq_base_swa(cfg["rope_parameters"]["sliding_attention"]["rope_theta"])
        w.add_sliding_window(cfg["local_attention"])
        w.add_sliding_window_pattern(cfg["global_attn_every_n_layers"])
        w.add_string("modern-bert.hidden_activation", cfg["hidden_activation"])
    w.add_name(hf_dir.name)
    w.add_context_length(cfg["max_position_embeddings"] - offset)
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_layer_norm_eps(cfg.get("norm_eps" if modern else "layer_norm_eps", 1e-12))
    w.add_causal_attention(False)
    pooling_file = hf_dir / "1_Pooling" / "config.json"
    classifier = cfg["architectures"][0].endswith("ForSequenceClassification")
    if classifier:
        w.add_pooling_type(gguf.PoolingType.RANK)
        id2label = cfg.get("id2label") or {}
        labels = [id2label.get(str(i), f"LABEL_{i}") for i in range(len(id2label) or cfg.get("num_labels", 1))]
        if any(label != f"LABEL_{i}" for i, label in enumerate(labels)):
            w.add_classifier_output_labels(labels)
    elif pooling_file.is_file():
        pooling = json.loads(pooling_file.read_text())
        w.add_pooling_type(gguf.PoolingType.MEAN if pooling.get("pooling_mode_mean_tokens") else gguf.PoolingType.CLS)
    w.add_token_type_count(cfg.get("type_vocab_size", 2))
    if modern:
        write_bpe_vocab(w, tok)
    elif tok["model"]["type"] == "Unigram":
        _write_unigram_vocab(w, tok, cfg["vocab_size"])
    else:
        _write_wordpiece_vocab(w, tok)
    weights = load_file(str(hf_dir / "model.safetensors"))
    for name, t in (_nomic_as_bert(weights) if nomic else _modernbert_as_bert(weights) if modern else weights).items():
        name = name.removeprefix("bert.").removeprefix("roberta.")
        stem, kind = name.rsplit(".", 1)
        if stem in _GGUF_TOP:
            ours = f"{_GGUF_TOP[stem]}.{kind}"
        elif classifier and stem in _GGUF_HEAD:
            ours = f"{_GGUF_HEAD[stem]}.{kind}"
        elif stem.startswith("encoder.layer."):
            _, _, i, rest = stem.split(".", 3)
            if rest not in _GGUF_LAYER:
                continue
            ours = f"blk.{i}.{_GGUF_LAYER[rest]}.{kind}"
        else:
            continue  # the pooler, position_ids: not written by the converter for an embedder
        values = t.float().numpy()
        if ours == "position_embd.weight":
            values = values[offset:]
        if values.ndim == 2 and qtype != "F32" and not ours.startswith(("token_types", "position_embd", "cls")):
            q = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(ours, gguf.quants.quantize(values, q), raw_dtype=q)
        else:
            w.add_tensor(ours, np.ascontiguousarray(values, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _nomic_as_bert(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Nomic BERT's checkpoint names (transformers saves them as nomic-embed-text ships them: `emb_ln`,
    `encoder.layers.N.attn.Wqkv`, `mlp.fc11` the up and `fc12` the gate projection) under the encoder's names,
    which write_bert_gguf maps to llama.cpp's (`attn_qkv`, `ffn_gate`, ...)."""
    from backend.encoder_weights import NOMIC_NAMES, nomic_layer_name
    return {NOMIC_NAMES.get(name) or nomic_layer_name(name) or name: t for name, t in weights.items()}


def _modernbert_as_bert(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from backend.encoder_weights import modernbert_name
    return {modernbert_name(name) or name: t for name, t in weights.items()}


MODERNBERT_SPECIALS = {"bos": "[CLS]", "eos": "[SEP]", "sep": "[SEP]", "pad": "[PAD]", "unk": "[UNK]", "mask": "[MASK]"}


def write_bpe_vocab(w, tok: dict, pre: str = "modern-bert",  # type: ignore[no-untyped-def]
                    specials: dict[str, str] = MODERNBERT_SPECIALS) -> None:
    """A tokenizer.json's byte-level BPE as `gpt2` under llama.cpp's pre-tokenizer `pre`, its special tokens'
    ids (ModernBERT's by default: [CLS] as BOS and [SEP] as EOS), BOS and EOS added."""
    import gguf
    vocab: dict[str, int] = tok["model"]["vocab"]
    control = {a["content"] for a in tok.get("added_tokens", []) if a.get("special")}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in control else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    for add, token in specials.items():
        getattr(w, f"add_{add}_token_id")(vocab[token])
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)


def _write_wordpiece_vocab(w, tok: dict) -> None:  # type: ignore[no-untyped-def]
    import gguf
    vocab: dict[str, int] = tok["model"]["vocab"]
    control = {a["content"] for a in tok.get("added_tokens", []) if a.get("special")}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("bert")
    w.add_token_list([t if t in control else t[2:] if t.startswith("##") else "\u2581" + t for t in tokens])
    w.add_token_types([gguf.TokenType.CONTROL if t in control else gguf.TokenType.NORMAL for t in tokens])
    w.add_bos_token_id(vocab["[CLS]"])
    w.add_sep_token_id(vocab["[SEP]"])
    w.add_unk_token_id(vocab["[UNK]"])
    w.add_pad_token_id(vocab["[PAD]"])
    # What the converter reads from "[CLS] $A [SEP]" and "[CLS] $A [SEP] $B [SEP]": [SEP] as the EOS too, both
    # added, no separator of its own between a pair's texts.
    w.add_eos_token_id(vocab["[SEP]"])
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)
    w.add_add_sep_token(False)


def _write_unigram_vocab(w, tok: dict, rows: int) -> None:  # type: ignore[no-untyped-def]
    import base64

    import gguf
    pieces: list[list] = tok["model"]["vocab"]
    ids = {p[0]: i for i, p in enumerate(pieces)}
    control = {a["content"] for a in tok.get("added_tokens", []) if a.get("special")} - {"<unk>"}
    types = [gguf.TokenType.UNKNOWN if t == "<unk>" else gguf.TokenType.CONTROL if t in control else
             gguf.TokenType.NORMAL for t, _ in pieces]
    padding = range(len(pieces), max(rows, len(pieces)))
    w.add_tokenizer_model("t5")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in pieces] + [f"[PAD{i}]" for i in padding])
    w.add_token_scores([float(s) for _, s in pieces] + [-10000.0] * len(padding))
    w.add_token_types(types + [gguf.TokenType.UNUSED] * len(padding))
    w.add_add_space_prefix(True)
    w.add_remove_extra_whitespaces(True)
    w.add_precompiled_charsmap(base64.b64decode(tok["normalizer"]["precompiled_charsmap"]))
    for add, value in (("bos", ids["<s>"]), ("eos", ids["</s>"]), ("sep", ids["</s>"]),
                       ("unk", ids["<unk>"]), ("pad", ids["<pad>"]), ("mask", ids["<mask>"])):
        getattr(w, f"add_{add}_token_id")(value)
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)
    w.add_add_sep_token(True)
