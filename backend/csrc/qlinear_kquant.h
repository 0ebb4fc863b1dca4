// The GGUF's K-quant blocks (Q4_K, Q5_K, Q6_K) served as they are by the int16-activation kernels of
// qlinear_vnni.h (AVX-512, with or without VNNI; AVX2: qlinear_kquant_avx2.h), in groups of 16 output rows
// ("n16", backend/quant.py lays them out):
//   Q4_K: per 256 weights a float16 scale d and minimum dmin, per 32 a 6-bit scale sc and minimum mn:
//         w = (d sc) q - (dmin mn), q in 0..15. Codes exactly as Q4_1's n16 ([G][nb][16 j][16 n] bytes:
//         k=j low nibble, k=j+16 high); d [G][nb/8][2][16] float16 (d, dmin); sub [G][nb][2][16] uint8 (sc, mn).
//   Q5_K: Q4_K with a fifth bit: q in 0..31. Codes [G][nb][20][16] bytes: rows 0-15 Q4_K's nibbles, then
//         16 little-endian uint32 words, word n = row n's 32 top bits (bit k: weight k); d and sub as Q4_K.
//   Q6_K: per 256 weights a float16 scale d, per 16 an int8 scale sc: w = (d sc) (q - 32), q in 0..63.
//         Codes [G][nb][24][16] bytes: rows 0-15 step j, byte n = low 4 bits of row n's k=2j | k=2j+1 << 4;
//         rows 16-23 pair i, byte n = the top 2 bits of k=4i..4i+3, 2 bits each from the bottom;
//         d [G][nb/8][16] float16; sub [G][nb][2][16] int8 (the scales of k 0-15 and 16-31).
//   Q5_K8, Q6_K8: Q5_K's and Q6_K's values with each code widened to a byte (AVX2 CPUs, where unpacking the
//         packed codes cost 2x and 3x a Q8_0 step at one token row): codes [G][nb][32][16] bytes, step j's
//         32 bytes = for each row n its pair of codes as Q5_K (q of k=j, j+16, uint8) and Q6_K (q - 32 of
//         k=2j, 2j+1, int8) pair them; d and sub as theirs. Exact: the file's numbers at Q8_0's size.
// 4.625, 5.625 and 6.5625 bits a weight, as in the file: no requantizing step (Q4_1: 5, Q8_0: 8.5 bits;
// Q5_K8 8.625, Q6_K8 8.5625).
//
// Activations are rounded per token row and super-block of 256 (quantize_rows_super: 14-bit values, one
// scale), so the sub-scales can join the integer sums: Σ_k (sc q_k) x_k over a whole Q4_K super-block, or
// Σ (sc (q_k - 32)) x_k over 64 Q6_K weights, is an exact 32-bit integer (at most 1.98e9 and 2.147e9 of
// int32's 2.147e9; Q5_K's codes reach 31, so its sums span half a super-block: 2.05e9), and the float part,
// acc = fma(float(sum), d s_x, acc), runs once a super-block (Q4_K), every 128 weights (Q5_K) or every 64
// (Q6_K) instead of every 32 or 16: at 32 token rows the 1.7B's K-quant linears ran 1.1-1.2x
// as fast as with a float step per block (qlinear_vnni.h's per-32 scales). Q6_K's two scales per 32 weights
// meet its activations paired k=2j, 2j+1 (quantize_rows_super's `adjacent`). Q4_K's minimum terms run as a
// second float chain per output, m = fma(-(dmin mn), S_x, m) with S_x each block's exact float sum
// (q4k_minimum_chain), added at the end. More than kDecodeAsYouGoRows rows run two groups' decoded weights
// against each chunk of rows at once (group_pair_rows16_k_decoded). As in qlinear_vnni.h every integer sum is
// exact and every output the same two float chains: the same bits whatever the batch.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "qlinear_vnni.h"
#include "simd.h"

namespace kvyard {

enum class BlockKind : int { Q4_1 = 0, Q8_0 = 1, Q4_K = 2, Q6_K = 3, Q5_K = 4, Q6_K8 = 5, Q5_K8 = 6 };

constexpr int64_t SUPER = 8;  // 32-weight blocks per K-quant super-block of 256

constexpr bool is_k_quant(BlockKind kind) {
  return kind == BlockKind::Q4_K || kind == BlockKind::Q5_K || kind == BlockKind::Q6_K || kind == BlockKind::Q6_K8 ||
         kind == BlockKind::Q5_K8;
}

// Q5_K's numbers (5-bit codes, packed or Q5_K8's bytes): sums over 128 weights, d and dmin.
constexpr bool is_q5(BlockKind kind) { return kind == BlockKind::Q5_K || kind == BlockKind::Q5_K8; }

// Q6_K's numbers (its 6-bit codes or Q6_K8's bytes): signed sub-scales per 16 weights, no minimums.
constexpr bool is_q6(BlockKind kind) { return kind == BlockKind::Q6_K || kind == BlockKind::Q6_K8; }

// Code bytes per block of 16 rows.
constexpr int64_t k_code_bytes(BlockKind kind) {
  return kind == BlockKind::Q4_K ? 256 : kind == BlockKind::Q5_K ? 320 : kind == BlockKind::Q6_K ? 384 : 512;
}

// f(std::integral_constant<BlockKind, KIND>{}) for a K-quant kind (is_k_quant): one dispatch to the templates.
template <class F>
inline void visit_k_kind(BlockKind kind, F&& f) {
  switch (kind) {
    case BlockKind::Q4_K: return f(std::integral_constant<BlockKind, BlockKind::Q4_K>{});
    case BlockKind::Q5_K: return f(std::integral_constant<BlockKind, BlockKind::Q5_K>{});
    case BlockKind::Q6_K: return f(std::integral_constant<BlockKind, BlockKind::Q6_K>{});
    case BlockKind::Q5_K8: return f(std::integral_constant<BlockKind, BlockKind::Q5_K8>{});
    case BlockKind::Q6_K8: return f(std::integral_constant<BlockKind, BlockKind::Q6_K8>{});
    default: return;
  }
}

// What the K-quant kinds differ in: code bytes per block of 16 rows, d's float16 values per super-block and
// 16 rows (Q4_K / Q5_K: d and dmin), the sub-scales' sign, and whether minimums are subtracted.
template <BlockKind KIND>
struct KTraits {
  static constexpr bool q6 = is_q6(KIND);
  static constexpr int64_t code_bytes = k_code_bytes(KIND);
  static constexpr int64_t d_halves = q6 ? 16 : 32;
  static constexpr bool signed_sub = q6, minimums = !q6;
};

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

// Step j of a Q5_K block (codes: the block's 320 bytes): Q4_K's nibble pairs (k=j, k=j+16) with their top bits
// at bit 4 of each int16, rotated out of the row's word (bits j and 16 + j to 4 and 20).
inline __m512i q5_weights(const uint8_t* codes, int64_t j) {
  const __m512i by = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j * 16)));
  const __m512i nib = _mm512_and_si512(_mm512_or_si512(by, _mm512_slli_epi32(by, 12)), _mm512_set1_epi32(0x000F000F));
  const __m512i top = _mm512_rorv_epi32(_mm512_loadu_si512(codes + 256), _mm512_set1_epi32(static_cast<int>((j - 4) & 31)));
  return _mm512_ternarylogic_epi32(nib, top, _mm512_set1_epi32(0x00100010), 0xF8);  // nib | (top & mask)
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

// Up to this many token rows the K-quant loops decode the weights as they go, one chunk of at most kChunkRows
// rows after another (13-16 rows: two passes over the weights); more rows decode each pair of groups once and
// run every chunk over it (decoding a 8192x2048 Q4_K matrix alone costs ~1 ms a thread: at 13 rows that path
// took 2.97 ms against 2.0 for 12 rows).
constexpr int64_t kDecodeAsYouGoRows = 16;

// Integer sums that carry the sub-scales: at most kMulDotsRows token rows multiply each block's (half's)
// dot products by its sub-scales (vpmulld, one a row), more rows multiply the step's weight pairs instead
// (vpmullw, one a step, shared by the rows). Both give the same exact integers, hence the same bits.
constexpr int kMulDotsRows = 5;

// 16 rows' sub-scales (int8 or uint8) as int32 lanes, or as int16 pairs (the scale in both halves of a lane).
template <bool SIGNED>
inline __m512i sub_lanes(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return SIGNED ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
}

template <bool SIGNED>
inline __m512i sub_pairs(const uint8_t* p) {
  const __m512i v = sub_lanes<SIGNED>(p);
  return _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(v, 16));
}

// Q4_K's minimum term of block b for R token rows: acc = fma(-(dmin mn), S_x, acc).
template <int R>
inline void q4k_minimums(const half_t* d, const uint8_t* sub, int64_t b, const float* xsum, int64_t lds, __m512* acc) {
  const __m512 minimum = _mm512_sub_ps(
      _mm512_setzero_ps(), _mm512_mul_ps(halves_ps(d + b / SUPER * 32 + 16), bytes_ps<false>(sub + b * 32 + 16)));
  for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(xsum[r * lds + b]), acc[r]);
}

// Q4_K's minimum terms for R token rows: their own float chain per row, over the blocks in order, m = fma(-(dmin
// mn), S_x, m), added to the scaled sums' chain at the end (every path adds the two the same way).
template <int R>
inline void q4k_minimum_chain(const half_t* d, const uint8_t* sub, int64_t nb, const float* xsum, int64_t lds,
                              __m512* acc) {
  __m512 m[R];
  for (int r = 0; r < R; ++r) m[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) q4k_minimums<R>(d, sub, b, xsum, lds, m);
  for (int r = 0; r < R; ++r) acc[r] = _mm512_add_ps(acc[r], m[r]);
}

// The float part of R rows' integer sums over a super-block (Q4_K) or 64 weights (Q6_K): acc = fma(float(sum),
// d s_x, acc). dv: the 16 rows' super-block scale d; xs: the rows' activation scales for that super-block.
template <int R>
inline void super_sums(const __m512i* sum, __m512 dv, const float* xs, int64_t lds, __m512* acc) {
  for (int r = 0; r < R; ++r)
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]), _mm512_mul_ps(dv, _mm512_set1_ps(xs[r * lds])), acc[r]);
}

// The blocks one float step covers (Q5_K: |sc q x| <= 63 * 31 * 8191, 128 of them 2.05e9), and that step's
// scale d for super-block sb.
template <BlockKind KIND>
constexpr int64_t kFloatSpan = KIND == BlockKind::Q4_K ? SUPER : is_q5(KIND) ? SUPER / 2 : 2;

template <BlockKind KIND>
inline __m512 super_scale(const half_t* d, int64_t sb) {
  return halves_ps(d + sb * KTraits<KIND>::d_halves);
}

// The sub-scales of block b's half h (Q4_K, Q5_K: one half, the whole block).
template <BlockKind KIND>
inline const uint8_t* half_scales(const uint8_t* sub, int64_t b, int64_t h) {
  return sub + b * 32 + (KTraits<KIND>::q6 ? 16 * h : 0);
}

// Step j of block b of one group's codes, as int16 weight pairs (Q6_K, Q6_K8: minus 32).
template <BlockKind KIND>
inline __m512i k_weights(const uint8_t* codes, int64_t b, int64_t j) {
  if constexpr (KIND == BlockKind::Q4_K) return group_weights<true>(codes, b, j);
  else if constexpr (KIND == BlockKind::Q5_K) return q5_weights(codes + b * 320, j);
  else if constexpr (KIND == BlockKind::Q6_K) return q6_weights(codes + b * 384, j);
  else if constexpr (KIND == BlockKind::Q5_K8)
    return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + b * 512 + j * 32)));
  else return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + b * 512 + j * 32)));
}

// Decodes one group's codes (nb blocks) into int16 weight pairs times their sub-scales: wp[b * 16 + j] is step
// j of block b, as k_weights gives it, times sc (|sc q| <= 945 (Q4_K), 1953 (Q5_K), |sc (q - 32)| <= 4096).
template <BlockKind KIND>
inline void decode_group_k(const uint8_t* codes, const uint8_t* sub, int64_t nb, __m512i* wp) {
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t h = 0; h < 2; ++h) {
      const __m512i sc = sub_pairs<KTraits<KIND>::signed_sub>(half_scales<KIND>(sub, b, h));
      for (int64_t j = 8 * h; j < 8 * h + 8; ++j) wp[b * 16 + j] = _mm512_mullo_epi16(k_weights<KIND>(codes, b, j), sc);
    }
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
  constexpr bool fold = R > kMulDotsRows;  // the sub-scales multiply the weights (else the dots)
  __m512 acc[R];
  __m512i whole[R];  // integer sums over the current 64 weights, sub-scales included
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (b % kFloatSpan<BlockKind::Q6_K> == 0)
      for (int r = 0; r < R; ++r) whole[r] = _mm512_setzero_si512();
    const __m512i sc[2] = {sub_pairs<true>(sub + b * 32), sub_pairs<true>(sub + b * 32 + 16)};
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
        __m512i w = _mm512_sub_epi16(nibble_pairs(even, odd, s), off);
        if constexpr (fold) w = _mm512_mullo_epi16(w, sc[t / 2]);
        const int c = (4 * t + s) % C;
        for (int r = 0; r < R; ++r)
          dot[t / 2][c][r] = _mm512_dpwssd_epi32(dot[t / 2][c][r], w, _mm512_set1_epi32(xb[r * ldq + 4 * t + s]));
      }
    }
    for (int h = 0; h < 2; ++h)
      for (int c = 1; c < C; ++c)
        for (int r = 0; r < R; ++r) dot[h][0][r] = _mm512_add_epi32(dot[h][0][r], dot[h][c][r]);
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < R; ++r)
        whole[r] = _mm512_add_epi32(whole[r], fold ? dot[h][0][r]
                                                   : _mm512_mullo_epi32(dot[h][0][r], sub_lanes<true>(sub + b * 32 + 16 * h)));
    if (b % kFloatSpan<BlockKind::Q6_K> == kFloatSpan<BlockKind::Q6_K> - 1)
      super_sums<R>(whole, super_scale<BlockKind::Q6_K>(d, b / SUPER), xs + b / SUPER * SUPER, lds, acc);
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

}  // namespace kvyard

#include "qlinear_kquant_avx2.h"

namespace kvyard {

// The K-quant kernels' rounding of rows [m0, m1) (quantize_rows_super_512), on the CPU's int16 code.
inline void quantize_rows_super(const float* x, int64_t K, int64_t m0, int64_t m1, int32_t* q, float* s, float* sum,
                                bool adjacent) {
  if (int16_code() == I16_AVX2) return quantize_rows_super_avx2(x, K, m0, m1, q, s, sum, adjacent);
  quantize_rows_super_512(x, K, m0, m1, q, s, sum, adjacent);
}

// Token rows [m0, m1) against groups [g0, g1), as qlinear_vnni.h's group_item16.
template <BlockKind KIND>
void group_item16_k(const Int16Rows& x, int64_t m0, int64_t m1, const uint8_t* qs, const half_t* d, const uint8_t* sub,
                    int64_t g0, int64_t g1, float* y, int64_t ldy) {
  if (int16_code() == I16_AVX2) return group_item16_k_avx2<KIND>(x, m0, m1, qs, d, sub, g0, g1, y, ldy);
  const bool vnni = int16_code() == I16_VNNI;  // else AVX-512 alone
  // Many rows: the decoded weights once per group (either namespace's group_item16_k), whatever the decode.
  if (KIND == BlockKind::Q6_K && vnni && vbmi_on() && m1 - m0 <= kDecodeAsYouGoRows)
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
    const uint8_t* cb = qs + (g * nb + b) * k_code_bytes(kind);
    if (!is_q6(kind)) {  // Q4_K, Q5_K, Q5_K8
      const half_t* dd = d + (g * nsb + sb) * 32;
      const float scale = half_to_float(dd[i]) * static_cast<float>(s[i]);
      const float minimum = half_to_float(dd[16 + i]) * static_cast<float>(s[16 + i]);
      uint32_t top = 0;
      if (kind == BlockKind::Q5_K) std::memcpy(&top, cb + 256 + 4 * i, 4);
      for (int64_t j = 0; j < 16; ++j) {
        const uint8_t byte = cb[j * G16 + i];
        const bool wide = kind == BlockKind::Q5_K8;  // the codes of k=j, j+16 as bytes
        const int lo = wide ? cb[j * 32 + 2 * i] : (byte & 0x0F) | static_cast<int>((top >> j) & 1) << 4;
        const int hi = wide ? cb[j * 32 + 2 * i + 1] : (byte >> 4) | static_cast<int>((top >> (j + 16)) & 1) << 4;
        out[b * QK + j] = scale * static_cast<float>(lo) - minimum;
        out[b * QK + j + 16] = scale * static_cast<float>(hi) - minimum;
      }
    } else {  // Q6_K, Q6_K8
      const float dv = half_to_float(d[(g * nsb + sb) * 16 + i]);
      for (int64_t k = 0; k < QK; ++k) {
        const uint8_t lo = (cb[(k / 2) * 16 + i] >> (4 * (k & 1))) & 0x0F;
        const uint8_t hi = (cb[(16 + k / 4) * 16 + i] >> (2 * (k & 3))) & 0x03;
        const int code = kind == BlockKind::Q6_K8 ? static_cast<int8_t>(cb[(k / 2) * 32 + 2 * i + (k & 1)])
                                                  : static_cast<int>(lo | (hi << 4)) - 32;
        const float scale = dv * static_cast<float>(static_cast<int8_t>(s[(k / 16) * 16 + i]));
        out[b * QK + k] = scale * static_cast<float>(code);
      }
    }
  }
}

}  // namespace kvyard
