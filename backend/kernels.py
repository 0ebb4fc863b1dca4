"""kvyard's C++ CPU kernels (backend/csrc/: cpu_kernels.cpp and its headers), built once with torch's cpp_extension.

`load()` returns the module, or None where it cannot run (no AVX2/FMA, no compiler, KVYARD_KERNELS=0):
the model then uses the pure-PyTorch path, which is also the reference in tests."""
from __future__ import annotations

import functools
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


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def cpu_supports_avx2() -> bool:
    flags = cpu_flags()
    return "avx2" in flags and "fma" in flags


PREFILL_GEMMS = ("int16", "float32", "bfloat16")

# KVYARD_CPU_ISA: the widest instruction set the kernels may use, in the C++ module's order (IsaLevel in
# csrc/simd.h). "avx2" and "avx512" run the paths of an AVX2-only CPU and of an AVX-512 CPU without VNNI on
# this one: int16 activations on the AVX2 kernels (qlinear_n16_avx2.h, qlinear_kquant_avx2.h),
# SDPA in place of the AVX-512 attention kernels (AVX2), as docs/performance.md's table of CPU kinds says. For
# tests and for measuring those paths.
ISA_LEVELS = ("avx2", "avx512", "native")


def isa_cap() -> str:
    from kvyard.env import env_choice
    return env_choice(os.environ, "KVYARD_CPU_ISA", "native", ISA_LEVELS)


def default_prefill_gemm() -> str:
    """What prefill-sized batches over n16 weights (int16 activations) multiply in by default:
    - bfloat16 through oneDNN where the CPU has AMX-BF16 (tile multiply-adds; the issue's AMX Xeon ran
      torch.matmul bf16 at 977 GFLOP/s, its int16 kernels ~300 and the float32 GEMM 259);
    - int16, the decode kernels, on Sapphire/Emerald Rapids cores without AMX (AVX512-FP16 marks them): they
      issue two vpdpwssd a cycle, twice the float32 FMAs' multiply-adds (an Emerald Rapids Xeon, the 1.7B's
      940-token prefill: 8.8 s against 11.3 s on float32 tiles);
    - elsewhere float32 on exactly dequantized tiles (Ice Lake, one vpdpwssd a cycle: 1.3-1.9x the kernels).
    A capped ISA (KVYARD_CPU_ISA, or the module's cap in tests) runs the capped CPU's choice.
    docs/performance.md has the measurements."""
    if cpu_has_native_bf16():
        return "bfloat16"
    module = load() if "avx512_fp16" in cpu_flags() else None
    return "int16" if module is not None and module.has_vnni() else "float32"  # has_vnni: below any ISA cap


@functools.cache
def os_grants_amx() -> bool:
    """Whether Linux grants this process AMX tile data (arch_prctl ARCH_GET_XCOMP_SUPP lists XTILEDATA, bit 18):
    a CPU (or a hypervisor's CPU model) can list AMX in /proc/cpuinfo while the OS grants no tile state; oneDNN
    then takes no AMX path."""
    import ctypes
    import platform
    if platform.machine() != "x86_64":
        return False
    mask = ctypes.c_ulong(0)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(158, 0x1021, ctypes.byref(mask)) == 0 and bool(mask.value & (1 << 18))  # SYS_arch_prctl
    except (OSError, AttributeError):
        return False


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN multiplies float32 operands in bfloat16 here under its bf16 math mode: AMX-BF16 tiles
    the OS grants, no ISA cap (KVYARD_CPU_ISA, or the loaded module's) below them.
    The mode only permits the rounding: on an Emerald Rapids Xeon whose OS grants no AMX (AVX512-BF16 only,
    oneDNN 3.12) it kept computing float32, errors ~1e-7 of the product, where bfloat16 gives ~1e-3."""
    if "amx_bf16" not in cpu_flags() or isa_cap() != "native" or not os_grants_amx():
        return False
    module = load()
    return module is not None and module.has_vnni()  # a module capped below VNNI (tests) runs a capped CPU's path


def load(verbose: bool = False) -> ModuleType | None:
    """The compiled kernels, built on first use into torch's extension cache (seconds when cached)."""
    if _cached:
        return _cached[0]
    module = None
    cap = isa_cap()  # a bad value is an error at start, before any build
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
    if module is not None and cap != "native":
        module.cap_isa(ISA_LEVELS.index(cap))
        log.info("C++ kernels capped at %s (KVYARD_CPU_ISA): the paths of a CPU without the wider units", cap)
    _cached.append(module)
    return module


def load_avx512() -> ModuleType | None:
    """The compiled kernels where their AVX-512 code runs (not capped below it), else None."""
    module = load()
    return module if module is not None and module.has_avx512() else None


def load_flash_bf16() -> ModuleType | None:
    """The compiled kernels where flash_attention_bf16 runs (AVX-512 and AMX-BF16 tiles torch's brgemm drives), else
    None: prefill attention of bfloat16 operands on a CPU (backend/csrc/flash_bf16.h)."""
    module = load_avx512()
    return module if module is not None and module.could_brgemm_bf16() else None


if __name__ == "__main__":  # `make setup` builds them once
    logging.basicConfig(level=logging.INFO)
    print("kvyard C++ kernels:", "ready" if load(verbose=True) is not None else "unavailable")
