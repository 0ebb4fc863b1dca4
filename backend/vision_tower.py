"""A LLaVA-style image side in the backend: CLIP vision tower + 2-layer MLP projector, pixels → one embedding
per image placeholder token, which backend/model.py puts in place of the placeholders' embeddings in prefill.
Plain functions over a dict of weights (as backend/model.py); the embedding cache is backend/image_tower.py's.
`load_vision_tower` loads whichever family's tower the checkpoint has."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from backend.image_tower import ImageTower, quick_gelu_, read_image_side
from backend.qwen_vl_tower import load_qwen_tower
from kvyard.model_config import ModelConfig
from kvyard.qwen_vl_config import QwenVisionConfig
from kvyard.vision_config import VisionConfig

log = logging.getLogger("kvyard.vision")


class VisionTower(ImageTower):
    """CLIP + projector; engine thread only."""

    config: VisionConfig

    def __init__(self, config: VisionConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        super().__init__(config, weights, dtype)
        for i in range(config.num_layers):  # q, k and v in one GEMM
            p = f"vision.encoder.layers.{i}.self_attn."
            for k in ("weight", "bias"):
                weights[f"{p}qkv.{k}"] = torch.cat([weights.pop(f"{p}{m}_proj.{k}") for m in "qkv"])

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
            h = quick_gelu_(h) if c.hidden_act == "quick_gelu" else F.gelu(h)
            x = x + self._linear(h, p + "mlp.fc2")
        if not c.keep_cls:
            x = x[:, 1:]
        return self._linear(F.gelu(self._linear(x, "projector.linear_1")), "projector.linear_2")  # [B, N, D]

    def _attention(self, x: torch.Tensor, p: str) -> torch.Tensor:
        b, n, width = x.shape
        heads = self.config.num_heads
        qkv = self._linear(x, p + "qkv").view(b, n, 3, heads, -1)                 # [B, N, 3, H, d]
        outs = [self._bidirectional(*qkv[i].unbind(1)) for i in range(b)]        # [N, H, d] each
        out = outs[0][None] if b == 1 else torch.stack(outs)
        return self._linear(out.reshape(b, n, width), p + "out_proj")

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.w[name + ".weight"], self.w[name + ".bias"], self.config.layer_norm_eps)


def load_vision_tower(path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> ImageTower:
    """The tower's and projector's tensors (vision.*, projector.*) from the checkpoint, layers past the
    feature layer left unread."""
    vision = config.vision
    if isinstance(vision, QwenVisionConfig):
        return load_qwen_tower(path, config, dtype, device)
    assert vision is not None
    weights = read_image_side(path, config, dtype, device, lambda name: _unused(name, vision), _needed(vision))
    tower = VisionTower(vision, weights, dtype)
    log.info("vision tower: %d layers run, %d image tokens per image, %.0f MB", vision.num_layers,
             vision.num_image_tokens, tower.weight_bytes() / 2**20)
    return tower


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
