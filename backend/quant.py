"""Weights kept in the GGUF's own block formats (Q4_1, Q8_0), repacked once at load for the C++ kernels.

A QuantWeight stands in for a dense [out, in] matrix: `dequantize()` gives the exact float32 matrix the
reference computes with; backend/ops.py multiplies by it without ever materialising it per token. Scales
and minimums stay float16, as the GGUF stores them: 20 bytes per 32 Q4_1 weights instead of 24.

Two layouts of the same blocks: "rows" (each output row's blocks together, the GGUF's order) for the
float32-activation kernels, and "n16" (groups of 16 output rows interleaved, backend/csrc/qlinear_vnni.h)
for the int16-activation kernels on CPUs with AVX-512 VNNI; `to_n16()` converts once at load."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QK = 32  # weights per block, both formats

# GGUF block layouts (bytes): Q4_1 = f16 d, f16 m, 16 bytes of nibbles; Q8_0 = f16 d, 32 int8.
Q4_1_BYTES, Q8_0_BYTES = 20, 34


@dataclass
class QuantWeight:
    """One [N, K] matrix as blocks of 32 along K: w[n, k] = d[n, b] * q[n, k] (+ m[n, b] for Q4_1)."""
    kind: str               # "q4_1" or "q8_0"
    qs: torch.Tensor        # rows: [N, K/2] uint8 (Q4_1: byte j of a block = weights j | j+16 << 4) or [N, K]
                            # int8; n16: [N/16, K/32, 16 j, 16 n] uint8 or [N/16, K/32, 16 j, 16 n, 2] int8
    d: torch.Tensor         # rows: [N, K/32] float16 scales; n16: [N/16, K/32, 16]
    m: torch.Tensor | None  # minimums (Q4_1 only), laid out as d

    @property
    def layout(self) -> str:
        return "n16" if self.d.dim() == 3 else "rows"

    @property
    def shape(self) -> tuple[int, int]:
        if self.layout == "n16":
            return self.d.shape[0] * 16, self.d.shape[1] * QK
        return self.d.shape[0], self.d.shape[1] * QK

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix [N, K] these blocks encode (what the reference path multiplies by)."""
        w = self.to_rows()
        n, k = w.shape
        if w.kind == "q4_1":
            lo, hi = (w.qs & 0x0F), (w.qs >> 4)
            q = torch.cat([lo.view(n, -1, 16), hi.view(n, -1, 16)], dim=-1).float()  # [N, nb, 32]
            return (q * w.d.float()[..., None] + w.m.float()[..., None]).view(n, k)  # type: ignore[union-attr]
        return (w.qs.view(n, -1, QK).float() * w.d.float()[..., None]).view(n, k)

    def to_n16(self) -> QuantWeight:
        """The same blocks in groups of 16 output rows (N must be a multiple of 16)."""
        assert self.layout == "rows" and self.shape[0] % 16 == 0
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
        g, nb = self.d.shape[0], self.d.shape[1]

        def scales(t: torch.Tensor) -> torch.Tensor:
            return t.permute(0, 2, 1).reshape(g * 16, nb)

        if self.kind == "q4_1":
            qs = self.qs.permute(0, 3, 1, 2).reshape(g * 16, nb * 16)
        else:
            qs = self.qs.permute(0, 3, 1, 4, 2).reshape(g * 16, nb * QK)
        return QuantWeight(self.kind, qs, scales(self.d), None if self.m is None else scales(self.m))

    def rows(self, index: torch.Tensor) -> QuantWeight:
        """These output rows only (e.g. llama.cpp's Q/K row interleave undone)."""
        assert self.layout == "rows"
        return QuantWeight(self.kind, self.qs[index].contiguous(), self.d[index].contiguous(),
                           None if self.m is None else self.m[index].contiguous())

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight:
        """Stack along the output rows (fused q/k/v, gate/up)."""
        assert len({p.kind for p in parts}) == 1 and len({p.shape[1] for p in parts}) == 1
        assert all(p.layout == "rows" for p in parts)
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])  # type: ignore[misc]
        return QuantWeight(parts[0].kind, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m)


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
