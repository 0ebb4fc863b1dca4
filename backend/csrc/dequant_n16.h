// n16-layout weights (qlinear_vnni.h, qlinear_kquant.h) dequantized to float32 in transposed tiles, for
// prefill-sized batches: backend/ops.py then hands the tile to torch's GEMM (oneDNN/MKL), which on CPUs
// whose int16 kernel rate is below the float32 GEMM's (measured in docs/performance.md) amortises one
// decode of the weights over hundreds of token rows. A group's 16 lanes are 16 consecutive output rows,
// so the tile is W^T [K, 16 * groups]: each step stores 16 contiguous floats, no shuffles. The values are
// the reference dequantization's (backend/quant.py; gguf's arithmetic for the K-quants).
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "qlinear.h"

namespace kvyard {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

// Groups [g0, g1) of w into out [K][ldo] at column (g - g0) * 16; blocks [b0, b1) only (b1 < 0: to the last),
// block b0's 32 rows first.
inline void dequantize_groups_t_512(const QMatrix& w, int64_t g0, int64_t g1, float* out, int64_t ldo,
                                    int64_t b0 = 0, int64_t b1 = -1) {
  const int64_t nb = w.nb(), nsb = nb / SUPER;
  if (b1 < 0) b1 = nb;
  for (int64_t g = g0; g < g1; ++g) {
    float* col = out + (g - g0) * G16;
    for (int64_t b = b0; b < b1; ++b) {
      float* o = col + (b - b0) * QK * ldo;
      switch (w.kind) {
        case BlockKind::Q4_1:
        case BlockKind::Q4_K:
        case BlockKind::Q5_K:
        case BlockKind::Q5_K8: {
          const uint8_t* codes = w.qs + g * nb * (w.kind == BlockKind::Q4_1 ? 256 : k_code_bytes(w.kind));
          __m512 scale, minimum;
          if (w.kind == BlockKind::Q4_1) {
            scale = halves_ps(w.d + (g * nb + b) * G16);
            minimum = halves_ps(w.m + (g * nb + b) * G16);
          } else {  // (d sc) q - (dmin mn), as gguf: no fused multiply-add
            const half_t* dd = w.d + (g * nsb + b / SUPER) * 32;
            const uint8_t* s = w.sub + (g * nb + b) * 32;
            scale = _mm512_mul_ps(halves_ps(dd), bytes_ps<false>(s));
            minimum = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(halves_ps(dd + 16), bytes_ps<false>(s + 16)));
          }
          for (int64_t j = 0; j < 16; ++j) {
            // lane n: the pair (k=j, k=j+16) of row n as int16 halves (Q5_K: with their top bits)
            const __m512i pair = w.kind == BlockKind::Q5_K    ? k_weights<BlockKind::Q5_K>(codes, b, j)
                                 : w.kind == BlockKind::Q5_K8 ? k_weights<BlockKind::Q5_K8>(codes, b, j)
                                                              : group_weights<true>(codes, b, j);
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(pair, _mm512_set1_epi32(0xFFFF)));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(pair, 16));
            _mm512_storeu_ps(o + j * ldo, _mm512_add_ps(_mm512_mul_ps(lo, scale), minimum));
            _mm512_storeu_ps(o + (j + 16) * ldo, _mm512_add_ps(_mm512_mul_ps(hi, scale), minimum));
          }
          break;
        }
        case BlockKind::Q8_0: {
          const int8_t* codes = reinterpret_cast<const int8_t*>(w.qs) + g * nb * 512;
          const __m512 scale = halves_ps(w.d + (g * nb + b) * G16);
          for (int64_t j = 0; j < 16; ++j) {  // lane n: the int8 pair (k=j, k=j+16) of row n
            const __m512i pair = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + (b * 16 + j) * 32)));
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(pair, 16), 16));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_srai_epi32(pair, 16));
            _mm512_storeu_ps(o + j * ldo, _mm512_mul_ps(lo, scale));
            _mm512_storeu_ps(o + (j + 16) * ldo, _mm512_mul_ps(hi, scale));
          }
          break;
        }
        case BlockKind::Q6_K:
        case BlockKind::Q6_K8: {
          const uint8_t* cb = w.qs + g * nb * k_code_bytes(w.kind);
          const __m512 dv = halves_ps(w.d + (g * nsb + b / SUPER) * 16);
          const uint8_t* s = w.sub + (g * nb + b) * 32;
          const __m512 s0 = _mm512_mul_ps(dv, bytes_ps<true>(s)), s1 = _mm512_mul_ps(dv, bytes_ps<true>(s + 16));
          for (int64_t j = 0; j < 16; ++j) {  // lane n: (k=2j, k=2j+1) of row n, minus 32
            const __m512i pair = w.kind == BlockKind::Q6_K ? k_weights<BlockKind::Q6_K>(cb, b, j)
                                                           : k_weights<BlockKind::Q6_K8>(cb, b, j);
            const __m512 a = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(pair, 16), 16));
            const __m512 c = _mm512_cvtepi32_ps(_mm512_srai_epi32(pair, 16));
            const __m512 scale = j < 8 ? s0 : s1;
            _mm512_storeu_ps(o + 2 * j * ldo, _mm512_mul_ps(a, scale));
            _mm512_storeu_ps(o + (2 * j + 1) * ldo, _mm512_mul_ps(c, scale));
          }
          break;
        }
      }
    }
  }
}

#pragma GCC pop_options

// The same for Q4_1 / Q8_0 on AVX2 (the n16 int16 kernels of qlinear_n16_avx2.h): a group's 16 columns as
// two halves of 8, the same arithmetic, so the same floats.
inline void dequantize_groups_t_avx2(const QMatrix& w, int64_t g0, int64_t g1, float* out, int64_t ldo) {
  const int64_t nb = w.nb();
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t b = 0; b < nb; ++b)
      for (int h = 0; h < 2; ++h) {
        float* o = out + (g - g0) * G16 + 8 * h + b * QK * ldo;
        const int64_t at = (g * nb + b) * G16 + 8 * h;  // this half's scales (and minimums)
        const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.d + at)));
        if (w.q4) {
          const __m256 minimum = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.m + at)));
          const uint8_t* codes = w.qs + g * nb * 256;
          for (int64_t j = 0; j < 16; ++j) {
            const __m256i by = _mm256_cvtepu8_epi32(
                _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + (b * 16 + j) * 16 + 8 * h)));
            const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(by, _mm256_set1_epi32(0x0F)));
            const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(by, 4));
            _mm256_storeu_ps(o + j * ldo, _mm256_add_ps(_mm256_mul_ps(lo, scale), minimum));
            _mm256_storeu_ps(o + (j + 16) * ldo, _mm256_add_ps(_mm256_mul_ps(hi, scale), minimum));
          }
        } else {
          const int8_t* codes = reinterpret_cast<const int8_t*>(w.qs) + g * nb * 512;
          for (int64_t j = 0; j < 16; ++j) {
            const __m256i pair = _mm256_cvtepi8_epi16(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (b * 16 + j) * 32 + 16 * h)));
            const __m256 lo = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(pair, 16), 16));
            const __m256 hi = _mm256_cvtepi32_ps(_mm256_srai_epi32(pair, 16));
            _mm256_storeu_ps(o + j * ldo, _mm256_mul_ps(lo, scale));
            _mm256_storeu_ps(o + (j + 16) * ldo, _mm256_mul_ps(hi, scale));
          }
        }
      }
}

// Groups [g0, g1) of w into out [K][ldo] at column (g - g0) * 16.
inline void dequantize_groups_t(const QMatrix& w, int64_t g0, int64_t g1, float* out, int64_t ldo) {
  if (int16_code() != I16_AVX2) return dequantize_groups_t_512(w, g0, g1, out, ldo);
  if (is_k_quant(w.kind))
    return visit_k_kind(w.kind, [&](auto kind) {
      dequantize_groups_k_avx2<decltype(kind)::value>(w.qs, w.d, w.sub, w.nb(), g0, g1, out, ldo);
    });
  dequantize_groups_t_avx2(w, g0, g1, out, ldo);
}

}  // namespace kvyard
