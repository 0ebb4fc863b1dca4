"""A Qwen2-VL / Qwen2.5-VL image side in the backend: patches (backend/image_preprocess.py) → ViT with 2-D
rotary positions → 2×2 patch merger → one embedding per `<|image_pad|>` token, which backend/model.py puts in
place of the placeholders' embeddings in prefill (as LLaVA's; the embedding cache is backend/image_tower.py's).
Qwen2.5-VL: RMSNorm/SwiGLU blocks, attention within windows of window_size² pixels except at
fullatt_block_indexes; Qwen2-VL: LayerNorm/GELU blocks, every layer over the whole image."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from backend.image_tower import ImageTower, quick_gelu_, read_image_side
from backend.model import default_ops
from kvyard.model_config import ModelConfig
from kvyard.qwen_vl_config import QwenVisionConfig

log = logging.getLogger("kvyard.vision")
_ROPE_THETA = 10000.0  # the tower's rotary base in both families
_NORM_EPS = 1e-6


class QwenVisionTower(ImageTower):
    """Engine thread only."""

    config: QwenVisionConfig

    def __init__(self, config: QwenVisionConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        super().__init__(config, weights, dtype)
        device = next(iter(weights.values())).device
        self.ops = default_ops(device, dtype)  # the language model's RMSNorm and SiLU·up (C++ for float32 CPU)
        if config.family == "qwen2_5_vl":  # gate and up in one GEMM, as the language model's gate_up
            for i in range(config.num_layers):
                p = f"vision.blocks.{i}.mlp."
                for k in ("weight", "bias"):
                    weights[f"{p}gate_up.{k}"] = torch.cat([weights.pop(f"{p}gate_proj.{k}"),
                                                            weights.pop(f"{p}up_proj.{k}")])

    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, int, int] | None) -> torch.Tensor:
        if grid is None:
            raise ValueError("a Qwen-VL image needs its patch grid")
        return self.forward(pixel_values, grid)

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """patches [N, 3·t·p·p] (N = t·h·w, in 2×2 merge blocks) → [N / 4, D]."""
        c, w = self.config, self.w
        proj = w["vision.patch_embed.proj.weight"]
        x = F.linear(patches.to(device=proj.device, dtype=self.dtype), proj.reshape(proj.shape[0], -1))  # [N, C]
        cos, sin = self._rotary(grid, x.device)                                  # [N, 1, 1, d] each
        windows = None
        if c.window_size:  # patches in window order once (as the model does), so a window is a slice
            order, merged_order, windows = self._window_order(grid, x.device)
            x, cos, sin = x[order], cos[order], sin[order]
        for i in range(c.num_layers):
            p = f"vision.blocks.{i}."
            groups = None if i in c.full_attention_layers else windows
            x = x + self._attention(self._norm(x, p + "norm1"), p + "attn.", cos, sin, groups)
            x = x + self._mlp(self._norm(x, p + "norm2"), p + "mlp.")
        x = self._norm(x, "vision.merger.ln_q").reshape(-1, c.hidden_size * c.merge_size ** 2)  # [N/4, 4C]
        x = F.gelu(self._linear(x, "vision.merger.mlp.0"))
        x = self._linear(x, "vision.merger.mlp.2")                               # [N/4, D]
        if windows is None:
            return x
        out = torch.empty_like(x)
        out[merged_order] = x                                                    # back to merge-block order
        return out

    def _rotary(self, grid: tuple[int, int, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Each patch's row and column rotate half the head's frequencies each, in merge-block order."""
        t, gh, gw = grid
        m, d = self.config.merge_size, self.config.hidden_size // self.config.num_heads
        rows = torch.arange(gh)[:, None].expand(gh, gw)
        cols = torch.arange(gw)[None, :].expand(gh, gw)
        rows, cols = ((a.reshape(gh // m, m, gw // m, m).transpose(1, 2).flatten().repeat(t)) for a in (rows, cols))
        inv_freq = 1.0 / (_ROPE_THETA ** (torch.arange(0, d // 2, 2, dtype=torch.float) / (d // 2)))  # [d/4]
        angles = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)            # [N, d/2]
        angles = torch.cat([angles, angles], dim=-1).to(device)                                     # [N, d]
        # _rope's sin carries rotate-half's sign: x·cos + swap_halves(x)·(-sin | sin)
        sin = angles.sin()
        sin[:, :d // 2].neg_()
        return angles.cos()[:, None, None], sin[:, None, None]

    def _window_order(self, grid: tuple[int, int, int], device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
        """Qwen2.5-VL's windows (window_size pixels square, counted in merged tokens from the top left; those
        at the right and bottom edges cut short) as an order of the patches in which each window is a run,
        windows of one length next to each other: (the patches' order [N], the merged tokens' [N/4], and
        (k windows, L patches each) per run of equal windows), so a windowed layer attends within each
        window by one call per run over a view, with no gather."""
        t, gh, gw = grid
        m = self.config.merge_size
        side = self.config.window_size // m // self.config.patch_size  # merged tokens per window side
        lh, lw = gh // m, gw // m
        across = -(-lw // side)                                        # windows per row of windows
        unit = (torch.arange(lh)[:, None] // side * across + torch.arange(lw)[None, :] // side).flatten()
        unit = (torch.arange(t)[:, None] * (-(-lh // side) * across) + unit[None, :]).flatten()  # window of each merged token
        counts = torch.bincount(unit)                                  # merged tokens per window
        merged_order = torch.argsort(counts[unit] * counts.numel() + unit, stable=True)
        runs = [(int((counts == n).sum()), int(n) * m * m) for n in counts.unique().tolist() if n]
        order = (merged_order[:, None] * m * m + torch.arange(m * m)[None, :]).flatten()  # a merged token's m² patches
        return order.to(device), merged_order.to(device), runs

    def _attention(self, x: torch.Tensor, p: str, cos: torch.Tensor, sin: torch.Tensor,
                   windows: list[tuple[int, int]] | None) -> torch.Tensor:
        """Bidirectional attention over the whole image, or within each window (x in _window_order's order)."""
        n, width = x.shape
        qkv = self._linear(x, p + "qkv").view(n, 3, self.config.num_heads, -1)   # [N, 3, H, d]
        (q, k), v = _rope(qkv[:, :2], cos, sin).unbind(1), qkv[:, 2]          # [N, H, d] each
        if windows is None:
            return self._linear(self._bidirectional(q, k, v).reshape(n, width), p + "proj")
        parts, start = [], 0
        for count, length in windows:                                       # count windows of `length` patches
            run = slice(start, start + count * length)
            o = F.scaled_dot_product_attention(*(a[run].view(count, length, *a.shape[1:]).transpose(1, 2)
                                                 for a in (q, k, v)))       # [count, H, length, d]
            parts.append(o.transpose(1, 2).reshape(count * length, width))
            start = run.stop
        return self._linear(parts[0] if len(parts) == 1 else torch.cat(parts), p + "proj")

    def _mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        if self.config.family == "qwen2_5_vl":
            return self._linear(self.ops.silu_mul(self._linear(x, p + "gate_up")), p + "down_proj")
        h = self._linear(x, p + "fc1")
        h = quick_gelu_(h) if self.config.hidden_act == "quick_gelu" else F.gelu(h)
        return self._linear(h, p + "fc2")

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if self.config.family == "qwen2_5_vl":  # RMSNorm, computed in float32
            return self.ops.rms_norm(x, self.w[name + ".weight"], _NORM_EPS)
        return F.layer_norm(x, x.shape[-1:], self.w[name + ".weight"], self.w[name + ".bias"], _NORM_EPS)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, ..., d] rotated in float32 (pairs i, i + d/2); cos, sin [N, 1, 1, d] (sin signed: _rotary)."""
    h = x.float()
    half = h.shape[-1] // 2
    swapped = torch.cat([h[..., half:], h[..., :half]], dim=-1)
    return torch.addcmul(h * cos, swapped, sin).to(x.dtype)


def load_qwen_tower(path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> QwenVisionTower:
    vision = config.vision
    assert isinstance(vision, QwenVisionConfig)
    weights = read_image_side(path, config, dtype, device, lambda name: False, _needed(vision))
    tower = QwenVisionTower(vision, weights, dtype)
    log.info("vision tower (%s): %d layers, %.0f MB", vision.family, vision.num_layers, tower.weight_bytes() / 2**20)
    return tower


def _needed(vision: QwenVisionConfig) -> list[str]:
    wb = ("weight", "bias")
    if vision.family == "qwen2_5_vl":
        norms = ["norm1.weight", "norm2.weight"]
        mlp = [f"mlp.{m}.{k}" for m in ("gate_proj", "up_proj", "down_proj") for k in wb]
        top = ["vision.merger.ln_q.weight"]
    else:
        norms = [f"{n}.{k}" for n in ("norm1", "norm2") for k in wb]
        mlp = [f"mlp.{m}.{k}" for m in ("fc1", "fc2") for k in wb]
        top = ["vision.merger.ln_q.weight", "vision.merger.ln_q.bias"]
    per_layer = norms + mlp + [f"attn.{m}.{k}" for m in ("qkv", "proj") for k in wb]
    top += ["vision.patch_embed.proj.weight"] + [f"vision.merger.mlp.{i}.{k}" for i in (0, 2) for k in wb]
    return top + [f"vision.blocks.{i}.{n}" for i in range(vision.num_layers) for n in per_layer]
