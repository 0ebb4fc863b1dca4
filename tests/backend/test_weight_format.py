"""WEIGHT_FORMAT resolves once in BackendConfig: GGUF blocks where the C++ kernels run, dense elsewhere,
and an impossible explicit choice is refused at start-up, never silently ignored."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend import kernels
from backend.config import BackendConfig
from kvyard.model_path import embedded_model_path


def cfg(**env: str) -> BackendConfig:
    return BackendConfig.from_env({"DEVICE": "cpu", **env})


@pytest.mark.skipif(not kernels.cpu_supports_avx2(), reason="needs AVX2/FMA")
def test_auto_keeps_gguf_blocks_for_float32_on_the_cpu() -> None:
    assert cfg().weight_format == "gguf"
    assert cfg(KVYARD_KERNELS="0").weight_format == "dense"
    assert cfg(DTYPE="bfloat16").weight_format == "dense"


def test_explicit_choices() -> None:
    assert cfg(WEIGHT_FORMAT="dense").weight_format == "dense"
    with pytest.raises(ValueError, match="DTYPE=float32"):
        cfg(WEIGHT_FORMAT="gguf", DTYPE="bfloat16")
    with pytest.raises(ValueError, match="WEIGHT_FORMAT"):
        cfg(WEIGHT_FORMAT="int3")
    with pytest.raises(ValueError, match="C\\+\\+ CPU kernels"):
        cfg(WEIGHT_FORMAT="gguf", KVYARD_KERNELS="0")


def test_gguf_format_needs_a_gguf_file(tmp_path: Path) -> None:
    hf_dir = tmp_path / "model"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({  # read at start-up: an unsupported model fails the launch
        "model_type": "llama", "hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 1,
        "intermediate_size": 128, "vocab_size": 100}))
    (hf_dir / "tokenizer.json").write_text("{}")  # (checked to exist at start-up too)
    assert embedded_model_path().suffix == ".gguf"
    with pytest.raises(ValueError, match="needs a .gguf checkpoint"):
        cfg(WEIGHT_FORMAT="gguf", CHECKPOINT_PATH=str(hf_dir))
    assert cfg(CHECKPOINT_PATH=str(hf_dir)).weight_format == "dense"


@pytest.mark.skipif(not kernels.cpu_supports_avx2(), reason="needs AVX2/FMA")
def test_kv_cache_dtype_follows_the_kernels() -> None:
    """KV_CACHE_DTYPE=auto: float16 where the C++ kernels read the cache, the model's dtype elsewhere."""
    assert cfg().kv_cache_dtype == "float16"
    assert cfg(WEIGHT_FORMAT="dense").kv_cache_dtype == "float32"
    assert cfg(DTYPE="bfloat16").kv_cache_dtype == "bfloat16"
    assert cfg(KV_CACHE_DTYPE="float32").kv_cache_dtype == "float32"
    assert cfg(WEIGHT_FORMAT="dense", KV_CACHE_DTYPE="float16").kv_cache_dtype == "float16"
    with pytest.raises(ValueError, match="KV_CACHE_DTYPE"):
        cfg(KV_CACHE_DTYPE="int8")


@pytest.mark.skipif(kernels.load() is None, reason="needs the C++ kernels (int16 activations)")
def test_prefill_gemm_resolves_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """PREFILL_GEMM=auto: bfloat16 where the CPU has AMX-BF16, the int16 kernels on a Sapphire/Emerald Rapids
    core without AMX (AVX512-FP16; not when KVYARD_CPU_ISA caps the kernels), float32 on other
    int16-activation CPUs; explicit choices kept; one that cannot apply (float32 activations multiply no
    int16) refused."""
    no_amx, amx = frozenset({"avx512_vnni"}), frozenset({"avx512_vnni", "amx_tile", "amx_bf16"})
    rapids = frozenset({"avx512_vnni", "avx512_bf16", "avx512_fp16"})
    monkeypatch.setattr(kernels, "cpu_flags", lambda: no_amx)
    assert cfg().prefill_gemm == "float32"
    monkeypatch.setattr(kernels, "cpu_flags", lambda: rapids)
    module = kernels.load()
    assert cfg().prefill_gemm == ("int16" if module.has_vnni() else "float32")  # the kernels this machine runs
    module.cap_isa(kernels.ISA_LEVELS.index("avx512"))  # as KVYARD_CPU_ISA=avx512 caps them at load
    try:
        assert cfg().prefill_gemm == "float32"
    finally:
        module.cap_isa(kernels.ISA_LEVELS.index("native"))
    monkeypatch.setattr(kernels, "cpu_flags", lambda: amx | rapids)
    assert cfg().prefill_gemm == "bfloat16"
    monkeypatch.setattr(kernels, "cpu_flags", lambda: amx)
    assert cfg().prefill_gemm == "bfloat16"
    assert cfg(PREFILL_GEMM="int16").prefill_gemm == "int16"
    assert cfg(PREFILL_GEMM="float32").prefill_gemm == "float32"
    assert cfg(ACTIVATIONS="float32").prefill_gemm == "float32"  # its chunks dequantize to float32 anyway
    with pytest.raises(ValueError, match="PREFILL_GEMM=bfloat16 applies to int16 activations"):
        cfg(ACTIVATIONS="float32", PREFILL_GEMM="bfloat16")
    with pytest.raises(ValueError, match="PREFILL_GEMM"):
        cfg(PREFILL_GEMM="int8")


@pytest.mark.skipif(kernels.load() is None, reason="needs the C++ kernels (int16 activations)")
def test_kquants_resolves_once() -> None:
    """KQUANTS=auto: the file's K-quant blocks where the int16 kernels run on AVX-512, mixed on an AVX2-only CPU
    (KVYARD_CPU_ISA=avx2 caps them so here: Q4_K converted, Q6_K widened); the others as asked; a kept K-quant without int16 activations
    refused, and float32 activations always convert (their rows layout has no K-quant kernels)."""
    module = kernels.load()
    assert cfg().kquants == ("native" if module.has_avx512() else "mixed")
    module.cap_isa(kernels.ISA_LEVELS.index("avx2"))
    try:
        assert cfg().kquants == "mixed"
        assert cfg(KQUANTS="convert").kquants == "convert"
        assert cfg(KQUANTS="native").kquants == "native"
    finally:
        module.cap_isa(kernels.ISA_LEVELS.index("native"))
    assert cfg(KQUANTS="convert").kquants == "convert"
    assert cfg(ACTIVATIONS="float32").kquants == "convert"
    with pytest.raises(ValueError, match="KQUANTS=native needs int16 activations"):
        cfg(ACTIVATIONS="float32", KQUANTS="native")
    with pytest.raises(ValueError, match="KQUANTS=mixed needs int16 activations"):
        cfg(ACTIVATIONS="float32", KQUANTS="mixed")
    with pytest.raises(ValueError, match="KQUANTS"):
        cfg(KQUANTS="yes")
