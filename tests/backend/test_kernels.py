"""The C++ CPU kernels against the pure-PyTorch reference ops, on random data and on the GGUF's blocks."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from backend import kernels
from backend import ops as ops_module
from backend.attention import AttentionMetadata, KVCache, PrefillSpan, attend_decode_gathered
from backend.ops import DENSE_ROWS, KernelOps, TorchOps
from backend.quant import Q4_1_BYTES, Q8_0_BYTES, QuantWeight, from_gguf_blocks
from kvyard.model_path import embedded_model_path

K = kernels.load()
pytestmark = pytest.mark.skipif(K is None, reason="C++ kernels unavailable (no AVX2/FMA or no compiler)")


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> QuantWeight:
    """Valid GGUF bytes for an [n, k] matrix: random codes, scales and minimums."""
    rng = np.random.default_rng(seed)
    nb = k // 32
    size = Q4_1_BYTES if kind == "q4_1" else Q8_0_BYTES
    raw = rng.integers(0, 256, size=(n, nb, size), dtype=np.uint8)
    scales = rng.uniform(-0.05, 0.05, size=(n, nb, 2 if kind == "q4_1" else 1)).astype(np.float16)
    raw[..., : scales.shape[-1] * 2] = scales.view(np.uint8).reshape(n, nb, -1)
    return from_gguf_blocks(kind, raw.reshape(n, nb * size), n, k)


@pytest.fixture(scope="module")
def gguf_tensors() -> dict[str, object]:
    reader = gguf.GGUFReader(str(embedded_model_path()))
    return {t.name: t for t in reader.tensors}


@pytest.mark.parametrize("name", ["blk.0.ffn_up.weight", "blk.3.attn_q.weight", "token_embd.weight"])
def test_blocks_decode_to_ggufs_own_dequantization(gguf_tensors: dict, name: str) -> None:
    t = gguf_tensors[name]
    k, n = int(t.shape[0]), int(t.shape[1])
    w = from_gguf_blocks(t.tensor_type.name.lower(), t.data, n, k)
    expected = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
    assert torch.equal(w.dequantize(), expected)
    rows = torch.tensor([0, 5, n - 1])
    assert torch.equal(K.dequant_rows(w.qs, w.d, w.m if w.m is not None else w.d, rows, w.kind == "q4_1"),
                       expected[rows])
    if n * k <= 4 << 20:
        out = torch.empty(n, k)
        K.dequantize_into(w.qs, w.d, w.m if w.m is not None else w.d, out, w.kind == "q4_1")
        assert torch.equal(out, expected)


def has_avx512() -> bool:
    before = K.use_avx512(True)
    on = K.use_avx512(before)
    return on


@pytest.fixture(params=["avx2", "avx512"])
def isa(request: pytest.FixtureRequest) -> str:
    """Each linear test on both code paths the CPU offers: AVX2 everywhere, AVX-512 where present."""
    if request.param == "avx512" and not has_avx512():
        pytest.skip("this CPU has no AVX-512")
    before = K.use_avx512(request.param == "avx512")
    yield request.param
    K.use_avx512(before)


class _Calls:
    """The kernels module, recording which of its functions a KernelOps looks up."""

    def __init__(self, k: object) -> None:
        self.k = k
        self.names: list[str] = []

    def __getattr__(self, name: str) -> object:
        self.names.append(name)
        return getattr(self.k, name)


def tiled_linear_is_exact(ops: KernelOps, w: QuantWeight, rows: int, seed: int, rel: float) -> None:
    """ops.linear over w for `rows` token rows with DENSE_MAX_NUMEL made small (tiles of 32 output rows): within
    float32 rounding of the exact (float64) product, bias and residual included."""
    n, k = w.shape
    dense = w.dequantize()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    bias, residual = torch.randn(n, generator=gen), torch.randn(rows, n, generator=gen)
    want = x.double() @ dense.double().T + bias.double() + residual.double()
    rounding = 1e-6 * (x.abs().double() @ dense.abs().double().T) + rel * want.abs() + 1e-6
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops_module, "DENSE_MAX_NUMEL", 40 * k)
        got = ops.linear(x, w, bias, residual)
    assert ((got.double() - want).abs() <= rounding).all()


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_a_prefill_over_a_large_matrix_goes_through_the_gemm_in_tiles(kind: str) -> None:
    """Past DENSE_ROWS rows a rows-layout matrix of any size is dequantized a tile of output rows at a time
    (three tiles and a short one) and multiplied by torch's GEMM, within float32 rounding of the exact product;
    the block kernel is not called (it re-decodes each block per 8 rows: an AVX2 CPU's 1.7B prefill took 4.5x
    llama-server's time through it)."""
    ops = KernelOps(K)
    calls = _Calls(K)
    ops.k = calls  # type: ignore[assignment]
    tiled_linear_is_exact(ops, random_blocks(kind, 104, 544, seed=5), DENSE_ROWS + 30, seed=5, rel=1e-6)
    assert calls.names.count("dequantize_into") == 4 and not {"q4_1_linear", "q8_0_linear"} & set(calls.names)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 17, 32, DENSE_ROWS, DENSE_ROWS + 7])
def test_block_linear_matches_dense_linear(kind: str, rows: int, isa: str) -> None:
    w = random_blocks(kind, 72, 96 if rows % 2 else 544, seed=rows)  # 3 and 17 blocks: tails of every width
    dense = w.dequantize()
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, w.shape[1], generator=gen)
    bias, residual = torch.randn(72, generator=gen), torch.randn(rows, 72, generator=gen)
    ops, ref = KernelOps(K), TorchOps()
    # Against the exact (float64) product, within float32's rounding of a 96- or 544-term sum: ~16 eps of the
    # sum of |terms| (a wrong block or scale would be off by whole terms, orders of magnitude more).
    rounding = 1e-6 * (x.abs().double() @ dense.abs().double().T) + 1e-6
    want = ref.linear(x.double(), dense.double(), bias.double(), residual.double())
    assert ((ops.linear(x, w, bias, residual).double() - want).abs() <= rounding + 1e-6 * want.abs()).all()
    assert ((ops.linear(x, w).double() - ref.linear(x.double(), dense.double())).abs() <= rounding).all()


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_n16_layout_holds_the_same_blocks(kind: str) -> None:
    w = random_blocks(kind, 48, 544, seed=5)
    w16 = w.to_n16()
    assert w16.layout == "n16" and w16.shape == w.shape and w16.nbytes() == w.nbytes()
    back = w16.to_rows()
    assert torch.equal(back.qs, w.qs) and torch.equal(back.d, w.d)
    assert torch.equal(w16.dequantize(), w.dequantize())
    rows = torch.tensor([0, 15, 16, 47])  # the embedding lookup reads rows out of the groups
    mins = w16.m if w16.m is not None else w16.d
    assert torch.equal(K.dequant_rows(w16.qs, w16.d, mins, rows, kind == "q4_1"), w.dequantize()[rows])


def int16_rounding_bound(x: torch.Tensor, dense: torch.Tensor, block: int = 32, levels: int = 32767) -> torch.Tensor:
    """|error| of rounding each `block` activations to integers with scale max|x|/levels (Q4_1 / Q8_0: 32
    and 32767; the K-quants: 256 and 8191): at most half a step per value, times the weights it meets; plus
    float32's rounding of the sums."""
    rows, k = x.shape
    step = x.abs().view(rows, k // block, block).amax(-1) / levels  # [M, k / block]
    w_block = dense.abs().view(dense.shape[0], k // block, block).sum(-1)  # [N, k / block]
    return 0.5 * step.double() @ w_block.double().T * 1.001 + 2e-6 * (x.abs().double() @ dense.abs().double().T)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 17, 32, 64, 65, 130])
def test_int16_linear_matches_dense_linear(kind: str, rows: int) -> None:
    w = random_blocks(kind, 80, 96 if rows % 2 else 544, seed=rows).to_n16()
    dense = w.dequantize()
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, w.shape[1], generator=gen) * torch.rand(rows, 1, generator=gen) * 4
    x[0, :7] = 0.0  # an all-zero stretch inside a block, and (K=96) a block of one sign
    bias, residual = torch.randn(80, generator=gen), torch.randn(rows, 80, generator=gen)
    ops, ref = KernelOps(K), TorchOps()
    want = ref.linear(x.double(), dense.double(), bias.double(), residual.double())
    bound = int16_rounding_bound(x, dense) + 1e-6 * want.abs()
    assert ((ops.linear(x, w, bias, residual).double() - want).abs() <= bound).all()


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_int16_linear_gives_each_row_the_same_bits_in_any_batch(kind: str) -> None:
    """The dot products are exact integers and the float part one fixed chain per output: a row's
    result does not depend on how many rows share the call (1 to 130, across every chunking)."""
    w = random_blocks(kind, 96, 544, seed=9).to_n16()
    x = torch.randn(130, 544, generator=torch.Generator().manual_seed(9))
    ops = KernelOps(K)
    batched = ops.linear(x, w)
    for size in (*range(1, 14), 17, 23, 32, 64, 65):  # every chunk size alone, and split evenly (13: 7 + 6)
        assert torch.equal(ops.linear(x[:size], w), batched[:size]), size
    assert torch.equal(torch.cat([ops.linear(x[i:i + 1], w) for i in range(0, 130, 7)]), batched[::7])


def test_rms_norm_and_silu_mul() -> None:
    x, w = torch.randn(7, 96) * 3, torch.randn(96)
    ops, ref = KernelOps(K), TorchOps()
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    gu = torch.randn(7, 2 * 40)
    torch.testing.assert_close(ops.silu_mul(gu), ref.silu_mul(gu.clone()), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_silu_mul_in_place_rounds_as_two_new_tensors(dtype: torch.dtype) -> None:
    """TorchOps.silu_mul writes over gate_up's gate half: the bits of silu(gate) * up as new tensors."""
    gu = (torch.randn(33, 2 * 48) * 4).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = TorchOps().silu_mul(gu)
    assert got.data_ptr() == gu.data_ptr() and torch.equal(got, want)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_rope_store_rotates_and_writes_the_cache(kv_dtype: torch.dtype) -> None:
    torch.manual_seed(294)  # a seed where a float32 rounding difference crosses a float16 rounding boundary
    n_heads, n_kv, d, T = 6, 2, 64, 5
    qkv = torch.randn(T, (n_heads + 2 * n_kv) * d)
    angles = torch.rand(T, d // 2) * 6
    cos, sin = angles.cos(), angles.sin()
    slots = torch.tensor([3, 17, 4, 30, 9])
    caches = [KVCache(1, 4, 8, n_kv, d, kv_dtype, torch.device("cpu")) for _ in range(2)]
    q_ref = TorchOps().rope_store(qkv, cos, sin, caches[0], 0, slots, n_heads, n_kv)
    q_got = KernelOps(K).rope_store(qkv, cos, sin, caches[1], 0, slots, n_heads, n_kv)
    torch.testing.assert_close(q_got, q_ref, rtol=1e-6, atol=1e-6)
    # The kernel's rotation may fuse a multiply-add (1 float32 ulp from torch's): a float16 cache then holds
    # the same value or its neighbour, never more than one float16 step apart (2^-10 relative).
    rtol = 1e-6 if kv_dtype == torch.float32 else 2 ** -10
    torch.testing.assert_close(caches[1].data.float(), caches[0].data.float(), rtol=rtol, atol=1e-6)
    with pytest.raises(RuntimeError, match="slot out of range"):
        K.rope_store(qkv, cos, sin, caches[1].data[0, 0], caches[1].data[0, 1], slots + 100, n_heads, n_kv)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(9, 3), (8, 2), (7, 1)])  # groups of 3, 4 and 7 query heads per KV head
@pytest.mark.parametrize("window", [0, 24])
def test_decode_attention_reads_paged_blocks_in_place(head_dim: int, kv_dtype: torch.dtype,
                                                       heads: tuple[int, int], window: int, isa: str) -> None:
    """Against gather + SDPA over the same cache (a float16 cache: the same float16 values, widened);
    with a sliding window of 24 keys, rows both shorter and longer than it (the window's first key
    mid-block), on the 256-bit and the AVX-512 passes."""
    torch.manual_seed(head_dim)
    bs, (n_heads, n_kv) = 16, heads
    cache = KVCache(1, 64, bs, n_kv, head_dim, kv_dtype, torch.device("cpu"))
    cache.data.normal_()
    lens = torch.tensor([1, 7, 16, 17, 33, 200])   # block edges, partial blocks, one key
    nblk = 13
    table = torch.randint(0, 64, (len(lens), nblk))  # any block anywhere, as after reuse
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), decode_rows=torch.arange(len(lens)),
                             decode_blocks=table, decode_lens=lens, prefills=[])
    q = torch.randn(len(lens), n_heads, head_dim) * 3
    want = attend_decode_gathered(q, cache, 0, meta, window)
    got = KernelOps(K).attention(q, cache, 0, meta, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if window:  # the window changes the answer of the rows longer than it
        assert not torch.allclose(got[lens > window], attend_decode_gathered(q, cache, 0, meta)[lens > window])
    with pytest.raises(RuntimeError, match="block out of range"):
        K.decode_attention(q, cache.data[0, 0], cache.data[0, 1], table + 64, lens, bs, head_dim ** -0.5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [0, 24])
def test_decode_attention_row_alone_equals_its_batch(kv_dtype: torch.dtype, window: int, isa: str) -> None:
    """A row decoding alone has its KV heads split into ranges (work items for the threads); in a batch
    of 8 each row is one item over all its heads. Either way each head's sums run in the same order: the
    same bits, and gather + SDPA's answer. 12 KV heads of 64 (no grouping, as SmolLM2-1.7B's 32)."""
    torch.manual_seed(7)
    bs, n_heads, head_dim = 16, 12, 64
    cache = KVCache(1, 112, bs, n_heads, head_dim, kv_dtype, torch.device("cpu"))
    cache.data.normal_()
    lens = torch.tensor([1, 9, 16, 40, 77, 130, 200, 31])
    table = torch.randperm(112)[:8 * 13].view(8, 13)
    q = torch.randn(len(lens), n_heads, head_dim) * 3
    batch = K.decode_attention(q, cache.data[0, 0], cache.data[0, 1], table, lens, bs, head_dim ** -0.5, window)
    for b in range(len(lens)):
        alone = K.decode_attention(q[b:b + 1], cache.data[0, 0], cache.data[0, 1], table[b:b + 1], lens[b:b + 1],
                                   bs, head_dim ** -0.5, window)
        assert torch.equal(alone[0], batch[b]), b
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), decode_rows=torch.arange(len(lens)),
                             decode_blocks=table, decode_lens=lens, prefills=[])
    torch.testing.assert_close(batch, attend_decode_gathered(q, cache, 0, meta, window), rtol=1e-5, atol=1e-5)


def test_kernels_off_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    from backend.model import default_ops
    from backend.ops import CpuBf16Ops
    monkeypatch.setattr(kernels, "_cached", [None])
    assert type(default_ops(torch.device("cpu"), torch.float32)) is TorchOps
    assert type(default_ops(torch.device("cpu"), torch.bfloat16)) is TorchOps
    monkeypatch.setattr(kernels, "_cached", [K])
    assert isinstance(default_ops(torch.device("cpu"), torch.float32), KernelOps)
    # bfloat16: torch's ops with the kernels' RMSNorm and SiLU·up where they run AVX-512 (tests/backend/test_bf16_rows.py)
    assert type(default_ops(torch.device("cpu"), torch.bfloat16)) is (CpuBf16Ops if K.has_avx512() else TorchOps)


@pytest.mark.skipif(K is None or not K.has_avx512(), reason="the prefill attention kernel needs AVX-512")
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("window", [0, 24])
def test_prefill_attention_matches_sdpa(head_dim: int, kv_dtype: torch.dtype, heads: tuple[int, int],
                                        window: int) -> None:
    """A prompt's first chunk (causal over itself) and a later chunk over a cached prefix, beside a decode
    row in the same step, against gather + SDPA (TorchOps) over the same scattered blocks."""
    torch.manual_seed(head_dim + window)
    bs, (n_heads, n_kv) = 16, heads
    cache = KVCache(1, 32, bs, n_kv, head_dim, kv_dtype, torch.device("cpu"))
    cache.data.normal_()
    blocks = torch.randperm(32)[:8]
    first = PrefillSpan(rows=slice(0, 45), key_blocks=blocks[:3], num_keys=45, start=0)
    later = PrefillSpan(rows=slice(1, 38), key_blocks=blocks, num_keys=120, start=83)  # keys 0..119, mid-block
    for spans, rows in (([first], 45), ([later], 38)):
        decode = spans[0] is later  # the later chunk shares its step with a decode row (row 0)
        meta = AttentionMetadata(
            slot_mapping=torch.empty(0, dtype=torch.long), prefills=spans,
            decode_rows=torch.tensor([0]) if decode else None, decode_blocks=blocks[None, :2] if decode else None,
            decode_lens=torch.tensor([20]) if decode else None)
        q = torch.randn(rows, n_heads, head_dim) * 2
        want = TorchOps().attention(q, cache, 0, meta, window)
        got = KernelOps(K).attention(q, cache, 0, meta, window)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="block out of range"):
        K.prefill_attention(q, cache.data[0, 0], cache.data[0, 1], blocks + 32, bs, 83, head_dim ** -0.5)
