"""A sentence-transformers checkpoint's own files (modules.json, 1_Pooling/config.json, sentence_bert_config.json,
config_sentence_transformers.json, each Dense module's folder): how it pools, the dense layers after the pooling,
whether it normalises, its prompts and longest input, as kvyard/pooling_model.py builds a PoolingSpec from them.
No torch here: the frontend reads them too."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvyard.model_path import ModelFileError

POOLING_METHODS = ("mean", "cls", "max", "mean_sqrt_len", "last")
# A Dense module's activation as its config.json names the torch class → ours (backend/st_dense.py runs them).
DENSE_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity", "torch.nn.modules.activation.Tanh": "tanh",
                     "torch.nn.modules.activation.ReLU": "relu", "torch.nn.modules.activation.GELU": "gelu",
                     "torch.nn.modules.activation.SiLU": "silu", "torch.nn.modules.activation.Sigmoid": "sigmoid"}
DENSE_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


@dataclass(frozen=True)
class DenseModule:
    """A sentence-transformers Dense module after the pooling (LaBSE's tanh projection, stella's and
    EmbeddingGemma's projections): activation(x W^T + b), plus x (or x R^T) with use_residual."""
    weights: Path        # its model.safetensors or pytorch_model.bin: linear.weight/.bias (and residual.weight)
    in_features: int
    out_features: int
    activation: str      # one of DENSE_ACTIVATIONS' values
    residual: bool = False
    tensor: str = ""     # set: `weights` is a GGUF holding the matrix under this name (llama.cpp's dense_2, no bias)


def sentence_transformers_files(path: Path, positions: int) -> dict[str, Any]:
    """Pooling, normalisation, prompts and max_seq_length from the sentence-transformers files (absent:
    CLS pooling, no normalisation, BGE's habit). A module we cannot honour is refused by name."""
    out: dict[str, Any] = {"dense": []}
    modules_file = path / "modules.json"
    modules = read_json(modules_file) if modules_file.is_file() else []
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        where = path / module.get("path", "")
        if out.get("normalize") and kind != "Normalize":
            raise ModelFileError(f"{path}: sentence-transformers module {kind} after Normalize is not supported")
        if kind == "StaticEmbedding" and not out.get("static"):  # token vectors averaged: no transformer
            out["static"], out["pooling"] = where, "mean"
        elif kind == "Transformer":
            bert_cfg = where / "sentence_bert_config.json"
            if bert_cfg.is_file():
                max_seq = read_json(bert_cfg).get("max_seq_length")
                if max_seq:
                    out["max_seq_length"] = min(int(max_seq), positions)
        elif kind == "Pooling":
            out["pooling"] = _pooling_mode(read_json(where / "config.json"), where)
        elif kind == "Dense" and "pooling" in out:
            out["dense"].append(_dense(where))
        elif kind == "Normalize":
            out["normalize"] = True
        else:
            raise ModelFileError(f"{path}: sentence-transformers module {module.get('type')!r} is not supported "
                                 "(supported: Transformer, Pooling, StaticEmbedding, Dense after either, Normalize)")
    st_file = path / "config_sentence_transformers.json"
    if st_file.is_file():
        st = read_json(st_file)
        out["prompts"] = {str(k): str(v) for k, v in (st.get("prompts") or {}).items()}
        out["default_prompt_name"] = st.get("default_prompt_name") or None
    return out


def static_embedding(path: Path) -> Path | None:
    """The folder of a sentence-transformers StaticEmbedding module when it is the checkpoint's first module
    (static-retrieval-mrl-en-v1, static-similarity-mrl-multilingual-v1: no config.json at the top), else None."""
    modules_file = path / "modules.json"
    if path.is_dir() and modules_file.is_file():
        modules = read_json(modules_file)
        if modules and str(modules[0].get("type", "")).endswith("StaticEmbedding"):
            return path / modules[0].get("path", "")
    return None


def static_embedding_shape(folder: Path) -> tuple[int, int]:
    """[vocabulary, width] of a StaticEmbedding's `embedding.weight`, or of a model2vec file's `embeddings` (rows
    picked per token id by its `mapping` when it has one), from the model.safetensors header (no torch here);
    another layout is refused by name."""
    file = folder / "model.safetensors"
    try:
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"cannot read {file}: {exc}") from exc
    shape = (header.get("embedding.weight") or header.get("embeddings") or {}).get("shape")
    if shape and len(shape) == 2 and "embedding.weight" not in header and "mapping" in header:
        shape = [header["mapping"]["shape"][0], shape[1]]
    if not shape or len(shape) != 2:
        raise ModelFileError(f"{file}: a StaticEmbedding needs its `embedding.weight` (or model2vec's `embeddings`) "
                             f"(found {sorted(k for k in header if k != '__metadata__')[:3]})")
    return int(shape[0]), int(shape[1])


def _dense(where: Path) -> DenseModule:
    """A Dense module's folder → its facts; one that reads token embeddings, or whose activation or weights we
    cannot honour, is refused naming the folder."""
    cfg = read_json(where / "config.json")
    act = cfg.get("activation_function", "torch.nn.modules.activation.Tanh")  # sentence-transformers' default
    if act not in DENSE_ACTIVATIONS:
        raise ModelFileError(f"{where}: Dense activation {act!r} is not supported "
                             f"(supported: {', '.join(n.rsplit('.', 1)[-1] for n in DENSE_ACTIVATIONS)})")
    for key in ("module_input_name", "module_output_name"):
        if cfg.get(key, "sentence_embedding") != "sentence_embedding":
            raise ModelFileError(f"{where}: a Dense module with {key} {cfg[key]!r} is not supported")
    weights = next((where / f for f in DENSE_WEIGHT_FILES if (where / f).is_file()), None)
    if weights is None:
        raise ModelFileError(f"{where}: the Dense module has no {' or '.join(DENSE_WEIGHT_FILES)}")
    return DenseModule(weights, int(cfg["in_features"]), int(cfg["out_features"]), DENSE_ACTIVATIONS[act],
                       bool(cfg.get("use_residual", False)))


def _pooling_mode(cfg: dict[str, Any], where: Path) -> str:
    if cfg.get("pooling_mode"):
        mode = {"mean_sqrt_len_tokens": "mean_sqrt_len", "lasttoken": "last"}.get(cfg["pooling_mode"],
                                                                                cfg["pooling_mode"])
        if mode in POOLING_METHODS:
            return mode
    modes = [name for key, name in (("pooling_mode_cls_token", "cls"), ("pooling_mode_mean_tokens", "mean"),
                                    ("pooling_mode_max_tokens", "max"),
                                    ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len"),
                                    ("pooling_mode_lasttoken", "last")) if cfg.get(key)]
    for key in ("pooling_mode_weightedmean_tokens",):
        if cfg.get(key):
            raise ModelFileError(f"{where}: {key} is not supported")
    if len(modes) != 1:
        raise ModelFileError(f"{where}: exactly one pooling mode must be on (found {modes or 'none'})")
    return modes[0]


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelFileError(f"cannot read {path}: {exc}") from exc
