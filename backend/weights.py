"""Checkpoint → tensors named the way backend/model.py wants them (GGUF or Hugging Face safetensors).

Our tensor names: embed, norm, lm_head (absent when tied), and per layer i: layers.{i}.attn_norm, .qkv
(+ .qkv_bias), .o, .ffn_norm, .gate_up, .down — all [out, in].

Loading streams: every matrix is allocated once in its serving format and filled a few MB of rows at a
time, read with pread from the file (no memory map, whose touched pages would count as resident), so
the peak stays near the served weights however large the model (backend/main.py logs it;
benchmarks/load_weights.py measures it per format). Serving formats:
- keep_blocks (the C++ kernels): GGUF blocks. Q4_1 and Q8_0 stay as they are; Q4_0 and Q4_K become Q4_1
  (the same weights; Q4_K's scale products rounded to float16); every other type (F32, F16, BF16, Q5_*,
  Q6_K, Q2_K, Q3_K, IQ*...) is requantized to Q8_0 from its exact dequantization, rows at a time. A fused
  matrix whose parts would differ (Q4_K_M files mix Q4_K and Q6_K) is Q8_0 throughout.
- otherwise dense in the model's dtype (dequantized or cast rows at a time, straight onto the device)."""
from __future__ import annotations

import ctypes
import gc
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from backend.quant import QK, QuantWeight, blocks_from_gguf, q8_0_from_float, serving_kind
from kvyard.gguf_meta import GGUFTensorInfo, read_gguf_index, read_tensor_bytes
from kvyard.model_config import ModelConfig
from kvyard.model_path import ModelFileError, is_gguf

log = logging.getLogger("kvyard.weights")

Tensor = torch.Tensor | QuantWeight
CHUNK_ELEMENTS = 1 << 20  # weights converted per step: bounds the temporaries (float32: 4 MB)
# Into GGUF blocks, a quarter of that: requantizing a chunk to Q8_0 holds ~5 float32 copies of it, ~18 MB
# at 1M weights, which against 4-bit weights is 1.48x a 37 MB model's (benchmarks/load_weights.py).
BLOCK_CHUNK_ELEMENTS = CHUNK_ELEMENTS // 4


def load_weights(path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 keep_blocks: bool = False, block_layout: str = "rows", progress: bool = True) -> dict[str, Tensor]:
    """block_layout: how kept blocks are laid out, "rows" (float32-activation kernels) or "n16" (the
    int16-activation kernels; matrices whose row count is no multiple of 16 stay "rows")."""
    start = time.monotonic()
    with _open_checkpoint(path, config) as source:
        if keep_blocks and not isinstance(source, _GGUF):
            raise ValueError("GGUF blocks (keep_blocks) need a .gguf checkpoint")
        plan = _plan(source, config)
        bar = _Progress(sum(source.nbytes(n) for parts in plan.values() for n in parts), str(path),
                        enabled=progress)
        target = _Target(dtype, device, keep_blocks, block_layout)
        out: dict[str, Tensor] = {}
        for name, parts in plan.items():
            out[name] = _load_one(source, parts, target, bar)
        bar.close()
    _give_back_freed_memory()
    n_bytes = sum(t.nbytes() if isinstance(t, QuantWeight) else t.numel() * t.element_size() for t in out.values())
    kinds = sorted({t.kind for t in out.values() if isinstance(t, QuantWeight)})
    kept = sum(isinstance(t, QuantWeight) for t in out.values())
    log.info("loaded %d tensors (%.0f MB; %d in GGUF blocks %s) from %s in %.1f s as %s on %s", len(out),
             n_bytes / 2**20, kept, "/".join(kinds) or "-", path, time.monotonic() - start, dtype, device)
    return out


@dataclass(frozen=True)
class _Target:
    dtype: torch.dtype
    device: torch.device
    keep_blocks: bool
    block_layout: str


def _load_one(source: _Source, parts: list[str], target: _Target, bar: _Progress) -> Tensor:
    shapes = [source.shape(n) for n in parts]
    if len(shapes[0]) == 1:  # norms and biases: small, float32 (biases of fused q/k/v concatenated)
        vec = torch.cat([source.read_float(n, 0, s[0]).reshape(-1) for n, s in zip(parts, shapes)])
        bar.update(sum(source.nbytes(n) for n in parts))
        return vec.to(device=target.device, dtype=target.dtype).contiguous()
    k = shapes[0][1]
    if any(len(s) != 2 or s[1] != k for s in shapes):
        raise ModelFileError(f"tensors {', '.join(parts)} cannot be stacked: shapes {shapes}")
    n = sum(s[0] for s in shapes)
    kinds = [source.block_kind(p) for p in parts]
    if target.keep_blocks and k % QK == 0 and all(kinds):
        kind = "q4_1" if all(kd == "q4_1" for kd in kinds) else "q8_0"
        layout = "n16" if target.block_layout == "n16" and n % 16 == 0 else "rows"
        dest: Tensor = QuantWeight.empty(kind, n, k, layout)
        rows_per_chunk = max(16, BLOCK_CHUNK_ELEMENTS // k // 16 * 16)
        for r0, pieces in _row_chunks(shapes, rows_per_chunk):
            chunk = [source.read_blocks(parts[i], a, b, kind) for i, a, b in pieces]
            dest.write_rows(r0, chunk[0] if len(chunk) == 1 else QuantWeight.cat(chunk))
            bar.update(sum(source.nbytes(parts[i]) * (b - a) // shapes[i][0] for i, a, b in pieces))
        return dest
    dense = torch.empty((n, k), dtype=target.dtype, device=target.device)
    rows_per_chunk = max(1, CHUNK_ELEMENTS // k)
    for r0, pieces in _row_chunks(shapes, rows_per_chunk):
        r = r0
        for i, a, b in pieces:
            _store(dense[r:r + b - a], source.read_float(parts[i], a, b))
            r += b - a
            bar.update(source.nbytes(parts[i]) * (b - a) // shapes[i][0])
    return dense


def _store(dst: torch.Tensor, values: torch.Tensor) -> None:
    """dst[:] = values, converted. On the CPU through numpy where it can: single-threaded copies, which a
    busy 2-core machine runs ~10x faster than torch's OpenMP ones at these sizes."""
    np_types = {torch.float32: np.float32, torch.float16: np.float16}
    if dst.device.type == "cpu" and dst.dtype in np_types and values.dtype in (*np_types, torch.bfloat16):
        if values.dtype == torch.bfloat16:  # bfloat16 is float32's top half
            bits = values.view(torch.int16).numpy().astype(np.uint16).astype(np.uint32) << 16
            src = bits.view(np.float32)
        else:
            src = values.numpy()
        dst.numpy()[...] = src
    else:
        dst.copy_(values)


def _row_chunks(shapes: list[tuple[int, ...]], rows: int) -> list[tuple[int, list[tuple[int, int, int]]]]:
    """The stacked rows of several parts in chunks of `rows`: (first stacked row, [(part, first, end)])."""
    out, offsets = [], np.cumsum([0] + [s[0] for s in shapes])
    total = int(offsets[-1])
    for r0 in range(0, total, rows):
        r1 = min(total, r0 + rows)
        pieces = [(i, max(r0, int(offsets[i])) - int(offsets[i]), min(r1, int(offsets[i + 1])) - int(offsets[i]))
                  for i in range(len(shapes)) if offsets[i] < r1 and offsets[i + 1] > r0]
        out.append((r0, pieces))
    return out


def _plan(source: _Source, config: ModelConfig) -> dict[str, list[str]]:
    """Our tensor → the checkpoint tensors (our source names) stacked into it. Every checkpoint tensor
    must be used: one the model would not read (an o_proj bias, an unknown tensor) is an error."""
    names = set(source.names())
    plan: dict[str, list[str]] = {"embed": ["embed"], "norm": ["norm"]}
    if "lm_head" in names and not config.tie_word_embeddings:
        plan["lm_head"] = ["lm_head"]
    for i in range(config.num_layers):
        p = f"layers.{i}."
        plan[p + "attn_norm"] = [p + "attn_norm"]
        plan[p + "qkv"] = [p + "q", p + "k", p + "v"]
        if config.attention_bias:
            plan[p + "qkv_bias"] = [p + "q_bias", p + "k_bias", p + "v_bias"]
        plan[p + "o"] = [p + "o"]
        plan[p + "ffn_norm"] = [p + "ffn_norm"]
        plan[p + "gate_up"] = [p + "gate", p + "up"]
        plan[p + "down"] = [p + "down"]
    wanted = {n for parts in plan.values() for n in parts}
    missing = sorted(wanted - names)
    if missing:
        raise ModelFileError(f"checkpoint lacks tensor for {missing[0]}" + (f" (and {len(missing) - 1} more)"
                                                                           if len(missing) > 1 else ""))
    unused = sorted(names - wanted - ({"lm_head"} if config.tie_word_embeddings else set()))
    if unused:
        raise ModelFileError(f"checkpoint tensors this model would not use: {', '.join(source.original(n) for n in unused[:5])}")
    return plan


# ---- checkpoint readers ---------------------------------------------------------------------------

class _Source:
    """A checkpoint's tensors under our source names (embed, layers.3.q, layers.3.q_bias, ...)."""

    def names(self) -> list[str]: ...
    def original(self, name: str) -> str: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def nbytes(self, name: str) -> int: ...
    def block_kind(self, name: str) -> str | None:
        """The GGUF block kind it would be served in (None: it cannot be kept in blocks)."""
        return None
    def read_float(self, name: str, a: int, b: int) -> torch.Tensor:
        """Rows [a, b) as a float tensor [b - a, K] ([b - a] for a vector), in the checkpoint's precision."""
        ...
    def read_blocks(self, name: str, a: int, b: int, kind: str) -> QuantWeight: ...
    def __enter__(self) -> _Source:
        return self
    def __exit__(self, *exc: object) -> None:
        self.close()
    def close(self) -> None: ...


_GGUF_LAYER_NAMES = {
    "attn_norm": "attn_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
    "ffn_norm": "ffn_norm", "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down",
}
_GGUF_TOP_NAMES = {"token_embd": "embed", "output_norm": "norm", "output": "lm_head"}


class _GGUF(_Source):
    def __init__(self, path: Path, config: ModelConfig) -> None:
        index = read_gguf_index(path)
        self.path = path
        self.fd = os.open(str(path), os.O_RDONLY)
        self.infos: dict[str, GGUFTensorInfo] = {}
        self.perm: dict[str, np.ndarray] = {}
        # llama.cpp's converter interleaves each head's q/k rows for the llama architecture (so RoPE pairs
        # (2i, 2i+1) are adjacent); we use the Hugging Face pairing (i, i + d/2) and undo it. Its qwen2
        # conversion keeps the Hugging Face order.
        interleaved = config.architecture != "qwen2"
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
}
_HF_TOP_NAMES = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}
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


class _Safetensors(_Source):
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


def _hf_name(key: str) -> str | None:
    if key in _HF_TOP_NAMES:
        return _HF_TOP_NAMES[key]
    if key.startswith("model.layers."):
        _, _, idx, rest = key.split(".", 3)
        kind = _HF_LAYER_NAMES.get(rest)
        return None if kind is None else f"layers.{idx}.{kind}"
    return None


def _open_checkpoint(path: Path, config: ModelConfig) -> _Source:
    return _GGUF(path, config) if is_gguf(path) else _Safetensors(path)


# ---- progress -------------------------------------------------------------------------------------

class _Progress:
    """A progress bar (tqdm) when stderr is a terminal; otherwise one log line per 10 % read."""

    def __init__(self, total: int, what: str, enabled: bool = True) -> None:
        self.total, self.done, self.next_tenth = max(total, 1), 0, 1
        self.start = time.monotonic()
        self.what = what
        self.enabled = enabled
        self.bar: Any = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", leave=False)
            except ImportError:  # tqdm is a dependency; without it the log lines still come
                self.bar = None

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        while self.enabled and self.done * 10 >= self.next_tenth * self.total and self.next_tenth <= 10:
            log.info("loading weights: %d%% (%.0f of %.0f MB read, %.1f s)", self.next_tenth * 10,
                     self.done / 2**20, self.total / 2**20, time.monotonic() - self.start)
            self.next_tenth += 1

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _give_back_freed_memory() -> None:
    """glibc keeps freed heap pages resident until trimmed; the chunks' temporaries are freed by now."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass

