"""An encoder checkpoint's tensors under the names backend/encoder.py reads (Hugging Face BERT's: embeddings.*,
encoder.layer.N.{qkv, attention.output.dense, attention.output.LayerNorm, intermediate.dense, output.dense,
output.LayerNorm}, pooler.dense, classifier, ...): from a safetensors directory of each family's own names (BERT,
XLM-R, Nomic BERT, ModernBERT, GTE), or a GGUF of llama.cpp's `bert` / `nomic-bert` / `modern-bert` (dequantized);
q/k/v fused into one matrix, a GLU's gate and up into one [gate; up], missing biases as zeros."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from backend.checkpoint import read_gguf_floats
from kvyard.model_path import ModelFileError

_PREFIXES = ("bert.", "roberta.", "distilbert.", "mpnet.", "model.", "gte.", "new.")
LAYER_LINEARS = ("qkv", "attention.output.dense", "intermediate.dense", "output.dense")


def load_encoder_weights(path: Path, dtype: torch.dtype, device: torch.device, gguf_file: bool) -> dict[str, torch.Tensor]:
    return (_load_gguf if gguf_file else _load)(path, dtype, device)


# llama.cpp's `bert` tensor names → Hugging Face BERT's (a layer's part after `blk.N.`).
_GGUF_TOP = {"token_embd": "embeddings.word_embeddings", "token_types": "embeddings.token_type_embeddings",
             "position_embd": "embeddings.position_embeddings", "token_embd_norm": "embeddings.LayerNorm",
             "cls": "pooler.dense", "cls.output": "classifier",  # a cross-encoder's head (pooling type rank)
             "output_norm": "final_norm"}  # ModernBERT's
_GGUF_LAYER = {"attn_q": "attention.self.query", "attn_k": "attention.self.key", "attn_v": "attention.self.value",
               "attn_output": "attention.output.dense", "attn_output_norm": "attention.output.LayerNorm",
               "ffn_up": "intermediate.dense", "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm",
               # nomic-bert's: q, k and v in one matrix; SwiGLU's gate beside ffn_up (joined as [gate; up] below)
               "attn_qkv": "qkv", "ffn_gate": "intermediate.gate",
               "attn_norm": "attention.norm", "ffn_norm": "ffn.norm"}  # modern-bert's pre-norms


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """A BERT (or Nomic BERT) GGUF's tensors, dequantized (an encoder's linears run as float GEMMs here), under
    Hugging Face's names (a cross-encoder's `cls` / `cls.output`: BERT's pooler and classifier); then as _load. A
    tensor we have no place for is refused by name."""
    raw: dict[str, torch.Tensor] = {}
    for name, t in read_gguf_floats(path).items():
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_LAYER:
            ours = f"encoder.layer.{parts[1]}.{_GGUF_LAYER[parts[2]]}.{parts[3]}"
        elif ".".join(parts[:-1]) in _GGUF_TOP:
            ours = f"{_GGUF_TOP['.'.join(parts[:-1])]}.{parts[-1]}"
        else:
            raise ModelFileError(f"{path}: tensor {name} is not part of a BERT encoder this server runs")
        raw[ours] = t
    return _fuse_and_place(raw, dtype, device)


def _load(path: Path, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor under our names, q/k/v fused into one [3D, D] matrix per layer."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{path}: no *.safetensors files")
    raw: dict[str, torch.Tensor] = {}
    for file in files:
        for name, t in load_file(str(file)).items():
            for prefix in _PREFIXES:
                if name.startswith(prefix):
                    name = name[len(prefix):]
                    break
            raw[NOMIC_NAMES.get(name) or nomic_layer_name(name) or modernbert_name(name) or gte_name(name)
                or _layer_name(name, "transformer.layer.", _DISTILBERT_LAYER) or _layer_name(name, "encoder.layer.",
                                                                                              _MPNET_LAYER) or name] = t
    for head in ("sparse_linear", "colbert_linear"):  # BGE-M3 ships these as torch state dicts
        if (path / f"{head}.pt").is_file():
            for key, t in torch.load(path / f"{head}.pt", map_location="cpu", weights_only=True).items():
                raw[f"{head}.{key}"] = t
    return _fuse_and_place(raw, dtype, device)


# Nomic BERT's checkpoint names (as nomic-embed-text ships them, and as transformers saves its NomicBertModel):
# `fc11` is the up and `fc12` the gate projection.
NOMIC_NAMES = {"emb_ln.weight": "embeddings.LayerNorm.weight", "emb_ln.bias": "embeddings.LayerNorm.bias"}
NOMIC_LAYER = {"attn.Wqkv": "qkv", "attn.out_proj": "attention.output.dense", "norm1": "attention.output.LayerNorm",
                "mlp.fc11": "intermediate.dense", "mlp.fc12": "intermediate.gate", "mlp.fc2": "output.dense",
                "norm2": "output.LayerNorm"}


def _layer_name(name: str, prefix: str, parts: dict[str, str]) -> str | None:
    """<prefix>N.<part>.<kind> → encoder.layer.N.<ours>.<kind> for a part in `parts`, else None."""
    if not name.startswith(prefix):
        return None
    i, rest = name[len(prefix):].split(".", 1)
    part, kind = rest.rsplit(".", 1)
    return f"encoder.layer.{i}.{parts[part]}.{kind}" if part in parts else None


def nomic_layer_name(name: str) -> str | None:
    """encoder.layers.N.<part>.<kind> → encoder.layer.N.<ours>.<kind>, or None for any other name."""
    return _layer_name(name, "encoder.layers.", NOMIC_LAYER)


# ModernBERT's names (after the `model.` prefix): its pre-norms as `attention.norm` / `ffn.norm`.
_MODERNBERT_LAYER = {"attn_norm": "attention.norm", "attn.Wqkv": "qkv", "attn.Wo": "attention.output.dense",
                     "mlp_norm": "ffn.norm", "mlp.Wi": "intermediate.dense", "mlp.Wo": "output.dense"}
_MODERNBERT_TOP = {"embeddings.tok_embeddings": "embeddings.word_embeddings", "embeddings.norm": "embeddings.LayerNorm"}


def modernbert_name(name: str) -> str | None:
    """layers.N.<part>.<kind> and the embeddings' names → ours, or None for any other name."""
    stem, kind = name.rsplit(".", 1)
    if stem in _MODERNBERT_TOP:
        return f"{_MODERNBERT_TOP[stem]}.{kind}"
    if not name.startswith("layers."):
        return None
    _, i, part = stem.split(".", 2)
    return f"encoder.layer.{i}.{_MODERNBERT_LAYER[part]}.{kind}" if part in _MODERNBERT_LAYER else None


# GTE's names (gte-multilingual, gte-*-en-v1.5: Alibaba's `new` checkpoints, and transformers' GteModel, which
# saves in the same names): q/k/v in one matrix, [up; gate] in one.
_GTE_LAYER = {"attention.qkv_proj": "qkv", "attention.o_proj": "attention.output.dense",
              "attn_ln": "attention.output.LayerNorm", "mlp.up_gate_proj": "intermediate.up_gate",
              "mlp.down_proj": "output.dense", "mlp_ln": "output.LayerNorm"}


def gte_name(name: str) -> str | None:
    """encoder.layer.N.<GTE's part>.<kind> → ours, or None for any other name."""
    return _layer_name(name, "encoder.layer.", _GTE_LAYER)


# DistilBERT's names (after the `distilbert.` prefix of its classifier): BERT's layer under other names.
_DISTILBERT_LAYER = {"attention.q_lin": "attention.self.query", "attention.k_lin": "attention.self.key",
                     "attention.v_lin": "attention.self.value", "attention.out_lin": "attention.output.dense",
                     "sa_layer_norm": "attention.output.LayerNorm", "ffn.lin1": "intermediate.dense",
                     "ffn.lin2": "output.dense", "output_layer_norm": "output.LayerNorm"}


# MPNet's (after the `mpnet.` prefix of its classifier): q/k/v/o under `attention.attn`, the attention's norm.
_MPNET_LAYER = {"attention.attn.q": "attention.self.query", "attention.attn.k": "attention.self.key",
                "attention.attn.v": "attention.self.value", "attention.attn.o": "attention.output.dense",
                "attention.LayerNorm": "attention.output.LayerNorm"}


def _fuse_and_place(raw: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    i = 0
    while f"encoder.layer.{i}.attention.self.query.weight" in raw:
        p = f"encoder.layer.{i}."
        for kind in ("weight", "bias"):
            raw[p + "qkv." + kind] = torch.cat([raw.pop(f"{p}attention.self.{n}.{kind}")
                                                for n in ("query", "key", "value")])
        i += 1
    i = 0
    while f"encoder.layer.{i}.qkv.weight" in raw:
        p = f"encoder.layer.{i}."
        if p + "intermediate.up_gate.weight" in raw:  # GTE's [up; gate]
            up, gate = raw.pop(p + "intermediate.up_gate.weight").chunk(2)
            raw[p + "intermediate.gate.weight"], raw[p + "intermediate.dense.weight"] = gate, up
        if p + "intermediate.gate.weight" in raw:  # SwiGLU: [gate; up], as _act splits it
            raw[p + "intermediate.dense.weight"] = torch.cat([raw.pop(p + "intermediate.gate.weight"),
                                                              raw[p + "intermediate.dense.weight"]])
        for name in LAYER_LINEARS:  # Nomic BERT and ModernBERT have no biases: zeros, so every linear is one addmm
            if p + name + ".weight" in raw and p + name + ".bias" not in raw:
                raw[p + name + ".bias"] = torch.zeros(raw[p + name + ".weight"].shape[0])
        i += 1
    for name in [n for n in raw if n.endswith("norm.weight") or n.endswith("LayerNorm.weight")]:
        raw.setdefault(name.removesuffix("weight") + "bias", torch.zeros_like(raw[name]))  # ModernBERT's norms
    raw.pop("embeddings.position_ids", None)
    return {n: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype).contiguous()
            for n, t in raw.items()}
