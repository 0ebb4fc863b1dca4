"""The Llama-family network (GQA, RoPE, RMSNorm, SwiGLU): flat token batch in, logits out."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from backend.attention import AttentionMetadata, KVCache, paged_attention
from kvyard.model_config import ModelConfig


class LlamaModel:
    """Plain functions over a dict of weights (gpt-fast style): no nn.Module bookkeeping per step."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        self.config = config
        self.w = weights
        self.lm_head = weights.get("lm_head", weights["embed"])  # tied when the checkpoint has none
        self.device = weights["embed"].device
        self.dtype = weights["embed"].dtype
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.cos, self.sin = _rope_tables(config, self.device)  # [P, d/2] each, float32

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, logits_rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]; logits_rows: [S] rows that sample → logits [S, V] (float32)."""
        c = self.config
        cos = self.cos[positions].to(self.dtype)  # [T, d/2]; shared by every layer
        sin = self.sin[positions].to(self.dtype)
        x = self.w["embed"][input_ids]            # [T, D]
        for i in range(c.num_layers):
            p = f"layers.{i}."
            h = _rms_norm(x, self.w[p + "attn_norm"], c.rms_norm_eps)
            qkv = F.linear(h, self.w[p + "qkv"], self.w.get(p + "qkv_bias"))  # [T, (H+2Hkv)d]
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = _rope(q.view(-1, c.num_heads, c.head_dim), cos, sin)          # [T, H, d]
            k = _rope(k.view(-1, c.num_kv_heads, c.head_dim), cos, sin)       # [T, Hkv, d]
            v = v.view(-1, c.num_kv_heads, c.head_dim)
            attn = paged_attention(i, q, k, v, cache, meta)                   # [T, H, d]
            x = x + F.linear(attn.reshape(-1, self.q_size), self.w[p + "o"])
            h = _rms_norm(x, self.w[p + "ffn_norm"], c.rms_norm_eps)
            gate, up = F.linear(h, self.w[p + "gate_up"]).chunk(2, dim=-1)    # [T, F] each
            x = x + F.linear(F.silu(gate) * up, self.w[p + "down"])
        x = _rms_norm(x[logits_rows], self.w["norm"], c.rms_norm_eps)         # only rows that sample
        return F.linear(x, self.lm_head).float()                               # [S, V]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rope_tables(config: ModelConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, half, dtype=torch.float64) / half))
    pos = torch.arange(config.max_position_embeddings, dtype=torch.float64)
    angles = torch.outer(pos, inv_freq)  # [P, d/2]
    return angles.cos().float().to(device), angles.sin().float().to(device)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, d]; rotates pairs (i, i + d/2) as the Hugging Face layout does."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
