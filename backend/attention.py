"""Paged attention for one engine step: the block cache, the step's metadata, attention over the blocks."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backend.engine_types import KVLayout


@dataclass
class PrefillSpan:
    """One sequence's chunk of query rows that is longer than a single token."""
    rows: slice                 # its rows in the flat batch
    key_blocks: torch.Tensor    # [nblk] KV blocks holding every key it sees (cached prefix + this chunk)
    num_keys: int               # keys it sees: start + chunk length
    start: int                  # position of its first query row (== number of keys before the chunk)


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner and shared by every layer."""
    slot_mapping: torch.Tensor          # [T] where each new token's K/V is written
    decode_rows: torch.Tensor | None    # [B] rows that are single-token queries (decodes)
    decode_blocks: torch.Tensor | None  # [B, nblk] KV blocks each decode row reads (padded with 0)
    decode_lens: torch.Tensor | None    # [B] keys each decode row sees (its position + 1)
    prefills: list[PrefillSpan]

    @property
    def decode_only(self) -> bool:
        """Every row of the step is a single-token decode (the steady state)."""
        return (self.decode_rows is not None and not self.prefills
                and self.decode_rows.shape[0] == self.slot_mapping.shape[0])


class KVCache:
    """K and V for every layer, addressed by slot = block_id * block_size + offset."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)  # [L, 2, S, Hkv, d]
        # Gathered K/V for one layer's attention, reused by every layer and step: a fresh buffer of
        # tens of MB per gather costs page faults that dwarf the copy itself (measured ~7x on CPU).
        self._scratch: dict[str, torch.Tensor] = {}

    def scratch(self, name: str, numel: int) -> torch.Tensor:
        """A flat buffer of at least numel elements, kept and grown across steps. While a CUDA graph is being
        captured, a fresh one from the graph's pool instead: a kept buffer that a later step grows (frees)
        would leave the graph writing into freed memory."""
        if self.data.is_cuda and torch.cuda.is_current_stream_capturing():
            return torch.empty(numel, dtype=self.data.dtype, device=self.data.device)
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 2 * (0 if buf is None else buf.numel())), dtype=self.data.dtype,
                              device=self.data.device)
            self._scratch[name] = buf
        return buf[:numel]

    def layout(self) -> KVLayout:
        layers, two, _, hkv, d = self.data.shape
        return KVLayout(self.block_size, str(self.data.dtype).removeprefix("torch."),
                        (layers, two, self.block_size, hkv, d), self.data.dtype.itemsize)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype.itemsize


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, block_size: int, out: torch.Tensor) -> torch.Tensor:
    """cache: [S, Hkv, d] slots; blocks: [...] block ids → [..., len * block_size, Hkv, d] in `out`.
    Whole blocks are contiguous rows, so one index_select moves them at memcpy speed."""
    hkv, d = cache.shape[1], cache.shape[2]
    row = block_size * hkv * d
    rows = torch.index_select(cache.view(-1, row), 0, blocks.reshape(-1), out=out.view(-1, row))
    return rows.view(*blocks.shape[:-1], blocks.shape[-1] * block_size, hkv, d)


def attend_decode_gathered(q: torch.Tensor, cache: KVCache, layer: int, meta: AttentionMetadata,
                           window: int = 0) -> torch.Tensor:
    """Decode rows the portable way: gather each row's blocks, then SDPA. q: [B, H, d] → [B, H, d].
    window > 0: each row sees only its last `window` keys (a sliding window, itself included)."""
    assert meta.decode_blocks is not None and meta.decode_lens is not None
    k_cache, v_cache = cache.data[layer, 0], cache.data[layer, 1]  # [S, Hkv, d]
    bs = cache.block_size
    n = meta.decode_blocks.numel() * bs * k_cache.shape[1] * k_cache.shape[2]
    kd = _gather_blocks(k_cache, meta.decode_blocks, bs, cache.scratch("k", n)).transpose(1, 2)  # [B, Hkv, Kmax, d]
    vd = _gather_blocks(v_cache, meta.decode_blocks, bs, cache.scratch("v", n)).transpose(1, 2)
    kd, vd = kd.to(q.dtype), vd.to(q.dtype)  # a float16 cache under a float32 model: convert what was read
    key_pos = torch.arange(kd.shape[2], device=q.device)
    lens = meta.decode_lens[:, None, None, None]
    mask = key_pos < lens  # [B, 1, 1, Kmax]: the row's real keys (its table is padded with block 0)
    if window:
        mask &= key_pos >= lens - window
    od = F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, attn_mask=mask, enable_gqa=True)
    return od.squeeze(2)


def attend_prefills(q: torch.Tensor, cache: KVCache, layer: int, meta: AttentionMetadata,
                    out: torch.Tensor, window: int = 0) -> None:
    """Each multi-token chunk attends causally over its cached prefix and itself; rows into out.
    window > 0: query i sees only keys (start + i - window, start + i] (a sliding window)."""
    for span in meta.prefills:
        qp = q[span.rows].transpose(0, 1).unsqueeze(0)                      # [1, H, Q, d]
        kp, vp = span_keys(cache, layer, span, q.dtype)
        op = causal_attention(qp, kp, vp, span.start, window)
        out[span.rows] = op.squeeze(0).transpose(0, 1)


def span_keys(cache: KVCache, layer: int, span: PrefillSpan, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values a prefill chunk sees (its cached prefix and itself), [1, Hkv, K, d] in dtype."""
    k_cache, v_cache = cache.data[layer, 0], cache.data[layer, 1]  # [S, Hkv, d]
    n = span.key_blocks.numel() * cache.block_size * k_cache.shape[1] * k_cache.shape[2]
    kp = _gather_blocks(k_cache, span.key_blocks, cache.block_size, cache.scratch("pk", n))[:span.num_keys]
    vp = _gather_blocks(v_cache, span.key_blocks, cache.block_size, cache.scratch("pv", n))[:span.num_keys]
    # a float16 cache under a float32 model: convert what was read
    return kp.transpose(0, 1).unsqueeze(0).to(dtype), vp.transpose(0, 1).unsqueeze(0).to(dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int = 0,
                     scale: float | None = None) -> torch.Tensor:
    """One chunk's attention: q [1, H, Q, d] at positions start.., k and v [1, Hkv, start + Q, d]; query i sees
    keys 0..start+i (window > 0: only those after start + i - window). → [1, H, Q, d] in q's dtype."""
    n_q, n_k = q.shape[2], k.shape[2]
    if start == 0 and (not window or n_q <= window):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale)
    if not window and q.device.type == "cpu":
        if start * (8 if q.dtype == torch.float32 else 4) <= n_q:
            return _padded_to_the_prefix(q, k, v, start, scale)
        return _prefix_then_chunk(q, k, v, start, scale)
    q_pos = torch.arange(start, start + n_q, device=q.device)
    k_pos = torch.arange(n_k, device=q.device)[None, :]
    mask = k_pos <= q_pos[:, None]
    if window:
        mask &= k_pos > q_pos[:, None] - window
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=scale)


def _padded_to_the_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                          scale: float | None) -> torch.Tensor:
    """causal_attention after a short cached prefix, on a CPU: `start` rows of zeros in front of q make the chunk
    a causal square (padded row start + i sees keys 0..start+i), one flash call, their rows dropped. Each padded
    row costs what a query row does, so this wins while the prefix is short against the chunk, the common case of
    a chat template's first block before a long new prompt (9 heads of 64, 1060 rows after 16 keys, AMX Xeon:
    bfloat16 4.1 → 3.0 ms against _prefix_then_chunk; float32 8.2 → 7.8 ms; break-even near a prefix of a
    quarter of the chunk in bfloat16, an eighth in float32)."""
    n_heads, n_q, d = q.shape[1], q.shape[2], q.shape[3]
    padded = q.new_zeros(1, n_heads, start + n_q, d)
    padded[:, :, start:] = q
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return flash(padded, k, v, 0.0, True, scale=scale)[0][:, :, start:]


def _prefix_then_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                       scale: float | None) -> torch.Tensor:
    """causal_attention after a cached prefix, on a CPU: torch's flash kernel twice without a mask, over the
    prefix (every key visible) and over the chunk (causal), the two merged by their log-sum-exps. A boolean
    mask sends SDPA to a slower path (930 rows after 16 cached keys, 32 heads of 64, AMX Xeon: bfloat16
    16.0 → 10.2 ms; float32 40.1 → 26.0 ms)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o_chunk, lse_chunk = flash(q, k[:, :, start:], v[:, :, start:], 0.0, True, scale=scale)   # lse [1, H, Q]
    o_prefix, lse_prefix = flash(q, k[:, :, :start], v[:, :, :start], 0.0, False, scale=scale)
    top = torch.maximum(lse_chunk, lse_prefix)
    w_chunk, w_prefix = (lse_chunk - top).exp_(), (lse_prefix - top).exp_()
    total = w_chunk + w_prefix
    merged = o_chunk.float().mul_((w_chunk / total).unsqueeze(-1))
    return merged.add_(o_prefix.float().mul_((w_prefix / total).unsqueeze(-1))).to(q.dtype)
