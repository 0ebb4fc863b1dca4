"""How many of the kernels' multiply-add instructions one core issues a second: which PREFILL_GEMM a CPU kind
should default to (kernels.default_prefill_gemm) and how far a kernel is from its arithmetic bound.

    .venv/bin/python benchmarks/issue_rates.py [--core 0]

Compiles a small C loop (gcc -O3) that runs 16 independent chains of one instruction on register operands, pinned
to one core, and prints G instructions/s for vpdpwssd (32 int16 multiply-adds: the int16 kernels), vpdpbusd (64
int8), vfmadd231ps (16 float32: torch's float32 GEMM) and, where the CPU has AVX512-BF16, vdpbf16ps (32
bfloat16). An Emerald Rapids Xeon (2026-11-26): 5.80, 5.83, 5.49 and 1.34 G/s, i.e. two vpdpwssd a cycle, twice
the float32 FMAs' multiply-adds, and bfloat16 dot products at half the float32 rate. The Ice Lake Xeon issued one
vpdpwssd a cycle (2.2-2.8 G/s in an earlier loop of this kind), as many multiply-adds as its FMAs.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.kernels import cpu_flags  # noqa: E402  (what the kernels read: /proc/cpuinfo's flags)

CHAINS = 16
SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#define N 400000000L
#define CH %(chains)d
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
/* One function per instruction: CH accumulators in registers, each a chain of the instruction. */
#define RATE(NAME, TYPE, INIT, STEP, SUM)                                                   \
  __attribute__((target("avx512f,avx512bw,avx512vnni%(bf16_target)s"))) static void NAME(void) { \
    TYPE acc[CH];                                                                          \
    for (int i = 0; i < CH; i++) acc[i] = INIT;                                            \
    __m512i w = _mm512_set1_epi32(3), x = _mm512_set1_epi32(5);                            \
    __m512 fw = _mm512_set1_ps(1.0001f), fx = _mm512_set1_ps(0.9999f);                     \
    double t = now();                                                                      \
    for (long n = 0; n < N / CH; n++) {                                                    \
      for (int i = 0; i < CH; i++) acc[i] = STEP;                                          \
      __asm__ volatile("" : "+v"(w), "+v"(x), "+v"(fw), "+v"(fx));                         \
    }                                                                                      \
    double d = now() - t, s = 0;                                                           \
    for (int i = 0; i < CH; i++) s += SUM;                                                 \
    printf("%%-12s %%.2f G/s%%s\n", #NAME, N / d / 1e9, s == 42 ? " " : "");              \
  }
RATE(vpdpwssd, __m512i, _mm512_setzero_si512(), _mm512_dpwssd_epi32(acc[i], w, x), _mm512_reduce_add_epi32(acc[i]))
RATE(vpdpbusd, __m512i, _mm512_setzero_si512(), _mm512_dpbusd_epi32(acc[i], w, x), _mm512_reduce_add_epi32(acc[i]))
RATE(vfmadd231ps, __m512, _mm512_setzero_ps(), _mm512_fmadd_ps(acc[i], fw, fx), _mm512_reduce_add_ps(acc[i]))
%(bf16_rate)s
int main(void) {
  vpdpwssd(); vpdpbusd(); vfmadd231ps();
  %(bf16_call)s
  return 0;
}
"""
BF16_RATE = ("RATE(vdpbf16ps, __m512, _mm512_setzero_ps(), _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_castps_si512(fw), "
             "(__m512bh)_mm512_castps_si512(fx)), _mm512_reduce_add_ps(acc[i]))")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--core", type=int, default=0)
    args = ap.parse_args()
    flags = cpu_flags()
    if not {"avx512f", "avx512_vnni"} <= flags:
        raise SystemExit("needs AVX-512 VNNI (the instructions measured here)")
    bf16 = "avx512_bf16" in flags
    with tempfile.TemporaryDirectory() as tmp:
        src, binary = Path(tmp) / "rates.c", Path(tmp) / "rates"
        src.write_text(SOURCE % {"chains": CHAINS, "bf16_target": ",avx512bf16" if bf16 else "",
                                 "bf16_rate": BF16_RATE if bf16 else "", "bf16_call": "vdpbf16ps();" if bf16 else ""})
        subprocess.run(["gcc", "-O3", "-funroll-all-loops", "-o", str(binary), str(src)], check=True)
        os.sched_setaffinity(0, {args.core})  # the child inherits the pinning
        print(f"core {args.core}, {CHAINS} independent chains, register operands:")
        subprocess.run([str(binary)], check=True)


if __name__ == "__main__":
    main()
