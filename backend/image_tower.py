"""The image tower's common part in the backend: an embedding cache by image hash (LRU), so an image seen
again costs no tower pass, and reading a checkpoint's image-side tensors. The families' towers
(backend/vision_tower.py: LLaVA; backend/qwen_vl_tower.py: Qwen-VL) say how pixels become embeddings."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from backend import kernels
from backend.checkpoint import open_checkpoint
from backend.image_preprocess import image_input
from kvyard.model_config import ModelConfig

# Image embeddings kept for images seen again (LLaVA-1.5-7B in bfloat16: 4.5 MB an image, ~56 images).
EMBED_CACHE_BYTES = 256 << 20


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ImageTower:
    """Engine thread only (the engine calls `embed` as it adds a request), but for `known`."""

    def __init__(self, config: Any, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 cache_bytes: int = EMBED_CACHE_BYTES) -> None:
        self.config = config
        self.w = weights
        self.dtype = dtype
        self.cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # image hash → [N, D] embeddings
        self.cache_bytes = cache_bytes
        self.cached_bytes = 0
        # The cache's digests, republished (a new frozenset) by the engine thread after each change: the gRPC
        # edge reads it, as a hint, to skip preprocessing an image whose embedding is here.
        self.known: frozenset[bytes] = frozenset()
        self.tower_runs = 0  # images the tower has computed (the rest came from the cache)
        on_cpu = all(t.device.type == "cpu" for t in weights.values())
        # Attention over a whole image on AMX-BF16 tiles (backend/csrc/flash_bf16.h) where they run it.
        self.flash = kernels.load_flash_bf16() if dtype == torch.bfloat16 and on_cpu else None

    def weight_bytes(self) -> int:
        return sum(_nbytes(t) for t in self.w.values())

    def embed(self, image_hash: bytes, pixel_values: torch.Tensor | None, grid: tuple[int, int, int] | None = None,
              file: bytes | None = None) -> torch.Tensor:
        """An image's preprocessed pixels (and, for a dynamic-resolution tower, its patch grid) → one
        embedding per placeholder token [N, D] in the language model's dtype. pixel_values None: the edge
        found the digest in `known`; should it have been evicted since, `file` is preprocessed here."""
        hit = self.cache.get(image_hash)
        if hit is not None:
            self.cache.move_to_end(image_hash)
            return hit
        if pixel_values is None:
            if file is None:
                raise ValueError("an image reached the tower with neither pixels nor its file")
            pixel_values = image_input(file, self.config).pixels
        out = self.encode(pixel_values, grid)
        self.tower_runs += 1
        self.cache[image_hash] = out
        self.cached_bytes += _nbytes(out)
        while self.cached_bytes > self.cache_bytes and len(self.cache) > 1:
            self.cached_bytes -= _nbytes(self.cache.popitem(last=False)[1])
        self.known = frozenset(self.cache)
        return out

    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, int, int] | None) -> torch.Tensor:
        raise NotImplementedError

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w[name + ".bias"])

    def _bidirectional(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Every patch attends to every patch: q, k, v [N, H, d] (rows at any stride) → [N, H, d]. The flash kernel
        where it runs (1024 patches, 6 heads of 64, AMX Xeon: 2.4 → 2.0 ms against torch's flash kernel), else SDPA
        on 4-D views (a 3-D input takes SDPA's math path on the CPU, ~4x slower at 1024 patches)."""
        if self.flash is not None and q.shape[-1] % 32 == 0:
            return self.flash.flash_attention_bf16(q, k, v, 0, False, q.shape[-1] ** -0.5)
        return F.scaled_dot_product_attention(*(a.transpose(0, 1)[None] for a in (q, k, v)))[0].transpose(0, 1)


def quick_gelu_(h: torch.Tensor) -> torch.Tensor:
    """h·σ(1.702·h) in place, as silu(1.702·h) / 1.702: no new tensor (written as h * sigmoid(1.702 * h),
    the three fresh [1025, 1536] tensors of a CLIP layer cost 5x the arithmetic in page faults)."""
    return F.silu(h.mul_(1.702), inplace=True).div_(1.702)


def read_image_side(path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                    unused: Callable[[str], bool], needed: list[str]) -> dict[str, torch.Tensor]:
    """The checkpoint's vision.* and projector.* tensors but the unused; ValueError naming one missing."""
    weights: dict[str, torch.Tensor] = {}
    with open_checkpoint(path, config) as source:
        for name in source.names():
            if not name.startswith(("vision.", "projector.")) or unused(name):
                continue
            shape = source.shape(name)
            weights[name] = source.read_float(name, 0, shape[0]).to(device=device, dtype=dtype).contiguous()
    missing = [n for n in needed if n not in weights]
    if missing:
        raise ValueError(f"{path}: the vision tower lacks {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return weights
