"""The servers benchmarks/peers.py compares: llama.cpp's llama-server (built once from the
llama-cpp-python sdist on PyPI) and kvyard itself, each started on a free loopback port and stopped by pid."""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from backend.kernels import isa_cap  # KVYARD_CPU_ISA, read as kvyard's kernels read it
from kvyard.ports import free_port_block
from tests.support.procs import stop_groups, wait_healthy  # the tests' helpers (peers.py puts the repo on the path)

ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendored llama.cpp we build
CACHE = Path(os.environ.get("KVYARD_PEER_CACHE", Path.home() / ".cache" / "kvyard"))


def torch_isa_env(level: str) -> dict[str, str]:
    """The variables that cap torch's own kernels at `level` as KVYARD_CPU_ISA caps kvyard's: MKL's GEMMs,
    oneDNN's and ATen's vectorized ops (on this Xeon MKL's float32 GEMM then runs 114 GFLOP/s against 219)."""
    if level == "native":
        return {}
    return {"MKL_ENABLE_INSTRUCTIONS": level.upper(), "ONEDNN_MAX_CPU_ISA": "AVX2" if level == "avx2" else "AVX512_CORE",
            "ATEN_CPU_CAPABILITY": level}


def llama_cpp_flags(level: str = "native") -> list[str]:
    """llama.cpp's instruction-set options for this CPU (capped at `level`), spelled out: `-DGGML_NATIVE=ON`
    emits AMX tile code on CPUs that list AMX, which dies with SIGILL where the OS grants no tile state, and
    built with AMX on purpose it died the same way on a Xeon whose OS grants it (its first `tilezero`, in
    ggml_backend_amx_mul_mat, 2026-11-27): no AMX for llama.cpp, its AVX-512 VNNI code instead."""
    try:
        cpu = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        cpu = set()
    wanted = {"AVX": "avx", "AVX2": "avx2", "FMA": "fma", "F16C": "f16c", "BMI2": "bmi2", "AVX512": "avx512f",
              "AVX512_VBMI": "avx512vbmi", "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16"}
    allowed = {"avx2": {"AVX", "AVX2", "FMA", "F16C", "BMI2"}, "avx512": {"AVX", "AVX2", "FMA", "F16C", "BMI2", "AVX512"},
               "native": set(wanted)}[level]
    return ["-DGGML_NATIVE=OFF"] + [f"-DGGML_{opt}={'ON' if flag in cpu and opt in allowed else 'OFF'}"
                                    for opt, flag in wanted.items()]


def llama_binary(name: str = "llama-server") -> Path:
    """llama-server or llama-quantize, built once (cmake, Release, this CPU's instruction sets up to
    KVYARD_CPU_ISA's level, no curl; ~10 min on 2 cores), then reused."""
    src = CACHE / "llama-src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    level = isa_cap()  # KVYARD_CPU_ISA=avx2 / avx512: a build for that level, in its own directory
    build = src / ("build" if level == "native" else f"build-{level}")
    binary = build / "bin" / name
    if binary.exists():
        return binary
    sdist_dir = CACHE / "llama-src"
    sdist_dir.mkdir(parents=True, exist_ok=True)
    sdist = sdist_dir / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.exists():
        print(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "-d", str(sdist_dir), f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], check=True)
    if not src.exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(sdist_dir, filter="data")
    flags = llama_cpp_flags(level)
    print(f"building {name} into {build} (cmake, Release, {' '.join(flags)}) ...", flush=True)
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", *flags,
                    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"], check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "llama-quantize",
                    f"-j{os.cpu_count() or 2}"], check=True)
    return binary


def tree_rss_mb(pid: int) -> dict[int, float]:
    """Resident MB of pid and every descendant."""
    out: dict[int, float] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            out[p] = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS")) / 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration):
            continue
    return out


@contextmanager
def llama_server(gguf: Path, threads: int = 2, slots: int = 32, context: int = 16384) -> Iterator[tuple[str, int]]:
    """(base_url, pid) of a llama-server on the GGUF, as PERF_NOTES ran it (`-t 2 -np 32 -c 16384`:
    512 tokens a slot, its fastest setting for many streams); peers.py starts a one-slot server for the
    long-prompt TTFT (`--kv-unified` would fit it in the 32-slot one but costs it ~25 % decode speed)."""
    port = free_port_block()
    proc = subprocess.Popen([str(llama_binary("llama-server")), "-m", str(gguf), "--host", "127.0.0.1",
                             "--port", str(port), "-t", str(threads), "-np", str(slots), "-c", str(context),
                             "--jinja"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc, 300)
        yield f"http://127.0.0.1:{port}/v1", proc.pid
    finally:
        stop_groups([proc], 30)  # kvyard's launcher has children: the whole group


@contextmanager
def kvyard_server(env_overrides: dict[str, str], root: Path = ROOT,
                  log_name: str = "kvyard-peer.log") -> Iterator[tuple[str, int]]:
    """(base_url, launcher pid) of `python -m kvyard` (PDFUSION) as a user starts it; root: another checkout
    to run instead of this one (benchmarks/scale.py's before/after)."""
    port = free_port_block(6)  # START_PORT .. +5: the frontend, the backend's gRPC (+1) and HTTP (+5)
    env = {**os.environ, "ROLE_TYPE": "PDFUSION", "START_PORT": str(port), "HOST": "127.0.0.1",
           "LOG_LEVEL": "INFO", "PYTHONPATH": str(root), **torch_isa_env(isa_cap()), **env_overrides}
    log = open(CACHE / log_name, "w")
    proc = subprocess.Popen([str(root / ".venv" / "bin" / "python"), "-m", "kvyard"], cwd=root, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc, 300)
        yield f"http://127.0.0.1:{port}/v1", proc.pid
    finally:
        stop_groups([proc], 30)  # kvyard's launcher has children: the whole group
        log.close()
