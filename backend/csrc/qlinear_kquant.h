// The GGUF's K-quant blocks (Q4_K, Q6_K) served as they are by the int16-activation kernels of
// qlinear_vnni.h (AVX-512, with or without VNNI), in groups of 16 output rows ("n16", backend/quant.py lays
// them out):
//   Q4_K: per 256 weights a float16 scale d and minimum dmin, per 32 a 6-bit scale sc and minimum mn:
//         w = (d sc) q - (dmin mn), q in 0..15. Codes exactly as Q4_1's n16 ([G][nb][16 j][16 n] bytes:
//         k=j low nibble, k=j+16 high); d [G][nb/8][2][16] float16 (d, dmin); sub [G][nb][2][16] uint8 (sc, mn).
//   Q6_K: per 256 weights a float16 scale d, per 16 an int8 scale sc: w = (d sc) (q - 32), q in 0..63.
//         Codes [G][nb][24][16] bytes: rows 0-15 step j, byte n = low 4 bits of row n's k=2j | k=2j+1 << 4;
//         rows 16-23 pair i, byte n = the top 2 bits of k=4i..4i+3, 2 bits each from the bottom;
//         d [G][nb/8][16] float16; sub [G][nb][2][16] int8 (the scales of k 0-15 and 16-31).
// 4.625 and 6.5625 bits a weight, as in the file: no requantizing step (Q4_1: 5, Q8_0: 8.5 bits).
//
// Q6_K's two scales per 32 weights need the two 16-weight halves' dot products apart, so its activations
// are paired k=2j, 2j+1 (quantize_rows16's `adjacent`: the same int16 values in another order) and steps
// 0-7 and 8-15 accumulate separately. As in qlinear_vnni.h every dot is an exact integer and every output
// one fixed float chain: the same bits whatever the batch.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "qlinear_vnni.h"
#include "simd.h"

namespace kvyard {

enum class BlockKind : int { Q4_1 = 0, Q8_0 = 1, Q4_K = 2, Q6_K = 3 };

constexpr int64_t SUPER = 8;  // 32-weight blocks per K-quant super-block of 256

inline bool cpu_has_vbmi() {
  static const bool yes = __builtin_cpu_supports("avx512vbmi");
  return yes && cpu_has_vnni();
}

// Whether the K-quant kernels decode with VBMI's byte permutes: the CPU's answer unless a test turned it
// off (use_vbmi), to check that both decodes give the same bits.
inline bool& vbmi_on() {
  static bool on = cpu_has_vbmi();
  return on;
}

#pragma GCC push_options
// Plain AVX-512 (no VNNI): both builds of the step loops call these.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

// Step j of a Q6_K block: the 16 rows' weights k=2j and 2j+1 minus 32, as int16 pairs.
inline __m512i q6_weights(const uint8_t* codes, int64_t j) {
  const __m512i lo8 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j * 16)));
  const __m512i lo = _mm512_and_si512(_mm512_or_si512(lo8, _mm512_slli_epi32(lo8, 12)), _mm512_set1_epi32(0x000F000F));
  const __m512i hi8 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (16 + j / 2) * 16)));
  const __m512i h = _mm512_and_si512(_mm512_srli_epi32(hi8, static_cast<unsigned>(4 * (j & 1))), _mm512_set1_epi32(0xF));
  const __m512i hp = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(h, _mm512_set1_epi32(0x3)), 4),
                                     _mm512_slli_epi32(_mm512_and_si512(h, _mm512_set1_epi32(0xC)), 18));
  return _mm512_sub_epi16(_mm512_or_si512(lo, hp), _mm512_set1_epi16(32));
}

// 16 int8 or uint8 sub-scales as floats.
template <bool SIGNED>
inline __m512 bytes_ps(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(SIGNED ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
}

inline __m512 halves_ps(const half_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Q6_K's float part for half h of block b: acc = fma(dot_h, (d sc_h) s_x, acc).
template <int R>
inline void q6k_half_sums(const __m512i* dot, const half_t* d, const uint8_t* sub, int64_t b, int64_t sb, int64_t h,
                          const float* xs, int64_t lds, __m512* acc) {
  const __m512 scale = _mm512_mul_ps(halves_ps(d + sb * 16), bytes_ps<true>(sub + b * 32 + 16 * h));
  for (int r = 0; r < R; ++r)
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(scale, _mm512_set1_ps(xs[r * lds + b])), acc[r]);
}

// A block's float part for R token rows, in one fixed order (the same bits from either decode): Q4_K
// acc = fma(dot, (d sc) s_x, acc) then fma(-(dmin mn), S_x, acc); Q6_K per half h acc = fma(dot_h, (d sc_h) s_x,
// acc). dot1: Q6_K's second half.
template <BlockKind KIND, int R>
inline void kquant_block_sums(const __m512i* dot0, const __m512i* dot1, const half_t* d, const uint8_t* sub, int64_t b,
                              int64_t sb, const float* xs, const float* xsum, int64_t lds, __m512* acc) {
  if constexpr (KIND == BlockKind::Q4_K) {
    const __m512 scale = _mm512_mul_ps(halves_ps(d + sb * 32), bytes_ps<false>(sub + b * 32));
    const __m512 minimum = _mm512_sub_ps(_mm512_setzero_ps(),
                                         _mm512_mul_ps(halves_ps(d + sb * 32 + 16), bytes_ps<false>(sub + b * 32 + 16)));
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot0[r]), _mm512_mul_ps(scale, _mm512_set1_ps(xs[r * lds + b])), acc[r]);
      acc[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(xsum[r * lds + b]), acc[r]);
    }
  } else {
    q6k_half_sums<R>(dot0, d, sub, b, sb, 0, xs, lds, acc);
    q6k_half_sums<R>(dot1, d, sub, b, sb, 1, xs, lds, acc);
  }
}

// Decodes one group's codes (nb blocks) into int16 weight pairs: wp[b * 16 + j] is step j of block b, as
// group_weights / q6_weights give it (VBMI's decode gives the same values).
template <BlockKind KIND>
inline void decode_group_k(const uint8_t* codes, int64_t nb, __m512i* wp) {
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t j = 0; j < 16; ++j)
      wp[b * 16 + j] = KIND == BlockKind::Q4_K ? group_weights<true>(codes, b, j) : q6_weights(codes + b * 384, j);
}

#pragma GCC pop_options

// The portable step loops (qlinear_kquant_steps512.h), compiled twice as qlinear_vnni.h's: vpdpwssd on
// AVX-512 VNNI, vpmaddwd + vpaddd on AVX-512 alone, the same bits.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
namespace vnni {
#include "qlinear_kquant_steps512.h"
}  // namespace vnni
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
namespace bw {
#include "qlinear_kquant_steps512.h"
}  // namespace bw
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi")

// Q6_K with AVX-512 VBMI's two-table byte permute: four steps' 64 code bytes are split into nibbles and
// joined with their top bits once, and each step's int16 weight pairs are then one vpermt2b and a
// subtraction instead of two widenings and ten shifts and masks: 1.7-1.9x the portable decode's rate at
// 1-8 token rows, 1.1x at 32 (an Ice Lake Xeon, the matrix in L2). Few token rows split each block's dot
// products into independent chains (integer sums: exact, the same bits) so the multiply-adds' 5-cycle
// latency does not bound them. (Q4_K's decode is already cheap: the permute measured no faster there.)
inline __m512i nibble_pairs(__m512i lo, __m512i hi, int s) {
  // dword n: byte 0 = lo[16 s + n], byte 2 = hi[16 s + n], bytes 1 and 3 zero
  const __m512i n = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i idx = _mm512_add_epi32(_mm512_mullo_epi32(n, _mm512_set1_epi32(0x10001)),
                                       _mm512_set1_epi32((16 * s) | ((64 + 16 * s) << 16)));
  return _mm512_maskz_permutex2var_epi8(0x5555555555555555ull, lo, idx, hi);
}

template <int R>
inline void group_rows16_q6k_vbmi(const uint8_t* codes, const half_t* d, const uint8_t* sub, int64_t nb,
                                  const int32_t* xq, const float* xs, const float* xsum, int64_t ldq, int64_t lds,
                                  float* y, int64_t ldy) {
  constexpr int C = R == 1 ? 4 : R == 2 ? 2 : 1;  // independent dot chains per token row
  // In a 4-step vector (128-bit lane s: step 4t + s), rotations bringing the top bits of weights 2j and
  // 2j+1 to bits 4-5 of their byte: even steps hold them in bits 0-1 and 2-3 of the pair's top byte, odd
  // steps in bits 4-5 and 6-7.
  const __m512i rot_even = _mm512_set_epi32(0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4);
  const __m512i rot_odd = _mm512_set_epi32(30, 30, 30, 30, 2, 2, 2, 2, 30, 30, 30, 30, 2, 2, 2, 2);
  const __m512i spread = _mm512_set_epi32(0x1F1E1D1C, 0x1B1A1918, 0x17161514, 0x13121110, 0x1F1E1D1C, 0x1B1A1918,
                                          0x17161514, 0x13121110, 0x0F0E0D0C, 0x0B0A0908, 0x07060504, 0x03020100,
                                          0x0F0E0D0C, 0x0B0A0908, 0x07060504, 0x03020100);  // byte 16 s + n ← top byte 16 (s / 2) + n
  const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30), off = _mm512_set1_epi16(32);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* cb = codes + b * 384;
    const int32_t* xb = xq + b * 16;
    prefetch_ahead<R>(cb + kAhead * 384, 384);
    if (b % 2 == 0) prefetch_ahead<R>(sub + (b + kAhead) * 32, 64);
    __m512i dot[2][C][R];
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < C; ++c)
        for (int r = 0; r < R; ++r) dot[h][c][r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {  // steps 4t..4t+3: half t / 2 of the block
      const __m512i v = _mm512_loadu_si512(cb + t * 64);
      const __m512i top = _mm512_permutexvar_epi8(
          spread, _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + 256 + t * 32))));
      const __m512i te = _mm512_and_si512(_mm512_rolv_epi32(top, rot_even), bits45);
      const __m512i to = _mm512_and_si512(_mm512_rolv_epi32(top, rot_odd), bits45);
      const __m512i even = _mm512_ternarylogic_epi32(v, low4, te, 0xEA);  // (v & 15) | te: weights 2j, 0..63
      const __m512i odd = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), low4, to, 0xEA);
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {
        const __m512i w = _mm512_sub_epi16(nibble_pairs(even, odd, s), off);
        const int c = (4 * t + s) % C;
        for (int r = 0; r < R; ++r)
          dot[t / 2][c][r] = _mm512_dpwssd_epi32(dot[t / 2][c][r], w, _mm512_set1_epi32(xb[r * ldq + 4 * t + s]));
      }
    }
    for (int h = 0; h < 2; ++h)
      for (int c = 1; c < C; ++c)
        for (int r = 0; r < R; ++r) dot[h][0][r] = _mm512_add_epi32(dot[h][0][r], dot[h][c][r]);
    kquant_block_sums<BlockKind::Q6_K, R>(dot[0][0], dot[1][0], d, sub, b, b / SUPER, xs, xsum, lds, acc);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

// Token rows [m0, m1) against groups [g0, g1) of a Q6_K matrix, with the VBMI decode.
inline void group_item16_q6k_vbmi(const Int16Rows& x, int64_t m0, int64_t m1, const uint8_t* qs, const half_t* d,
                                  const uint8_t* sub, int64_t g0, int64_t g1, float* y, int64_t ldy) {
  const int64_t nb = x.nb, ldq = nb * 16, nsb = nb / SUPER;
  walk_row_chunks(x, m0, m1, g0, g1, y, ldy, [&](auto rows, int64_t g, const int32_t* xq, const float* xs,
                                                  const float* xsum, float* out) {
    group_rows16_q6k_vbmi<decltype(rows)::value>(qs + g * nb * 384, d + g * nsb * 16, sub + g * nb * 32, nb, xq, xs,
                                                 xsum, ldq, nb, out, ldy);
  });
}

#pragma GCC pop_options

// Token rows [m0, m1) against groups [g0, g1), as qlinear_vnni.h's group_item16.
template <BlockKind KIND>
void group_item16_k(const Int16Rows& x, int64_t m0, int64_t m1, const uint8_t* qs, const half_t* d, const uint8_t* sub,
                    int64_t g0, int64_t g1, float* y, int64_t ldy) {
  const bool vnni = int16_code() == I16_VNNI;  // else AVX-512 alone (K-quants are served on AVX-512 only)
  // Many rows: the decoded weights once per group (either namespace's group_item16_k), whatever the decode.
  if (KIND == BlockKind::Q6_K && vnni && vbmi_on() && m1 - m0 <= kChunkRows)
    return group_item16_q6k_vbmi(x, m0, m1, qs, d, sub, g0, g1, y, ldy);
  if (vnni) return vnni::group_item16_k<KIND>(x, m0, m1, qs, d, sub, g0, g1, y, ldy);
  bw::group_item16_k<KIND>(x, m0, m1, qs, d, sub, g0, g1, y, ldy);
}

// Row n of a K-quant n16 matrix as float32 (the embedding lookup: a few rows a step), the same float
// operations as gguf's reference dequantization: (d sc) q - (dmin mn), (d sc) (q - 32).
inline void decode_row_k(BlockKind kind, const uint8_t* qs, const half_t* d, const uint8_t* sub, int64_t nb, int64_t n,
                         float* out) {
  const int64_t g = n / G16, i = n % G16, nsb = nb / SUPER;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t sb = b / SUPER;
    const uint8_t* s = sub + (g * nb + b) * 32;
    if (kind == BlockKind::Q4_K) {
      const half_t* dd = d + (g * nsb + sb) * 32;
      const float scale = half_to_float(dd[i]) * static_cast<float>(s[i]);
      const float minimum = half_to_float(dd[16 + i]) * static_cast<float>(s[16 + i]);
      for (int64_t j = 0; j < 16; ++j) {
        const uint8_t byte = qs[((g * nb + b) * 16 + j) * G16 + i];
        out[b * QK + j] = scale * static_cast<float>(byte & 0x0F) - minimum;
        out[b * QK + j + 16] = scale * static_cast<float>(byte >> 4) - minimum;
      }
    } else {
      const float dv = half_to_float(d[(g * nsb + sb) * 16 + i]);
      const uint8_t* cb = qs + (g * nb + b) * 384;
      for (int64_t k = 0; k < QK; ++k) {
        const uint8_t lo = (cb[(k / 2) * 16 + i] >> (4 * (k & 1))) & 0x0F;
        const uint8_t hi = (cb[(16 + k / 4) * 16 + i] >> (2 * (k & 3))) & 0x03;
        const float scale = dv * static_cast<float>(static_cast<int8_t>(s[(k / 16) * 16 + i]));
        out[b * QK + k] = scale * static_cast<float>(static_cast<int>(lo | (hi << 4)) - 32);
      }
    }
  }
}

}  // namespace kvyard
