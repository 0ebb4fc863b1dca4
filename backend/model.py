"""The Llama-family network (GQA, RoPE, RMSNorm, SwiGLU): flat token batch in, logits out."""
from __future__ import annotations

import torch

from backend.attention import AttentionMetadata, KVCache
from backend.ops import DENSE_ROWS, KernelOps, TorchOps, Weight
from backend.quant import QuantWeight
from kvyard.model_config import ModelConfig


def default_ops(device: torch.device, dtype: torch.dtype) -> TorchOps:
    """The C++ kernels for float32 on a CPU that has them; plain PyTorch everywhere else (CUDA, bf16)."""
    if device.type == "cpu" and dtype == torch.float32:
        from backend import kernels
        module = kernels.load()
        if module is not None:
            return KernelOps(module)
    return TorchOps()


class LlamaModel:
    """Plain functions over a dict of weights (gpt-fast style): no nn.Module bookkeeping per step.
    A weight is a dense tensor or a QuantWeight (GGUF blocks, computed on by the C++ kernels)."""

    def __init__(self, config: ModelConfig, weights: dict[str, Weight], ops: TorchOps | None = None) -> None:
        self.config = config
        self.w = weights
        self.lm_head = weights.get("lm_head", weights["embed"])  # tied when the checkpoint has none
        embed = weights["embed"]
        self.device = embed.qs.device if isinstance(embed, QuantWeight) else embed.device
        self.dtype = torch.float32 if isinstance(embed, QuantWeight) else embed.dtype
        self.ops = ops or default_ops(self.device, self.dtype)
        if not isinstance(self.ops, KernelOps) and any(isinstance(w, QuantWeight) for w in weights.values()):
            raise ValueError("GGUF block weights need the C++ CPU kernels (float32 on an AVX2 CPU)")
        self.cos, self.sin = _rope_tables(config, self.device)  # [P, d/2] each, float32
        # Decode-only steps of up to DENSE_ROWS rows (the linears' kernel range) in one C++ call, when the
        # ops have one: the same kernels in the same order, so the same logits as the loop below.
        self.fused = self.ops.fused_decoder(config, weights, self.lm_head)

    def weight_bytes(self) -> int:
        """Bytes the weights take in their serving format."""
        return sum(w.nbytes() if isinstance(w, QuantWeight) else w.numel() * w.element_size()
                   for w in self.w.values())

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, logits_rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]; logits_rows: [S] rows that sample → logits [S, V] (float32)."""
        if self.fused is not None and meta.decode_only and input_ids.shape[0] <= DENSE_ROWS:
            return self.fused.forward(input_ids, positions, meta.slot_mapping, meta.decode_blocks, meta.decode_lens,
                                      self.cos, self.sin, cache.data, cache.block_size, logits_rows)
        c, ops, w = self.config, self.ops, self.w
        cos = self.cos[positions]  # [T, d/2]; shared by every layer
        sin = self.sin[positions]
        x = ops.embed(w["embed"], input_ids).to(self.dtype)  # [T, D]
        for i in range(c.num_layers):
            p = f"layers.{i}."
            h = ops.rms_norm(x, w[p + "attn_norm"], c.rms_norm_eps)
            qkv = ops.linear(h, w[p + "qkv"], w.get(p + "qkv_bias"))                    # [T, (H+2Hkv)d]
            q = ops.rope_store(qkv, cos, sin, cache, i, meta.slot_mapping, c.num_heads, c.num_kv_heads)
            attn = ops.attention(q, cache, i, meta)                                       # [T, H, d]
            x = ops.linear(attn.reshape(attn.shape[0], -1), w[p + "o"], residual=x)
            h = ops.rms_norm(x, w[p + "ffn_norm"], c.rms_norm_eps)
            x = ops.linear(ops.silu_mul(ops.linear(h, w[p + "gate_up"])), w[p + "down"], residual=x)
        x = ops.rms_norm(x[logits_rows], w["norm"], c.rms_norm_eps)  # only rows that sample
        return ops.linear(x, self.lm_head).float()                     # [S, V]


def _rope_tables(config: ModelConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, half, dtype=torch.float64) / half))
    pos = torch.arange(config.max_position_embeddings, dtype=torch.float64)
    angles = torch.outer(pos, inv_freq)  # [P, d/2]
    return angles.cos().float().to(device), angles.sin().float().to(device)
