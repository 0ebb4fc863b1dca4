"""Prefill attention on AMX-BF16 tiles (backend/csrc/flash_bf16.h): bfloat16 q, k, v → bfloat16, float32 sums and
softmax, one pass over the keys per block of query rows. Checked against float64 attention with an explicit mask,
next to torch's SDPA on the same bfloat16 operands (whose error is the bfloat16 output's rounding); then where
the ops and the image towers use it. Skipped where the CPU has no tiles the OS grants."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend import kernels
from backend.attention import AttentionMetadata, KVCache, PrefillSpan
from backend.ops import CpuBf16Ops, TorchOps

K = kernels.load_flash_bf16()
pytestmark = pytest.mark.skipif(K is None, reason="no AMX-BF16 tiles (with AVX-512) on this CPU")


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, causal: bool) -> torch.Tensor:
    """[Q, H, d], [N, Hkv, d] → [Q, H, d] float64; query i at position start + i."""
    n_q, n_k = q.shape[0], k.shape[0]
    mask = (torch.arange(n_k)[None, :] <= torch.arange(start, start + n_q)[:, None]) if causal else None
    qq, kk, vv = (a.double().transpose(0, 1)[None] for a in (q, k, v))
    return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)


def sdpa_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, causal: bool, want: torch.Tensor) -> float:
    n_q, n_k = q.shape[0], k.shape[0]
    mask = (torch.arange(n_k)[None, :] <= torch.arange(start, start + n_q)[:, None]) if causal else None
    got = F.scaled_dot_product_attention(*(a.transpose(0, 1)[None] for a in (q, k, v)), attn_mask=mask,
                                         enable_gqa=True)[0].transpose(0, 1)
    return float((got.double() - want).abs().max())


@pytest.mark.parametrize("n_q, start, heads, d, causal, n_k", [
    (45, 0, (8, 2), 64, True, 45),
    (300, 0, (9, 3), 64, True, 300),      # several query blocks and key blocks
    (300, 213, (6, 2), 64, True, 513),    # after a cached prefix that ends inside a key block
    (1, 700, (4, 2), 64, True, 701),      # one row over many keys
    (130, 0, (4, 4), 128, False, 77),     # an image tower's: every key visible, fewer keys than queries
    (257, 0, (6, 6), 64, False, 600),
    (64, 5, (3, 1), 32, True, 69),        # head size 32, a group of 3
])
def test_matches_the_masked_attention(n_q: int, start: int, heads: tuple[int, int], d: int, causal: bool,
                                      n_k: int) -> None:
    torch.manual_seed(n_q + start)
    n_heads, n_kv = heads
    q = (torch.randn(n_q, n_heads, d) * 2).bfloat16()
    k, v = (torch.randn(n_k, n_kv, d).bfloat16() for _ in range(2))
    got = K.flash_attention_bf16(q, k, v, start, causal, d ** -0.5)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    want = reference(q, k, v, start, causal)
    err = float((got.double() - want).abs().max())
    # torch's SDPA on the same operands measured 3.8e-3 to 7.8e-3 here (the bfloat16 output's last bit)
    assert err <= max(1.5 * sdpa_error(q, k, v, start, causal, want), 8e-3), err


def test_strided_rows_and_any_block_sizes() -> None:
    """q, k and v as views of a fused [T, 3, H, d] projection (rows 3Hd apart) give what contiguous copies give;
    other block sizes sum in another order (each within the bound of the reference)."""
    torch.manual_seed(0)
    qkv = torch.randn(333, 3, 4, 64).bfloat16()
    q, k, v = qkv.unbind(1)
    got = K.flash_attention_bf16(q, k, v, 0, True, 0.125)
    assert torch.equal(got, K.flash_attention_bf16(q.contiguous(), k.contiguous(), v.contiguous(), 0, True, 0.125))
    want = reference(q, k, v, 0, True)
    for q_block, k_block in ((64, 64), (128, 256), (256, 512), (7, 32)):
        other = K.flash_attention_bf16(q, k, v, 0, True, 0.125, q_block, k_block)
        assert float((other.double() - want).abs().max()) <= 8e-3, (q_block, k_block)


@pytest.mark.parametrize("change, message", [
    (lambda q, k, v: (q.float(), k, v, 0, True), "bfloat16"),
    (lambda q, k, v: (q, k[:-1], v[:-1], 0, True), "start \\+ Q"),
    (lambda q, k, v: (*(a[..., :48].contiguous() for a in (q, k, v)), 0, True), "multiple of 32"),
    (lambda q, k, v: (q[:, :3], k, v, 0, True), "multiple of the KV heads"),
    (lambda q, k, v: (q, k, v[:, :1], 0, True), "k and v must both be"),
])
def test_bad_operands_are_refused(change, message: str) -> None:  # type: ignore[no-untyped-def]
    q, k, v = torch.randn(20, 4, 64).bfloat16(), torch.randn(20, 2, 64).bfloat16(), torch.randn(20, 2, 64).bfloat16()
    with pytest.raises(RuntimeError, match=message):
        K.flash_attention_bf16(*change(q, k, v), 0.125)


class _Spy:
    """The kernels module, counting flash attention calls."""

    def __init__(self, module: object) -> None:
        self.module, self.calls = module, 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.module, name)

    def flash_attention_bf16(self, *args: object) -> torch.Tensor:
        self.calls += 1
        return self.module.flash_attention_bf16(*args)  # type: ignore[attr-defined]

    def flash_attention_paged(self, *args: object, **kwargs: object) -> torch.Tensor:
        self.calls += 1
        return self.module.flash_attention_paged(*args, **kwargs)  # type: ignore[attr-defined]


def test_bfloat16_ops_run_prefill_chunks_in_it() -> None:
    """CpuBf16Ops.attention: a chunk after a cached prefix and a decode row in one batch, against TorchOps'
    SDPA on the same cache; a sliding window stays with TorchOps."""
    torch.manual_seed(1)
    bs, n_heads, n_kv, d = 16, 6, 2, 64
    cache = KVCache(1, 40, bs, n_kv, d, torch.bfloat16, torch.device("cpu"))
    cache.data.normal_()
    blocks = torch.randperm(40)
    start, rows = 37, 150
    span = PrefillSpan(rows=slice(1, 1 + rows), start=start, key_blocks=blocks[:-(-(start + rows) // bs)],
                       num_keys=start + rows)
    meta = AttentionMetadata(slot_mapping=torch.zeros(1 + rows, dtype=torch.long), decode_rows=torch.tensor([0]),
                             decode_blocks=blocks[None, 20:24], decode_lens=torch.tensor([60]), prefills=[span])
    q = torch.randn(1 + rows, n_heads, d).bfloat16()
    ops = CpuBf16Ops(K)
    spy = _Spy(K)
    ops.k = spy
    got = ops.attention(q, cache, 0, meta)
    assert spy.calls == 1
    want = TorchOps().attention(q, cache, 0, meta)
    assert torch.equal(got[:1], want[:1])  # the decode row: TorchOps' own
    assert float((got[1:].float() - want[1:].float()).abs().max()) <= 1.6e-2
    ops.attention(q, cache, 0, meta, window=8)
    assert spy.calls == 1


def test_an_image_tower_in_bfloat16_attends_in_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A CLIP tower loaded in bfloat16 on this CPU takes the kernel for every layer's attention, and embeds an image
    as SDPA does (each layer's attention within bfloat16's error: the embeddings agree to a cosine of 0.999)."""
    from backend.image_preprocess import decode_image, pixels
    from backend.vision_tower import load_vision_tower
    from kvyard.model_config import load_model_config
    from tests.support.tiny_vision import png_bytes, save_llava_dir, tiny_llava

    path = save_llava_dir(tiny_llava(image_size=112, vision={"hidden_size": 128, "num_attention_heads": 2}), tmp_path)
    config = load_model_config(path)
    tower = load_vision_tower(path, config, torch.bfloat16, torch.device("cpu"))
    assert tower.flash is not None
    spy = _Spy(tower.flash)
    tower.flash = spy  # type: ignore[assignment]
    assert config.vision is not None
    px = pixels(decode_image(png_bytes(112, 112, seed=4)), config.vision.preprocess)
    got = tower.encode(px, None).float()
    assert spy.calls == config.vision.num_layers
    tower.flash = None
    want = tower.encode(px, None).float()
    cos = F.cosine_similarity(got, want, dim=-1)
    assert float(cos.min()) >= 0.999, float(cos.min())
    print(f"lowest cosine {float(cos.min()):.6f}, flash vs SDPA equal: {torch.equal(got, want)}")


@pytest.mark.parametrize("q_dtype, cache_dtype", [(torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16),
                                                  (torch.float32, torch.bfloat16), (torch.float32, torch.float32)])
def test_paged_reads_the_cache_in_place(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """flash_attention_paged: keys and values straight from scattered cache blocks, q and out in q's dtype (float32
    q, out and a float16 cache: the GGUF prefill's), rounded to bfloat16 as they are read; into a given out view."""
    torch.manual_seed(2)
    bs, n_heads, n_kv, d, start, rows = 16, 8, 2, 64, 45, 300
    cache = KVCache(1, 40, bs, n_kv, d, cache_dtype, torch.device("cpu"))
    cache.data.normal_()
    blocks = torch.randperm(40)[:-(-(start + rows) // bs)]
    slots = (blocks[:, None] * bs + torch.arange(bs)).flatten()[:start + rows]
    k, v = (cache.data[0, i][slots] for i in (0, 1))
    q = (torch.randn(rows + 10, n_heads, d) * 2).to(q_dtype)[5:5 + rows]
    want = reference(q.bfloat16(), k.bfloat16(), v.bfloat16(), start, True)
    got = K.flash_attention_paged(q, cache.data[0, 0], cache.data[0, 1], blocks, bs, start, d ** -0.5)
    assert got.dtype == q_dtype and got.shape == q.shape
    err = float((got.double() - want).abs().max())
    # bfloat16 out: within torch's SDPA's error on the same operands; float32 out is not rounded again, which leaves
    # the probabilities' rounding to bfloat16 (2.2e-3 to 2.3e-3 measured, against 8.1e-3 with a bfloat16 out)
    bound = 1.5 * sdpa_error(q.bfloat16(), k.bfloat16(), v.bfloat16(), start, True, want) if q_dtype == torch.bfloat16 else 4e-3
    assert err <= bound, (err, bound)
    out = torch.full((rows + 4, n_heads, d), 7.0, dtype=q_dtype)
    K.flash_attention_paged(q, cache.data[0, 0], cache.data[0, 1], blocks, bs, start, d ** -0.5, out=out[2:2 + rows])
    assert torch.equal(out[2:2 + rows], got) and bool((out[:2] == 7).all() and (out[2 + rows:] == 7).all())
    with pytest.raises(RuntimeError, match="fewer blocks than keys"):
        K.flash_attention_paged(q, cache.data[0, 0], cache.data[0, 1], blocks[:-2], bs, start, d ** -0.5)
    with pytest.raises(RuntimeError, match="block out of range"):
        K.flash_attention_paged(q, cache.data[0, 0], cache.data[0, 1], blocks + 40, bs, start, d ** -0.5)
