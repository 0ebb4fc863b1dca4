"""kvyard's C++ CPU kernels (backend/csrc/: cpu_kernels.cpp and its headers), built once with torch's cpp_extension.

`load()` returns the module, or None where it cannot run (no AVX2/FMA, no compiler, KVYARD_KERNELS=0):
the model then uses the pure-PyTorch path, which is also the reference in tests."""
from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

log = logging.getLogger("kvyard.kernels")

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "cpu_kernels.cpp"
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-DNDEBUG"]


def _source_digest() -> str:
    """Of every file in csrc/ and where it is: torch's extension cache keys on the .cpp alone and would keep a
    build whose headers changed; this digest, passed as a define, makes any change a new build. The path
    counts because torch rebuilds a directory whose source path changed: checkouts of the same sources at
    two paths (worktrees) would otherwise rebuild it for each other on every start."""
    h = hashlib.sha256(str(CSRC.resolve()).encode())
    for f in sorted(CSRC.iterdir()):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]
_cached: list[ModuleType | None] = []


def cpu_flags() -> set[str]:
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


def cpu_supports_avx2() -> bool:
    flags = cpu_flags()
    return "avx2" in flags and "fma" in flags


def int16_prefill_beats_gemm() -> bool:
    """Whether prefill-sized batches over n16 weights should stay on the int16 kernels: on Intel CPUs with
    AMX (whose int16 kernels measured ~300 GFLOP/s against the float32 GEMM's 259, docs/performance.md);
    elsewhere (AVX-512 VNNI without AMX) the float32 GEMM on dequantized tiles measured 1.3-1.9x faster."""
    return "amx_tile" in cpu_flags()


def load(verbose: bool = False) -> ModuleType | None:
    """The compiled kernels, built on first use into torch's extension cache (seconds when cached)."""
    if _cached:
        return _cached[0]
    module = None
    if os.environ.get("KVYARD_KERNELS", "1") == "0":
        log.info("C++ kernels off (KVYARD_KERNELS=0): pure-PyTorch path")
    elif not cpu_supports_avx2():
        log.warning("this CPU lacks AVX2/FMA: pure-PyTorch path")
    else:
        try:
            from torch.utils.cpp_extension import load as build
            # The venv's own ninja (the `ninja` package) when the shell never activated the venv.
            os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
            # The digest in the name too: worktrees and checkouts of other versions share torch's extension
            # cache, and one build directory per name would let them overwrite each other's module.
            digest = _source_digest()
            module = build(name=f"kvyard_cpu_kernels_{digest[:12]}", sources=[str(SOURCE)],
                           extra_cflags=[*_FLAGS, f"-DKVYARD_SRC={digest}"],
                           extra_ldflags=["-fopenmp"], verbose=verbose)
        except Exception as exc:  # a missing compiler must not take the backend down
            log.warning("C++ kernels unavailable (%s): pure-PyTorch path", exc)
    _cached.append(module)
    return module


if __name__ == "__main__":  # `make setup` builds them once
    logging.basicConfig(level=logging.INFO)
    print("kvyard C++ kernels:", "ready" if load(verbose=True) is not None else "unavailable")
