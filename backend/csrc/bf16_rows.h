// A decoder's per-row ops on bfloat16 activations (a CPU's DTYPE=bfloat16 over dense weights: backend/ops.py
// CpuBf16Ops), each one pass where torch's bfloat16 ops take five to eight, with the same roundings as those
// ops (TorchOps.rms_norm, TorchOps.silu_mul): float32 inside, bfloat16 where torch rounds.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "encoder_norm.h"

namespace kvyard {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

// 16 floats rounded to bfloat16 and back (what torch holds after a bfloat16 op).
inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(ps_to_bf16x16(v)), 16));
}

// e^x for 16 floats, x ≤ 88: simd.h's exp_ps (2^n · p(r), x = n ln2 + r, p of degree 6) at twice the width.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// One row of D (a multiple of 16): y = bf16(bf16(x · rsqrt(mean(x²) + eps)) · w).
inline void rms_norm_bf16_row(const uint16_t* x, const uint16_t* w, int64_t D, float eps, uint16_t* y) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < D; i += 16) {
    const __m512 v = bf16x16_to_ps(x + i);
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(D) + eps));
  for (int64_t i = 0; i < D; i += 16) {
    const __m512 t = round_bf16(_mm512_mul_ps(bf16x16_to_ps(x + i), r));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), ps_to_bf16x16(_mm512_mul_ps(t, bf16x16_to_ps(w + i))));
  }
}

// One row of gate_up [2F] (F a multiple of 16), in place on its gate half: gate = bf16(bf16(silu(gate)) · up).
inline void silu_mul_bf16_row(uint16_t* gu, int64_t F) {
  const uint16_t* up = gu + F;
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < F; i += 16) {
    const __m512 g = bf16x16_to_ps(gu + i);
    const __m512 s = round_bf16(_mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(gu + i), ps_to_bf16x16(_mm512_mul_ps(s, bf16x16_to_ps(up + i))));
  }
}

// One head of one token (d = 2 · half, half a multiple of 16): the Hugging Face rotation of pairs (i, i + half)
// as TorchOps' bfloat16 _rope rounds it: cos and sin rounded first, each product, then the sum.
inline void rope_bf16_head(const uint16_t* x, const float* cos, const float* sin, int64_t half, uint16_t* out) {
  for (int64_t i = 0; i < half; i += 16) {
    const __m512 x1 = bf16x16_to_ps(x + i), x2 = bf16x16_to_ps(x + half + i);
    const __m512 c = round_bf16(_mm512_loadu_ps(cos + i)), s = round_bf16(_mm512_loadu_ps(sin + i));
    const __m512 lo = _mm512_sub_ps(round_bf16(_mm512_mul_ps(x1, c)), round_bf16(_mm512_mul_ps(x2, s)));
    const __m512 hi = _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, c)), round_bf16(_mm512_mul_ps(x1, s)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), ps_to_bf16x16(lo));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + half + i), ps_to_bf16x16(hi));
  }
}

#pragma GCC pop_options

}  // namespace kvyard
