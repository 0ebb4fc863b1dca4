// The few-row linear of qlinear.h with AVX-512 (F, BW, VL, DQ), chosen at run time where the CPU has it
// (AMD Zen 4, Intel since Skylake-SP); every other x86-64 CPU with AVX2 keeps the 256-bit code. Same
// float32 arithmetic, fewer instructions per block: one 512-bit widening of the 16 code bytes gives all 32
// weights (low nibbles 0-15, high nibbles 16-31) where AVX2 needs eight shuffles and conversions, so a
// one-token decode stops being bound by unpacking and runs near memory speed.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "simd.h"

namespace kvyard {

constexpr int64_t MAX_BLOCKS = 1024;  // blocks per weight row: rows of up to 32768 weights

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

// 32 weights of a block as two vectors of 16 floats: weights 0-15 and 16-31.
template <bool Q4>
inline void unpack512(const uint8_t* q, __m512& w0, __m512& w1) {
  if constexpr (Q4) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    w0 = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)));
    w1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
  } else {
    w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
    w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
  }
}

// y[m, n] for R token rows and one output row: Σ_b d_b (q_b · x_b) + Σ_b m_b S_b, where S_b = Σ x_b
// (block_sums512). Each block is unpacked once for all R rows.
template <bool Q4, int R>
inline void dot_rows512(const float* x, int64_t ldx, const uint8_t* qs, const float* d, const float* mins,
                 const float* bsum, int64_t nb, float* out, int64_t ldo) {
  constexpr int U = R <= 2 ? 2 : 1;  // independent chains where one would wait on the FMA latency
  __m512 acc[U][R];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r) acc[u][r] = _mm512_setzero_ps();
  constexpr int64_t step = Q4 ? 16 : 32;  // code bytes per block
  for (int64_t b0 = 0; b0 < nb; b0 += U) {
    for (int u = 0; u < U; ++u) {
      const int64_t b = b0 + u;
      if (U > 1 && b >= nb) break;
      __m512 w0, w1;
      unpack512<Q4>(qs + b * step, w0, w1);
      const __m512 scale = _mm512_set1_ps(d[b]);
      for (int r = 0; r < R; ++r) {
        const float* xb = x + r * ldx + b * QK;
        const __m512 t = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(xb)));
        acc[u][r] = _mm512_fmadd_ps(t, scale, acc[u][r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512 total = acc[0][r];
    for (int u = 1; u < U; ++u) total = _mm512_add_ps(total, acc[u][r]);
    if constexpr (Q4) {  // the minimums' share, 16 blocks at a time
      const float* s = bsum + r * nb;
      for (int64_t b = 0; b < nb; b += 16) {
        const __mmask16 k = nb - b >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (nb - b)) - 1);
        total = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, mins + b), _mm512_maskz_loadu_ps(k, s + b), total);
      }
    }
    out[r * ldo] = _mm512_reduce_add_ps(total);
  }
}

// The few-row part of one work item (qlinear.h's linear_item): output rows [n0, n1) for token rows
// [m0, m1), MT token rows at a time; bsum: block_sums512 of all M rows. One call per item, so the
// per-row work (widening the row's float16 scales) stays inlined with the dot products.
template <bool Q4>
void rows_item512(const float* x, int64_t K, int64_t m0, int64_t m1, const uint8_t* qs, const half_t* dh,
                  const half_t* mh, const float* bsum, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  constexpr int64_t MT8 = 8;
  const int64_t nb = K / QK, rb = Q4 ? K / 2 : K;
  alignas(64) float d[MAX_BLOCKS], mins[MAX_BLOCKS];
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t b = 0; b < nb; b += 16) {  // this row's scales (and minimums) as floats
      const __mmask16 k = nb - b >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (nb - b)) - 1);
      _mm512_store_ps(d + b, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, dh + n * nb + b)));
      if constexpr (Q4) _mm512_store_ps(mins + b, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, mh + n * nb + b)));
    }
    for (int64_t m = m0; m < m1; m += MT8) {
      const float* xm = x + m * K;
      const float* bs = Q4 ? bsum + m * nb : nullptr;
      float* out = y + m * ldy + n;
      switch (std::min<int64_t>(MT8, m1 - m)) {
        case 1: dot_rows512<Q4, 1>(xm, K, qs + n * rb, d, mins, bs, nb, out, ldy); break;
        case 2: dot_rows512<Q4, 2>(xm, K, qs + n * rb, d, mins, bs, nb, out, ldy); break;
        case 3: dot_rows512<Q4, 3>(xm, K, qs + n * rb, d, mins, bs, nb, out, ldy); break;
        case 4: dot_rows512<Q4, 4>(xm, K, qs + n * rb, d, mins, bs, nb, out, ldy); break;
        case 5: dot_rows512<Q4, 5>(xm, K, qs + n * rb, d, mins, bs, nb, out, ldy); break;
        case 6: dot_rows512<Q4, 6>(xm, K, qs + n * rb, d, mins, bs, nb, out, ldy); break;
        case 7: dot_rows512<Q4, 7>(xm, K, qs + n * rb, d, mins, bs, nb, out, ldy); break;
        default: dot_rows512<Q4, 8>(xm, K, qs + n * rb, d, mins, bs, nb, out, ldy); break;
      }
    }
  }
}

// Σ x over each block of rows [m0, m1): bsum[m][b] (the minimums' share needs them).
inline void block_sums512(const float* x, int64_t K, int64_t m0, int64_t m1, float* bsum) {
  const int64_t nb = K / QK;
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * QK;
      bsum[m * nb + b] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(xb), _mm512_loadu_ps(xb + 16)));
    }
}

#pragma GCC pop_options

}  // namespace kvyard
