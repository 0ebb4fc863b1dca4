"""The Llama-family network (GQA, RoPE, RMSNorm, SwiGLU): flat token batch in, logits out."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from backend.attention import AttentionMetadata, KVCache, paged_attention
from kvyard.model_config import ModelConfig


class LlamaModel:
    """Plain functions over a dict of weights (gpt-fast style): no nn.Module bookkeeping per step."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], compile: bool = False) -> None:
        """compile=True runs each layer's dense halves through torch.compile (measured in
        benchmarks/compile_check.py); attention over the paged cache stays eager."""
        self.config = config
        self.w = weights
        self.lm_head = weights.get("lm_head", weights["embed"])  # tied when the checkpoint has none
        self.device = weights["embed"].device
        self.dtype = weights["embed"].dtype
        self.cos, self.sin = _rope_tables(config, self.device)  # [P, d/2] each, float32
        self._attn_in, self._attn_out = _attn_in, _attn_out
        if compile:
            self._attn_in = torch.compile(_attn_in, dynamic=True)
            self._attn_out = torch.compile(_attn_out, dynamic=True)

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
            q, k, v = self._attn_in(x, self.w[p + "attn_norm"], self.w[p + "qkv"], self.w.get(p + "qkv_bias"),
                                    cos, sin, c.num_heads, c.num_kv_heads, c.rms_norm_eps)
            attn = paged_attention(i, q, k, v, cache, meta)                   # [T, H, d]
            x = self._attn_out(x, attn, self.w[p + "o"], self.w[p + "ffn_norm"], self.w[p + "gate_up"],
                               self.w[p + "down"], c.rms_norm_eps)
        x = _rms_norm(x[logits_rows], self.w["norm"], c.rms_norm_eps)         # only rows that sample
        return F.linear(x, self.lm_head).float()                               # [S, V]


def _attn_in(x: torch.Tensor, norm: torch.Tensor, qkv_w: torch.Tensor, qkv_b: torch.Tensor | None,
             cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv: int,
             eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [T, D] → q [T, H, d], k and v [T, Hkv, d] (RoPE applied to q and k)."""
    h = _rms_norm(x, norm, eps)
    qkv = F.linear(h, qkv_w, qkv_b)                                    # [T, (H+2Hkv)d]
    d = qkv.shape[-1] // (n_heads + 2 * n_kv)
    q, k, v = qkv.split([n_heads * d, n_kv * d, n_kv * d], dim=-1)
    return (_rope(q.view(-1, n_heads, d), cos, sin), _rope(k.view(-1, n_kv, d), cos, sin),
            v.view(-1, n_kv, d))


def _attn_out(x: torch.Tensor, attn: torch.Tensor, o_w: torch.Tensor, norm: torch.Tensor,
              gate_up_w: torch.Tensor, down_w: torch.Tensor, eps: float) -> torch.Tensor:
    """Residual adds around the output projection and the SwiGLU MLP: x [T, D] → [T, D]."""
    x = x + F.linear(attn.reshape(attn.shape[0], -1), o_w)
    gate, up = F.linear(_rms_norm(x, norm, eps), gate_up_w).chunk(2, dim=-1)  # [T, F] each
    return x + F.linear(F.silu(gate) * up, down_w)


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
