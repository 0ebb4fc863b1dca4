// An encoder layer's residual step under bfloat16 matrices and float32 activations (backend/encoder.py on a
// CPU with DTYPE=bfloat16): the GEMM's bfloat16 output plus its bias plus the residual, LayerNorm, and the
// result rounded to bfloat16 for the next GEMM, in one pass over each row where torch took five.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace kvyard {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

inline __m512 bf16x16_to_ps(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Round to nearest, ties to even, as torch's float → bfloat16 (finite values; activations hold no NaN).
inline __m256i ps_to_bf16x16(__m512 v) {
  __m512i b = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16));
}

// One row of D floats (D a multiple of 16): t = float(y) + bias + x; x = (t - mean(t)) / sqrt(var(t) + eps) * w
// + b; xb (if not null) = bfloat16(x). The variance over t - mean, as torch's LayerNorm (two passes, no
// cancellation).
inline void residual_norm_row(const uint16_t* y, const float* bias, float* x, const float* w, const float* b,
                              int64_t D, float eps, uint16_t* xb) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < D; i += 16) {
    const __m512 t = _mm512_add_ps(_mm512_add_ps(bf16x16_to_ps(y + i), _mm512_loadu_ps(bias + i)),
                                   _mm512_loadu_ps(x + i));
    _mm512_storeu_ps(x + i, t);
    sum = _mm512_add_ps(sum, t);
  }
  const __m512 mean = _mm512_set1_ps(_mm512_reduce_add_ps(sum) / static_cast<float>(D));
  __m512 sq = _mm512_setzero_ps();
  for (int64_t i = 0; i < D; i += 16) {
    const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(x + i), mean);
    sq = _mm512_fmadd_ps(d, d, sq);
  }
  const __m512 rstd = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(D) + eps));
  for (int64_t i = 0; i < D; i += 16) {
    const __m512 o = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), mean), rstd),
                                     _mm512_loadu_ps(w + i), _mm512_loadu_ps(b + i));
    _mm512_storeu_ps(x + i, o);
    if (xb != nullptr) _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb + i), ps_to_bf16x16(o));
  }
}

#pragma GCC pop_options

}  // namespace kvyard
