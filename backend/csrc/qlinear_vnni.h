// Linears with 16-bit integer activations on AVX-512 VNNI (vpdpwssd: 32 multiply-adds per instruction,
// twice float32's 16), on AVX-512 without VNNI (vpmaddwd + vpaddd on 512 bits: the same integers), or on
// AVX2 (qlinear_n16_avx2.h: the same on 256 bits), over weights re-laid in groups of 16 output rows ("n16",
// backend/quant.py):
//   Q4_1: codes [G][nb][16 j][16 n] bytes: byte (j, n) holds row 16g+n's weights k=j (low nibble) and
//         k=j+16 (high nibble) of block b; scales and minimums [G][nb][16] float16.
//   Q8_0: codes [G][nb][16 j][16 n][2] int8: row n's weights k=j and k=j+16; scales [G][nb][16].
// A vector lane is an output row, so a block's 16 j steps accumulate 16 outputs at once with no
// horizontal sums, for one token row as for sixty.
//
// Activations are rounded per token row and 32-wide block to int16 with their own scale s = max|x| / 32767
// (error ≤ s/2 per value: ~1.5e-5 of the block's largest), and keep their exact float sum S for Q4_1's
// minimums. Per row r, output n and block b the dot product Σ q·x_q is an exact 32-bit integer; the float
// part is one chain per lane, acc = fma(float(dot_b), d_b * s_b, acc) then acc = fma(m_b, S_b, acc) for
// b = 0, 1, ... So an output has the same bits whatever else shares the batch and however the rows are
// chunked: batches equal runs alone, and the fused decode step equals the op-by-op path.
// (The K-quant kernels, qlinear_kquant.h, round per 256-wide super-block instead: quantize_rows_super.)
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace kvyard {

constexpr int64_t G16 = 16;  // output rows per group: one 512-bit vector of float32 results

inline bool cpu_has_vnni() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512vnni");
  return yes && isa_cap() >= ISA_NATIVE;
}

// Which code runs the n16 linears: vpdpwssd (AVX-512 VNNI), vpmaddwd + vpaddd on 512 bits (AVX-512 without
// VNNI) or on 256 (AVX2, qlinear_n16_avx2.h). All three give the same bits. The CPU's best unless a test
// chose another (use_int16), to compare them on a CPU that has them all.
enum Int16Code : int { I16_AVX2 = 0, I16_AVX512 = 1, I16_VNNI = 2 };
inline int cpu_int16_code() { return cpu_has_vnni() ? I16_VNNI : cpu_has_avx512() ? I16_AVX512 : I16_AVX2; }
inline int& int16_code() {
  static int code = cpu_int16_code();
  return code;
}

// M token rows rounded to int16 per block: q [M][nb][16] (x_j in the low half of word j, x_{j+16} in the
// high half), s [M][nb] scales, sum [M][nb] exact float sums.
struct Int16Rows {
  const int32_t* q;
  const float* s;
  const float* sum;
  int64_t nb;
};

// Token rows [m0, m1) against groups [g0, g1): a chunk of rows against each group in turn, so the chunk's
// int16 rows stay in L1 while the groups' codes (a few KB each) stay in L1 across chunks. The chunk size
// changes the speed, never the bits. kernel(R, g, xq, xs, xsum, out) runs one chunk of R rows (a
// std::integral_constant, 1 to kChunkRows) against group g; every n16 kernel walks this way (plain code:
// outside the AVX-512 target, so AVX2 builds call it too).
//
// Chunks are as even as kChunkRows allows (chunk_rows): up to 12 rows are one chunk, so a few-row step
// streams each weight once (5-7 rows as 4 + 1..3 read the 1.7B's weights twice: 103-118 ms a step against
// 95 for 8 rows); past 12 rows the chunks come out even too (32 rows as 11 + 11 + 10: measured as fast as
// 12 + 12 + 8, each group's weights decoded once either way).
constexpr int64_t kChunkRows = 12;  // the most token rows one step loop carries (their accumulators in registers)

// The next chunk's rows when `left` rows remain: the fewest chunks of at most `most` rows, as even as they go.
constexpr int64_t chunk_rows(int64_t left, int64_t most = kChunkRows) {
  const int64_t chunks = (left + most - 1) / most;
  return (left + chunks - 1) / chunks;
}

template <int R, class Kernel>
inline void chunk_kernel(int64_t rows, Kernel& kernel, int64_t g, const int32_t* xq, const float* xs,
                         const float* xsum, float* out) {
  if constexpr (R > 1) {
    if (rows < R) return chunk_kernel<R - 1>(rows, kernel, g, xq, xs, xsum, out);
  }
  kernel(std::integral_constant<int, R>{}, g, xq, xs, xsum, out);
}

template <class Kernel>
inline void walk_row_chunks(const Int16Rows& x, int64_t m0, int64_t m1, int64_t g0, int64_t g1, float* y,
                            int64_t ldy, Kernel&& kernel) {
  const int64_t nb = x.nb, ldq = nb * 16;
  for (int64_t m = m0; m < m1;) {
    const int64_t rows = chunk_rows(m1 - m);
    const int32_t* xq = x.q + m * ldq;
    const float* xs = x.s + m * nb;
    const float* xsum = x.sum + m * nb;
    for (int64_t g = g0; g < g1; ++g)
      chunk_kernel<static_cast<int>(kChunkRows)>(rows, kernel, g, xq, xs, xsum, y + m * ldy + g * G16);
    m += rows;
  }
}

struct alignas(64) Lanes16 {  // one 512-bit vector's worth of scratch (decoded weights), cache-line aligned
  int32_t v[16];
};

// walk_row_chunks for more rows than one chunk: each group's weights are decoded once into this thread's
// scratch by unpack(g, wp) (16 vectors a block, K * 32 bytes: in L2), and every chunk of rows then runs over
// them, kernel(R, g, wp, xq, xs, xsum, out), instead of each chunk decoding them again. The same values reach
// the same multiply-adds: the speed changes, never the bits. Plain code, as walk_row_chunks.
template <class Unpack, class Kernel>
inline void walk_decoded_groups(const Int16Rows& x, int64_t m0, int64_t m1, int64_t g0, int64_t g1, float* y,
                                int64_t ldy, Unpack&& unpack, Kernel&& kernel) {
  thread_local std::vector<Lanes16> scratch;
  if (scratch.size() < static_cast<size_t>(x.nb * 16)) scratch.resize(x.nb * 16);
  auto* wp = reinterpret_cast<__m512i*>(scratch.data());
  for (int64_t g = g0; g < g1; ++g) {
    unpack(g, wp);
    walk_row_chunks(x, m0, m1, g, g + 1, y, ldy, [&](auto rows, int64_t, const int32_t* xq, const float* xs,
                                                     const float* xsum, float* out) {
      kernel(rows, g, wp, xq, xs, xsum, out);
    });
  }
}

// Up to 8 token rows stream the weights at memory speed: each block asks for the bytes kAhead blocks further
// on (its codes, and its scales every other block), so more of a core's memory reads are in flight than the
// hardware prefetcher keeps (the 1.7B's one-row step 78 -> 57-64 ms, 8 rows 184 -> 169 ms; 12-row chunks,
// bound by arithmetic, gain nothing). Past a matrix's end the hint reads nothing (prefetches do not fault).
constexpr int64_t kAhead = 8;
template <int R>
inline void prefetch_ahead(const void* p, int64_t bytes) {
  if constexpr (R <= 8)
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(static_cast<const char*>(p) + o, _MM_HINT_T0);
}

#pragma GCC push_options
// Plain AVX-512 (no VNNI): both builds of the step loops below call these.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

// One 32-wide block of a row, lo = x_0..15 and hi = x_16..31, rounded to integers times inv into 16 words q
// (x_j in the low half of word j, x_{j+16} in the high half; `adjacent`: x_2j and x_2j+1), and its exact sum.
inline void round_block16(__m512 lo, __m512 hi, float inv, bool adjacent, int32_t* q, float* sum) {
  constexpr int round = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  *sum = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
  const __m512i ql = _mm512_cvt_roundps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)), round);
  const __m512i qh = _mm512_cvt_roundps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)), round);
  const __m512i pairs =
      adjacent ? _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(ql)), _mm512_cvtepi32_epi16(qh), 1)
               : _mm512_or_si512(_mm512_and_si512(ql, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(qh, 16));
  _mm512_storeu_si512(q, pairs);
}

// adjacent: word j holds x_2j and x_2j+1 instead (Q6_K's layout, qlinear_kquant.h): the same int16 values.
inline void quantize_rows16_512(const float* x, int64_t K, int64_t m0, int64_t m1, int32_t* q, float* s,
                                float* sum, bool adjacent = false) {
  const int64_t nb = K / QK;
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * QK;
      const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float inv = amax > 0.f ? 32767.f / amax : 0.f;
      s[m * nb + b] = amax / 32767.f;
      round_block16(lo, hi, inv, adjacent, q + (m * nb + b) * 16, sum + m * nb + b);
    }
}

// The K-quant kernels' rounding (qlinear_kquant.h): one scale per token row and 256-wide super-block,
// s = max|x| / 8191 (14-bit values: error <= s/2 per value, ~6e-5 of the super-block's largest), repeated in
// s[m][b] for its 8 blocks; the pairs and exact float sums per 32-wide block as quantize_rows16_512's. With
// |x| <= 8191 a super-block's dot product with Q4_K's sub-scaled codes (|sc q| <= 945) and 64 weights' with
// Q6_K's (|sc (q - 32)| <= 4096) stay exact 32-bit integers, so the sub-scales join the integer sums and the
// float part runs once a super-block (Q4_K) or every 64 weights (Q6_K) instead of every 32 or 16.
constexpr float kSuperLevels = 8191.f;

inline void quantize_rows_super_512(const float* x, int64_t K, int64_t m0, int64_t m1, int32_t* q, float* s,
                                    float* sum, bool adjacent) {
  const int64_t nb = K / QK;
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t b0 = 0; b0 < nb; b0 += 8) {
      const float* xs = x + m * K + b0 * QK;
      __m512 big = _mm512_setzero_ps();
      for (int64_t i = 0; i < 16; ++i) big = _mm512_max_ps(big, _mm512_abs_ps(_mm512_loadu_ps(xs + 16 * i)));
      const float amax = _mm512_reduce_max_ps(big);
      const float inv = amax > 0.f ? kSuperLevels / amax : 0.f;
      for (int64_t b = b0; b < b0 + 8; ++b) {
        const float* xb = x + m * K + b * QK;
        const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
        s[m * nb + b] = amax / kSuperLevels;
        round_block16(lo, hi, inv, adjacent, q + (m * nb + b) * 16, sum + m * nb + b);
      }
    }
}

// Step j of a block: the 16 rows' weights k=j and k=j+16 as int16 pairs, one per 32-bit lane.
template <bool Q4>
inline __m512i group_weights(const uint8_t* codes, int64_t b, int64_t j) {
  if constexpr (Q4) {
    const __m512i by = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (b * 16 + j) * 16)));
    return _mm512_and_si512(_mm512_or_si512(by, _mm512_slli_epi32(by, 12)), _mm512_set1_epi32(0x000F000F));
  } else {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + (b * 16 + j) * 32)));
  }
}

#pragma GCC pop_options

// The step loops (qlinear_n16_steps512.h), compiled twice: with vpdpwssd where the CPU has AVX-512 VNNI, and
// with vpmaddwd + vpaddd where it has AVX-512 alone (Skylake-SP/X). The dot products are the same exact
// integers (no pair sum overflows: |x| <= 32767, weights within int8), so the two give the same bits.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
namespace vnni {
inline __m512i dot16(__m512i acc, __m512i w, __m512i x) { return _mm512_dpwssd_epi32(acc, w, x); }
#include "qlinear_n16_steps512.h"
}  // namespace vnni
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
namespace bw {
inline __m512i dot16(__m512i acc, __m512i w, __m512i x) { return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x)); }
#include "qlinear_n16_steps512.h"
}  // namespace bw
#pragma GCC pop_options

}  // namespace kvyard

#include "qlinear_n16_avx2.h"

namespace kvyard {

// Rounds rows [m0, m1) of x to int16 (see Int16Rows): the AVX-512 code, or AVX2's (the same values and sums;
// Q6_K's `adjacent` pairing exists on AVX-512 only, as the K-quant kernels do).
inline void quantize_rows16(const float* x, int64_t K, int64_t m0, int64_t m1, int32_t* q, float* s, float* sum,
                            bool adjacent = false) {
  if (adjacent || int16_code() != I16_AVX2) return quantize_rows16_512(x, K, m0, m1, q, s, sum, adjacent);
  quantize_rows16_avx2(x, K, m0, m1, q, s, sum);
}

template <bool Q4>
void group_item16(const Int16Rows& x, int64_t m0, int64_t m1, const uint8_t* qs, const half_t* d, const half_t* mins,
                  int64_t g0, int64_t g1, float* y, int64_t ldy) {
  if (int16_code() == I16_VNNI) return vnni::group_item16_512<Q4>(x, m0, m1, qs, d, mins, g0, g1, y, ldy);
  if (int16_code() == I16_AVX512) return bw::group_item16_512<Q4>(x, m0, m1, qs, d, mins, g0, g1, y, ldy);
  group_item16_avx2<Q4>(x, m0, m1, qs, d, mins, g0, g1, y, ldy);
}

}  // namespace kvyard
