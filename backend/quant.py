"""Weights kept in the GGUF's own block formats (Q4_1, Q8_0), repacked once at load for the C++ kernels.

A QuantWeight stands in for a dense [out, in] matrix: `dequantize()` gives the exact float32 matrix the
reference computes with; backend/ops.py multiplies by it without ever materialising it per token. Scales
and minimums stay float16, as the GGUF stores them: 20 bytes per 32 Q4_1 weights instead of 24.

Two layouts of the same blocks: "rows" (each output row's blocks together, the GGUF's order) for the
float32-activation kernels, and "n16" (groups of 16 output rows interleaved, backend/csrc/qlinear_vnni.h)
for the int16-activation kernels (AVX-512 or AVX2); `to_n16()` converts once at load. There the
GGUF's K-quants are served as they are too (Q4_K, Q5_K, Q6_K: backend/csrc/qlinear_kquant.h), n16 only: their
"rows" layout is just the step between the file and the groups (and the reference's way back)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from backend import kquant
from backend.kquant import K_CODE_ROWS, K_KINDS, QK, QK_K


# GGUF block layouts (bytes): Q4_1 = f16 d, f16 m, 16 bytes of nibbles; Q8_0 = f16 d, 32 int8.
Q4_1_BYTES, Q8_0_BYTES = 20, 34


@dataclass
class QuantWeight:
    """One [N, K] matrix as blocks of 32 along K: w[n, k] = d[n, b] * q[n, k] (+ m[n, b] for Q4_1).
    Q4_K, Q5_K and Q6_K (K_KINDS) keep the file's two-level scales instead: d per 256 weights, m the sub-scales
    per block (see backend/kquant.py's k_to_n16 for both layouts)."""
    kind: str               # "q4_1", "q8_0", or a K-quant: "q4_k", "q5_k", "q6_k", "q5_k8", "q6_k8" (kquant.K_KINDS)
    qs: torch.Tensor        # rows: [N, K/2] uint8 (Q4_1: byte j of a block = weights j | j+16 << 4) or [N, K]
                            # int8; n16: [N/16, K/32, 16 j, 16 n] uint8 or [N/16, K/32, 16 j, 16 n, 2] int8
    d: torch.Tensor         # rows: [N, K/32] float16 scales; n16: [N/16, K/32, 16]
    m: torch.Tensor | None  # minimums (Q4_1 only), laid out as d; K-quants: sub-scales

    @property
    def layout(self) -> str:
        return "n16" if self.qs.dim() > 2 else "rows"

    @property
    def shape(self) -> tuple[int, int]:
        if self.layout == "n16":
            return self.qs.shape[0] * 16, self.qs.shape[1] * QK
        return self.qs.shape[0], self.qs.shape[1] * (2 if self.kind in ("q4_1", "q4_k") else 1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix [N, K] these blocks encode (what the reference path multiplies by)."""
        w = self.to_rows()
        n, k = w.shape
        if w.kind in K_KINDS:
            return _k_dequantize(w)
        if w.kind == "q4_1":
            lo, hi = (w.qs & 0x0F), (w.qs >> 4)
            q = torch.cat([lo.view(n, -1, 16), hi.view(n, -1, 16)], dim=-1).float()  # [N, nb, 32]
            return (q * w.d.float()[..., None] + w.m.float()[..., None]).view(n, k)  # type: ignore[union-attr]
        return (w.qs.view(n, -1, QK).float() * w.d.float()[..., None]).view(n, k)

    def to_n16(self) -> QuantWeight:
        """The same blocks in groups of 16 output rows (N must be a multiple of 16)."""
        assert self.layout == "rows" and self.shape[0] % 16 == 0
        if self.kind in K_KINDS:
            return _k_to_n16(self)
        n, k = self.shape
        g, nb = n // 16, k // QK

        def scales(t: torch.Tensor) -> torch.Tensor:  # [N, nb] → [G, nb, 16]
            return t.view(g, 16, nb).permute(0, 2, 1).contiguous()

        if self.kind == "q4_1":
            qs = self.qs.view(g, 16, nb, 16).permute(0, 2, 3, 1).contiguous()  # [G, nb, 16 j, 16 n]
        else:  # k=j and k=j+16 side by side for each row n
            qs = self.qs.view(g, 16, nb, 2, 16).permute(0, 2, 4, 1, 3).contiguous()  # [G, nb, 16 j, 16 n, 2]
        return QuantWeight(self.kind, qs, scales(self.d), None if self.m is None else scales(self.m))

    def to_rows(self) -> QuantWeight:
        if self.layout == "rows":
            return self
        if self.kind in K_KINDS:
            return _k_to_rows(self)
        g, nb = self.d.shape[0], self.d.shape[1]

        def scales(t: torch.Tensor) -> torch.Tensor:
            return t.permute(0, 2, 1).reshape(g * 16, nb)

        if self.kind == "q4_1":
            qs = self.qs.permute(0, 3, 1, 2).reshape(g * 16, nb * 16)
        else:
            qs = self.qs.permute(0, 3, 1, 4, 2).reshape(g * 16, nb * QK)
        return QuantWeight(self.kind, qs, scales(self.d), None if self.m is None else scales(self.m))

    # Load-time helpers below work through numpy: single-threaded copies of a few MB, where torch's
    # OpenMP copies of such small tensors stall on a busy 2-core machine (measured 0.3 -> 12 ms each).

    def rows(self, index: torch.Tensor | np.ndarray) -> QuantWeight:
        """These output rows only (e.g. llama.cpp's Q/K row interleave undone)."""
        assert self.layout == "rows"
        idx = index.numpy() if isinstance(index, torch.Tensor) else index
        return QuantWeight(self.kind, torch.from_numpy(self.qs.numpy()[idx]), torch.from_numpy(self.d.numpy()[idx]),
                           None if self.m is None else torch.from_numpy(self.m.numpy()[idx]))

    @staticmethod
    def empty(kind: str, n: int, k: int, layout: str = "rows") -> QuantWeight:
        """Room for an [n, k] matrix of `kind` blocks in `layout`, filled by write_rows."""
        nb = k // QK
        if kind in K_KINDS:
            assert layout == "n16", "K-quant blocks are served in the n16 layout only"
            g, nsb, q4k = n // 16, k // QK_K, kind not in ("q6_k", "q6_k8")  # Q4_K, Q5_K: d, dmin
            return QuantWeight(kind, torch.empty((g, nb, K_CODE_ROWS[kind], 16), dtype=torch.uint8),
                               torch.empty((g, nsb, 2, 16) if q4k else (g, nsb, 16), dtype=torch.float16),
                               torch.empty((g, nb, 2, 16), dtype=torch.uint8 if q4k else torch.int8))
        if layout == "n16":
            g = n // 16
            qs = torch.empty((g, nb, 16, 16) if kind == "q4_1" else (g, nb, 16, 16, 2), dtype=torch.uint8
                             if kind == "q4_1" else torch.int8)
            shape: tuple[int, ...] = (g, nb, 16)
        else:
            qs = torch.empty((n, k // 2) if kind == "q4_1" else (n, k), dtype=torch.uint8 if kind == "q4_1" else torch.int8)
            shape = (n, nb)
        m = torch.empty(shape, dtype=torch.float16) if kind == "q4_1" else None
        return QuantWeight(kind, qs, torch.empty(shape, dtype=torch.float16), m)

    def write_rows(self, row0: int, rows: QuantWeight) -> None:
        """Copy `rows` ("rows" layout, same kind and width) into output rows [row0, row0 + len): in this
        matrix's own layout (n16: row0 and the length multiples of 16, except at the end)."""
        assert rows.layout == "rows" and rows.kind == self.kind and rows.shape[1] == self.shape[1]
        n, nb = rows.shape[0], rows.shape[1] // QK
        if self.kind in K_KINDS:  # n16 only: the chunk converted, then copied into its groups
            assert row0 % 16 == 0 and n % 16 == 0 and self.layout == "n16"
            part = _k_to_n16(rows)
            for dst, src in ((self.qs, part.qs), (self.d, part.d), (self.m, part.m)):
                dst.numpy()[row0 // 16:(row0 + n) // 16] = src.numpy()  # type: ignore[union-attr]
            return
        qs, d, m = rows.qs.numpy(), rows.d.numpy(), None if rows.m is None else rows.m.numpy()
        if self.layout == "n16":  # the same re-layout as to_n16, straight into place
            assert row0 % 16 == 0 and n % 16 == 0
            g = n // 16
            if self.kind == "q4_1":
                qs = qs.reshape(g, 16, nb, 16).transpose(0, 2, 3, 1)
            else:
                qs = qs.reshape(g, 16, nb, 2, 16).transpose(0, 2, 4, 1, 3)
            d = d.reshape(g, 16, nb).transpose(0, 2, 1)
            m = None if m is None else m.reshape(g, 16, nb).transpose(0, 2, 1)
            row0, n = row0 // 16, g
        self.qs.numpy()[row0:row0 + n] = qs
        self.d.numpy()[row0:row0 + n] = d
        if self.m is not None:
            self.m.numpy()[row0:row0 + n] = m

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight:
        """Stack along the output rows (fused q/k/v, gate/up)."""
        assert len({p.kind for p in parts}) == 1 and len({p.shape[1] for p in parts}) == 1
        assert all(p.layout == "rows" for p in parts)
        def cat(ts: list[torch.Tensor]) -> torch.Tensor:
            return torch.from_numpy(np.concatenate([t.numpy() for t in ts]))

        m = None if parts[0].m is None else cat([p.m for p in parts])  # type: ignore[misc]
        return QuantWeight(parts[0].kind, cat([p.qs for p in parts]), cat([p.d for p in parts]), m)


@dataclass
class StackedWeight:
    """A fused matrix (q/k/v, gate/up) whose checkpoint parts differ in block kind (a Q4_K_M file's Q6_K v
    beside a Q4_K q and k in half the layers): the parts stacked along the output rows, each served in its
    own kind (neighbours of one kind merged), so none is requantized for the others' sake. A linear runs
    each part's kernel into its own columns of one output (backend/csrc/qlinear_stack.h in the fused step),
    each output computed exactly as if its part were the whole matrix."""
    parts: list[QuantWeight]  # [N_i, K] each, one layout, in output-row order

    @property
    def kind(self) -> str:
        return "+".join(p.kind for p in self.parts)

    @property
    def layout(self) -> str:
        return self.parts[0].layout

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])


BlockWeight = QuantWeight | StackedWeight


def from_gguf_blocks(kind: str, raw: np.ndarray, n: int, k: int) -> QuantWeight:
    """raw: the tensor's bytes as the GGUF stores them ([n, k/32 * block bytes] uint8)."""
    nb = k // QK
    if kind == "q4_1":
        blocks = np.ascontiguousarray(raw).reshape(n, nb, Q4_1_BYTES)
        d = blocks[..., 0:2].copy().view(np.float16).reshape(n, nb)
        m = blocks[..., 2:4].copy().view(np.float16).reshape(n, nb)
        qs = blocks[..., 4:].reshape(n, nb * 16).copy()
        return QuantWeight(kind, torch.from_numpy(qs), torch.from_numpy(d), torch.from_numpy(m))
    if kind == "q8_0":
        blocks = np.ascontiguousarray(raw).reshape(n, nb, Q8_0_BYTES)
        d = blocks[..., 0:2].copy().view(np.float16).reshape(n, nb)
        qs = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
        return QuantWeight(kind, torch.from_numpy(qs), torch.from_numpy(d), None)
    raise ValueError(f"no kernel for the {kind} block format")


# ---- other GGUF block types, converted to the two the kernels compute on ------------------------------

Q4_0_BYTES = 18          # f16 d, 16 bytes of nibbles: w = d * (q - 8)


def serving_kind(gguf_type: str) -> str:
    """The block format a GGUF tensor type is served in: Q4_0 and Q4_K convert to Q4_1 exactly (up to the
    float16 rounding of Q4_K's scale products); every other type is requantized to Q8_0."""
    return "q4_1" if gguf_type in ("q4_1", "q4_0", "q4_k") else "q8_0"


def blocks_from_gguf(gguf_type: str, raw: np.ndarray, k: int) -> QuantWeight:
    """raw: [n, row bytes] uint8 rows of a Q4_1, Q8_0, Q4_0 or Q4_K tensor → the same weights in the
    serving kind's blocks, "rows" layout."""
    n = raw.shape[0]
    if gguf_type in ("q4_1", "q8_0"):
        return from_gguf_blocks(gguf_type, raw, n, k)
    nb = k // QK
    if gguf_type == "q4_0":  # the nibbles are laid out as Q4_1's; the minimum is -8 d, exact in float16
        blocks = np.ascontiguousarray(raw).reshape(n, nb, Q4_0_BYTES)
        d = blocks[..., 0:2].copy().view(np.float16).reshape(n, nb)
        qs = blocks[..., 2:].reshape(n, nb * 16).copy()
        return QuantWeight("q4_1", torch.from_numpy(qs), torch.from_numpy(d), torch.from_numpy(d * np.float16(-8)))
    if gguf_type == "q4_k":
        return _q4_1_from_q4_k(raw, n, k)
    raise ValueError(f"no direct block conversion from {gguf_type}")


def k_blocks_from_gguf(gguf_type: str, raw: np.ndarray, k: int, served: str | None = None) -> QuantWeight:
    """A Q4_K, Q5_K or Q6_K tensor's [n, row bytes] → its blocks, "rows" layout (kquant.k_blocks_from_gguf), as
    the served kind (q6_k8 for a Q6_K tensor; default: its own)."""
    return QuantWeight(served or gguf_type, *_tensors(kquant.k_blocks_from_gguf(gguf_type, raw, k)))


def _tensors(blocks: kquant.Blocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.from_numpy(blocks[0]), torch.from_numpy(blocks[1]), torch.from_numpy(blocks[2])


def _k_arrays(w: QuantWeight) -> tuple[str, np.ndarray, np.ndarray, np.ndarray, int, int]:
    return (w.kind, w.qs.numpy(), w.d.numpy(), w.m.numpy(), *w.shape)  # type: ignore[union-attr]


def _k_to_n16(w: QuantWeight) -> QuantWeight:
    return QuantWeight(w.kind, *_tensors(kquant.k_to_n16(*_k_arrays(w))))


def _k_to_rows(w: QuantWeight) -> QuantWeight:
    return QuantWeight(w.kind, *_tensors(kquant.k_to_rows(*_k_arrays(w))))


def _k_dequantize(w: QuantWeight) -> torch.Tensor:
    return torch.from_numpy(kquant.k_dequantize(*_k_arrays(w)))


def _q4_1_from_q4_k(raw: np.ndarray, n: int, k: int) -> QuantWeight:
    return QuantWeight("q4_1", *_tensors(kquant.q4_1_from_q4_k(raw, n, k)))


def q8_0_from_float(x: torch.Tensor) -> QuantWeight:
    """[n, k] float → Q8_0 blocks: per 32 values, scale = max|x| / 127 (rounded to float16 first, so the
    codes are rounded against the scale actually stored) and codes round(x / scale)."""
    n, k = x.shape
    blocks = x.float().numpy().reshape(n, k // QK, QK)
    d = (np.abs(blocks).max(axis=-1) / np.float32(127)).astype(np.float16)  # [n, nb]
    d32 = d.astype(np.float32)
    inv = np.divide(np.float32(1), d32, out=np.zeros_like(d32), where=d32 > 0)
    q = np.clip(np.rint(blocks * inv[..., None]), -127, 127).astype(np.int8)
    return QuantWeight("q8_0", torch.from_numpy(q.reshape(n, k)), torch.from_numpy(d), None)
