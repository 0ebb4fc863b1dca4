// Prefill-sized batches over n16 weights on a CPU with AMX-BF16: x (bfloat16) @ W^T → float32, through torch's
// brgemm (at::native::cpublas, oneDNN's micro-kernel: tile multiply-adds, float32 sums, float32 results).
// A thread takes a panel of output columns at a time: it dequantizes the panel (dequant_n16.h, float32, the
// reference values), rounds it to bfloat16 in the VNNI pair layout the tiles read ([K/2][cols][2]), and runs
// every token row over it while it sits in L2. Against oneDNN's float32 GEMM in its bf16 math mode on a
// dequantized float32 tile (backend/ops.py bf16_matmul), the same products of the same rounded operands,
// without the float32 weight tile written, read back and converted on every call.
#pragma once
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "dequant_n16.h"
#include "layer_ops.h"

namespace kvyard {

constexpr int64_t GEMM_ROWS = 128;         // token rows per brgemm call (n16_gemm_bf16's default)
constexpr int64_t GEMM_DEPTH = 2048;       // K per brgemm call, a multiple of 32 (n16_gemm_bf16's default)
constexpr int64_t PANEL_GROUPS = 16;       // a panel's output columns, in groups of 16 (at most)
constexpr int64_t SILU_PANEL_GROUPS = 8;   // the same with its up panel beside it (gemm_bf16_silu_groups)
constexpr int64_t CHUNK_BLOCKS = 8;        // blocks of 32 K rows dequantized (float32) before each packing

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")

// src [K][ld] float32 (columns [0, cols), cols a multiple of 16) → dst [K/2][cols][2] bfloat16, rounded to
// nearest even (as torch's float → bfloat16).
inline void pack_vnni_bf16(const float* src, int64_t ld, int64_t K, int64_t cols, uint16_t* dst) {
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t k = 0; k < K; k += 2)
    for (int64_t n = 0; n < cols; n += 16) {
      const __m512 even = _mm512_loadu_ps(src + k * ld + n), odd = _mm512_loadu_ps(src + (k + 1) * ld + n);
      // cvtne2ps: the second operand's 16 values in the low half, the first's in the high half
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even);
      _mm512_storeu_si512(dst + (k / 2 * cols + n) * 2, _mm512_permutexvar_epi16(pairs, both));
    }
}

#pragma GCC pop_options

// Groups [g0, g1) of w, dequantized a chunk of CHUNK_BLOCKS blocks at a time into f32 (so it stays in L2:
// [CHUNK_BLOCKS * 32][16 (g1 - g0)]) and packed into packed ([K/2][16 (g1 - g0)][2] bfloat16).
inline void pack_groups(const QMatrix& w, int64_t g0, int64_t g1, float* f32, uint16_t* packed) {
  const int64_t nb = w.nb(), cols = (g1 - g0) * G16;
  for (int64_t b0 = 0; b0 < nb; b0 += CHUNK_BLOCKS) {
    const int64_t b1 = std::min(nb, b0 + CHUNK_BLOCKS);
    dequantize_groups_t_512(w, g0, g1, f32, cols, b0, b1);
    pack_vnni_bf16(f32, cols, (b1 - b0) * QK, cols, packed + b0 * QK * cols);
  }
}

// What a block of rows gets once its products are summed: y += bias[column]; y += residual (row stride ld_res),
// in that order (as backend/ops.py adds them after a GEMM).
struct Epilogue {
  const float* bias = nullptr;
  const float* residual = nullptr;
  int64_t ld_res = 0;
};

inline void finish_rows(const Epilogue& e, float* y, int64_t ldy, int64_t m0, int64_t rows, int64_t c0, int64_t cols) {
  if (!e.bias && !e.residual) return;
  for (int64_t m = m0; m < m0 + rows; ++m) {
    float* row = y + m * ldy + c0;
    if (e.bias)
      for (int64_t c = 0; c < cols; ++c) row[c] += e.bias[c0 + c];
    if (e.residual)
      for (int64_t c = 0; c < cols; ++c) row[c] += e.residual[m * e.ld_res + c0 + c];
  }
}

// Groups [g0, g1) of w against x [M, K] bfloat16 (row stride K) into y [M, ldy] float32 at column 16 g0. K in
// slices of at most `depth`, each slice's B (depth x cols bfloat16) kept in L2 while every block of `rows`
// token rows passes over it (brgemm adds the later slices' products into C, float32); after the last slice a
// block gets its epilogue. Scratch as pack_groups'. The caller runs brgemm_release() after its last call.
inline void gemm_bf16_groups(const QMatrix& w, const at::BFloat16* x, int64_t M, int64_t g0, int64_t g1,
                             float* y, int64_t ldy, const Epilogue& e, float* f32, uint16_t* packed,
                             int64_t rows, int64_t depth) {
  const int64_t K = w.K, cols = (g1 - g0) * G16, c0 = g0 * G16;
  pack_groups(w, g0, g1, f32, packed);
  const auto* b = reinterpret_cast<const at::BFloat16*>(packed);
  for (int64_t k0 = 0; k0 < K; k0 += depth)
    for (int64_t m0 = 0; m0 < M; m0 += rows) {
      const int64_t mr = std::min(rows, M - m0);
      at::native::cpublas::brgemm(mr, cols, std::min(depth, K - k0), K, cols, ldy, k0 > 0, x + m0 * K + k0,
                                  b + k0 * cols, y + m0 * ldy + c0, true);
      if (k0 + depth >= K) finish_rows(e, y, ldy, m0, mr, c0, cols);
    }
}

// gate_up (gate's F rows, then up's) against x, straight to silu(gate) * up: gate groups [g0, g1) and the up
// groups F/16 further, a block of `rows` token rows at a time into c [rows][2 cols] (gate, then up: the row
// layout layer_ops.h's silu_mul_cols reads, so the same float operations as linear + silu_mul), then into
// y [M, F] at column 16 g0 — the [M, 2F] product never reaches memory. Scratch: f32 as pack_groups', packed
// [2][K * 16 (g1 - g0)], c [rows * 2 * 16 (g1 - g0)].
inline void gemm_bf16_silu_groups(const QMatrix& w, const at::BFloat16* x, int64_t M, int64_t g0, int64_t g1,
                                  float* y, float* f32, uint16_t* packed, float* c, int64_t rows, int64_t depth) {
  const int64_t K = w.K, F = w.N / 2, cols = (g1 - g0) * G16, up = F / G16;
  pack_groups(w, g0, g1, f32, packed);
  pack_groups(w, g0 + up, g1 + up, f32, packed + K * cols);
  const auto* gate_b = reinterpret_cast<const at::BFloat16*>(packed);
  const auto* up_b = gate_b + K * cols;
  for (int64_t m0 = 0; m0 < M; m0 += rows) {
    const int64_t mr = std::min(rows, M - m0);
    for (int64_t k0 = 0; k0 < K; k0 += depth) {
      const int64_t kd = std::min(depth, K - k0);
      at::native::cpublas::brgemm(mr, cols, kd, K, cols, 2 * cols, k0 > 0, x + m0 * K + k0, gate_b + k0 * cols, c, true);
      at::native::cpublas::brgemm(mr, cols, kd, K, cols, 2 * cols, k0 > 0, x + m0 * K + k0, up_b + k0 * cols,
                                  c + cols, true);
    }
    for (int64_t m = 0; m < mr; ++m) silu_mul_cols(c + m * 2 * cols, cols, 0, cols, y + (m0 + m) * F + g0 * G16);
  }
}

}  // namespace kvyard
