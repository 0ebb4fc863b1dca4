// The K-quant linears (Q4_K, Q5_K, Q6_K, qlinear_kquant.h's n16 layout) on AVX2 CPUs: the blocks served as the
// file has them there too, instead of converted to Q4_1 and requantized to Q8_0 (on the random-weight 1.7B
// the requantized Q6_K parts took the top-1 agreement with float32 to 0.93 for Q4_K_M and 0.89 for Q5_K_M,
// under the 0.98 the AVX-512 kernels keep). The same rounding of the activations (per row and 256 values, 14
// bits) and the same integer sums and float chains per output lane as the AVX-512 step loops, 8 lanes a
// 256-bit vector: vpmaddwd + vpaddd give vpdpwssd's exact integers, so every output has the AVX-512 bits
// (tests/backend/test_kquant.py compares them).
//
// A group's 16 output rows are two vectors of 8 lanes ("sides"), decoded and multiplied in the same pass.
// Included by qlinear_kquant.h (plain AVX2: the module's baseline).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace kvyard {

// quantize_rows_super's values, scales, pairs and sums on AVX2: the same amax (a maximum in any order), the same
// reciprocal and rounding (vcvtps2dq rounds to nearest even, as the AVX-512 code asks), each block's sum in
// _mm512_reduce_add_ps's order (block_sum_avx2). adjacent: word j holds x_2j and x_2j+1.
inline void quantize_rows_super_avx2(const float* x, int64_t K, int64_t m0, int64_t m1, int32_t* q, float* s,
                                     float* sum, bool adjacent) {
  const int64_t nb = K / QK;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t b0 = 0; b0 < nb; b0 += 8) {
      const float* xs = x + m * K + b0 * QK;
      __m256 big = _mm256_setzero_ps();
      for (int64_t i = 0; i < 32; ++i) big = _mm256_max_ps(big, _mm256_and_ps(_mm256_loadu_ps(xs + 8 * i), abs_mask));
      const float amax = hmax8(big);
      const float inv = amax > 0.f ? kSuperLevels / amax : 0.f;
      const __m256 vinv = _mm256_set1_ps(inv);
      for (int64_t b = b0; b < b0 + 8; ++b) {
        const float* xb = x + m * K + b * QK;
        const __m256 v[4] = {_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8), _mm256_loadu_ps(xb + 16),
                             _mm256_loadu_ps(xb + 24)};
        s[m * nb + b] = amax / kSuperLevels;
        sum[m * nb + b] = block_sum_avx2(v[0], v[1], v[2], v[3]);
        alignas(32) int32_t r[32];
        for (int i = 0; i < 4; ++i)
          _mm256_store_si256(reinterpret_cast<__m256i*>(r + 8 * i), _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vinv)));
        int32_t* out = q + (m * nb + b) * 16;
        for (int j = 0; j < 16; ++j) {
          const int32_t lo = adjacent ? r[2 * j] : r[j], hi = adjacent ? r[2 * j + 1] : r[j + 16];
          out[j] = static_cast<int32_t>((static_cast<uint32_t>(lo) & 0xFFFFu) | (static_cast<uint32_t>(hi) << 16));
        }
      }
    }
}

// Step j of block b, side h (output rows 8h..8h+7 of the group): the int16 weight pairs k_weights gives those
// lanes (Q6_K: minus 32).
template <BlockKind KIND>
inline __m256i k_weights_avx2(const uint8_t* codes, int64_t b, int64_t j, int h) {
  if constexpr (KIND == BlockKind::Q6_K8 || KIND == BlockKind::Q5_K8) {  // the bytes widened: one vpmov{s,z}xbw
    const __m128i by = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + b * 512 + j * 32 + 16 * h));
    return KIND == BlockKind::Q6_K8 ? _mm256_cvtepi8_epi16(by) : _mm256_cvtepu8_epi16(by);
  } else if constexpr (KIND == BlockKind::Q6_K) {
    const uint8_t* cb = codes + b * 384;
    const __m256i lo8 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cb + j * 16 + 8 * h)));
    const __m256i lo = _mm256_and_si256(_mm256_or_si256(lo8, _mm256_slli_epi32(lo8, 12)), _mm256_set1_epi32(0x000F000F));
    const __m256i hi8 =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cb + (16 + j / 2) * 16 + 8 * h)));
    const __m256i t = _mm256_and_si256(_mm256_srli_epi32(hi8, static_cast<int>(4 * (j & 1))), _mm256_set1_epi32(0xF));
    const __m256i hp = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(t, _mm256_set1_epi32(0x3)), 4),
                                       _mm256_slli_epi32(_mm256_and_si256(t, _mm256_set1_epi32(0xC)), 18));
    return _mm256_sub_epi16(_mm256_or_si256(lo, hp), _mm256_set1_epi16(32));
  } else {
    constexpr int64_t block = KTraits<KIND>::code_bytes;
    const uint8_t* cb = codes + b * block;
    const __m256i by = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cb + j * 16 + 8 * h)));
    const __m256i nib = _mm256_and_si256(_mm256_or_si256(by, _mm256_slli_epi32(by, 12)), _mm256_set1_epi32(0x000F000F));
    if constexpr (KIND == BlockKind::Q4_K) {
      return nib;
    } else {  // Q5_K: bits j and 16 + j of each row's word to bits 4 and 20
      const __m256i word = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + 256 + 32 * h));
      const __m256i top = j >= 4 ? _mm256_srli_epi32(word, static_cast<int>(j - 4))
                                 : _mm256_slli_epi32(word, static_cast<int>(4 - j));
      return _mm256_or_si256(nib, _mm256_and_si256(top, _mm256_set1_epi32(0x00100010)));
    }
  }
}

inline __m256 halves8_ps(const half_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <bool SIGNED>
inline __m256i sub_lanes8(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return SIGNED ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
}

template <bool SIGNED>
inline __m256i sub_pairs8(const uint8_t* p) {  // the scale in both int16 halves of each lane
  const __m256i v = sub_lanes8<SIGNED>(p);
  return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16));
}

// y[r, 0..15] for R <= AVX2_ROWS token rows against one group (codes, d, sub: the group's):
// qlinear_kquant_steps512.h's group_rows16_k lane for lane, both sides of 8 lanes in one pass over the codes
// (two passes, a side each, took the 1.7B's one-row step 90 ms against 81-87: each pass streams every cache
// line for half its work). The sub-scales multiply the weights (vpmullw, as the AVX-512 loops do for many rows) and
// the float accumulators wait in memory between float steps, so 2R integer sums keep the registers.
template <BlockKind KIND, int R>
inline void group_rows16_k_avx2(const uint8_t* codes, const half_t* d, const uint8_t* sub, int64_t nb, const int32_t* xq,
                                const float* xs, const float* xsum, int64_t ldq, int64_t lds, float* y, int64_t ldy) {
  static_assert(R <= AVX2_ROWS);
  using T = KTraits<KIND>;
  constexpr int64_t halves = T::q6 ? 2 : 1, steps = 16 / halves, span = kFloatSpan<KIND>;
  alignas(32) float acc[R][16] = {};
  __m256i whole0[R], whole1[R];
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_ahead<R>(codes + (b + kAhead) * T::code_bytes, T::code_bytes);
    if (b % 2 == 0) prefetch_ahead<R>(sub + (b + kAhead) * 32, 64);
    if (b % span == 0)
      for (int r = 0; r < R; ++r) whole0[r] = whole1[r] = _mm256_setzero_si256();
    for (int64_t half = 0; half < halves; ++half) {
      const uint8_t* sc = sub + b * 32 + (T::q6 ? 16 * half : 0);
      const __m256i sc0 = sub_pairs8<T::signed_sub>(sc), sc1 = sub_pairs8<T::signed_sub>(sc + 8);
#pragma GCC unroll 16
      for (int64_t j = half * steps; j < half * steps + steps; ++j) {
        const __m256i w0 = _mm256_mullo_epi16(k_weights_avx2<KIND>(codes, b, j, 0), sc0);
        const __m256i w1 = _mm256_mullo_epi16(k_weights_avx2<KIND>(codes, b, j, 1), sc1);
        for (int r = 0; r < R; ++r) {
          const __m256i xv = _mm256_set1_epi32(xq[r * ldq + b * 16 + j]);
          whole0[r] = _mm256_add_epi32(whole0[r], _mm256_madd_epi16(w0, xv));
          whole1[r] = _mm256_add_epi32(whole1[r], _mm256_madd_epi16(w1, xv));
        }
      }
    }
    if (b % span == span - 1) {  // super_sums: acc = fma(float(sum), d s_x, acc)
      const half_t* dd = d + b / SUPER * T::d_halves;
      const __m256 d0 = halves8_ps(dd), d1 = halves8_ps(dd + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 sx = _mm256_set1_ps(xs[r * lds + b / SUPER * SUPER]);
        _mm256_store_ps(acc[r], _mm256_fmadd_ps(_mm256_cvtepi32_ps(whole0[r]), _mm256_mul_ps(d0, sx), _mm256_load_ps(acc[r])));
        _mm256_store_ps(acc[r] + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(whole1[r]), _mm256_mul_ps(d1, sx),
                                                    _mm256_load_ps(acc[r] + 8)));
      }
    }
  }
  for (int h = 0; h < 2; ++h) {
    __m256 a[R];
    for (int r = 0; r < R; ++r) a[r] = _mm256_load_ps(acc[r] + 8 * h);
    if constexpr (T::minimums) {  // q4k_minimum_chain: m = fma(-(dmin mn), S_x, m) over the blocks, then acc + m
      __m256 mc[R];
      for (int r = 0; r < R; ++r) mc[r] = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const __m256 minimum = _mm256_sub_ps(
            _mm256_setzero_ps(), _mm256_mul_ps(halves8_ps(d + b / SUPER * 32 + 16 + 8 * h),
                                               _mm256_cvtepi32_ps(sub_lanes8<false>(sub + b * 32 + 16 + 8 * h))));
        for (int r = 0; r < R; ++r) mc[r] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(xsum[r * lds + b]), mc[r]);
      }
      for (int r = 0; r < R; ++r) a[r] = _mm256_add_ps(a[r], mc[r]);
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy + 8 * h, a[r]);
  }
}

// Token rows [m0, m1) against groups [g0, g1): walk_row_chunks' chunks, each in sub-chunks of AVX2_ROWS rows.
template <BlockKind KIND>
void group_item16_k_avx2(const Int16Rows& x, int64_t m0, int64_t m1, const uint8_t* qs, const half_t* d,
                         const uint8_t* sub, int64_t g0, int64_t g1, float* y, int64_t ldy) {
  using T = KTraits<KIND>;
  const int64_t nb = x.nb, ldq = nb * 16, nsb = nb / SUPER;
  walk_row_chunks(x, m0, m1, g0, g1, y, ldy, [&](auto rows, int64_t g, const int32_t* xq, const float* xs,
                                                  const float* xsum, float* out) {
    constexpr int R = decltype(rows)::value, TAIL = R % AVX2_ROWS;
    auto part = [&](auto n, int r0) {
      group_rows16_k_avx2<KIND, decltype(n)::value>(qs + g * nb * T::code_bytes, d + g * nsb * T::d_halves,
                                                    sub + g * nb * 32, nb, xq + r0 * ldq, xs + r0 * nb, xsum + r0 * nb,
                                                    ldq, nb, out + r0 * ldy, ldy);
    };
    int r0 = 0;
    for (; r0 + AVX2_ROWS <= R; r0 += AVX2_ROWS) part(std::integral_constant<int, AVX2_ROWS>{}, r0);
    if constexpr (TAIL != 0) part(std::integral_constant<int, TAIL>{}, r0);
  });
}

// Groups [g0, g1) of a K-quant matrix into out [K][ldo] at column (g - g0) * 16, as dequantize_groups_t_512:
// the same products (d sc) q - (dmin mn) and (d sc) (q - 32), 8 columns at a time.
template <BlockKind KIND>
inline void dequantize_groups_k_avx2(const uint8_t* qs, const half_t* d, const uint8_t* sub, int64_t nb, int64_t g0,
                                     int64_t g1, float* out, int64_t ldo) {
  using T = KTraits<KIND>;
  const int64_t nsb = nb / SUPER;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* codes = qs + g * nb * T::code_bytes;
    for (int64_t b = 0; b < nb; ++b)
      for (int h = 0; h < 2; ++h) {
        float* o = out + (g - g0) * G16 + 8 * h + b * QK * ldo;
        const half_t* dd = d + (g * nsb + b / SUPER) * T::d_halves + 8 * h;
        const uint8_t* s = sub + (g * nb + b) * 32 + 8 * h;
        for (int64_t j = 0; j < 16; ++j) {
          const __m256i pair = k_weights_avx2<KIND>(codes, b, j, h);
          const __m256 a = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(pair, 16), 16));
          const __m256 c = _mm256_cvtepi32_ps(_mm256_srai_epi32(pair, 16));
          if constexpr (T::q6) {  // lane n: (k=2j, k=2j+1), both under the scale of k 0-15 or 16-31
            const __m256 scale = _mm256_mul_ps(halves8_ps(dd), _mm256_cvtepi32_ps(sub_lanes8<true>(s + (j < 8 ? 0 : 16))));
            _mm256_storeu_ps(o + 2 * j * ldo, _mm256_mul_ps(a, scale));
            _mm256_storeu_ps(o + (2 * j + 1) * ldo, _mm256_mul_ps(c, scale));
          } else {  // lane n: (k=j, k=j+16)
            const __m256 scale = _mm256_mul_ps(halves8_ps(dd), _mm256_cvtepi32_ps(sub_lanes8<false>(s)));
            const __m256 minimum = _mm256_sub_ps(_mm256_setzero_ps(),
                                                 _mm256_mul_ps(halves8_ps(dd + 16), _mm256_cvtepi32_ps(sub_lanes8<false>(s + 16))));
            _mm256_storeu_ps(o + j * ldo, _mm256_add_ps(_mm256_mul_ps(a, scale), minimum));
            _mm256_storeu_ps(o + (j + 16) * ldo, _mm256_add_ps(_mm256_mul_ps(c, scale), minimum));
          }
        }
      }
  }
}

}  // namespace kvyard
