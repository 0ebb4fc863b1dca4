"""Head sizes the C++ decode attention is not compiled for (backend/ops.py KERNEL_HEAD_DIMS) still serve:
attention falls back to PyTorch, the rest of the step stays in the kernels. Tiny random Llama and Qwen2
checkpoints with head_dim 16, 80 and 100, through the Engine (paged cache, chunked prefill, prefix-cache
hit, decode): greedy tokens and logits equal transformers' on the same weights (tests/backend/
test_model_families.py's comparison). Before the fallback every decode step failed in decode_attention."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from backend import kernels
from backend.ops import KERNEL_HEAD_DIMS, KernelOps
from tests.backend.test_model_families import ATOL, compare, load
from tests.support.tiny_models import EXACT_TYPES, save_hf_dir, tiny_model, write_gguf

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="C++ kernels unavailable (PyTorch serves any head_dim)")


@pytest.mark.parametrize(("family", "head_dim"), [("llama", 16), ("qwen2", 80), ("llama", 100)])
def test_dense_checkpoint_serves_any_head_dim(family: str, head_dim: int, tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    assert head_dim not in KERNEL_HEAD_DIMS
    tiny = tiny_model(family, head_dim=head_dim, max_positions=128)
    with caplog.at_level(logging.WARNING, logger="kvyard.backend"):
        model = load(save_hf_dir(tiny, tmp_path / "m"))
    assert model.config.head_dim == head_dim and isinstance(model.ops, KernelOps)
    said = [r.getMessage() for r in caplog.records if "head_dim" in r.getMessage()]
    assert len(said) == 1 and f"head_dim {head_dim}" in said[0], said  # one line at start
    compare(model, tiny, ATOL)


@pytest.mark.parametrize("head_dim", [16, 80])
def test_gguf_blocks_serve_any_head_dim(head_dim: int, tmp_path: Path) -> None:
    """Quantized linears in the kernels, attention in PyTorch (no fused C++ decode step for this size)."""
    tiny = tiny_model("llama", head_dim=head_dim, max_positions=128)
    model = load(write_gguf(tiny, tmp_path / "m.gguf", EXACT_TYPES), blocks=True)
    assert model.config.head_dim == head_dim and model.fused is None
    compare(model, tiny, ATOL)
