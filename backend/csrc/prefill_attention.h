// Causal attention of a prefill chunk (many query rows of one sequence) over the paged KV cache, with
// AVX-512: each KV head's keys are widened once into float32 panels (K transposed in 16-key panels, V as
// rows), then each group of R query rows (position-major, the query heads sharing the KV head side by side)
// scores the keys it may see two panels at a time (R × 32 sums in registers, d multiply-adds each), takes
// an exact softmax over them, and sums the weighted V rows in registers. What torch's SDPA does through
// small-K GEMM calls and a score matrix per block, here 1.5x faster on one core (docs/performance.md).
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "attention512.h"

namespace kvyard {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

// e^x for 16 floats, x ≤ 0: exp_ps (simd.h) on each half (a small part of the work: once per score).
inline __m512 exp16(__m512 x) {
  const __m256 lo = exp_ps(_mm512_castps512_ps256(x)), hi = exp_ps(_mm512_extractf32x8_ps(x, 1));
  return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

// Keys [0, n) of KV head kvh, widened: kt [n16][d][16] (panel j holds keys 16j..16j+15, dimension-major, zero
// past n) and v [n][d]. slots: each key's cache row; caches [S, Hkv, d]. Panels [j0, j1).
template <typename T>
inline void widen_keys(const T* kc, const T* vc, const int64_t* slots, int64_t n, int64_t Hkv, int64_t kvh,
                       int64_t d, int64_t j0, int64_t j1, float* kt, float* v) {
  for (int64_t j = j0; j < j1; ++j) {
    float* panel = kt + j * d * 16;
    for (int64_t l = 0; l < 16; ++l) {
      const int64_t p = j * 16 + l;
      if (p >= n) {
        for (int64_t i = 0; i < d; ++i) panel[i * 16 + l] = 0.f;
        continue;
      }
      const T* k = kc + (slots[p] * Hkv + kvh) * d;
      const T* vr = vc + (slots[p] * Hkv + kvh) * d;
      for (int64_t i = 0; i < d; i += 16) {
        alignas(64) float tmp[16];
        _mm512_store_ps(tmp, load16(k + i));
        for (int64_t t = 0; t < 16; ++t) panel[(i + t) * 16 + l] = tmp[t];
        _mm512_storeu_ps(v + p * d + i, load16(vr + i));
      }
    }
  }
}

// Which keys query row r of a chunk sees: [lo, hi).
struct RowKeys {
  int64_t lo, hi;
};

// Dimensions [off, off + 16 W) of R output rows: Σ_t w[r][t] V[k0 + t] / l[r] over nk keys (w: sc, R rows of
// np weights; v: rows of d floats), the sums in R × W registers (a slice of d at a time keeps them there).
template <int W, int R>
inline void weigh_values(const float* sc, int64_t np, const float* v, int64_t d, int64_t k0, int64_t nk,
                         int64_t off, const float l[R], float* const out[R]) {
  __m512 o[R][W];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int i = 0; i < W; ++i) o[r][i] = _mm512_setzero_ps();
  for (int64_t t = 0; t < nk; ++t) {
    const float* vr = v + (k0 + t) * d + off;
#pragma GCC unroll 8
    for (int i = 0; i < W; ++i) {
      const __m512 vv = _mm512_loadu_ps(vr + 16 * i);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) o[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(sc[r * np + t]), vv, o[r][i]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    if (out[r] == nullptr) continue;
    const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
#pragma GCC unroll 8
    for (int i = 0; i < W; ++i) _mm512_storeu_ps(out[r] + off + 16 * i, _mm512_mul_ps(o[r][i], inv));
  }
}

// R query rows (q: R rows of d = 16 NV floats, already scaled), each seeing keys keys[r], over the widened
// keys of one KV head → out rows (each at its own pointer; null: not stored). Three passes over the keys the
// rows see, with an exact softmax (no running rescale): the scores of two 16-key panels at a time into sc
// (R rows of np floats; -inf where a row may not look) and each row's maximum, then e^(score - max) and its
// sum, then the weighted V rows (weigh_values). kt holds one zero panel past the last key.
template <int64_t NV, int R>
inline void attend_rows(const float* const q[R], const RowKeys keys[R], const float* kt, const float* v,
                        float* const out[R], float* sc, int64_t np) {
  constexpr int64_t d = NV * 16;
  int64_t lo = keys[0].lo, hi = keys[0].hi;
  for (int r = 1; r < R; ++r) {
    lo = std::min(lo, keys[r].lo);
    hi = std::max(hi, keys[r].hi);
  }
  const int64_t k0 = lo / 16 * 16;  // keys [k0, hi) are scored, from panel k0 / 16
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __m512 mx[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) mx[r] = ninf;
  for (int64_t j = k0; j < hi; j += 32) {
    const float* p0 = kt + j * d;  // panels j/16 and j/16 + 1
    const float* p1 = p0 + 16 * d;
    __m512 a[R], b[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) a[r] = b[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; ++i) {
      const __m512 ka = _mm512_loadu_ps(p0 + i * 16), kb = _mm512_loadu_ps(p1 + i * 16);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 qi = _mm512_set1_ps(q[r][i]);
        a[r] = _mm512_fmadd_ps(qi, ka, a[r]);
        b[r] = _mm512_fmadd_ps(qi, kb, b[r]);
      }
    }
    const __m512i ka = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(j)), lane);
    const __m512i kb = _mm512_add_epi32(ka, _mm512_set1_epi32(16));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i rl = _mm512_set1_epi32(static_cast<int>(keys[r].lo)), rh = _mm512_set1_epi32(static_cast<int>(keys[r].hi));
      const __mmask16 sa = _mm512_cmpge_epi32_mask(ka, rl) & _mm512_cmplt_epi32_mask(ka, rh);
      const __mmask16 sb = _mm512_cmpge_epi32_mask(kb, rl) & _mm512_cmplt_epi32_mask(kb, rh);
      a[r] = _mm512_mask_mov_ps(ninf, sa, a[r]);
      b[r] = _mm512_mask_mov_ps(ninf, sb, b[r]);
      mx[r] = _mm512_max_ps(mx[r], _mm512_max_ps(a[r], b[r]));
      _mm512_storeu_ps(sc + r * np + (j - k0), a[r]);
      _mm512_storeu_ps(sc + r * np + (j - k0) + 16, b[r]);
    }
  }
  const int64_t nk = hi - k0, ne = (nk + 15) / 16 * 16;
  float l[R];
  for (int r = 0; r < R; ++r) {
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx[r]));
    __m512 sum = _mm512_setzero_ps();
    float* row = sc + r * np;
    for (int64_t t = 0; t < ne; t += 16) {  // -inf (unseen) → e^-87, ~1e-38 of the largest weight's 1
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + t), m));
      _mm512_storeu_ps(row + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    l[r] = _mm512_reduce_add_ps(sum);
  }
  for (int64_t off = 0; off + 64 <= d; off += 64) weigh_values<4, R>(sc, np, v, d, k0, nk, off, l, out);
  if (d % 64) weigh_values<2, R>(sc, np, v, d, k0, nk, d - 32, l, out);
}

// The chunk's query rows of KV head kvh from row chunk c (R rows of the T * group (position, head) pairs,
// position-major): q [T, H, d] scaled into qs (R d floats), sc: R np floats of scratch, each row's keys from its position (start + t sees keys up to
// and including start + t; the last `window` of them when window > 0). out [T, H, d].
template <int64_t NV, int R>
inline void attend_chunk(const float* q, int64_t T, int64_t H, int64_t group, int64_t kvh, int64_t c, int64_t start,
                         int64_t window, float scale, const float* kt, const float* v, float* out, float* qs,
                         float* sc, int64_t np) {
  constexpr int64_t d = NV * 16;
  const float* rows[R];
  float* outs[R];
  RowKeys keys[R];
  for (int r = 0; r < R; ++r) {
    const int64_t idx = std::min(c * R + r, T * group - 1);  // past the end: repeat the last row, store nothing
    const int64_t t = idx / group, h = kvh * group + idx % group;
    const float* src = q + (t * H + h) * d;
    for (int64_t i = 0; i < d; i += 16)
      _mm512_storeu_ps(qs + r * d + i, _mm512_mul_ps(_mm512_loadu_ps(src + i), _mm512_set1_ps(scale)));
    rows[r] = qs + r * d;
    outs[r] = c * R + r < T * group ? out + (t * H + h) * d : nullptr;
    const int64_t hi = start + t + 1;
    keys[r] = {window > 0 ? std::max<int64_t>(0, hi - window) : 0, hi};
  }
  attend_rows<NV, R>(rows, keys, kt, v, outs, sc, np);
}

#pragma GCC pop_options

}  // namespace kvyard
