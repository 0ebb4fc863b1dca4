"""The fused decode step (one C++ call per decode-only step, backend/csrc/decode_step.h) computes exactly
what the model's op-by-op loop computes with the same kernels: the same logits bit for bit and the same
KV cache writes, on the embedded model and on a tiny random one with a q/k/v bias (Qwen2-style)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend import kernels
from backend.attention import KVCache
from backend.model import LlamaModel
from backend.model_runner import DirectChunk, DirectSeq, ModelRunner
from backend.ops import TorchOps
from backend.weights import load_weights
from kvyard.model_config import ModelConfig
from tests.backend.conftest import BLOCK_LAYOUTS, CPU
from tests.backend.test_kernels import isa, random_blocks  # noqa: F401  (isa: a fixture)

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="C++ kernels unavailable")


def decode_step(model: LlamaModel, cache: KVCache, contexts: list[int], fused: bool) -> torch.Tensor:
    """One decode step of len(contexts) rows, row b at position contexts[b], its blocks scattered."""
    bs, nblk = cache.block_size, max(contexts) // cache.block_size + 1
    order = torch.randperm(cache.num_blocks, generator=torch.Generator().manual_seed(len(contexts))).tolist()
    chunks = [DirectChunk(DirectSeq([(31 * b + 7 * i) % model.config.vocab_size for i in range(n + 1)],
                                    order[b * nblk:(b + 1) * nblk]), n, 1)
              for b, n in enumerate(contexts)]
    saved = model.fused
    model.fused = saved if fused else None
    try:
        return ModelRunner(model, cache).run(chunks)
    finally:
        model.fused = saved


def both_ways(model: LlamaModel, contexts: list[int], kv_dtype: torch.dtype, block_size: int = 16) -> None:
    c = model.config
    nblk = max(contexts) // block_size + 1
    caches = [KVCache(c.num_layers, len(contexts) * nblk, block_size, c.num_kv_heads, c.head_dim, kv_dtype, CPU)
              for _ in range(2)]
    caches[0].data.normal_(generator=torch.Generator().manual_seed(1))  # earlier keys and values
    caches[1].data.copy_(caches[0].data)
    fused = decode_step(model, caches[0], contexts, fused=True)
    per_op = decode_step(model, caches[1], contexts, fused=False)
    assert torch.equal(fused, per_op)
    assert torch.equal(caches[0].data, caches[1].data)  # this step's K and V written to the same slots


@pytest.fixture(scope="module", params=BLOCK_LAYOUTS)
def model_blocks(request: pytest.FixtureRequest, model_path: Path, model_config: ModelConfig) -> LlamaModel:
    return LlamaModel(model_config, load_weights(model_path, model_config, torch.float32, CPU, keep_blocks=True,
                                                 block_layout=request.param))


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 32, 64])
def test_fused_step_equals_op_by_op(model_blocks: LlamaModel, rows: int, kv_dtype: torch.dtype) -> None:
    """Both sides of the linears' one-row/tile switch (16 rows) and of the micro-tile sizes."""
    assert model_blocks.fused is not None
    both_ways(model_blocks, [3 + 37 * b % 200 for b in range(rows)], kv_dtype)


@pytest.mark.parametrize("rows", [1, 17])
def test_fused_step_split_over_two_threads(model_blocks: LlamaModel, rows: int) -> None:
    """The team splits rows, items and attention heads by thread: still the per-op numbers."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        both_ways(model_blocks, [9 + 41 * b % 150 for b in range(rows)], torch.float16)
    finally:
        torch.set_num_threads(before)


def tiny_qwen2_like(seed: int = 0, layout: str = "rows", window: int = 0,
                    window_layers: tuple[bool, ...] | None = None, qk_norm: bool = False) -> LlamaModel:
    """Random Q4_1 matrices, a Q8_0 embedding and q/k/v biases: 2 layers, 4 query heads of 32, 2 KV heads;
    optionally a sliding attention window (on the layers window_layers marks), or Qwen3's q/k norms instead
    of the biases."""
    config = ModelConfig(architecture="qwen3" if qk_norm else "qwen2", vocab_size=96, hidden_size=128,
                         intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                         rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=True,
                         attention_bias=not qk_norm, qk_norm=qk_norm, sliding_window=window,
                         window_layers=window_layers)
    gen = torch.Generator().manual_seed(seed)
    w: dict = {"embed": random_blocks("q8_0", 96, 128, seed), "norm": 1 + 0.1 * torch.randn(128, generator=gen)}
    for i in range(2):
        p = f"layers.{i}."
        w[p + "attn_norm"] = 1 + 0.1 * torch.randn(128, generator=gen)
        w[p + "ffn_norm"] = 1 + 0.1 * torch.randn(128, generator=gen)
        w[p + "qkv"] = random_blocks("q4_1", (4 + 2 * 2) * 32, 128, seed + 10 * i + 1)
        if qk_norm:  # per-head norms far from 1, so a step that skipped them would differ
            w[p + "q_norm"] = 1 + 0.5 * torch.randn(32, generator=gen)
            w[p + "k_norm"] = 1 + 0.5 * torch.randn(32, generator=gen)
        else:
            w[p + "qkv_bias"] = torch.randn(256, generator=gen)
        w[p + "o"] = random_blocks("q4_1", 128, 128, seed + 10 * i + 2)
        w[p + "gate_up"] = random_blocks("q4_1", 192, 128, seed + 10 * i + 3)
        w[p + "down"] = random_blocks("q4_1", 128, 96, seed + 10 * i + 4)
    if layout == "n16":
        w = {k: v.to_n16() if hasattr(v, "to_n16") else v for k, v in w.items()}
    return LlamaModel(config, w)


@pytest.mark.parametrize("layout", BLOCK_LAYOUTS)
@pytest.mark.parametrize("rows", [1, 3, 20])
def test_fused_step_with_qkv_bias(rows: int, layout: str) -> None:
    model = tiny_qwen2_like(layout=layout)
    assert model.fused is not None
    both_ways(model, [1 + 29 * b % 300 for b in range(rows)], torch.float32, block_size=8)


@pytest.mark.parametrize("layout", BLOCK_LAYOUTS)
@pytest.mark.parametrize("rows", [1, 3, 20])
def test_fused_step_with_qk_norm(rows: int, layout: str) -> None:
    """Qwen3: each head of q and k RMS-normed before RoPE, inside the one-call step as the per-op path does."""
    model = tiny_qwen2_like(layout=layout, qk_norm=True)
    assert model.fused is not None
    both_ways(model, [1 + 29 * b % 300 for b in range(rows)], torch.float32, block_size=8)


@pytest.mark.parametrize("layout", BLOCK_LAYOUTS)
@pytest.mark.parametrize("rows", [1, 3, 20])
def test_fused_step_with_a_sliding_window(rows: int, layout: str) -> None:
    """Contexts up to 300 keys past a 24-key window (on the second layer only, then on both)."""
    for layers in ((False, True), None):
        model = tiny_qwen2_like(layout=layout, window=24, window_layers=layers)
        both_ways(model, [1 + 29 * b % 300 for b in range(rows)], torch.float32, block_size=8)


@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize("layout", BLOCK_LAYOUTS)
def test_fused_step_against_the_reference_ops(layout: str, window: int, isa: str) -> None:
    """And against plain PyTorch over the dequantized weights, within float32 rounding (int16
    activations: within their rounding, 4e-4 of the logits here); with a window, against the
    gathered-SDPA path's mask; on the 256-bit and the AVX-512 attention passes."""
    model = tiny_qwen2_like(seed=3, layout=layout, window=window)
    dense = {k: v.dequantize() if hasattr(v, "dequantize") else v for k, v in model.w.items()}
    reference = LlamaModel(model.config, dense, ops=TorchOps())
    contexts = [5, 17, 40]
    c = model.config
    caches = [KVCache(c.num_layers, 3 * 6, 8, c.num_kv_heads, c.head_dim, torch.float32, CPU) for _ in range(2)]
    caches[0].data.normal_(generator=torch.Generator().manual_seed(2))
    caches[1].data.copy_(caches[0].data)
    got = decode_step(model, caches[0], contexts, fused=True)
    want = decode_step(reference, caches[1], contexts, fused=False)
    if layout == "rows":
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    else:  # measured 8e-3 on logits of ~20 (up to 89) from these random weights
        torch.testing.assert_close(got, want, rtol=0, atol=2e-2)


def test_mixed_steps_go_op_by_op(model_blocks: LlamaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step with a prefill chunk never reaches the fused decoder (it handles single-token rows only)."""
    calls: list[int] = []
    real = model_blocks.fused

    class Spy:
        def forward(self, *args: object) -> torch.Tensor:
            calls.append(1)
            return real.forward(*args)

    monkeypatch.setattr(model_blocks, "fused", Spy())
    c = model_blocks.config
    cache = KVCache(c.num_layers, 8, 16, c.num_kv_heads, c.head_dim, torch.float16, CPU)
    runner = ModelRunner(model_blocks, cache)
    prompt = DirectSeq(list(range(1, 21)), [0, 1])
    runner.run([DirectChunk(prompt, 0, 20)])
    assert calls == []
    other = DirectSeq(list(range(5, 40)), [2, 3, 4])
    runner.run([DirectChunk(other, 0, 34), DirectChunk(DirectSeq(prompt.token_ids + [7], [0, 1]), 20, 1)])
    assert calls == []
    runner.run([DirectChunk(DirectSeq(prompt.token_ids + [7], [0, 1]), 20, 1)])
    assert calls == [1]


def test_the_weights_cross_by_name_and_a_bad_one_is_named() -> None:
    """The FusedDecoder takes named structs (BlockTensors, LayerTensors, ModelTensors), not a flat list
    whose layout both sides mirror by hand; a weight of the wrong shape is refused naming its field."""
    k = kernels.load()
    d_model, heads, head_dim, ffn = 64, 2, 32, 128
    none = torch.empty(0)

    def blocks(n: int, kk: int, seed: int) -> object:
        w = random_blocks("q8_0", n, kk, seed)
        return k.BlockTensors(qs=w.qs, d=w.d, m=none)

    def model(attn_norm: torch.Tensor) -> object:
        layer = k.LayerTensors(attn_norm=attn_norm, qkv=blocks(3 * heads * head_dim, d_model, 1), qkv_bias=none, q_norm=none, k_norm=none,
                               o=blocks(d_model, heads * head_dim, 2), ffn_norm=torch.ones(d_model),
                               gate_up=blocks(2 * ffn, d_model, 3), down=blocks(d_model, ffn, 4))
        return k.ModelTensors(embed=blocks(96, d_model, 5), norm=torch.ones(d_model), lm_head=blocks(96, d_model, 6),
                              layers=[layer])

    k.FusedDecoder(heads, heads, head_dim, 1e-5, model(torch.ones(d_model)), [0])  # well formed
    with pytest.raises(RuntimeError, match="attn_norm: a contiguous float32 vector of 64"):
        k.FusedDecoder(heads, heads, head_dim, 1e-5, model(torch.ones(d_model + 1)), [0])
