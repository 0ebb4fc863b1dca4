// The n16 Q4_1 / Q8_0 linears with int16 activations on AVX2 (no VNNI): qlinear_vnni.h's layout, rounding
// and arithmetic, 8 output rows a 256-bit vector. vpmaddwd multiplies a lane's two int16 pairs and adds them
// (16 multiply-adds an instruction, twice AVX2's float32 FMA) and vpaddd adds that to the block's dot: the
// same exact 32-bit integer vpdpwssd gives (no product overflows: |x| ≤ 32767, weights within int8). The
// float part is the same fused multiply-adds in the same order, and the rounding the same values and sums, so
// every output has the bits the AVX-512 VNNI kernels give (tests/backend/test_int16_avx2.py checks this).
//
// Against the float32-activation kernels an AVX2 CPU ran before (qlinear.h's "rows" layout), a weight costs
// no float conversion: a Q4_1 step of 16 weights is a widen, a shift, an or, an and and one vpmaddwd per
// token row.
//
// qlinear_vnni.h includes this file after what both share (Int16Rows, walk_row_chunks, prefetch_ahead).
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "simd.h"

namespace kvyard {

// The 16 lanes of a group are two vectors ("halves" h = 0, 1: output rows 8h..8h+7). Rows of a chunk run in
// sub-chunks of at most 4: a block's 2 x 4 dots, two weight vectors and an activation fit AVX2's 16
// registers (the float accumulators are touched once a block).
constexpr int AVX2_ROWS = 4;

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// A 32-wide block's sum (l0, l1: values 0-15, h0, h1: 16-31) in _mm512_reduce_add_ps's order (GCC's
// avx512fintrin.h) over the 16 lanes of lo + hi (256-bit halves, then 128-bit halves, then pairs): the same bits.
inline float block_sum_avx2(__m256 l0, __m256 l1, __m256 h0, __m256 h1) {
  const __m256 t = _mm256_add_ps(_mm256_add_ps(l1, h1), _mm256_add_ps(l0, h0));
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}

// quantize_rows16_512's values, scales and sums (block_sum_avx2), so the same bits.
inline void quantize_rows16_avx2(const float* x, int64_t K, int64_t m0, int64_t m1, int32_t* q, float* s,
                                 float* sum) {
  const int64_t nb = K / QK;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i low16 = _mm256_set1_epi32(0xFFFF);
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * QK;
      const __m256 l0 = _mm256_loadu_ps(xb), l1 = _mm256_loadu_ps(xb + 8);
      const __m256 h0 = _mm256_loadu_ps(xb + 16), h1 = _mm256_loadu_ps(xb + 24);
      const float amax = hmax8(_mm256_max_ps(_mm256_max_ps(_mm256_and_ps(l0, abs_mask), _mm256_and_ps(l1, abs_mask)),
                                             _mm256_max_ps(_mm256_and_ps(h0, abs_mask), _mm256_and_ps(h1, abs_mask))));
      const float inv = amax > 0.f ? 32767.f / amax : 0.f;
      s[m * nb + b] = amax / 32767.f;
      sum[m * nb + b] = block_sum_avx2(l0, l1, h0, h1);
      const __m256 vinv = _mm256_set1_ps(inv);
      for (int half = 0; half < 2; ++half) {
        const __m256i ql = _mm256_cvtps_epi32(_mm256_mul_ps(half ? l1 : l0, vinv));
        const __m256i qh = _mm256_cvtps_epi32(_mm256_mul_ps(half ? h1 : h0, vinv));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + (m * nb + b) * 16 + 8 * half),
                            _mm256_or_si256(_mm256_and_si256(ql, low16), _mm256_slli_epi32(qh, 16)));
      }
    }
}

// Step j of a block, half h: rows 8h..8h+7's weights k=j and k=j+16 as int16 pairs, one per 32-bit lane.
template <bool Q4>
inline __m256i half_weights(const uint8_t* codes, int64_t b, int64_t j, int h) {
  if constexpr (Q4) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + (b * 16 + j) * 16 + 8 * h));
    const __m256i by = _mm256_cvtepu8_epi32(bytes);
    return _mm256_and_si256(_mm256_or_si256(by, _mm256_slli_epi32(by, 12)), _mm256_set1_epi32(0x000F000F));
  } else {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (b * 16 + j) * 32 + 16 * h)));
  }
}

// y[r, 0..15] for R ≤ AVX2_ROWS token rows against one group of 16 rows (qlinear_vnni.h's group_rows16):
// both halves in each step, so a row's activation is broadcast once for the two.
template <bool Q4, int R>
inline void group_rows16_avx2(const uint8_t* codes, const half_t* d, const half_t* mins, int64_t nb, const int32_t* xq,
                              const float* xs, const float* xsum, int64_t ldq, int64_t lds, float* y, int64_t ldy) {
  static_assert(R <= AVX2_ROWS);
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  constexpr int64_t code_bytes = Q4 ? 256 : 512;
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_ahead<R>(codes + (b + kAhead) * code_bytes, code_bytes);
    if (b % 2 == 0) prefetch_ahead<R>(d + (b + kAhead) * 16, 64);
    if (Q4 && b % 2 == 0) prefetch_ahead<R>(mins + (b + kAhead) * 16, 64);
    __m256i dot0[R], dot1[R];
    for (int r = 0; r < R; ++r) dot0[r] = dot1[r] = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int64_t j = 0; j < 16; ++j) {
      const __m256i w0 = half_weights<Q4>(codes, b, j, 0), w1 = half_weights<Q4>(codes, b, j, 1);
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_set1_epi32(xq[r * ldq + b * 16 + j]);
        dot0[r] = _mm256_add_epi32(dot0[r], _mm256_madd_epi16(w0, xv));
        dot1[r] = _mm256_add_epi32(dot1[r], _mm256_madd_epi16(w1, xv));
      }
    }
    const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + b * 16)));
    const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + b * 16 + 8)));
    for (int r = 0; r < R; ++r) {
      const __m256 sv = _mm256_set1_ps(xs[r * lds + b]);
      acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot0[r]), _mm256_mul_ps(d0, sv), acc0[r]);
      acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot1[r]), _mm256_mul_ps(d1, sv), acc1[r]);
    }
    if constexpr (Q4) {
      const __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + b * 16)));
      const __m256 m1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + b * 16 + 8)));
      for (int r = 0; r < R; ++r) {
        const __m256 sv = _mm256_set1_ps(xsum[r * lds + b]);
        acc0[r] = _mm256_fmadd_ps(m0, sv, acc0[r]);
        acc1[r] = _mm256_fmadd_ps(m1, sv, acc1[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * ldy, acc0[r]);
    _mm256_storeu_ps(y + r * ldy + 8, acc1[r]);
  }
}

template <bool Q4>
void group_item16_avx2(const Int16Rows& x, int64_t m0, int64_t m1, const uint8_t* qs, const half_t* d,
                       const half_t* mins, int64_t g0, int64_t g1, float* y, int64_t ldy) {
  const int64_t nb = x.nb, ldq = nb * 16, code_bytes = Q4 ? 256 : 512;
  walk_row_chunks(x, m0, m1, g0, g1, y, ldy, [&](auto rows, int64_t g, const int32_t* xq, const float* xs,
                                                  const float* xsum, float* out) {
    constexpr int R = decltype(rows)::value, TAIL = R % AVX2_ROWS;  // AVX2_ROWS at a time, then the rest
    auto sub = [&](auto n, int r0) {
      group_rows16_avx2<Q4, decltype(n)::value>(qs + g * nb * code_bytes, d + g * nb * 16, Q4 ? mins + g * nb * 16 : nullptr,
                                                nb, xq + r0 * ldq, xs + r0 * nb, xsum + r0 * nb, ldq, nb, out + r0 * ldy, ldy);
    };
    int r0 = 0;
    for (; r0 + AVX2_ROWS <= R; r0 += AVX2_ROWS) sub(std::integral_constant<int, AVX2_ROWS>{}, r0);
    if constexpr (TAIL != 0) sub(std::integral_constant<int, TAIL>{}, r0);
  });
}

}  // namespace kvyard
