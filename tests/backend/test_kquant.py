"""Q4_K, Q5_K and Q6_K blocks served as the GGUF stores them (n16 layout, int16 activations: AVX-512,
backend/csrc/qlinear_kquant.h; AVX2, qlinear_kquant_avx2.h): the blocks decode to gguf's own reference
dequantization, the kernels' linears equal dequantize-then-matmul within the int16 activations' rounding, a
row's bits do not depend on its batch, and a K-quant GGUF loads into them and decodes the same fused as op
by op."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from backend import kernels
from backend.model import LlamaModel
from backend import ops as ops_module
from backend.ops import N16_GEMM_ROWS, KernelOps, TorchOps
from backend.kquant import K_FILE_KIND, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, QK_K
from backend.quant import QuantWeight, StackedWeight, k_blocks_from_gguf
from backend.weights import load_weights
from kvyard.model_config import load_model_config
from tests.backend.conftest import CPU, full_logits
from tests.backend.test_fused_decode import both_ways
from tests.backend.test_kernels import int16_rounding_bound, random_blocks, tiled_linear_is_exact
from tests.support.tiny_models import EXACT_TYPES, tiny_model, write_gguf

K = kernels.load()
pytestmark = pytest.mark.skipif(K is None, reason="K-quant blocks are served by the C++ int16 kernels")
AVX512 = pytest.mark.skipif(K is None or not K.has_avx512(), reason="compares with the AVX-512 kernels")
KINDS = {"q4_k": gguf.GGMLQuantizationType.Q4_K, "q5_k": gguf.GGMLQuantizationType.Q5_K,
         "q5_k8": gguf.GGMLQuantizationType.Q5_K, "q6_k8": gguf.GGMLQuantizationType.Q6_K,
         "q6_k": gguf.GGMLQuantizationType.Q6_K}


def k_blocks(kind: str, raw: np.ndarray, k: int) -> QuantWeight:
    """A served K-quant kind's "rows" blocks from its GGUF type's bytes (q6_k8: a Q6_K tensor's)."""
    return k_blocks_from_gguf(K_FILE_KIND.get(kind, kind), raw, k, served=kind)


def random_k_raw(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Valid GGUF bytes [n, row bytes] of an [n, k] K-quant matrix: random codes and sub-scales (Q6_K's
    signed, -128 included), float16 scales of either sign."""
    rng = np.random.default_rng(seed)
    nsb = k // QK_K
    kind = K_FILE_KIND.get(kind, kind)
    size = {"q4_k": Q4_K_BYTES, "q5_k": Q5_K_BYTES, "q6_k": Q6_K_BYTES}[kind]
    raw = rng.integers(0, 256, size=(n, nsb, size), dtype=np.uint8)
    if kind != "q6_k":  # d, dmin
        raw[..., 0:4] = rng.uniform(-0.004, 0.004, size=(n, nsb, 2)).astype(np.float16).view(np.uint8)
    else:
        raw[..., 208:210] = rng.uniform(-0.0004, 0.0004, size=(n, nsb, 1)).astype(np.float16).view(np.uint8)
        raw[0, 0, 192] = 0x80  # an int8 scale of -128
    return raw.reshape(n, nsb * size)


def reference(kind: str, raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, KINDS[kind]).astype(np.float32).reshape(n, k))


@pytest.mark.parametrize("kind", ["q4_k", "q5_k", "q6_k", "q5_k8", "q6_k8"])
def test_blocks_decode_to_ggufs_own_dequantization(kind: str) -> None:
    n, k = 48, 512
    raw = random_k_raw(kind, n, k, seed=1)
    w = k_blocks(kind, raw, k)
    want = reference(kind, raw, n, k)
    assert torch.equal(w.dequantize(), want)
    w16 = w.to_n16()
    assert w16.layout == "n16" and w16.shape == (n, k)
    back = w16.to_rows()
    assert all(torch.equal(a, b) for a, b in ((back.qs, w.qs), (back.d, w.d), (back.m, w.m)))
    assert torch.equal(w16.dequantize(), want)
    # bits a weight, as in the file (scales included): 4.625, 5.625 and 6.5625; codes widened: 8.625, 8.5625
    assert w16.nbytes() * 8 / (n * k) == {"q4_k": 4.625, "q5_k": 5.625, "q6_k": 6.5625, "q5_k8": 8.625,
                                            "q6_k8": 8.5625}[kind]
    rows = torch.tensor([0, 15, 16, 47])  # the embedding lookup reads rows out of the groups
    assert torch.equal(K.dequant_rows(w16.qs, w16.d, w16.m, rows, False), want[rows])
    out = torch.empty(n, k)
    K.dequantize_into(w16.qs, w16.d, w16.m, out, False)
    assert torch.equal(out, want)


@pytest.mark.parametrize("kind", ["q4_k", "q5_k", "q6_k", "q5_k8", "q6_k8"])
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 17, 32, 64, 65, 130])
def test_int16_linear_matches_dense_linear(kind: str, rows: int) -> None:
    n, k = 80, 256 if rows % 2 else 768
    w_rows = k_blocks(kind, random_k_raw(kind, n, k, seed=rows), k)
    w = w_rows.to_n16()
    dense = w.dequantize()
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
    x[0, :7] = 0.0
    bias, residual = torch.randn(n, generator=gen), torch.randn(rows, n, generator=gen)
    want = TorchOps().linear(x.double(), dense.double(), bias.double(), residual.double())
    bound = int16_rounding_bound(x, dense, block=QK_K, levels=8191) + 1e-6 * want.abs()
    got = KernelOps(K).linear(x, w, bias, residual).double()
    assert ((got - want).abs() <= bound).all(), float((got - want).abs().max())
    # Tighter: what the kernel computes is the exact product of the activations as it rounds them (per row
    # and 256-wide super-block, 14 bits) with the scaled codes, minus Q4_K's minimums times the unrounded
    # activations' sums, up to float32's rounding of the float part.
    minimums = k_minimums(w_rows)
    rounded = super_block_rounding(x)
    exact = (rounded @ (dense.double() + minimums).T - x.double() @ minimums.T + bias.double()
             + residual.double())
    scale = rounded.abs() @ (dense.double() + minimums).abs().T + x.abs().double() @ minimums.abs().T + 1.0
    assert ((got - exact).abs() <= 2e-6 * scale).all(), float(((got - exact).abs() / scale).max())


def k_minimums(w: QuantWeight) -> torch.Tensor:
    """[n, k] float64: what a Q4_K or Q5_K weight subtracts, dmin mn (zeros for Q6_K); w in the "rows" layout."""
    n, k = w.shape
    if w.kind in ("q6_k", "q6_k8"):
        return torch.zeros(n, k, dtype=torch.float64)
    dmin = w.d[..., 1].double().repeat_interleave(QK_K, dim=1)  # [n, k]
    mn = w.m[..., 1].double().repeat_interleave(32, dim=1)
    return dmin * mn


def super_block_rounding(x: torch.Tensor) -> torch.Tensor:
    """x as the K-quant kernels round it: per row and 256 values, to integers of at most 8191 in magnitude
    times max|x| / 8191 (float64)."""
    rows, k = x.shape
    xb = x.double().view(rows, k // QK_K, QK_K)
    amax = xb.abs().amax(-1, keepdim=True).float()  # the kernel's float32 scale and its reciprocal
    # 8191 / amax divided as the kernel does (a scalar over a tensor is a reciprocal times 8191 in torch)
    inv = torch.where(amax > 0, torch.full_like(amax, 8191.0) / amax, torch.zeros_like(amax))
    q = torch.round(xb.float() * inv)
    assert q.abs().max() <= 8191
    return (q.double() * (amax / 8191.0).double()).view(rows, k)


@pytest.mark.parametrize("kind", ["q4_k", "q5_k", "q6_k", "q5_k8", "q6_k8"])
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_integer_sums_at_their_largest_stay_exact(kind: str, rows: int) -> None:
    """The sub-scales join the 32-bit integer sums (a Q4_K super-block's, 128 Q5_K weights', 64 Q6_K
    weights'): at the largest codes and sub-scales a format allows (Q4_K: q 15, sc 63; Q5_K: q 31, sc 63;
    Q6_K: q - 32 = -32, sc -128) times activations at their largest rounded value (8191), the sums reach
    1.98e9, 2.05e9 and 2.147e9 of int32's 2.147e9 and must not wrap (Q5_K's over a whole super-block would:
    4.1e9). A wrapped sum would be off by ~4.3e9 steps."""
    n, k = 32, 512
    raw = random_k_raw(kind, n, k, seed=9).reshape(n, k // QK_K, -1)
    if K_FILE_KIND.get(kind, kind) in ("q4_k", "q5_k"):
        raw[..., 4:16] = 0xFF  # every 6-bit scale and minimum 63
        raw[..., 16:] = 0xFF  # every code 15 (Q5_K: every top bit set too, 31)
        raw[..., 0:2] = np.array([0.001], dtype=np.float16).view(np.uint8)  # d > 0
    else:
        raw[..., 0:192] = 0  # every code 0: q - 32 = -32
        raw[..., 192:208] = 0x80  # every scale -128
        raw[..., 208:210] = np.array([0.0001], dtype=np.float16).view(np.uint8)
    w = k_blocks(kind, raw.reshape(n, -1), k).to_n16()
    dense = w.dequantize()
    x = torch.full((rows, k), 0.75)
    x[:, QK_K:] = 1.5  # each super-block at its own scale
    x[1::2] *= -1  # rows of either sign (a row's sums all of one sign: their errors could not cancel)
    got = KernelOps(K).linear(x, w).double()
    minimums = k_minimums(k_blocks(kind, raw.reshape(n, -1), k))
    rounded = super_block_rounding(x)
    exact = rounded @ (dense.double() + minimums).T - x.double() @ minimums.T
    scale = rounded.abs() @ (dense.double() + minimums).abs().T + x.abs().double() @ minimums.abs().T
    assert ((got - exact).abs() <= 1e-6 * scale).all(), float(((got - exact).abs() / scale).max())


def random_n16(kind: str, n: int, k: int, seed: int) -> QuantWeight:
    """A random [n, k] matrix of any served block kind, in the n16 layout."""
    if kind in KINDS:
        return k_blocks(kind, random_k_raw(kind, n, k, seed=seed), k).to_n16()
    return random_blocks(kind, n, k, seed=seed).to_n16()


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q4_k", "q5_k", "q6_k", "q5_k8", "q6_k8"])
def test_prefill_sized_batches_go_through_the_gemm_exactly(kind: str) -> None:
    """From N16_GEMM_ROWS rows (where the CPU prefers it) the n16 weight is dequantized tile by tile into
    W^T and multiplied by torch's GEMM: float32 activations, so within float32 rounding of the exact product
    (several tiles: DENSE_MAX_NUMEL made small)."""
    k = 512
    w = random_n16(kind, 96, k, seed=3)
    ops = KernelOps(K)
    ops.n16_gemm = torch.float32
    tile = torch.empty(k, 32)
    K.dequantize_n16_t(w.qs, w.d, w.m if w.m is not None else w.d, tile, 2, 4, kind == "q4_1")
    assert torch.equal(tile, w.dequantize()[32:64].T)  # the reference dequantization, bit for bit
    tiled_linear_is_exact(ops, w, N16_GEMM_ROWS + 5, seed=3, rel=1e-5)  # three tiles of 32 rows


@pytest.mark.parametrize("kind", ["q4_1", "q4_k", "q5_k", "q6_k", "q5_k8", "q6_k8"])
def test_prefill_gemm_choice_picks_the_multiply(kind: str) -> None:
    """PREFILL_GEMM's three choices over the same n16 weight and prefill-sized batch: int16 gives the int16
    kernel's bits (what a short batch gets), float32 the exact product within float32 rounding, bfloat16
    the product of x and W rounded to bfloat16 (8 significant bits: within ~1% of the product's magnitude),
    never the kernel's bits."""
    n, k = 64, 512
    w = random_n16(kind, n, k, seed=5)
    dense = w.dequantize()
    x = torch.randn(N16_GEMM_ROWS + 3, k, generator=torch.Generator().manual_seed(5))
    kernel_rows = torch.cat([KernelOps(K, "int16").linear(x[i:i + 64], w) for i in range(0, len(x), 64)])
    assert torch.equal(KernelOps(K, "int16").linear(x, w), kernel_rows)
    want = x.double() @ dense.double().T
    scale = x.abs().double() @ dense.abs().double().T  # what rounding each operand's digits can move
    f32 = KernelOps(K, "float32").linear(x, w).double()
    assert ((f32 - want).abs() <= 1e-6 * scale + 1e-6).all()
    bf16_ops = KernelOps(K, "bfloat16")
    assert bf16_ops.n16_gemm == torch.bfloat16
    bf16 = bf16_ops.linear(x, w).double()
    err = (bf16 - want).abs()
    assert (err <= 2 ** -7 * scale + 2 ** -8 * want.abs()).all(), float((err / scale).max())
    assert ((err > 1e-5 * scale).float().mean() > 0.5).item()  # it rounded: not the float32 path renamed
    assert not torch.equal(bf16.float(), kernel_rows)


def test_bf16_matmul_asks_onednn_for_bf16_math_where_the_cpu_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU with bfloat16 units the float32 operands go to oneDNN under its bf16 math mode (it rounds
    them itself, sums and returns float32); the mode is put back after. Elsewhere: rounded copies."""
    seen: list[str] = []

    class Spy(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if "matmul" in getattr(func, "__name__", ""):
                seen.append(torch.backends.mkldnn.matmul.fp32_precision)
            return super().__torch_function__(func, types, args, kwargs or {})

    a, b = torch.randn(8, 64), torch.randn(64, 16)
    before = torch.backends.mkldnn.matmul.fp32_precision
    monkeypatch.setattr(kernels, "cpu_has_native_bf16", lambda: True)
    ops_module.bf16_matmul(a.as_subclass(Spy), b)
    assert seen == ["bf16"] and torch.backends.mkldnn.matmul.fp32_precision == before
    monkeypatch.setattr(kernels, "cpu_has_native_bf16", lambda: False)
    got = ops_module.bf16_matmul(a, b)
    assert torch.allclose(got.double(), a.bfloat16().double() @ b.bfloat16().double(), atol=1e-4)
    assert got.dtype == torch.float32


@pytest.mark.parametrize("kind", ["q4_k", "q5_k", "q6_k", "q5_k8", "q6_k8"])
def test_int16_linear_gives_each_row_the_same_bits_in_any_batch(kind: str) -> None:
    w = k_blocks(kind, random_k_raw(kind, 112, 512, seed=9), 512).to_n16()  # 7 groups: pairs and one alone
    x = torch.randn(130, 512, generator=torch.Generator().manual_seed(9))
    ops = KernelOps(K)
    batched = ops.linear(x, w)
    for size in (*range(1, 14), 17, 23, 32, 64, 65):  # every chunk size alone, and split evenly (13: 7 + 6)
        assert torch.equal(ops.linear(x[:size], w), batched[:size]), size


@AVX512
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 12, 17, 64])
def test_q6_k_vbmi_decode_gives_the_portable_bits(rows: int) -> None:
    """Where the CPU has AVX-512 VBMI, Q6_K codes are unpacked with byte permutes (and few rows split their
    dot products into chains): the same integer dots, so the same bits as the portable decode."""
    w = k_blocks_from_gguf("q6_k", random_k_raw("q6_k", 48, 768, seed=rows), 768).to_n16()
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows)) * 3
    before = K.use_vbmi(True)
    try:
        fast = KernelOps(K).linear(x, w)
        K.use_vbmi(False)
        assert torch.equal(KernelOps(K).linear(x, w), fast)
    finally:
        K.use_vbmi(before)


@pytest.mark.skipif(K is None or not K.has_vnni(), reason="compares the VNNI code with the plain AVX-512 one")
@pytest.mark.parametrize("kind", ["q4_k", "q5_k", "q6_k", "q5_k8", "q6_k8"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 12, 17, 64])
def test_k_quant_linear_without_vnni_gives_the_vnni_bits(kind: str, rows: int) -> None:
    """On AVX-512 without VNNI the step loops multiply with vpmaddwd + vpaddd: the same integer dots, so the
    same bits as vpdpwssd (the portable decode on both; VBMI needs VNNI)."""
    w = k_blocks(kind, random_k_raw(kind, 48, 768, seed=rows), 768).to_n16()
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows)) * 3
    vbmi, code = K.use_vbmi(False), K.use_int16("vnni")
    try:
        with_vnni = KernelOps(K).linear(x, w)
        assert K.use_int16("avx512") == "vnni"
        assert torch.equal(KernelOps(K).linear(x, w), with_vnni)
    finally:
        K.use_vbmi(vbmi)
        K.use_int16(code)


@AVX512
@pytest.mark.parametrize("kind", ["q4_k", "q5_k", "q6_k", "q5_k8", "q6_k8"])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 13, 64, N16_GEMM_ROWS + 3])
def test_k_quant_linear_on_avx2_gives_the_avx512_bits(kind: str, rows: int) -> None:
    """An AVX2-only CPU serves K-quant blocks as they are too (qlinear_kquant_avx2.h: 8 lanes a vector, vpmaddwd
    + vpaddd): the same rounding, integer sums and float chains, so the same bits as the AVX-512 kernels, for
    decode-sized batches and for prefill tiles (dequantized on AVX2, then torch's GEMM)."""
    w = random_n16(kind, 48, 768, seed=rows)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows)) * 3
    ops = KernelOps(K, "float32")  # prefill-sized batches through dequantized tiles; fewer rows the kernel
    vbmi = K.use_vbmi(False)
    try:
        wide = ops.linear(x, w)
        code = K.use_int16("avx2")
        try:
            assert torch.equal(ops.linear(x, w), wide)
            tile = torch.empty(768, 32)
            K.dequantize_n16_t(w.qs, w.d, w.m, tile, 1, 3, False)
            assert torch.equal(tile, w.dequantize()[16:48].T)
        finally:
            K.use_int16(code)
    finally:
        K.use_vbmi(vbmi)


K_TYPES = {**EXACT_TYPES, "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q4_K", "attn_output": "Q6_K",
           "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K", "token_embd": "Q6_K", "output": "Q6_K"}
# A Q5_K_M file's kinds: Q5_K, with Q6_K where llama-quantize spends more bits
K5_TYPES = {**K_TYPES, "attn_q": "Q5_K", "attn_k": "Q5_K", "attn_v": "Q5_K", "ffn_gate": "Q5_K", "ffn_up": "Q5_K"}


@pytest.fixture(scope="module", params=["q4_k", "q5_k"])
def k_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    tiny = tiny_model("llama", hidden=256, heads=4, kv_heads=2, layers=2, tie=True)
    types = K_TYPES if request.param == "q4_k" else K5_TYPES
    return write_gguf(tiny, tmp_path_factory.mktemp("kq") / f"{request.param}.gguf", types), request.param


@pytest.mark.parametrize("kquants", ["native", "mixed"])
def test_k_quant_gguf_is_served_as_it_is(k_gguf: tuple[Path, str], kquants: str) -> None:
    """n16: every Q4_K, Q5_K or Q6_K matrix kept in its own blocks (the file's bytes, no requantizing), the
    fused decode step equal to the op-by-op loop bit for bit, and both within int16 rounding of the
    dense float32 model. KQUANTS=mixed: Q4_K converted to Q4_1, Q5_K's and Q6_K's codes widened to bytes
    (q5_k8, q6_k8: the same numbers)."""
    path, main_kind = k_gguf
    config = load_model_config(path)
    weights = load_weights(path, config, torch.float32, CPU, keep_blocks=True, block_layout="n16", kquants=kquants)
    kinds = {name: w.kind for name, w in weights.items() if isinstance(w, QuantWeight)}
    mixed = kquants == "mixed"
    assert kinds["layers.0.qkv"] == kinds["layers.1.gate_up"] == (main_kind if not mixed else
                                                                   "q4_1" if main_kind == "q4_k" else "q5_k8")
    assert kinds["layers.0.o"] == kinds["layers.1.down"] == ("q6_k8" if mixed else "q6_k")
    assert config.vocab_size % 16 and kinds["embed"] == "q8_0"  # rows not in groups of 16: requantized, as before
    dense = load_weights(path, config, torch.float32, CPU)  # the file's exact dequantization
    for name, w in weights.items():
        if isinstance(w, QuantWeight) and w.kind not in ("q8_0", "q4_1"):  # q4_1: Q4_K's scales rounded
            assert torch.equal(w.dequantize(), dense[name]), name
    for name, w in weights.items():  # the reference takes what is served where the serving rounded (Q4_1, Q8_0)
        if isinstance(w, (QuantWeight, StackedWeight)) and ("q4_1" in w.kind or "q8_0" in w.kind):
            dense[name] = w.dequantize()
    model = LlamaModel(config, weights)
    assert model.fused is not None
    both_ways(model, [3, 40, 77], torch.float16)
    ids = [(7 * i + 3) % config.vocab_size for i in range(60)]
    got = full_logits(model, config, ids)
    want = full_logits(LlamaModel(config, dense, ops=TorchOps()), config, ids)
    # the activations' rounding (14 bits per 256): measured 1.2e-2 on logits up to 3.8, agreement 1.000
    # (2026-11-27; 2.8e-3 with 16 bits per 32)
    assert float((got - want).abs().max()) <= 0.02
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.98
