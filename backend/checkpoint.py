"""Checkpoint readers for backend/weights.py: a GGUF file or a Hugging Face safetensors directory, each
giving its tensors under our source names (embed, layers.3.q, ...) and reading rows [a, b) of one, as
floats or as GGUF blocks, with pread (no memory map)."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from backend.kquant import K_FILE_KIND
from backend.quant import K_KINDS, QK, QuantWeight, blocks_from_gguf, k_blocks_from_gguf, q8_0_from_float, serving_kind
from kvyard.gguf_meta import GGUFTensorInfo, read_gguf_index, read_tensor_bytes
from kvyard.model_config import ModelConfig
from kvyard.model_path import ModelFileError, is_gguf


class Source:
    """A checkpoint's tensors under our source names (embed, layers.3.q, layers.3.q_bias, ...)."""

    def names(self) -> list[str]: ...
    def original(self, name: str) -> str: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def nbytes(self, name: str) -> int: ...
    def block_kind(self, name: str) -> str | None:
        """The GGUF block kind it would be served in (None: it cannot be kept in blocks)."""
        return None
    def gguf_type(self, name: str) -> str | None:
        """Its GGUF tensor type ("q4_k", "f16", ...); None for other checkpoints."""
        return None
    def read_float(self, name: str, a: int, b: int) -> torch.Tensor:
        """Rows [a, b) as a float tensor [b - a, K] ([b - a] for a vector), in the checkpoint's precision."""
        ...
    def read_blocks(self, name: str, a: int, b: int, kind: str) -> QuantWeight: ...
    def __enter__(self) -> Source:
        return self
    def __exit__(self, *exc: object) -> None:
        self.close()
    def close(self) -> None: ...


_GGUF_LAYER_NAMES = {
    "attn_norm": "attn_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
    "ffn_norm": "ffn_norm", "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down",
    "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",  # Qwen3
}
_GGUF_TOP_NAMES = {"token_embd": "embed", "output_norm": "norm", "output": "lm_head"}


class GGUFSource(Source):
    def __init__(self, path: Path, config: ModelConfig) -> None:
        index = read_gguf_index(path)
        self.path = path
        self.fd = os.open(str(path), os.O_RDONLY)
        self.infos: dict[str, GGUFTensorInfo] = {}
        self.perm: dict[str, np.ndarray] = {}
        # llama.cpp's converter interleaves each head's q/k rows for the llama architecture (so RoPE pairs
        # (2i, 2i+1) are adjacent); we use the Hugging Face pairing (i, i + d/2) and undo it. Its qwen2 and
        # qwen3 conversions keep the Hugging Face order (NeoX-style RoPE there).
        interleaved = config.architecture not in ("qwen2", "qwen3")
        for tname, info in index.tensors.items():
            parts = tname.split(".")
            if parts[0] == "blk":
                kind = _GGUF_LAYER_NAMES.get(parts[2]) if len(parts) == 4 else None
                if kind is None or parts[3] not in ("weight", "bias"):
                    raise ModelFileError(f"{path}: unexpected tensor {tname}")
                name = f"layers.{parts[1]}.{kind}" + ("_bias" if parts[3] == "bias" else "")
                heads = {"q": config.num_heads, "k": config.num_kv_heads}.get(kind, 0)
                if heads and interleaved:
                    self.perm[name] = _interleave_order(info.shape[0], heads)
            elif tname == "rope_freqs.weight":
                continue  # read by the config loader (Llama 3.1's RoPE scaling)
            elif tname == "cls.output.weight":  # a rank GGUF's head (Qwen3-Reranker: the LM head's yes and no rows)
                name = "score"
            elif parts[0] in _GGUF_TOP_NAMES and tname == parts[0] + ".weight":
                name = _GGUF_TOP_NAMES[parts[0]]
            else:
                raise ModelFileError(f"{path}: unexpected tensor {tname}")
            self.infos[name] = info

    def names(self) -> list[str]:
        return list(self.infos)

    def original(self, name: str) -> str:
        return self.infos[name].name

    def shape(self, name: str) -> tuple[int, ...]:
        return self.infos[name].shape

    def nbytes(self, name: str) -> int:
        return self.infos[name].nbytes

    def block_kind(self, name: str) -> str | None:
        info = self.infos[name]
        if len(info.shape) != 2 or info.shape[1] % QK:
            return None
        return serving_kind(info.qtype.name.lower())

    def gguf_type(self, name: str) -> str | None:
        return self.infos[name].qtype.name.lower()

    def _rows(self, name: str, a: int, b: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The raw bytes of the source rows behind output rows [a, b): [rows, row bytes] uint8, and the
        index of each output row among them (None: in order)."""
        info = self.infos[name]
        row_bytes = info.nbytes // info.shape[0]
        order = self.perm.get(name)
        lo, hi, pick = a, b, None
        if order is not None:
            src = order[a:b]
            lo, hi = int(src.min()), int(src.max()) + 1
            pick = src - lo
        raw = read_tensor_bytes(self.fd, info, lo * row_bytes, (hi - lo) * row_bytes)
        return raw.reshape(hi - lo, row_bytes), pick

    def read_float(self, name: str, a: int, b: int) -> torch.Tensor:
        info = self.infos[name]
        raw, pick = self._rows(name, a, b)
        values = np.asarray(gguf.quants.dequantize(raw, info.qtype), dtype=np.float32)
        if len(info.shape) == 1:
            return torch.from_numpy(np.ascontiguousarray(values.reshape(-1)))
        return torch.from_numpy(np.ascontiguousarray(values if pick is None else values[pick]))

    def read_blocks(self, name: str, a: int, b: int, kind: str) -> QuantWeight:
        info = self.infos[name]
        own = info.qtype.name.lower()
        if kind in K_KINDS:  # served with the file's numbers (n16 layout)
            assert own == K_FILE_KIND.get(kind, kind), (own, kind)
            raw, pick = self._rows(name, a, b)
            blocks = k_blocks_from_gguf(own, raw, info.shape[1], served=kind)
            return blocks if pick is None else blocks.rows(pick)
        if serving_kind(own) == kind and (own in ("q4_1", "q8_0", "q4_0", "q4_k")):
            raw, pick = self._rows(name, a, b)
            blocks = blocks_from_gguf(own, raw, info.shape[1])
            return blocks if pick is None else blocks.rows(pick)
        assert kind == "q8_0", kind
        return q8_0_from_float(self.read_float(name, a, b))

    def close(self) -> None:
        os.close(self.fd)


def _interleave_order(rows: int, heads: int) -> np.ndarray:
    """For output row r (Hugging Face order), the GGUF row holding it: within each head of d rows, row
    i < d/2 is stored at 2i and row d/2 + i at 2i + 1."""
    d = rows // heads
    return np.arange(rows).reshape(heads, d // 2, 2).swapaxes(1, 2).reshape(rows)


_HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
    "self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias", "self_attn.o_proj.weight": "o",
    "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",  # Qwen3
}
# `score`: a *ForSequenceClassification's head. A base model saved on its own (sentence-transformers saves
# Qwen3-Embedding so) has the names without "model.".
_HF_TOP_NAMES = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head",
                 "embed_tokens.weight": "embed", "norm.weight": "norm", "score.weight": "score"}
_SAFETENSORS_DTYPES: dict[str, tuple[np.dtype[Any], torch.dtype]] = {
    "F32": (np.dtype(np.float32), torch.float32), "F16": (np.dtype(np.float16), torch.float16),
    "BF16": (np.dtype(np.uint16), torch.bfloat16),  # numpy has no bfloat16: read the bits, view in torch
}


@dataclass(frozen=True)
class _SafeTensor:
    file: Path
    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file
    nbytes: int


class SafetensorsSource(Source):
    """A Hugging Face directory: every *.safetensors file (the shards model.safetensors.index.json lists,
    when there is one), read tensor by tensor and rows at a time from each file's header offsets."""

    def __init__(self, path: Path) -> None:
        index_file = path / "model.safetensors.index.json"
        if index_file.is_file():
            weight_map = json.loads(index_file.read_text())["weight_map"]
            files = sorted({path / f for f in weight_map.values()})
            absent = [f.name for f in files if not f.is_file()]
            if absent:
                raise ModelFileError(f"{path}: shards listed in {index_file.name} are missing: {', '.join(absent)}")
        else:
            files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelFileError(f"{path}: no *.safetensors files")
        self.tensors: dict[str, _SafeTensor] = {}
        self.fds: dict[Path, int] = {}
        for file in files:
            for key, t in _safetensors_header(file).items():
                name = _hf_name(key)
                if name is None:
                    if key.endswith("rotary_emb.inv_freq"):
                        continue  # a buffer old checkpoints saved; recomputed from the config
                    raise ModelFileError(f"{file}: unexpected tensor {key}")
                if t.dtype not in _SAFETENSORS_DTYPES:
                    raise ModelFileError(f"{file}: tensor {key} has dtype {t.dtype} (supported: F32, F16, BF16)")
                self.tensors[name] = t
            self.fds[file] = os.open(str(file), os.O_RDONLY)

    def names(self) -> list[str]:
        return list(self.tensors)

    def original(self, name: str) -> str:
        return self.tensors[name].key

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def nbytes(self, name: str) -> int:
        return self.tensors[name].nbytes

    def read_float(self, name: str, a: int, b: int) -> torch.Tensor:
        t = self.tensors[name]
        np_dtype, torch_dtype = _SAFETENSORS_DTYPES[t.dtype]
        row = math.prod(t.shape[1:]) * np_dtype.itemsize
        info = GGUFTensorInfo(t.key, gguf.GGMLQuantizationType.F32, t.shape, t.offset, t.nbytes)
        raw = read_tensor_bytes(self.fds[t.file], info, a * row, (b - a) * row)
        values = torch.from_numpy(raw.view(np_dtype)).view(torch_dtype)
        return values.reshape(b - a, *t.shape[1:]) if len(t.shape) > 1 else values

    def read_blocks(self, name: str, a: int, b: int, kind: str) -> QuantWeight:
        raise AssertionError("a safetensors checkpoint is served dense")

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def _safetensors_header(file: Path) -> dict[str, _SafeTensor]:
    """The format: 8 bytes little-endian header length, a JSON header {name: {dtype, shape, data_offsets}},
    then the data (offsets relative to its start)."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size <= 0 or size > 100 << 20:
            raise ModelFileError(f"{file}: not a safetensors file")
        header = json.loads(f.read(size))
    out = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        begin, end = meta["data_offsets"]
        out[key] = _SafeTensor(file, key, meta["dtype"], tuple(meta["shape"]), 8 + size + begin, end - begin)
    return out


# A LLaVA or Qwen-VL checkpoint's language model under a prefix (transformers 4 and 5 spell it differently),
# and its image side, which backend/vision_tower.py and backend/qwen_vl_tower.py read as vision.* and projector.*.
_HF_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                ("language_model.lm_head.", "lm_head."), ("model.vision_tower.vision_model.", "vision."),
                ("model.vision_tower.", "vision."), ("vision_tower.vision_model.", "vision."), ("vision_tower.", "vision."),
                ("model.multi_modal_projector.", "projector."), ("multi_modal_projector.", "projector."),
                ("model.visual.", "vision."), ("visual.", "vision."))


def _hf_name(key: str) -> str | None:
    for prefix, ours in _HF_PREFIXES:
        if key.startswith(prefix):
            key = ours + key[len(prefix):]
            if ours in ("vision.", "projector."):
                return key
            break
    if key in _HF_TOP_NAMES:
        return _HF_TOP_NAMES[key]
    if key.startswith(("model.layers.", "layers.")):
        idx, rest = key.removeprefix("model.").split(".", 2)[1:]
        kind = _HF_LAYER_NAMES.get(rest)
        return None if kind is None else f"layers.{idx}.{kind}"
    return None


def open_checkpoint(path: Path, config: ModelConfig) -> Source:
    return GGUFSource(path, config) if is_gguf(path) else SafetensorsSource(path)


def read_gguf_floats(path: Path, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """A GGUF's tensors (those in `names`; all by default) dequantized whole to float32, under the file's
    names, in PyTorch order: for the small models read at once (encoders, their heads)."""
    index = read_gguf_index(path)
    out: dict[str, torch.Tensor] = {}
    fd = os.open(str(path), os.O_RDONLY)
    try:
        for name, info in index.tensors.items():
            if names is None or name in names:
                values = gguf.quants.dequantize(read_tensor_bytes(fd, info), info.qtype)
                out[name] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(info.shape)
    finally:
        os.close(fd)
    return out
