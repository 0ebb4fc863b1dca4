"""Qwen-VL's M-RoPE positions on the engine side: an image's tokens rotate by their (t, h, w) place in the
image, text tokens by one position on all three axes, counting on from the image's largest plus one. So
after an image a sequence's rotary position is its index plus a fixed `delta` (negative: an image of N
tokens spans only max(h, w) positions); every token the model generates is text, so a decode step is the
ordinary 1-D rotary at index + delta and stays on the fast kernels. The positions of a token depend only
on the tokens before it, so prefix-cache hits (whose keys already hold the images' digests) stay exact."""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from kvyard.qwen_vl_config import QwenVisionConfig


@dataclass(frozen=True)
class MropePositions:
    """A sequence's feature: its prompt's rotary positions and the shift of every token after it."""
    prompt: torch.Tensor                   # [3, P] long: (t, h, w) rotary position of each prompt token
    delta: int                             # rotary position - index, for every token after the prompt
    spans: tuple[tuple[int, int], ...]     # (start, length) of each image's tokens, whose axes differ

    def rows(self, start: int, n: int) -> torch.Tensor:
        """[3, n] positions of tokens [start, start + n)."""
        p = self.prompt.shape[1]
        head = self.prompt[:, start:min(start + n, p)]
        if start + n <= p:
            return head
        tail = torch.arange(max(start, p), start + n) + self.delta
        return torch.cat([head, tail.expand(3, -1)], dim=1)

    def flat(self, start: int, n: int) -> list[int] | None:
        """The 1-D positions of [start, start + n) when no image token is among them (all axes equal)."""
        if any(a < start + n and start < a + length for a, length in self.spans):
            return None
        if start >= self.prompt.shape[1]:
            return list(range(start + self.delta, start + n + self.delta))
        return self.rows(start, n)[0].tolist()


def mrope_positions(prompt_len: int, spans: Seq[tuple[int, int]], grids: Seq[tuple[int, int, int]],
                    vision: QwenVisionConfig) -> MropePositions:
    """spans: each image's placeholder run (start, length) in prompt order; grids: its (t, h, w) patches."""
    m = vision.merge_size
    parts: list[torch.Tensor] = []
    cursor, at = 0, 0  # next prompt index; next rotary position
    for (start, length), (t, gh, gw) in zip(spans, grids):
        parts.append(torch.arange(start - cursor).expand(3, -1) + at)
        at += start - cursor
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh // m), torch.arange(gw // m), indexing="ij")
        parts.append(torch.stack([tt.flatten(), hh.flatten(), ww.flatten()]) + at)  # [3, t·h·w / m²]
        at += max(gh, gw) // m
        cursor = start + length
    parts.append(torch.arange(prompt_len - cursor).expand(3, -1) + at)
    at += prompt_len - cursor
    return MropePositions(torch.cat(parts, dim=1), at - prompt_len, tuple(spans))


class StepPositions:
    """One step's rotary positions, chunk by chunk: flat [T] while every row's axes agree, plus [3, T]
    once a chunk covers an image's tokens (that step's prefill then takes the PyTorch path)."""

    def __init__(self) -> None:
        self.flat: list[int] = []
        self._chunks: list[tuple[MropePositions | None, int, int]] = []
        self._spatial = False

    def add(self, rope: MropePositions | None, start: int, n: int) -> None:
        flat = list(range(start, start + n)) if rope is None else rope.flat(start, n)
        if flat is None:
            assert rope is not None
            flat, self._spatial = rope.rows(start, n)[0].tolist(), True
        self.flat.extend(flat)
        self._chunks.append((rope, start, n))

    def mrope(self, device: torch.device) -> torch.Tensor | None:
        """[3, T] long when some row is an image token; None: `flat` says all."""
        if not self._spatial:
            return None
        rows = [torch.arange(start, start + n).expand(3, -1) if rope is None else rope.rows(start, n)
                for rope, start, n in self._chunks]
        return torch.cat(rows, dim=1).to(device)
