"""The Llama-family network (GQA, RoPE, RMSNorm, SwiGLU; Qwen3's q/k norms): flat token batch in, logits
out (or the hidden states, for a pooling model: backend/decoder_pooling.py)."""
from __future__ import annotations

import logging
import math
from typing import Any

import torch

from backend.attention import AttentionMetadata, KVCache
from backend.cuda_graphs import GraphedDecoder
from backend.lora import LoraBatch
from backend.lora_weights import FUSED_TARGETS, LoraAdapter
from backend.ops import DENSE_ROWS, KERNEL_HEAD_DIMS, CpuBf16Ops, KernelOps, TorchOps, Weight
from backend.quant import BlockWeight, QuantWeight
from kvyard.model_config import ModelConfig, RopeScaling

log = logging.getLogger("kvyard.backend")


def default_ops(device: torch.device, dtype: torch.dtype, prefill_gemm: str = "auto") -> TorchOps:
    """The C++ kernels for float32 on a CPU that has them; bfloat16 on an AVX-512 CPU: PyTorch with the kernels'
    RMSNorm, SiLU·up and RoPE (CpuBf16Ops); plain PyTorch everywhere else (CUDA, other CPUs' bfloat16).
    prefill_gemm: KernelOps' (BackendConfig.prefill_gemm)."""
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        from backend import kernels
        module = kernels.load() if dtype == torch.float32 else kernels.load_avx512()
        if module is not None:
            return KernelOps(module, prefill_gemm) if dtype == torch.float32 else CpuBf16Ops(module)
    return TorchOps()


def column_major_linears(weights: dict[str, Weight]) -> None:
    """The layers' dense matrices W [N, K] stored as W^T, contiguous (still seen as W: same shape, strides
    (1, N)): torch's float32 CPU GEMM computes x·W^T for a few rows (a prefill's uncached tail after a prefix
    hit, small decode batches) faster from this layout. Measured in process on a shared 2-core AVX-512 Xeon,
    576-wide 30-layer model, 2 threads: a 9-row tail 84-89 → 56-70 ms, a 281-row prefill 534 → 438 ms, 512
    rows 704 → 643 ms, but 1049 rows 1485-1685 → 1586-1718 ms (2-7% slower; 1 thread 2373 → 2500 ms)."""
    for name, w in weights.items():
        if name.startswith("layers.") and isinstance(w, torch.Tensor) and w.dim() == 2 and w.is_contiguous():
            weights[name] = w.t().contiguous().t()


class LlamaModel:
    """Plain functions over a dict of weights (gpt-fast style): no nn.Module bookkeeping per step.
    A weight is a dense tensor or a QuantWeight (GGUF blocks, computed on by the C++ kernels)."""

    def __init__(self, config: ModelConfig, weights: dict[str, Weight], ops: TorchOps | None = None,
                 max_positions: int | None = None, cuda_graphs: bool = True) -> None:
        """max_positions: the longest sequence served (RoPE tables are built that long; default the model's
        context), e.g. MAX_SEQ_LEN's cap on a 128K-context model. cuda_graphs: on a GPU, decode-only steps
        replay CUDA graphs of this forward (backend/cuda_graphs.py; CUDA_GRAPHS)."""
        self.config = config
        self.w = weights
        self.lm_head = weights.get("lm_head", weights["embed"])  # tied when the checkpoint has none
        embed = weights["embed"]
        self.device = embed.qs.device if isinstance(embed, QuantWeight) else embed.device
        self.dtype = torch.float32 if isinstance(embed, QuantWeight) else embed.dtype
        self.ops = ops or default_ops(self.device, self.dtype)
        if self.device.type == "cpu" and self.dtype == torch.float32:
            column_major_linears(weights)
        if not isinstance(self.ops, KernelOps) and any(isinstance(w, BlockWeight) for w in weights.values()):
            raise ValueError("GGUF block weights need the C++ CPU kernels (float32 on an AVX2 CPU)")
        if isinstance(self.ops, KernelOps) and config.head_dim not in KERNEL_HEAD_DIMS:
            log.warning("head_dim %d: the C++ attention kernels take %s; attention runs in PyTorch (slower decode)",
                        config.head_dim, ", ".join(map(str, sorted(KERNEL_HEAD_DIMS))))
        self.cos, self.sin = rope_tables(config, max_positions or config.max_position_embeddings,
                                         self.device)  # [P, d/2] each, float32
        self.windows = [config.layer_window(i) for i in range(config.num_layers)]  # 0: the whole context
        # Long prefill chunks attend on bfloat16 tiles where the layers' linears multiply there (an AMX CPU's
        # PREFILL_GEMM=bfloat16 over GGUF blocks); a model whose linears stay float32 keeps float32 attention.
        self.attention_tiles = isinstance(self.ops, KernelOps) and self.ops.takes_tiles(weights["layers.0.qkv"])
        # Decode-only steps of up to DENSE_ROWS rows (the linears' kernel range) in one C++ call, when the
        # ops have one: the same kernels in the same order, so the same logits as the loop below.
        self.fused = self.ops.fused_decoder(config, weights, self.lm_head)
        # On a GPU, decode-only steps of up to DENSE_ROWS rows replay CUDA graphs of the op-by-op step below.
        self.graphs = (GraphedDecoder(self._decode_step, self.device, DENSE_ROWS)
                       if cuda_graphs and self.device.type == "cuda" and self.fused is None else None)

    def fused_lora(self, adapter: LoraAdapter) -> Any:
        """An adapter in the fused decode step's form: A and B^T per layer and projection, empty where none
        (made once per adapter, on the engine thread)."""
        if adapter.fused is None:
            none = torch.empty(0)
            keys = [(i, t) for i in range(self.config.num_layers) for t in FUSED_TARGETS]
            adapter.fused = self.ops.fused_lora([adapter.mats[k][0] if k in adapter.mats else none for k in keys],
                                                [adapter.mats[k][1] if k in adapter.mats else none for k in keys])
        return adapter.fused

    def weight_bytes(self) -> int:
        """Bytes the weights take in their serving format."""
        return sum(w.nbytes() if isinstance(w, BlockWeight) else w.numel() * w.element_size()
                   for w in self.w.values())

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, logits_rows: torch.Tensor,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None, lora: LoraBatch | None = None,
                mrope: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T]; logits_rows: [S] rows that sample → logits [S, V] (float32).
        embeds: rows [M] whose input embedding is given instead of looked up, and those embeddings [M, D]
        (an image's placeholder tokens). lora: the rows that use LoRA adapters (backend/lora.py); the fused
        C++ decode step takes them too (each row's own adapter's terms, backend/csrc/lora_step.h). mrope:
        [3, T] (t, h, w) rotary positions (Qwen-VL, a step with image tokens) instead of `positions`."""
        if (self.fused is not None and meta.decode_only and input_ids.shape[0] <= DENSE_ROWS and embeds is None
                and mrope is None):
            args = (input_ids, positions, meta.slot_mapping, meta.decode_blocks, meta.decode_lens, self.cos, self.sin,
                    cache.data, cache.block_size, logits_rows)
            if lora is None:
                return self.fused.forward(*args)
            return self.fused.forward_lora(*args, lora.fused(self.fused_lora), lora.row_owner)
        if (self.graphs is not None and meta.decode_only and embeds is None and lora is None and mrope is None
                and meta.decode_blocks is not None and meta.decode_lens is not None
                and self.graphs.takes(input_ids.shape[0], meta.decode_blocks.shape[1])):
            logits = self.graphs.run(input_ids, positions, meta.slot_mapping, meta.decode_blocks, meta.decode_lens,
                                     cache)
            if logits is not None:
                return logits[logits_rows]
        x = self.hidden_states(input_ids, positions, cache, meta, embeds, lora, mrope)
        x = self.ops.rms_norm(x[logits_rows], self.w["norm"], self.config.rms_norm_eps)  # only rows that sample
        return self.ops.linear(x, self.lm_head).float()                                   # [S, V]

    def _decode_step(self, cache: KVCache, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                     blocks: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """A decode-only step from its bare tensors (what a CUDA graph records): logits [B, V] of every row."""
        meta = AttentionMetadata(slot_mapping=slots, decode_rows=torch.arange(input_ids.shape[0], device=lens.device),
                                 decode_blocks=blocks, decode_lens=lens, prefills=[])
        x = self.hidden_states(input_ids, positions, cache, meta)
        return self.ops.linear(self.ops.rms_norm(x, self.w["norm"], self.config.rms_norm_eps), self.lm_head).float()

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                      meta: AttentionMetadata, embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
                      lora: LoraBatch | None = None, mrope: torch.Tensor | None = None) -> torch.Tensor:
        """The last layer's output [T, D], before the final norm (a pooling model pools it, normed); embeds,
        lora and mrope as forward's."""
        c, ops, w = self.config, self.ops, self.w
        if mrope is None:
            cos, sin = self.cos[positions], self.sin[positions]  # [T, d/2]; shared by every layer
        else:
            cos, sin = self._mrope_tables(mrope)
        x = ops.embed(w["embed"], input_ids).to(self.dtype)  # [T, D]
        if embeds is not None:
            x[embeds[0]] = embeds[1].to(self.dtype)
        for i in range(c.num_layers):
            p = f"layers.{i}."
            h = ops.rms_norm(x, w[p + "attn_norm"], c.rms_norm_eps)
            qkv = ops.linear(h, w[p + "qkv"], w.get(p + "qkv_bias"))                    # [T, (H+2Hkv)d]
            if lora is not None:
                lora.add(qkv, h, i, "qkv")
            if c.qk_norm:
                qkv = self._qk_norm(qkv, p)
            q = ops.rope_store(qkv, cos, sin, cache, i, meta.slot_mapping, c.num_heads, c.num_kv_heads)
            attn = ops.attention(q, cache, i, meta, self.windows[i], self.attention_tiles)  # [T, H, d]
            attn = attn.reshape(attn.shape[0], -1)
            x = ops.linear(attn, w[p + "o"], residual=x)
            if lora is not None:
                lora.add(x, attn, i, "o")
            h = ops.rms_norm(x, w[p + "ffn_norm"], c.rms_norm_eps)
            if lora is None:
                m = ops.gate_up_silu(h, w[p + "gate_up"])                                # [T, F]
            else:  # the adapters' deltas join gate_up before the activation
                gate_up = ops.linear(h, w[p + "gate_up"])
                lora.add(gate_up, h, i, "gate_up")
                m = ops.silu_mul(gate_up)
            x = ops.linear(m, w[p + "down"], residual=x)
            if lora is not None:
                lora.add(x, m, i, "down")
        return x

    def _mrope_tables(self, mrope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, d/2] for (t, h, w) positions [3, T]: mrope_section's first run of frequencies
        turns with t, the next with h, the last with w."""
        assert self.config.mrope_section is not None, "3-D positions on a model without M-RoPE"
        cos, sin, at = [], [], 0
        for axis, size in enumerate(self.config.mrope_section):
            cos.append(self.cos[mrope[axis], at:at + size])
            sin.append(self.sin[mrope[axis], at:at + size])
            at += size
        return torch.cat(cos, dim=-1), torch.cat(sin, dim=-1)

    def _qk_norm(self, qkv: torch.Tensor, p: str) -> torch.Tensor:
        """Qwen3: each head of q and k RMS-normed over its d values (before RoPE); v as it is."""
        c, d = self.config, self.config.head_dim
        q, k, v = qkv.split([c.num_heads * d, c.num_kv_heads * d, c.num_kv_heads * d], dim=-1)
        q = self.ops.rms_norm(q.reshape(-1, d), self.w[p + "q_norm"], c.rms_norm_eps).view(q.shape)
        k = self.ops.rms_norm(k.reshape(-1, d), self.w[p + "k_norm"], c.rms_norm_eps).view(k.shape)
        return torch.cat([q, k, v], dim=-1)


def rope_tables(config: ModelConfig, positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, d/2] (float32) of every position's rotation angles, RoPE scaling included
    (yarn's attention factor multiplies both). Both the op-by-op path and the fused decode step index them
    by position, so a position's keys rotate the same way whatever batch, chunk or prefix-cache hit
    computes them. Computed in float64, rounded once."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, half, dtype=torch.float64) / half))  # [d/2]
    pos = torch.arange(positions, dtype=torch.float64)
    rope, scale = config.rope_scaling, 1.0
    if rope is None:
        angles = torch.outer(pos, inv_freq)
    elif rope.rope_type == "dynamic":
        angles = _dynamic_ntk_angles(config, pos)
    else:
        if rope.rope_type == "linear":
            inv_freq = inv_freq / rope.factor
        elif rope.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(rope, inv_freq)
        elif rope.rope_type == "yarn":
            inv_freq, scale = _yarn_inv_freq(rope, inv_freq, config.rope_theta, config.head_dim), rope.attention_factor
        else:
            raise ValueError(f"RoPE type {rope.rope_type!r} has no tables")
        angles = torch.outer(pos, inv_freq)  # [P, d/2]
    return (angles.cos() * scale).float().to(device), (angles.sin() * scale).float().to(device)


def _llama3_inv_freq(rope: RopeScaling, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3.1's frequency-dependent stretch: wavelengths beyond original/low_freq_factor are divided by
    the factor, those below original/high_freq_factor kept, the band between blended smoothly. A GGUF
    stores the resulting divisors instead (rope_freqs)."""
    if rope.freq_factors is not None:
        return inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float64)
    original = rope.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
    out = torch.where(wavelen > original / rope.low_freq_factor, inv_freq / rope.factor, inv_freq)
    between = (wavelen >= original / rope.high_freq_factor) & (wavelen <= original / rope.low_freq_factor)
    return torch.where(between, blended, out)


def _yarn_inv_freq(rope: RopeScaling, inv_freq: torch.Tensor, theta: float, dim: int) -> torch.Tensor:
    """YaRN: high frequencies (more than beta_fast turns over the original context) extrapolate, low ones
    (fewer than beta_slow turns) interpolate by the factor, a linear ramp over the dimensions between."""
    def dim_at(turns: float) -> float:  # the dimension whose frequency turns `turns` times in the context
        return dim * math.log(rope.original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_at(rope.beta_fast), dim_at(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-dimension ramp would divide by zero
    # The ramp in float32, as the reference computes it: its values are what the blend is made of.
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).double()
    extrapolate = 1 - ramp
    return inv_freq / rope.factor * (1 - extrapolate) + inv_freq * extrapolate


def _dynamic_ntk_angles(config: ModelConfig, pos: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK: past the original context, the base grows with the sequence length. A position's
    rotation uses the base for a sequence that ends at it, so a key's rotation depends on its position
    alone: the paged cache, chunked prefill and prefix-cache hits all see the keys a token-by-token
    decode would have written (transformers computes exactly this when it decodes one token at a time;
    its one-shot prefill of a prompt beyond the original context rotates every key with the prompt's
    full-length base instead, which no cache can keep consistent as the sequence grows)."""
    rope = config.rope_scaling
    assert rope is not None
    half, dim, original = config.head_dim // 2, config.head_dim, rope.original_max_position_embeddings
    length = torch.clamp(pos + 1, min=original)  # [P]: the sequence a position ends
    base = config.rope_theta * ((rope.factor * length / original) - (rope.factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base[:, None] ** (torch.arange(0, half, dtype=torch.float64)[None, :] / half))  # [P, d/2]
    return pos[:, None] * inv_freq
