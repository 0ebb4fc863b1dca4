"""The int16-activation linears on AVX2 (backend/csrc/qlinear_n16_avx2.h) and on AVX-512 without VNNI
(vpmaddwd + vpaddd: qlinear_n16_steps512.h and qlinear_kquant_steps512.h built without vpdpwssd) give the
bits of the AVX-512 VNNI ones: the same rounding of the activations, the same exact integer dots, the same
float part in the same order. On a CPU with VNNI, each check runs every code (K.use_int16)
and compares; elsewhere these tests skip, and test_kernels' int16 tests (against dense float32) and the
fused-step tests check the CPU's own code alone. An AVX2 CPU serves a K-quant GGUF in the n16 layout as
Q4_1 / Q8_0; an AVX-512 CPU without VNNI serves its blocks as they are."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from backend import kernels
from backend.attention import KVCache
from backend.config import BackendConfig
from backend.model import LlamaModel
from backend.quant import QuantWeight
from backend.weights import load_weights
from kvyard.model_config import ModelConfig, load_model_config
from tests.backend.conftest import CPU
from tests.backend.test_fused_decode import both_ways, decode_step
from tests.backend.test_kernels import random_blocks
from tests.support.tiny_models import tiny_model, write_gguf

K = kernels.load()
pytestmark = pytest.mark.skipif(K is None or not K.has_vnni(),
                                reason="needs AVX-512 VNNI to compare the AVX2 int16 code against")


def every_code(run) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """run() with the VNNI code, with plain AVX-512's (vpmaddwd on 512 bits) and with AVX2's."""
    before = K.use_int16("vnni")
    try:
        got = {}
        for code in ("vnni", "avx512", "avx2"):
            K.use_int16(code)
            got[code] = run()
        return got
    finally:
        K.use_int16(before)


def both_codes(run) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    """run()'s VNNI result and its AVX2 one, after checking that plain AVX-512's equals the VNNI one."""
    got = every_code(run)
    assert torch.equal(got["vnni"], got["avx512"])
    return got["vnni"], got["avx2"]


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 11, 12, 13, 17, 32, 65])
def test_avx2_int16_linear_has_the_vnni_bits(kind: str, rows: int) -> None:
    w = random_blocks(kind, 80, 96 if rows % 2 else 544, seed=rows).to_n16()
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, w.shape[1], generator=gen) * torch.rand(rows, 1, generator=gen) * 4
    x[0, :32] = 0  # an all-zero block: scale 0
    bias, residual = torch.randn(80, generator=gen), torch.randn(rows, 80, generator=gen)

    def run() -> torch.Tensor:
        if kind == "q4_1":
            return K.q4_1_linear(x, w.qs, w.d, w.m, bias, residual)
        return K.q8_0_linear(x, w.qs, w.d, bias, residual)

    vnni, avx2 = both_codes(run)
    assert torch.equal(vnni, avx2)
    dense = w.dequantize()
    assert (avx2 - (x @ dense.T + bias + residual)).abs().max() < 0.05  # and it is the product, not noise


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_avx2_dequantized_tiles_are_the_exact_weights(kind: str) -> None:
    """Prefill chunks multiply dequantized W^T tiles in torch's GEMM (ops.N16_GEMM_ROWS rows and more)."""
    w = random_blocks(kind, 64, 544, seed=9).to_n16()
    mins = w.m if w.m is not None else w.d

    def run() -> torch.Tensor:
        out = torch.full((544, 32), float("nan"))
        K.dequantize_n16_t(w.qs, w.d, mins, out, 1, 3, kind == "q4_1")  # groups 1-2: output rows 16-47
        return out

    vnni, avx2 = both_codes(run)
    assert torch.equal(vnni, avx2) and torch.equal(avx2, w.dequantize()[16:48].T)


@pytest.fixture(scope="module")
def model_n16(model_path: Path, model_config: ModelConfig) -> LlamaModel:
    return LlamaModel(model_config, load_weights(model_path, model_config, torch.float32, CPU, keep_blocks=True,
                                                 block_layout="n16"))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 32])
def test_avx2_decode_step_has_the_vnni_bits(model_n16: LlamaModel, rows: int, fused: bool) -> None:
    """The embedded model's decode step (the fused C++ step, and op by op) on both codes: the same logits
    bit for bit, so the quality measured for int16 activations holds on AVX2 unchanged."""
    c = model_n16.config
    contexts = [7 + 9 * b for b in range(rows)]
    nblk = max(contexts) // 16 + 1

    def run() -> torch.Tensor:
        cache = KVCache(c.num_layers, rows * nblk, 16, c.num_kv_heads, c.head_dim, torch.float16, CPU)
        cache.data.normal_(generator=torch.Generator().manual_seed(rows))
        return decode_step(model_n16, cache, contexts, fused=fused)

    vnni, avx2 = both_codes(run)
    assert torch.equal(vnni, avx2)


@pytest.fixture
def capped(request: pytest.FixtureRequest) -> Iterator[str]:
    K.cap_isa(kernels.ISA_LEVELS.index(request.param))
    yield request.param
    K.cap_isa(kernels.ISA_LEVELS.index("native"))


# (cap, KQUANTS, as resolved, Q4_K served as, Q6_K served as): by default AVX2 serves them mixed: Q4_K
# converted to Q4_1, Q6_K's codes widened to bytes (q6_k8: the file's numbers at Q8_0's cost); KQUANTS=native
# keeps both (qlinear_kquant_avx2.h, 256 bits), convert requantizes Q6_K to Q8_0; AVX-512 without VNNI
# (Skylake-SP/X) keeps them, multiplied by vpmaddwd on 512 bits.
@pytest.mark.parametrize("capped, kquants, resolved, q4_k, q6_k", [
    ("avx2", "auto", "mixed", "q4_1", "q6_k8"), ("avx2", "native", "native", "q4_k", "q6_k"),
    ("avx2", "convert", "convert", "q4_1", "q8_0"), ("avx512", "auto", "native", "q4_k", "q6_k")], indirect=["capped"])
def test_a_capped_cpu_serves_k_quants_in_n16_with_int16_activations(tmp_path: Path, capped: str, kquants: str,
                                                                    resolved: str, q4_k: str, q6_k: str) -> None:
    """Capped below VNNI the backend still picks int16 activations, every matrix in groups of 16 where its
    rows allow, and the fused step equals the op-by-op loop bit for bit."""
    assert not K.has_vnni() and K.has_avx512() is (capped == "avx512")
    path = write_gguf(tiny_model("llama", hidden=256, heads=4, kv_heads=2, layers=2, tie=True), tmp_path / "k.gguf",
                      {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q4_K", "attn_output": "Q6_K",
                       "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"})
    cfg = BackendConfig.from_env({"CHECKPOINT_PATH": str(path), "KQUANTS": kquants})
    assert (cfg.weight_format, cfg.activations, cfg.prefill_gemm) == ("gguf", "int16", "float32")
    assert cfg.kquants == resolved
    config = load_model_config(path)
    weights = load_weights(path, config, torch.float32, CPU, keep_blocks=True, block_layout="n16", progress=False,
                           kquants=cfg.kquants)
    kinds = {name: (w.kind, w.layout) for name, w in weights.items() if isinstance(w, QuantWeight)}
    assert kinds["layers.0.qkv"] == kinds["layers.1.gate_up"] == (q4_k, "n16")
    assert kinds["layers.0.o"] == kinds["layers.1.down"] == (q6_k, "n16")
    model = LlamaModel(config, weights)
    assert model.fused is not None
    both_ways(model, [3, 20, 45], torch.float16)  # the fused step equals the op-by-op loop, bit for bit
