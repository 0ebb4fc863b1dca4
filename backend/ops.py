"""The per-layer operations of backend/model.py, in two interchangeable sets.

TorchOps is plain PyTorch (any device and dtype; dense weights): the reference. KernelOps runs the
C++ CPU kernels of backend/csrc over weights kept in the GGUF's block formats (float32 activations),
and must compute what TorchOps computes over the dequantized weights (tests/backend/test_kernels.py)."""
from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from backend.attention import AttentionMetadata, KVCache, PrefillSpan, attend_decode_gathered, attend_prefills
from backend.quant import K_KINDS, BlockWeight, QuantWeight, StackedWeight
from kvyard.model_config import ModelConfig

Weight = torch.Tensor | BlockWeight

# Above this many rows a linear over "rows"-layout blocks (float32 activations) dequantizes the weight
# into a scratch matrix and calls the BLAS GEMM (prefill chunks): the block kernel re-decodes every block
# per 8 rows, the GEMM amortises one decode over all of them ("n16" blocks: N16_GEMM_ROWS below). Measured
# crossover on a 2-core AVX2 machine (1536x576 and 3072x576 matrices): 64-128 rows; below it the kernel is up
# to 1.9x faster (16 rows).
# A matrix of more than DENSE_MAX_NUMEL weights is dequantized a tile of output rows at a time into the same
# scratch (_gemm_tiles): the 1.7B's qkv, gate_up and down went to the block kernel instead, and an AVX2 CPU's
# 940-token prefill took 109 s against llama-server's 24 (KVYARD_CPU_ISA=avx2 on the Xeon, 2026-11-26).
DENSE_ROWS = 64
DENSE_MAX_NUMEL = 8 << 20
# From this many rows a linear over "n16" blocks dequantizes tiles of the weight (exactly, float32) and
# calls the GEMM instead of the int16 kernel (prefill chunks), in the dtype PREFILL_GEMM picks
# (kernels.default_prefill_gemm: bfloat16 where the CPU has AMX-BF16, None — the int16 kernels — on Sapphire/
# Emerald Rapids without AMX, else float32). Measured on an Intel
# Xeon with AVX-512 VNNI but no AMX or AVX512-BF16, 930 rows, 1.7B-shaped matrices, one thread: 1.3x (Q4_K)
# to 1.9x (Q6_K) the kernel's rate, and exact float32 activations. Decode batches (at most 64 rows, the
# fused step) never reach it: they keep the int16 kernels and their batch-invariant bits.
N16_GEMM_ROWS = 256

# The head sizes backend/csrc's decode attention is compiled for (decode_attention, FusedDecoder). Any
# other head size (Llama-family checkpoints with 16, 80 or 100 exist) runs attention in PyTorch, op by
# op; the linears, norms and RoPE stay in the kernels.
KERNEL_HEAD_DIMS = frozenset({32, 64, 96, 128})


def bf16_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (float32) with both operands rounded to bfloat16, the products summed and returned in float32:
    oneDNN's bf16 "fpmath mode" where it multiplies bfloat16 (AMX-BF16: kernels.cpu_has_native_bf16); elsewhere
    the same numbers computed from explicitly rounded copies (slowly: PREFILL_GEMM=bfloat16 forced, tests).
    A bfloat16 result would round every output to 8 significant bits: measured on the embedded 135M's
    prefill, top-1 agreement 0.979 that way against 0.995 with float32 results."""
    from backend.kernels import cpu_has_native_bf16
    if not cpu_has_native_bf16():
        return a.to(torch.bfloat16).float() @ b.to(torch.bfloat16).float()
    knob = torch.backends.mkldnn.matmul
    before = knob.fp32_precision
    knob.fp32_precision = "bf16"
    try:
        return a @ b
    finally:
        knob.fp32_precision = before


class TorchOps:
    """Reference implementations; dense weights only."""

    def fused_decoder(self, config: ModelConfig, weights: dict[str, Weight], lm_head: Weight) -> Any | None:
        """Something whose forward() runs a whole decode-only step in one call, or None: op by op."""
        return None

    def fused_lora(self, a: list[torch.Tensor], bt: list[torch.Tensor]) -> Any:
        """A LoRA adapter for the fused decoder's forward_lora (only called where fused_decoder gave one)."""
        raise NotImplementedError("no fused decode step in these ops")

    def embed(self, w: Weight, ids: torch.Tensor) -> torch.Tensor:
        assert isinstance(w, torch.Tensor)
        return w[ids]

    def linear(self, x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        assert isinstance(w, torch.Tensor)
        y = F.linear(x, w, bias)
        return y if residual is None else residual + y

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, written over gate_up's gate half (every caller's gate_up is its own fresh product): the
        same roundings as two new tensors, without them (bfloat16 on an AMX CPU, [1056, 3072] then the down
        linear: 4.95 → 3.72 ms)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate, inplace=True).mul_(up)

    def gate_up_silu(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """silu(x @ gate^T) * (x @ up^T) for a gate_up matrix: linear, then silu_mul."""
        return self.silu_mul(self.linear(x, w))

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                   layer: int, slots: torch.Tensor, n_heads: int, n_kv: int) -> torch.Tensor:
        """qkv: [T, (H+2Hkv)d] → q [T, H, d]; k (rotated) and v written into the cache at slots."""
        d = qkv.shape[-1] // (n_heads + 2 * n_kv)
        q, k, v = qkv.split([n_heads * d, n_kv * d, n_kv * d], dim=-1)
        c, s = cos.to(qkv.dtype), sin.to(qkv.dtype)
        kv_dtype = cache.data.dtype  # the cache may hold a narrower type than the model computes in
        cache.data[layer, 0].index_copy_(0, slots, _rope(k.view(-1, n_kv, d), c, s).to(kv_dtype))
        cache.data[layer, 1].index_copy_(0, slots, v.view(-1, n_kv, d).to(kv_dtype))
        return _rope(q.reshape(-1, n_heads, d), c, s)

    def attention(self, q: torch.Tensor, cache: KVCache, layer: int, meta: AttentionMetadata,
                  window: int = 0, tiles: bool = False) -> torch.Tensor:
        """q: [T, H, d] → [T, H, d]; window > 0: each query sees only its last `window` keys. tiles: the
        model's prefill linears run on bfloat16 tiles (KernelOps.takes_tiles), so may its long chunks'
        attention; PyTorch's attention computes in q's dtype either way."""
        out = torch.empty_like(q)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = attend_decode_gathered(q[meta.decode_rows], cache, layer, meta, window)
        self.attend_prefills(q, cache, layer, meta, out, window)
        return out

    def attend_prefills(self, q: torch.Tensor, cache: KVCache, layer: int, meta: AttentionMetadata,
                        out: torch.Tensor, window: int) -> None:
        """Each multi-token chunk's rows of out (backend/attention.py's gathered keys and SDPA)."""
        attend_prefills(q, cache, layer, meta, out, window)


class CpuBf16Ops(TorchOps):
    """bfloat16 activations over dense weights on a CPU whose kernels run AVX-512 (DTYPE=bfloat16 from a Hugging
    Face directory): TorchOps, with RMSNorm, SiLU·up and RoPE + the K/V store each one pass of the C++ kernels
    (backend/csrc/bf16_rows.h) where torch's bfloat16 ops took five to eight, with the same roundings. A
    LLaVA-shaped prompt with a new image: [1064, 576] RMSNorm 746 → 112 µs, [1064, 3072] SiLU·up 865 → 504 µs.
    Shapes the kernels do not take (rows not a multiple of 16, another cache dtype) go to TorchOps."""

    def __init__(self, module: Any) -> None:
        self.k = module
        # Prefill chunks' attention on AMX-BF16 tiles (backend/csrc/flash_bf16.h) where torch's brgemm runs there.
        self.flash = bool(module.could_brgemm_bf16())

    def linear(self, x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual + x @ w^T as one oneDNN call (its sum into the residual's copy: [1060, 1536] → 576, 2.35 →
        2.17 ms), the product added before its bfloat16 rounding rather than after."""
        if residual is not None and bias is None and isinstance(w, torch.Tensor) and x.dim() == 2:
            return torch.addmm(residual, x, w.t())
        return super().linear(x, w, bias, residual)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.shape[-1] % 16:
            return super().rms_norm(x, weight, eps)
        return self.k.rms_norm_bf16(x, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype != torch.bfloat16 or gate_up.dim() != 2 or gate_up.shape[-1] % 32 or not gate_up.is_contiguous():
            return super().silu_mul(gate_up)
        return self.k.silu_mul_bf16_(gate_up)

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                   layer: int, slots: torch.Tensor, n_heads: int, n_kv: int) -> torch.Tensor:
        d = qkv.shape[-1] // (n_heads + 2 * n_kv)
        if qkv.dtype != torch.bfloat16 or cache.data.dtype != torch.bfloat16 or d % 32 or cos.dtype != torch.float32:
            return super().rope_store(qkv, cos, sin, cache, layer, slots, n_heads, n_kv)
        return self.k.rope_store_bf16(qkv, cos, sin, cache.data[layer, 0], cache.data[layer, 1], slots, n_heads, n_kv)

    def attend_prefills(self, q: torch.Tensor, cache: KVCache, layer: int, meta: AttentionMetadata,
                        out: torch.Tensor, window: int) -> None:
        """Prefill chunks in the flash kernel, straight from the paged cache (a LLaVA-shaped prompt's 1076 rows, 9
        heads of 64: 3.1 → 1.9 ms against torch's flash kernel, the same bfloat16 probabilities and float32 sums);
        a sliding window, or head sizes it does not take, as TorchOps."""
        if not self.flash or window or q.dtype != torch.bfloat16 or q.shape[-1] % 32:
            super().attend_prefills(q, cache, layer, meta, out, window)
            return
        for span in meta.prefills:
            self.k.flash_attention_paged(q[span.rows], cache.data[layer, 0], cache.data[layer, 1], span.key_blocks,
                                         cache.block_size, span.start, q.shape[-1] ** -0.5, out=out[span.rows])


class KernelOps(TorchOps):
    """The C++ kernels (float32 on the CPU); QuantWeight or dense float32 weights."""

    def __init__(self, kernels: ModuleType, prefill_gemm: str = "auto") -> None:
        """prefill_gemm: what prefill chunks over n16 weights multiply in (kernels.PREFILL_GEMMS; auto:
        kernels.default_prefill_gemm(), BackendConfig's PREFILL_GEMM)."""
        self.k = kernels
        # One dense weight at a time, reused by every layer: a fresh 10+ MB buffer per matmul costs
        # more in page faults than the decode itself.
        self._dense = torch.empty(0)
        # Prefill-sized batches over n16 weights through the GEMM (N16_GEMM_ROWS) in this dtype; None: the
        # int16 kernels at every size.
        from backend.kernels import default_prefill_gemm
        choice = default_prefill_gemm() if prefill_gemm == "auto" else prefill_gemm
        self.n16_gemm: torch.dtype | None = None if choice == "int16" else getattr(torch, choice)
        # Whether torch's brgemm multiplies bfloat16 on tiles here (oneDNN's AMX micro-kernel): see brgemm_bf16
        # (benchmarks/prefill_profile.py turns it off to time the W^T tiles instead).
        from backend.kernels import cpu_has_native_bf16
        self.bf16_tiles = cpu_has_native_bf16() and bool(kernels.could_brgemm_bf16())
        # Prefill chunks' attention in the AVX-512 kernel (backend/csrc/prefill_attention.h), else SDPA.
        self.prefill_kernel = kernels.has_avx512()

    def fused_decoder(self, config: ModelConfig, weights: dict[str, Weight], lm_head: Weight) -> Any | None:
        """The C++ FusedDecoder (backend/csrc/decode_step.h) when every matrix is in GGUF blocks: one call
        and one OpenMP team per decode step instead of ~10 Python calls per layer."""
        if config.head_dim not in KERNEL_HEAD_DIMS:
            return None
        mats = [weights["embed"], lm_head] + [weights[f"layers.{i}.{n}"] for i in range(config.num_layers)
                                              for n in ("qkv", "o", "gate_up", "down")]
        if not all(isinstance(w, BlockWeight) for w in mats):
            return None
        none = torch.empty(0)

        def blocks(w: Weight) -> Any:
            if isinstance(w, StackedWeight):
                return self.k.BlockTensors(qs=none, d=none, m=none, parts=[blocks(p) for p in w.parts])
            assert isinstance(w, QuantWeight)
            return self.k.BlockTensors(qs=w.qs, d=w.d, m=w.m if w.m is not None else none)

        def layer(p: str) -> Any:
            bias = weights.get(p + "qkv_bias")
            norms = [weights.get(p + n) for n in ("q_norm", "k_norm")]  # Qwen3
            q_norm, k_norm = (n if isinstance(n, torch.Tensor) else none for n in norms)
            return self.k.LayerTensors(
                attn_norm=weights[p + "attn_norm"], qkv=blocks(weights[p + "qkv"]),
                qkv_bias=bias if isinstance(bias, torch.Tensor) else none, q_norm=q_norm, k_norm=k_norm,
                o=blocks(weights[p + "o"]),
                ffn_norm=weights[p + "ffn_norm"], gate_up=blocks(weights[p + "gate_up"]),
                down=blocks(weights[p + "down"]))

        tensors = self.k.ModelTensors(embed=blocks(weights["embed"]), norm=weights["norm"], lm_head=blocks(lm_head),
                                      layers=[layer(f"layers.{i}.") for i in range(config.num_layers)])
        return self.k.FusedDecoder(config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps,
                                   tensors, [config.layer_window(i) for i in range(config.num_layers)])

    def fused_lora(self, a: list[torch.Tensor], bt: list[torch.Tensor]) -> Any:
        return self.k.LoraWeights(a=a, bt=bt)

    def embed(self, w: Weight, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(w, torch.Tensor):
            return w[ids]
        return self.k.dequant_rows(w.qs, w.d, _mins(w), ids, w.kind == "q4_1")

    def linear(self, x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(w, torch.Tensor):
            return super().linear(x, w, bias, residual)
        if isinstance(w, StackedWeight):  # each part into its own columns, as the fused step runs it
            rows = [p.shape[0] for p in w.parts]
            biases = bias.split(rows) if bias is not None else [None] * len(rows)
            if self._on_brgemm(x, w):  # x rounded once, each part into its columns
                xb, y = _bf16(x), torch.empty(x.shape[0], w.shape[0])
                for p, b, cols in zip(w.parts, biases, y.split(rows, dim=1)):
                    self._brgemm(xb, p, b, out=cols)
            else:
                y = torch.cat([self.linear(x, p, b) for p, b in zip(w.parts, biases)], dim=-1)
            return y if residual is None else residual + y
        if w.layout == "rows" and x.shape[0] > DENSE_ROWS:
            return self._gemm_tiles(x, w, bias, residual, torch.matmul)
        if self._on_brgemm(x, w):
            return self._brgemm(_bf16(x), w, bias, residual)
        if w.layout == "n16" and x.shape[0] >= N16_GEMM_ROWS and self.n16_gemm is not None:
            return self._gemm_tiles(x, w, bias, residual, bf16_matmul if self.n16_gemm == torch.bfloat16 else torch.matmul)
        if w.kind in K_KINDS:
            return self.k.kquant_linear(x, w.qs, w.d, w.m, bias, residual)
        if w.kind == "q4_1":
            return self.k.q4_1_linear(x, w.qs, w.d, w.m, bias, residual)
        return self.k.q8_0_linear(x, w.qs, w.d, bias, residual)

    @property
    def brgemm_bf16(self) -> bool:
        """bfloat16 prefill GEMMs on brgemm straight from the blocks, float32 results (backend/csrc/gemm_bf16.h)
        where the CPU has bfloat16 tiles; else tiles of W^T through bf16_matmul."""
        return self.n16_gemm == torch.bfloat16 and self.bf16_tiles

    def takes_tiles(self, w: Weight) -> bool:
        """Whether prefill chunks of N16_GEMM_ROWS rows or more multiply w on brgemm's bfloat16 tiles."""
        if isinstance(w, StackedWeight):
            return all(self.takes_tiles(p) for p in w.parts)
        return self.brgemm_bf16 and isinstance(w, QuantWeight) and w.layout == "n16"

    def _on_brgemm(self, x: torch.Tensor, w: Weight) -> bool:
        return x.shape[0] >= N16_GEMM_ROWS and self.takes_tiles(w)

    def _brgemm(self, xb: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None,
                residual: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """xb (bfloat16) @ W^T in float32 on brgemm's bfloat16 tiles (the same products as bf16_matmul's),
        + bias, + residual (the order linear adds them in), into out where given."""
        return self.k.n16_gemm_bf16(xb, w.qs, w.d, _mins(w), w.kind == "q4_1", bias=bias, residual=residual,
                                    out=out)

    def gate_up_silu(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """On brgemm (prefill chunks, AMX): the two halves' products straight into silu(gate) * up, the [T, 2F]
        product never in memory; otherwise linear, then silu_mul."""
        if isinstance(w, QuantWeight) and self._on_brgemm(x, w) and w.shape[0] % 32 == 0:
            return self.k.n16_gemm_bf16_silu(_bf16(x), w.qs, w.d, _mins(w), w.kind == "q4_1")
        return self.silu_mul(self.linear(x, w))

    def _gemm_tiles(self, x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None,
                    residual: torch.Tensor | None, matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                    ) -> torch.Tensor:
        """x @ W^T through torch's GEMM (matmul: torch.matmul, or bf16_matmul for PREFILL_GEMM=bfloat16), W
        dequantized (exactly) a tile of output rows at a time into one reused float32 scratch of at most
        DENSE_MAX_NUMEL weights: n16 blocks straight into W^T's layout, rows blocks into W's."""
        n, k = w.shape
        tile = max(16, min(n, DENSE_MAX_NUMEL // k) // 16 * 16)
        if self._dense.numel() < tile * k:
            self._dense = torch.empty(tile * k)
        y = torch.empty(x.shape[0], n) if tile < n else None
        q4, mins = w.kind == "q4_1", _mins(w)
        for n0 in range(0, n, tile):
            n1 = min(n, n0 + tile)
            if w.layout == "n16":
                wt = self._dense[:(n1 - n0) * k].view(k, n1 - n0)
                self.k.dequantize_n16_t(w.qs, w.d, mins, wt, n0 // 16, n1 // 16, q4)
            else:
                rows = self._dense[:(n1 - n0) * k].view(n1 - n0, k)
                self.k.dequantize_into(w.qs[n0:n1], w.d[n0:n1], mins[n0:n1], rows, q4)
                wt = rows.t()
            if y is None:
                y = matmul(x, wt)
            else:
                y[:, n0:n1] = matmul(x, wt)
        assert y is not None
        if bias is not None:
            y += bias
        return y if residual is None else residual + y

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.k.rms_norm(x, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.k.silu_mul(gate_up)

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                   layer: int, slots: torch.Tensor, n_heads: int, n_kv: int) -> torch.Tensor:
        return self.k.rope_store(qkv, cos, sin, cache.data[layer, 0], cache.data[layer, 1], slots,
                                 n_heads, n_kv)

    def attention(self, q: torch.Tensor, cache: KVCache, layer: int, meta: AttentionMetadata,
                  window: int = 0, tiles: bool = False) -> torch.Tensor:
        if q.shape[-1] not in KERNEL_HEAD_DIMS:
            return super().attention(q, cache, layer, meta, window)
        if meta.decode_rows is None:
            if self.prefill_kernel and len(meta.prefills) == 1 and meta.prefills[0].rows == slice(0, q.shape[0]):
                return self._prefill(q, cache, layer, meta.prefills[0], window, tiles)  # one prompt's chunk: no copy
            out = torch.empty_like(q)
        elif not meta.prefills and meta.decode_rows.shape[0] == q.shape[0]:
            # Every row decodes (the steady state): straight from the paged blocks, no gather.
            return self.k.decode_attention(q, cache.data[layer, 0], cache.data[layer, 1], meta.decode_blocks,
                                           meta.decode_lens, cache.block_size, q.shape[-1] ** -0.5, window)
        else:
            out = torch.empty_like(q)
            out[meta.decode_rows] = self.k.decode_attention(
                q[meta.decode_rows], cache.data[layer, 0], cache.data[layer, 1], meta.decode_blocks,
                meta.decode_lens, cache.block_size, q.shape[-1] ** -0.5, window)
        if self.prefill_kernel:
            for span in meta.prefills:
                self._prefill(q[span.rows], cache, layer, span, window, tiles, out[span.rows])
        else:
            attend_prefills(q, cache, layer, meta, out, window)
        return out

    def _prefill(self, q: torch.Tensor, cache: KVCache, layer: int, span: PrefillSpan, window: int, tiles: bool,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """One chunk's causal attention over its cached prefix and itself, straight from the paged blocks (into out
        where given); a chunk as long as brgemm's (N16_GEMM_ROWS) on bfloat16 tiles instead where the model's
        linears run there."""
        if tiles and self.brgemm_bf16 and q.shape[0] >= N16_GEMM_ROWS and not window:
            return self._prefill_tiles(q, cache, layer, span, out)
        y = self.k.prefill_attention(q, cache.data[layer, 0], cache.data[layer, 1], span.key_blocks,
                                     cache.block_size, span.start, q.shape[-1] ** -0.5, window)
        return y if out is None else out.copy_(y)

    def _prefill_tiles(self, q: torch.Tensor, cache: KVCache, layer: int, span: PrefillSpan,
                       out: torch.Tensor | None) -> torch.Tensor:
        """The flash kernel straight from the paged float16 cache into out (backend/csrc/flash_bf16.h: q, keys and
        values rounded to bfloat16 as they are read, brgemm's tiles, float32 sums, softmax and output; 946 rows, 32
        heads of 64, AMX Xeon: 5.4 ms against 10.2 for torch's flash kernel, which also wanted the gathered,
        converted copies, and 23-26 ms for the float32 kernel)."""
        return self.k.flash_attention_paged(q, cache.data[layer, 0], cache.data[layer, 1], span.key_blocks,
                                            cache.block_size, span.start, q.shape[-1] ** -0.5, out=out)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, d]; rotates pairs (i, i + d/2) as the Hugging Face layout does."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bfloat16, row-major (what brgemm's A reads; .to keeps a transposed view's strides)."""
    return x.to(torch.bfloat16).contiguous()


def _mins(w: QuantWeight) -> torch.Tensor:
    return w.m if w.m is not None else w.d  # Q8_0 has none; the kernel does not read it then (K-quants: sub-scales)
