// The two passes of decode attention (layer_ops.h attend_item) with AVX-512, where the CPU has it: each K
// and V row of the paged cache is widened to float32 once and used by every query head of its group (up
// to GC at a time) while it sits in registers, where the 256-bit passes widen it once per head.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "simd.h"

namespace kvyard {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const half_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The 8 sums of a[0..7] (16 lanes each), as one 8-lane vector.
inline __m256 hsum8x16(const __m512 a[8]) {
  __m256 h[8];
  for (int j = 0; j < 8; ++j) h[j] = _mm256_add_ps(_mm512_castps512_ps256(a[j]), _mm512_extractf32x8_ps(a[j], 1));
  return hsum8(h);
}

// scores[g][p] = scale * q_g · K_p for GC heads (q: GC rows of 16*NV floats) and keys [0, n) of `slots`
// (cache rows; K row of a key at kc + (slot * Hkv + kvh) * d), 8 keys at a time; np = n rounded up to 8.
template <int64_t NV, int GC, typename T>
inline void scores_pass512(const float* q, const T* kc, const int64_t* slots, int64_t n, int64_t Hkv, int64_t kvh,
                           float scale, float* scores, int64_t np) {
  constexpr int64_t d = NV * 16;
  for (int64_t p = 0; p < n; p += 8) {
    __m512 acc[GC][8];
    for (int j = 0; j < 8; ++j) {
      for (int g = 0; g < GC; ++g) acc[g][j] = _mm512_setzero_ps();
      if (p + j >= n) continue;
      const T* k = kc + (slots[p + j] * Hkv + kvh) * d;
      for (int64_t i = 0; i < NV; ++i) {
        const __m512 kv = load16(k + 16 * i);
        for (int g = 0; g < GC; ++g) acc[g][j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * d + 16 * i), kv, acc[g][j]);
      }
    }
    for (int g = 0; g < GC; ++g)
      _mm256_storeu_ps(scores + g * np + p, _mm256_mul_ps(hsum8x16(acc[g]), _mm256_set1_ps(scale)));
  }
}

// out[g] += Σ_p w[g][p] V_p for GC heads over keys [0, n): every V row once, all GC heads against it.
template <int64_t NV, int GC, typename T>
inline void values_pass512(const float* w, int64_t np, const T* vc, const int64_t* slots, int64_t n, int64_t Hkv,
                           int64_t kvh, float* out) {
  constexpr int64_t d = NV * 16;
  __m512 acc[GC][NV];
  for (int g = 0; g < GC; ++g)
    for (int64_t i = 0; i < NV; ++i) acc[g][i] = _mm512_loadu_ps(out + g * d + 16 * i);
  for (int64_t p = 0; p < n; ++p) {
    const T* v = vc + (slots[p] * Hkv + kvh) * d;
    __m512 wg[GC];
    for (int g = 0; g < GC; ++g) wg[g] = _mm512_set1_ps(w[g * np + p]);
    for (int64_t i = 0; i < NV; ++i) {
      const __m512 vv = load16(v + 16 * i);
      for (int g = 0; g < GC; ++g) acc[g][i] = _mm512_fmadd_ps(wg[g], vv, acc[g][i]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int64_t i = 0; i < NV; ++i) _mm512_storeu_ps(out + g * d + 16 * i, acc[g][i]);
}

// Both passes over all `group` heads of a KV head, GC at a time (GC: as many as fit the 32 registers).
template <int64_t NV, typename T>
void scores512(const float* q, const T* kc, const int64_t* slots, int64_t n, int64_t Hkv, int64_t kvh, float scale,
               float* scores, int64_t np, int64_t group) {
  constexpr int GC = NV <= 4 ? 3 : 2;
  constexpr int64_t d = NV * 16;
  int64_t g = 0;
  for (; g + GC <= group; g += GC) scores_pass512<NV, GC, T>(q + g * d, kc, slots, n, Hkv, kvh, scale, scores + g * np, np);
  for (; g < group; ++g) scores_pass512<NV, 1, T>(q + g * d, kc, slots, n, Hkv, kvh, scale, scores + g * np, np);
}

template <int64_t NV, typename T>
void values512(const float* w, int64_t np, const T* vc, const int64_t* slots, int64_t n, int64_t Hkv, int64_t kvh,
               float* out, int64_t group) {
  constexpr int GC = NV <= 4 ? 3 : 2;
  constexpr int64_t d = NV * 16;
  int64_t g = 0;
  for (; g + GC <= group; g += GC) values_pass512<NV, GC, T>(w + g * np, np, vc, slots, n, Hkv, kvh, out + g * d);
  for (; g < group; ++g) values_pass512<NV, 1, T>(w + g * np, np, vc, slots, n, Hkv, kvh, out + g * d);
}

#pragma GCC pop_options

}  // namespace kvyard
