"""Prefill attention without a boolean mask (backend/attention.py causal_attention: after a cached prefix, torch's
CPU flash kernel over the prefix and over the chunk, merged by their log-sum-exps) and, on a CPU with AMX-BF16
where the model's prefill linears run on bfloat16 tiles, long chunks' attention on those tiles
(backend/ops.py KernelOps._prefill_tiles)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend import attention, kernels
from backend.attention import AttentionMetadata, KVCache, PrefillSpan, causal_attention
from backend.ops import N16_GEMM_ROWS, KernelOps

K = kernels.load()


def masked_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Query i (position start + i) sees keys 0..start+i, in float64 with an explicit mask."""
    n_q, n_k = q.shape[2], k.shape[2]
    mask = torch.arange(n_k)[None, :] <= torch.arange(start, start + n_q)[:, None]
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("start", [0, 1, 16, 37])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
def test_prefix_and_chunk_merge_to_the_masked_attention(dtype: torch.dtype, tol: float, start: int,
                                                         heads: tuple[int, int]) -> None:
    torch.manual_seed(start)
    (n_heads, n_kv), n_q, d = heads, 45, 64
    q = (torch.randn(1, n_heads, n_q, d) * 2).to(dtype)
    k, v = (torch.randn(1, n_kv, start + n_q, d).to(dtype) for _ in range(2))
    got = causal_attention(q, k, v, start)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), masked_reference(q, k, v, start), rtol=0, atol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 5e-6), (torch.bfloat16, 2e-2)])  # 160+ keys: the
@pytest.mark.parametrize("start", [1, 16, 40, 300])  # float32 kernel itself is 2.6e-6 off float64 on one seed
def test_both_ways_past_a_prefix_give_the_masked_attention(dtype: torch.dtype, tol: float, start: int) -> None:
    """The chunk padded to a causal square (short prefixes) and the prefix and chunk merged (long ones) alike,
    whichever causal_attention would pick for this length."""
    torch.manual_seed(start)
    n_heads, n_kv, n_q, d = 6, 2, 160, 64
    q = (torch.randn(1, n_heads, n_q, d) * 2).to(dtype)
    k, v = (torch.randn(1, n_kv, start + n_q, d).to(dtype) for _ in range(2))
    want = masked_reference(q, k, v, start)
    for way in (attention._padded_to_the_prefix, attention._prefix_then_chunk):
        got = way(q, k, v, start, None)
        assert got.dtype == dtype and got.shape == q.shape
        torch.testing.assert_close(got.double(), want, rtol=0, atol=tol, msg=way.__name__)


@pytest.mark.parametrize("dtype, short", [(torch.float32, 20), (torch.bfloat16, 40)])
def test_a_short_prefix_pads_the_chunk_a_long_one_merges(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                                          short: int) -> None:
    """The padded rows cost what query rows do: up to an eighth of the chunk in float32, a quarter in bfloat16."""
    taken: list[str] = []
    for way in ("_padded_to_the_prefix", "_prefix_then_chunk"):
        real = getattr(attention, way)
        monkeypatch.setattr(attention, way, lambda *a, real=real, way=way: taken.append(way) or real(*a))
    q = torch.randn(1, 4, 160, 32).to(dtype)
    for start in (short, short + 1):
        k, v = (torch.randn(1, 4, start + 160, 32).to(dtype) for _ in range(2))
        causal_attention(q, k, v, start)
    assert taken == ["_padded_to_the_prefix", "_prefix_then_chunk"]


def test_a_window_still_limits_what_a_query_sees() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 30, 32), torch.randn(1, 4, 50, 32), torch.randn(1, 4, 50, 32)
    got = causal_attention(q, k, v, 20, window=8)
    q_pos, k_pos = torch.arange(20, 50)[:, None], torch.arange(50)[None, :]
    mask = (k_pos <= q_pos) & (k_pos > q_pos - 8)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(K is None or not K.has_avx512() or not kernels.cpu_has_native_bf16() or not K.could_brgemm_bf16(),
                    reason="no bfloat16 tiles (AMX-BF16) the OS grants on this CPU")
@pytest.mark.parametrize("start", [0, 83])
def test_long_chunks_attend_on_tiles_where_the_linears_do(start: int) -> None:
    """tiles=True: a chunk of N16_GEMM_ROWS rows or more rounds q, k and v to bfloat16 (within bfloat16's error of
    the float32 kernel, and not equal to it); a shorter chunk, or tiles=False, is the float32 kernel's, bit for bit."""
    torch.manual_seed(start)
    bs, n_heads, n_kv, d = 16, 8, 4, 64
    cache = KVCache(1, 40, bs, n_kv, d, torch.float16, torch.device("cpu"))
    cache.data.normal_()
    blocks = torch.randperm(40)
    ops = KernelOps(K, "bfloat16")
    for rows in (N16_GEMM_ROWS + 44, N16_GEMM_ROWS - 1):
        span = PrefillSpan(rows=slice(0, rows), key_blocks=blocks[:-(-(start + rows) // bs)], num_keys=start + rows,
                           start=start)
        meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), prefills=[span], decode_rows=None,
                                 decode_blocks=None, decode_lens=None)
        q = torch.randn(rows, n_heads, d) * 2
        exact = ops.attention(q, cache, 0, meta, tiles=False)
        got = ops.attention(q, cache, 0, meta, tiles=True)
        assert got.dtype == torch.float32 and got.shape == q.shape and got.is_contiguous()
        if rows < N16_GEMM_ROWS:
            assert torch.equal(got, exact)
            continue
        assert not torch.equal(got, exact)
        torch.testing.assert_close(got, exact, rtol=0, atol=3e-2)
        ops.n16_gemm = torch.float32  # PREFILL_GEMM=float32: no tiles, whatever the model asks
        assert torch.equal(ops.attention(q, cache, 0, meta, tiles=True), exact)
        ops.n16_gemm = torch.bfloat16
