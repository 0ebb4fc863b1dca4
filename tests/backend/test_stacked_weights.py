"""A Q4_K_M-like GGUF (q and k Q4_K, v Q6_K; gate Q4_K, up Q6_K) served without requantizing: the fused
q/k/v and gate/up matrices become StackedWeights whose parts keep their own kinds (n16: the file's Q4_K and
Q6_K blocks with AVX-512 VNNI; rows layout, and n16 on AVX2: Q4_1 and Q8_0 parts), the served bytes are the file's, the weights decode to the
file's float32 dequantization, the fused decode step equals the op-by-op loop bit for bit, and the logits
stay within the int16 activations' rounding of the dense float32 model."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend import kernels
from backend.model import LlamaModel
from backend.ops import TorchOps
from backend.quant import QuantWeight, StackedWeight
from backend.weights import load_weights
from kvyard.gguf_meta import read_gguf_index
from kvyard.model_config import load_model_config
from tests.backend.conftest import BLOCK_LAYOUTS, CPU, full_logits
from tests.backend.test_fused_decode import both_ways
from tests.support.tiny_models import EXACT_TYPES, tiny_model, write_gguf

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="C++ kernels unavailable")

MIXED_TYPES = {**EXACT_TYPES, "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
               "ffn_gate": "Q4_K", "ffn_up": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"}
# The kinds each fused matrix's parts are served in: the file's own K-quants (n16 on AVX-512), KQUANTS=mixed's
# (n16 on AVX2: Q4_K → Q4_1, Q6_K's codes widened to bytes), or the conversions the rows layout takes (Q4_K →
# Q4_1, Q6_K requantized to Q8_0).
NATIVE, MIXED, CONVERTED = ["q4_k", "q6_k"], ["q4_1", "q6_k8"], ["q4_1", "q8_0"]
# n16 Q4_K keeps its 6-bit sub-scales as bytes: 148 bytes per 256 weights against the file's 144.
N16_BYTES = {"q4_k": 148 / 144, "q6_k": 1.0}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tiny = tiny_model("llama", hidden=256, heads=4, kv_heads=2, layers=2, tie=True)
    return write_gguf(tiny, tmp_path_factory.mktemp("mixed") / "q4_k_m.gguf", MIXED_TYPES)


@pytest.mark.parametrize("layout", BLOCK_LAYOUTS)
def test_mixed_kinds_are_stacked_not_requantized(mixed_gguf: Path, layout: str) -> None:
    config = load_model_config(mixed_gguf)
    native = layout == "n16" and kernels.load().has_avx512()  # type: ignore[union-attr]  # K-quant kernels
    weights = load_weights(mixed_gguf, config, torch.float32, CPU, keep_blocks=True, block_layout=layout)
    dense = load_weights(mixed_gguf, config, torch.float32, CPU)  # the file's exact float32 dequantization
    q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for i in range(config.num_layers):
        qkv, gate_up = weights[f"layers.{i}.qkv"], weights[f"layers.{i}.gate_up"]
        assert isinstance(qkv, StackedWeight) and isinstance(gate_up, StackedWeight)
        assert [p.kind for p in qkv.parts] == [p.kind for p in gate_up.parts] == (
            NATIVE if native else MIXED if layout == "n16" else CONVERTED)
        assert [p.shape[0] for p in qkv.parts] == [q_rows + kv_rows, kv_rows]  # q and k merged: one kind
        assert qkv.shape == (q_rows + 2 * kv_rows, config.hidden_size) and qkv.layout == layout
    exact = set(NATIVE) if native else {"q6_k8"}  # the file's numbers
    for name, w in weights.items():
        for part, rows in _parts_with_rows(w):
            if part.kind in exact:
                assert torch.equal(part.dequantize(), dense[name][rows]), name
    if native:  # every matrix in the file's blocks: the file's bytes, but for Q4_K's byte sub-scales
        infos = read_gguf_index(mixed_gguf).tensors
        file_bytes = sum(t.nbytes * N16_BYTES[t.qtype.name.lower()] for t in infos.values()
                         if t.qtype.name.lower() in N16_BYTES and t.name != "token_embd.weight")
        served = sum(p.nbytes() for n, w in weights.items() if n != "embed" for p, _ in _parts_with_rows(w))
        assert served == pytest.approx(file_bytes, rel=1e-9)

    model = LlamaModel(config, weights)
    assert model.fused is not None
    both_ways(model, [3, 40, 77], torch.float16)  # the fused step: the op-by-op bits, KV writes included
    both_ways(model, [5 + 11 * b for b in range(17)], torch.float32)  # past the one-row/tile switch
    served_dense = {n: (w.dequantize() if isinstance(w, (QuantWeight, StackedWeight)) else w)
                    for n, w in weights.items()}
    ids = [(7 * i + 3) % config.vocab_size for i in range(48)]
    got = full_logits(model, config, ids)
    want = full_logits(LlamaModel(config, served_dense, ops=TorchOps()), config, ids)
    # The served numbers through float32 PyTorch: within the int16 activations' rounding (n16), float32's (rows)
    assert float((got - want).abs().max()) <= (0.02 if layout == "n16" else 1e-3)
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.98


def _parts_with_rows(w: object) -> list[tuple[QuantWeight, slice]]:
    """A block weight's parts with the output rows each holds (one part for a plain QuantWeight)."""
    parts = w.parts if isinstance(w, StackedWeight) else [w] if isinstance(w, QuantWeight) else []
    out, r = [], 0
    for p in parts:
        out.append((p, slice(r, r + p.shape[0])))
        r += p.shape[0]
    return out
