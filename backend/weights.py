"""Checkpoint → tensors named the way backend/model.py wants them (GGUF or Hugging Face safetensors).

Our tensor names: embed, norm, lm_head (absent when tied), score (a sequence classifier's head), and per
layer i: layers.{i}.attn_norm, .qkv (+ .qkv_bias), .q_norm and .k_norm (Qwen3), .o, .ffn_norm, .gate_up,
.down — all [out, in].

Reading a file is backend/checkpoint.py's (GGUF or safetensors); this module plans and fills the tensors.

Loading streams: every matrix is allocated once in its serving format and filled a few MB of rows at a
time, read with pread from the file (no memory map, whose touched pages would count as resident), so
the peak stays near the served weights however large the model (backend/main.py logs it;
benchmarks/load_weights.py measures it per format). Serving formats:
- keep_blocks (the C++ kernels): GGUF blocks. Q4_1 and Q8_0 stay as they are; so do Q4_K, Q5_K and Q6_K
  in the n16 layout (int16 activations, AVX-512 or AVX2). In the rows layout (ACTIVATIONS=float32) Q4_0 and
  Q4_K become Q4_1 (the same weights; Q4_K's scale products rounded to float16); every other type (F32,
  F16, BF16, Q5_0, Q5_1, Q5_K, Q6_K, Q2_K, Q3_K, IQ*...) is requantized to Q8_0 from its exact
  dequantization, rows at a time.
  A fused matrix whose parts are served in different kinds (Q4_K_M files give v a Q6_K beside a Q4_K q
  and k in half the layers) is a StackedWeight: each part in its own kind, none requantized for the
  others' sake.
- otherwise dense in the model's dtype (dequantized or cast rows at a time, straight onto the device)."""
from __future__ import annotations

import ctypes
import gc
import logging
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from backend.checkpoint import GGUFSource, Source, open_checkpoint
from backend.kquant import KQUANT_CHOICES, native_kind
from backend.quant import QK, BlockWeight, QuantWeight, StackedWeight
from kvyard.model_config import ModelConfig
from kvyard.model_path import ModelFileError

log = logging.getLogger("kvyard.weights")

Tensor = torch.Tensor | BlockWeight
CHUNK_ELEMENTS = 1 << 20  # weights converted per step: bounds the temporaries (float32: 4 MB)
# Into GGUF blocks, a quarter of that: requantizing a chunk to Q8_0 holds ~5 float32 copies of it, ~18 MB
# at 1M weights, which against 4-bit weights is 1.48x a 37 MB model's (benchmarks/load_weights.py).
BLOCK_CHUNK_ELEMENTS = CHUNK_ELEMENTS // 4


def load_weights(path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 keep_blocks: bool = False, block_layout: str = "rows", progress: bool = True,
                 kquants: str = "auto") -> dict[str, Tensor]:
    """block_layout: how kept blocks are laid out, "rows" (float32-activation kernels) or "n16" (the
    int16-activation kernels; matrices whose row count is no multiple of 16 stay "rows"). kquants: which K-quant
    blocks are kept as they are in the n16 layout, else converted (KQUANTS: kquant.KQUANT_CHOICES, or "auto",
    resolve_kquants)."""
    start = time.monotonic()
    with open_checkpoint(path, config) as source:
        if keep_blocks and not isinstance(source, GGUFSource):
            raise ValueError("GGUF blocks (keep_blocks) need a .gguf checkpoint")
        plan = _plan(source, config)
        bar = _Progress(sum(source.nbytes(n) for parts in plan.values() for n in parts), str(path),
                        enabled=progress)
        target = _Target(dtype, device, keep_blocks, block_layout,
                         kquants=KQUANT_CHOICES[resolve_kquants(kquants)] if keep_blocks and block_layout == "n16"
                         and _kquant_kernels() else {})
        out: dict[str, Tensor] = {}
        dense = replace(target, keep_blocks=False)  # a classifier's few score rows: read only at the last token
        for name, parts in plan.items():
            out[name] = _load_one(source, parts, dense if name == "score" else target, bar)
        bar.close()
    _give_back_freed_memory()
    blocks = [p for t in out.values() if isinstance(t, BlockWeight)
              for p in (t.parts if isinstance(t, StackedWeight) else [t])]
    n_bytes = sum(p.nbytes() for p in blocks) + sum(t.numel() * t.element_size() for t in out.values()
                                                    if isinstance(t, torch.Tensor))
    kinds = sorted({p.kind for p in blocks})
    kept = sum(isinstance(t, BlockWeight) for t in out.values())
    log.info("loaded %d tensors (%.0f MB; %d in GGUF blocks %s) from %s in %.1f s as %s on %s", len(out),
             n_bytes / 2**20, kept, "/".join(kinds) or "-", path, time.monotonic() - start, dtype, device)
    return out


@dataclass(frozen=True)
class _Target:
    dtype: torch.dtype
    device: torch.device
    keep_blocks: bool
    block_layout: str
    kquants: Mapping[str, str]  # GGUF K-quant type → the kind it is served in (kquant.KQUANT_CHOICES)


def resolve_kquants(choice: str) -> str:
    """KQUANTS=auto: native where the int16 kernels run on AVX-512, mixed on an AVX2-only CPU (backend/config.py
    says why); other choices as they are."""
    if choice != "auto":
        return choice
    from backend import kernels
    module = kernels.load()
    return "native" if module is not None and module.has_avx512() else "mixed"


def _kquant_kernels() -> bool:
    """Whether the C++ kernels take Q4_K / Q5_K / Q6_K blocks as they are: wherever they load (AVX-512, with
    or without VNNI, and AVX2: backend/csrc/qlinear_kquant_avx2.h)."""
    from backend import kernels
    return kernels.load() is not None


def _load_one(source: Source, parts: list[str], target: _Target, bar: _Progress) -> Tensor:
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
        layout = "n16" if target.block_layout == "n16" and n % 16 == 0 else "rows"
        served = _served_kinds(source, parts, shapes, kinds, layout, target.kquants)  # type: ignore[arg-type]
        runs, first = [], 0  # neighbouring parts of one kind load as one matrix
        for i in range(1, len(parts) + 1):
            if i == len(parts) or served[i] != served[first]:
                runs.append(_load_blocks(source, parts[first:i], shapes[first:i], served[first], layout, bar))
                first = i
        return runs[0] if len(runs) == 1 else StackedWeight(runs)
    dense = torch.empty((n, k), dtype=target.dtype, device=target.device)
    rows_per_chunk = max(1, CHUNK_ELEMENTS // k)
    for r0, pieces in _row_chunks(shapes, rows_per_chunk):
        r = r0
        for i, a, b in pieces:
            _store(dense[r:r + b - a], source.read_float(parts[i], a, b))
            r += b - a
            bar.update(source.nbytes(parts[i]) * (b - a) // shapes[i][0])
    return dense


def _served_kinds(source: Source, parts: list[str], shapes: list[tuple[int, ...]], kinds: list[str],
                  layout: str, kquants: Mapping[str, str]) -> list[str]:
    """Each part's serving kind: a K-quant as it is (n16 on AVX-512 VNNI), else Q4_1 or Q8_0
    (source.block_kind). Parts whose rows do not fill groups of 16 cannot be stacked in n16: one kind for all."""
    if layout == "n16" and any(s[0] % 16 for s in shapes):
        return ["q4_1" if all(kd == "q4_1" for kd in kinds) else "q8_0"] * len(parts)
    native = kquants if layout == "n16" else {}
    return [native_kind(source.gguf_type(p) or "", native) or kd for p, kd in zip(parts, kinds)]


def _load_blocks(source: Source, parts: list[str], shapes: list[tuple[int, ...]], kind: str, layout: str,
                 bar: _Progress) -> QuantWeight:
    """Parts stacked into one matrix of `kind` blocks, filled a chunk of rows at a time."""
    n, k = sum(s[0] for s in shapes), shapes[0][1]
    dest = QuantWeight.empty(kind, n, k, layout)
    rows_per_chunk = max(16, BLOCK_CHUNK_ELEMENTS // k // 16 * 16)
    for r0, pieces in _row_chunks(shapes, rows_per_chunk):
        chunk = [source.read_blocks(parts[i], a, b, kind) for i, a, b in pieces]
        dest.write_rows(r0, chunk[0] if len(chunk) == 1 else QuantWeight.cat(chunk))
        bar.update(sum(source.nbytes(parts[i]) * (b - a) // shapes[i][0] for i, a, b in pieces))
    return dest


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


def _plan(source: Source, config: ModelConfig) -> dict[str, list[str]]:
    """Our tensor → the checkpoint tensors (our source names) stacked into it. Every checkpoint tensor
    must be used: one the model would not read (an o_proj bias, an unknown tensor) is an error."""
    names = set(source.names())
    plan: dict[str, list[str]] = {"embed": ["embed"], "norm": ["norm"]}
    if "lm_head" in names and not config.tie_word_embeddings:
        plan["lm_head"] = ["lm_head"]
    if "score" in names:
        plan["score"] = ["score"]
    for i in range(config.num_layers):
        p = f"layers.{i}."
        plan[p + "attn_norm"] = [p + "attn_norm"]
        plan[p + "qkv"] = [p + "q", p + "k", p + "v"]
        if config.attention_bias:
            plan[p + "qkv_bias"] = [p + "q_bias", p + "k_bias", p + "v_bias"]
        if config.qk_norm:
            plan[p + "q_norm"], plan[p + "k_norm"] = [p + "q_norm"], [p + "k_norm"]
        plan[p + "o"] = [p + "o"]
        plan[p + "ffn_norm"] = [p + "ffn_norm"]
        plan[p + "gate_up"] = [p + "gate", p + "up"]
        plan[p + "down"] = [p + "down"]
    wanted = {n for parts in plan.values() for n in parts}
    missing = sorted(wanted - names)
    if missing:
        raise ModelFileError(f"checkpoint lacks tensor for {missing[0]}" + (f" (and {len(missing) - 1} more)"
                                                                           if len(missing) > 1 else ""))
    image_side = {n for n in names if n.startswith(("vision.", "projector."))} if config.vision else set()
    unused = sorted(names - wanted - image_side - ({"lm_head"} if config.tie_word_embeddings else set()))
    if unused:
        raise ModelFileError(f"checkpoint tensors this model would not use: {', '.join(source.original(n) for n in unused[:5])}")
    return plan


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

