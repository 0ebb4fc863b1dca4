"""KVYARD_CPU_ISA caps the C++ kernels' instruction set, so this CPU runs the paths an older one takes (an
AVX2-only CPU, an AVX-512 CPU without VNNI): what the kernels report and what the backend's config then
chooses. tests/test_serve_families.py serves a Q4_K_M-style GGUF through the capped AVX2 path end to end."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from backend import kernels
from backend.config import BackendConfig
from backend.ops import KernelOps

K = kernels.load()
pytestmark = pytest.mark.skipif(K is None or not K.has_vnni(),
                                reason="capping needs a CPU with more than AVX2 (AVX-512 VNNI) to show anything")


@pytest.fixture
def capped() -> Iterator[None]:
    yield
    K.cap_isa(kernels.ISA_LEVELS.index("native"))  # the process's kernels as they were for the other tests


def test_a_level_outside_the_list_is_an_error_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVYARD_CPU_ISA", "avx512_bf16")
    with pytest.raises(ValueError, match="KVYARD_CPU_ISA must be one of avx2, avx512, native"):
        kernels.isa_cap()
    monkeypatch.setenv("KVYARD_CPU_ISA", "AVX2")
    assert kernels.isa_cap() == "avx2"
    with pytest.raises(RuntimeError, match="ISA level"):
        K.cap_isa(3)


@pytest.mark.parametrize("level,avx512,vnni", [("avx2", False, False), ("avx512", True, False), ("native", True, True)])
def test_the_cap_narrows_what_the_kernels_run(capped: None, level: str, avx512: bool, vnni: bool,
                                              model_path: Path) -> None:
    K.cap_isa(kernels.ISA_LEVELS.index(level))
    assert (K.has_avx512(), K.has_vnni()) == (avx512, vnni)
    # the tests' switches cannot turn on what the cap took away
    before = K.use_avx512(True)
    assert K.use_avx512(before) is avx512
    before = K.use_vbmi(True)
    assert K.use_vbmi(before) is vnni
    code = level if level != "native" else "vnni"  # the n16 linears' code: the best under the cap
    assert K.use_int16(code) == code
    for higher in ("avx512", "vnni")[("avx2", "avx512", "vnni").index(code):]:
        with pytest.raises(RuntimeError, match=f"has no {higher} int16 code"):
            K.use_int16(higher)
    assert KernelOps(K).prefill_kernel is avx512  # the AVX-512 prefill attention, else SDPA
    cfg = BackendConfig.from_env({"CHECKPOINT_PATH": str(model_path)})
    assert cfg.weight_format == "gguf" and cfg.activations == "int16"  # AVX2 has int16 kernels too
    explicit = BackendConfig.from_env({"CHECKPOINT_PATH": str(model_path), "ACTIVATIONS": "float32"})
    assert explicit.activations == "float32"
