"""A LLaVA-style image side in the backend: CLIP vision tower + 2-layer MLP projector, pixels → one embedding
per image placeholder token, which backend/model.py puts in place of the placeholders' embeddings in prefill.
Plain functions over a dict of weights (as backend/model.py); embeddings are kept by image hash (LRU), so
an image seen again costs no tower pass."""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from backend.checkpoint import open_checkpoint
from kvyard.model_config import ModelConfig
from kvyard.qwen_vl_config import QwenVisionConfig
from kvyard.vision_config import VisionConfig

log = logging.getLogger("kvyard.vision")
# Image embeddings kept for images seen again (LLaVA-1.5-7B in bfloat16: 4.5 MB an image, ~56 images).
EMBED_CACHE_BYTES = 256 << 20


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class VisionTower:
    """Engine thread only (the engine calls `embed` as it adds a request)."""

    def __init__(self, config: VisionConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 cache_bytes: int = EMBED_CACHE_BYTES) -> None:
        self.config = config
        self.w = weights
        self.dtype = dtype
        self.cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # image hash → [N, D] embeddings
        self.cache_bytes = cache_bytes
        self.cached_bytes = 0
        self.tower_runs = 0  # images the tower has computed (the rest came from the cache)

    def weight_bytes(self) -> int:
        return sum(_nbytes(t) for t in self.w.values())

    def embed(self, image_hash: bytes, pixel_values: torch.Tensor, grid: tuple[int, int, int] | None = None) -> torch.Tensor:
        """pixel_values [3, S, S] → [num_image_tokens, D] in the language model's dtype (a dynamic-resolution
        tower's subclass takes its patches and grid instead)."""
        hit = self.cache.get(image_hash)
        if hit is not None:
            self.cache.move_to_end(image_hash)
            return hit
        out = self.encode(pixel_values, grid)
        self.tower_runs += 1
        self.cache[image_hash] = out
        self.cached_bytes += _nbytes(out)
        while self.cached_bytes > self.cache_bytes and len(self.cache) > 1:
            self.cached_bytes -= _nbytes(self.cache.popitem(last=False)[1])
        return out

    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, int, int] | None) -> torch.Tensor:
        return self.forward(pixel_values[None])[0]

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 3, S, S] → [B, N, D]."""
        c, w = self.config, self.w
        device = w["vision.embeddings.patch_embedding.weight"].device
        x = F.conv2d(pixel_values.to(device=device, dtype=self.dtype), w["vision.embeddings.patch_embedding.weight"],
                     stride=c.patch_size)                                        # [B, C, g, g]
        x = x.flatten(2).transpose(1, 2)                                         # [B, g², C]
        cls = w["vision.embeddings.class_embedding"].expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1) + w["vision.embeddings.position_embedding.weight"][None]  # [B, 1 + g², C]
        x = self._norm(x, "vision.pre_layrnorm")
        for i in range(c.num_layers):
            p = f"vision.encoder.layers.{i}."
            x = x + self._attention(self._norm(x, p + "layer_norm1"), p + "self_attn.")
            h = self._linear(self._norm(x, p + "layer_norm2"), p + "mlp.fc1")
            h = h * torch.sigmoid(1.702 * h) if c.hidden_act == "quick_gelu" else F.gelu(h)
            x = x + self._linear(h, p + "mlp.fc2")
        if not c.keep_cls:
            x = x[:, 1:]
        return self._linear(F.gelu(self._linear(x, "projector.linear_1")), "projector.linear_2")  # [B, N, D]

    def _attention(self, x: torch.Tensor, p: str) -> torch.Tensor:
        b, n, width = x.shape
        heads = self.config.num_heads
        q, k, v = (self._linear(x, p + name).view(b, n, heads, -1).transpose(1, 2)
                   for name in ("q_proj", "k_proj", "v_proj"))                   # [B, H, N, d]
        out = F.scaled_dot_product_attention(q, k, v)                            # bidirectional
        return self._linear(out.transpose(1, 2).reshape(b, n, width), p + "out_proj")

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w[name + ".bias"])

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.w[name + ".weight"], self.w[name + ".bias"], self.config.layer_norm_eps)


def load_vision_tower(path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> VisionTower:
    """The tower's and projector's tensors (vision.*, projector.*) from the checkpoint, layers past the
    feature layer left unread."""
    vision = config.vision
    if isinstance(vision, QwenVisionConfig):
        from backend.qwen_vl_tower import load_qwen_tower  # it builds on this file's VisionTower
        return load_qwen_tower(path, config, dtype, device)
    assert vision is not None
    weights = read_image_side(path, config, dtype, device, lambda name: _unused(name, vision), _needed(vision))
    tower = VisionTower(vision, weights, dtype)
    log.info("vision tower: %d layers run, %d image tokens per image, %.0f MB", vision.num_layers,
             vision.num_image_tokens, tower.weight_bytes() / 2**20)
    return tower


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


def _unused(name: str, vision: VisionConfig) -> bool:
    if name.startswith("vision.post_layernorm."):
        return True  # LLaVA takes a hidden layer's features, before the tower's final norm
    if name.startswith("vision.encoder.layers."):
        return int(name.split(".")[3]) >= vision.num_layers
    return False


def _needed(vision: VisionConfig) -> list[str]:
    top = ["vision.embeddings.patch_embedding.weight", "vision.embeddings.class_embedding",
           "vision.embeddings.position_embedding.weight", "vision.pre_layrnorm.weight", "vision.pre_layrnorm.bias",
           "projector.linear_1.weight", "projector.linear_1.bias", "projector.linear_2.weight", "projector.linear_2.bias"]
    per_layer = [f"{m}.{k}" for m in ("layer_norm1", "layer_norm2", "mlp.fc1", "mlp.fc2", "self_attn.q_proj",
                                      "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj") for k in ("weight", "bias")]
    return top + [f"vision.encoder.layers.{i}.{n}" for i in range(vision.num_layers) for n in per_layer]
