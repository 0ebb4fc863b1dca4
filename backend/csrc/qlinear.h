// Linear layers over weights kept in the GGUF's own block formats, float32 activations.
//
// Weights are repacked once at load (backend/quant.py), scales and minimums float16 as in the GGUF:
//   Q4_1: per 32 weights along K a scale d, a minimum m and 16 bytes of 4-bit codes;
//         byte j of a block holds weight j (low nibble) and weight j + 16 (high nibble); w = d*q + m.
//   Q8_0: per 32 weights a scale d and 32 signed bytes; w = d*q.
// A linear here computes the same numbers as F.linear over the float32 dequantization (the reference),
// up to the order of the float additions, while reading 5-8x fewer bytes of weights per token.
//
// The unit of work is an item: up to MB token rows x up to NT output rows. qlinear (cpu_kernels.cpp)
// spreads items over at::parallel_for; the fused decode step (decode_step.h) splits them by thread.
// Either way each output is computed by the same code in the same order, so the two agree bit for bit.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "qlinear512.h"
#include "qlinear_kquant.h"
#include "qlinear_vnni.h"
#include "simd.h"

namespace kvyard {

struct QMatrix {                 // one [N, K] weight in blocks of 32 along K
  const uint8_t* qs = nullptr;   // rows: [N, K/2] (Q4_1) or [N, K] (Q8_0) codes; n16: qlinear_vnni.h's layout
  const half_t* d = nullptr;     // rows: [N, K/32] float16 scales; n16: [N/16, K/32, 16]
  const half_t* m = nullptr;     // minimums (Q4_1 only), laid out as d
  const uint8_t* sub = nullptr;  // Q4_K / Q5_K / Q6_K (n16 only, qlinear_kquant.h): the per-block sub-scales; d then
                                 // holds the per-256 scales
  int64_t N = 0, K = 0;
  BlockKind kind = BlockKind::Q4_1;
  bool q4 = true;                // Q4_1 (the rows layout knows Q4_1 and Q8_0 only)
  bool n16 = false;              // groups of 16 rows for the int16-activation kernels (AVX-512 VNNI)
  int64_t nb() const { return K / QK; }
  int64_t row_bytes() const { return q4 ? K / 2 : K; }
};

constexpr int MT = 8;         // token rows per micro-tile (accumulators kept in registers)
constexpr int64_t NT = 8;     // output rows per work item
constexpr int64_t MB = 64;    // token rows per work item: its x stays in L2 while the weights stream past
// Past this many rows an item decodes its weight rows once and runs register tiles over them (1.1-1.5x
// at 32-64 rows); up to it the decode to memory costs more than it saves (0.7-0.85x at 5-8 rows).
constexpr int64_t DECODE_ONCE_ROWS = 16;
constexpr int64_t TW = 4, TR = 3;  // register tile: weight rows x token rows (dot_tile)
constexpr int64_t MAX_K = MAX_BLOCKS * QK;  // a row's scales are widened to floats on the stack

// 16 bytes of Q4_1 codes → 4 vectors of 8 floats in weight order 0-7, 8-15, 16-23, 24-31.
inline void unpack_q4(const uint8_t* q, __m256 w[4]) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

inline void unpack_q8(const int8_t* q, __m256 w[4]) {
  for (int i = 0; i < 4; ++i) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i));
    w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
}

// y[m, n] for R token rows (R ≤ MT, a compile-time count so the accumulators live in registers) and one
// output row n: Σ_b d_b (q_b · x_b) [+ m_b Σ x_b]. Each block is unpacked once for all R rows.
template <bool Q4, int R>
inline void dot_rows(const float* x, int64_t ldx, const uint8_t* qs, const float* d, const float* mins,
                     const float* xsum, int64_t nb, float* out, int64_t ldo) {
  // Few rows are latency-bound on the accumulator chain: give them U independent chains (even/odd
  // blocks, and the minimum's share apart); many rows are throughput-bound and need the registers.
  constexpr int U = R <= 2 ? 2 : 1;
  constexpr bool SPLIT_MIN = R <= 4;
  __m256 acc[U][R], accm[U][R];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r) acc[u][r] = accm[u][r] = _mm256_setzero_ps();
  __m256 w[4];
  for (int64_t b0 = 0; b0 < nb; b0 += U) {
    for (int u = 0; u < U; ++u) {
      const int64_t b = b0 + u;
      if (U > 1 && b >= nb) break;
      if constexpr (Q4) unpack_q4(qs + b * 16, w);
      else unpack_q8(reinterpret_cast<const int8_t*>(qs) + b * 32, w);
      const __m256 scale = _mm256_set1_ps(d[b]);
      for (int r = 0; r < R; ++r) {
        const float* xb = x + r * ldx + b * QK;
        // Two short chains instead of one long one.
        __m256 t0 = _mm256_mul_ps(w[0], _mm256_loadu_ps(xb));
        __m256 t1 = _mm256_mul_ps(w[1], _mm256_loadu_ps(xb + 8));
        t0 = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), t0);
        t1 = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), t1);
        acc[u][r] = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), scale, acc[u][r]);
        // The minimum's share, m_b Σ x_b, from the block's 8-lane partial sums of x.
        if constexpr (Q4) {
          const __m256 ms = _mm256_mul_ps(_mm256_loadu_ps(xsum + (r * nb + b) * 8), _mm256_set1_ps(mins[b]));
          if constexpr (SPLIT_MIN) accm[u][r] = _mm256_add_ps(accm[u][r], ms);
          else acc[u][r] = _mm256_add_ps(acc[u][r], ms);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 total = acc[0][r];
    for (int u = 1; u < U; ++u) total = _mm256_add_ps(total, acc[u][r]);
    if constexpr (Q4 && SPLIT_MIN)
      for (int u = 0; u < U; ++u) total = _mm256_add_ps(total, accm[u][r]);
    out[r * ldo] = hsum(total);
  }
}

// Many rows: decode each block into its 32 weights once (w = d q + m) and run plain FMAs for every row:
// 4 FMAs per row-block instead of 6 arithmetic ops, and no per-block scale or minimum term. The FMA
// ports, not the decode, bound this shape.
template <bool Q4, int R>
inline void dot_rows_decoded(const float* x, int64_t ldx, const uint8_t* qs, const float* d, const float* mins,
                             int64_t nb, float* out, int64_t ldo) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  __m256 w[4];
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (Q4) unpack_q4(qs + b * 16, w);
    else unpack_q8(reinterpret_cast<const int8_t*>(qs) + b * 32, w);
    const __m256 scale = _mm256_set1_ps(d[b]);
    const __m256 shift = _mm256_set1_ps(Q4 ? mins[b] : 0.f);
    for (int i = 0; i < 4; ++i) w[i] = Q4 ? _mm256_fmadd_ps(w[i], scale, shift) : _mm256_mul_ps(w[i], scale);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * ldx + b * QK;
      for (int i = 0; i < 4; ++i) acc[r] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xb + 8 * i), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = hsum(acc[r]);
}

template <bool Q4>
inline void dot_row(const float* x, int64_t ldx, int rows, const uint8_t* qs, const float* d,
                    const float* mins, const float* xsum, int64_t nb, float* out, int64_t ldo) {
  switch (rows) {
    case 1: return dot_rows<Q4, 1>(x, ldx, qs, d, mins, xsum, nb, out, ldo);
    case 2: return dot_rows<Q4, 2>(x, ldx, qs, d, mins, xsum, nb, out, ldo);
    case 3: return dot_rows<Q4, 3>(x, ldx, qs, d, mins, xsum, nb, out, ldo);
    case 4: return dot_rows<Q4, 4>(x, ldx, qs, d, mins, xsum, nb, out, ldo);
    case 5: return dot_rows_decoded<Q4, 5>(x, ldx, qs, d, mins, nb, out, ldo);
    case 6: return dot_rows_decoded<Q4, 6>(x, ldx, qs, d, mins, nb, out, ldo);
    case 7: return dot_rows_decoded<Q4, 7>(x, ldx, qs, d, mins, nb, out, ldo);
    default: return dot_rows_decoded<Q4, 8>(x, ldx, qs, d, mins, nb, out, ldo);
  }
}

// Row n of a quantized matrix as float32 into out (K floats).
inline void decode_row(const QMatrix& w, int64_t n, float* out) {
  const int64_t nb = w.nb();
  if (is_k_quant(w.kind)) return decode_row_k(w.kind, w.qs, w.d, w.sub, nb, n, out);
  if (w.n16) {  // the row's codes are strided across its group (embedding lookups only: a few rows a step)
    const int64_t g = n / G16, i = n % G16;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t sb = (g * nb + b) * G16 + i;
      const float d = half_to_float(w.d[sb]), m = w.q4 ? half_to_float(w.m[sb]) : 0.f;
      for (int64_t j = 0; j < 16; ++j) {
        if (w.q4) {
          const uint8_t byte = w.qs[((g * nb + b) * 16 + j) * G16 + i];
          out[b * QK + j] = std::fma(static_cast<float>(byte & 0x0F), d, m);
          out[b * QK + j + 16] = std::fma(static_cast<float>(byte >> 4), d, m);
        } else {
          const int8_t* pair = reinterpret_cast<const int8_t*>(w.qs) + (((g * nb + b) * 16 + j) * G16 + i) * 2;
          out[b * QK + j] = static_cast<float>(pair[0]) * d;
          out[b * QK + j + 16] = static_cast<float>(pair[1]) * d;
        }
      }
    }
    return;
  }
  __m256 v[4];
  for (int64_t b = 0; b < nb; ++b) {
    if (w.q4) unpack_q4(w.qs + n * w.row_bytes() + b * 16, v);
    else unpack_q8(reinterpret_cast<const int8_t*>(w.qs) + n * w.row_bytes() + b * 32, v);
    const __m256 scale = _mm256_set1_ps(half_to_float(w.d[n * nb + b]));
    const __m256 shift = _mm256_set1_ps(w.q4 ? half_to_float(w.m[n * nb + b]) : 0.f);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + b * QK + 8 * i, _mm256_fmadd_ps(v[i], scale, shift));
  }
}

// Many rows over weights already decoded to float32: a register tile of NW output rows x R token rows.
// Per 8 columns: R loads of x and NW loads of w feed NW*R FMAs (4x3: 7 loads for 12 FMAs, where a
// row-at-a-time loop needs one load per FMA and the load ports bound it). Each output's sum runs over
// k in the same order as dot_rows_decoded, so the numbers are the same.
template <int NW, int R>
inline void dot_tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* out, int64_t ldo) {
  __m256 acc[NW][R];
  for (int j = 0; j < NW; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * ldx + k);
    for (int j = 0; j < NW; ++j) {
      const __m256 wv = _mm256_loadu_ps(w + j * ldw + k);
      for (int r = 0; r < R; ++r) acc[j][r] = _mm256_fmadd_ps(wv, xv[r], acc[j][r]);
    }
  }
  for (int j = 0; j < NW; ++j)
    for (int r = 0; r < R; ++r) out[r * ldo + j] = hsum(acc[j][r]);
}

template <int NW>
inline void dot_tile_rows(const float* x, int64_t ldx, int rows, const float* w, int64_t ldw, int64_t K, float* out,
                          int64_t ldo) {
  switch (rows) {
    case 1: return dot_tile<NW, 1>(x, ldx, w, ldw, K, out, ldo);
    case 2: return dot_tile<NW, 2>(x, ldx, w, ldw, K, out, ldo);
    default: return dot_tile<NW, 3>(x, ldx, w, ldw, K, out, ldo);
  }
}

// Q4_1's minimum term needs sums of x per token row and block: the 8-lane partial sums xsum[m][b][8] (AVX2)
// or the sums themselves xsum[m][b] (AVX-512), for rows [m0, m1) of x [M, K].
inline bool needs_block_sums(const QMatrix& w, int64_t M) { return w.q4 && M <= DECODE_ONCE_ROWS; }

inline void block_sums(const float* x, int64_t K, int64_t m0, int64_t m1, float* xsum) {
  if (avx512_on()) return block_sums512(x, K, m0, m1, xsum);
  const int64_t nb = K / QK;
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * QK;
      const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
      _mm256_storeu_ps(xsum + (m * nb + b) * 8, s);
    }
}

// What a linear reads of its input x [M, K]: the floats, and what is derived from them once per call
// (prepare_input): the block sums (rows layout), or the int16 rows (n16 layout).
struct LinearInput {
  const float* x = nullptr;
  int64_t M = 0;
  const float* xsum = nullptr;
  Int16Rows x16{};
};

// Floats of scratch prepare_input needs for M rows (0: none).
inline int64_t input_scratch(const QMatrix& w, int64_t M) {
  if (w.n16) return M * w.nb() * 18;  // 16 int16 pairs, a scale and a sum per block
  return needs_block_sums(w, M) ? M * w.nb() * 8 : 0;
}

// Fills rows [m0, m1) of the scratch (so threads can share the work) and returns the input for all M rows.
inline LinearInput prepare_input(const QMatrix& w, const float* x, int64_t M, int64_t m0, int64_t m1, float* scratch) {
  LinearInput in;
  in.x = x;
  in.M = M;
  const int64_t nb = w.nb();
  if (w.n16) {
    int32_t* q = reinterpret_cast<int32_t*>(scratch);
    float* s = scratch + M * nb * 16;
    float* sum = s + M * nb;
    if (is_k_quant(w.kind))
      quantize_rows_super(x, w.K, m0, m1, q, s, sum, is_q6(w.kind));
    else
      quantize_rows16(x, w.K, m0, m1, q, s, sum);
    in.x16 = Int16Rows{q, s, sum, nb};
  } else if (needs_block_sums(w, M)) {
    block_sums(x, w.K, m0, m1, scratch);
    in.xsum = scratch;
  }
  return in;
}

// One work item: y[m, n] = x[m] · w[n] for token rows [m0, m1) of x [M, K] (m1 - m0 ≤ MB) and output
// rows [n0, n1) (≤ NT). xsum: block_sums of all M rows when needs_block_sums; wbuf: NT*K floats of
// scratch when M > DECODE_ONCE_ROWS.
inline void linear_item(const float* x, int64_t M, int64_t m0, int64_t m1, const QMatrix& w, const float* xsum,
                        int64_t n0, int64_t n1, float* y, int64_t ldy, float* wbuf) {
  const int64_t K = w.K, nb = w.nb(), rb = w.row_bytes();
  if (M <= DECODE_ONCE_ROWS && avx512_on()) {
    if (w.q4) rows_item512<true>(x, K, m0, m1, w.qs, w.d, w.m, xsum, n0, n1, y, ldy);
    else rows_item512<false>(x, K, m0, m1, w.qs, w.d, nullptr, nullptr, n0, n1, y, ldy);
    return;
  }
  if (M <= DECODE_ONCE_ROWS) {
    // Each weight row once, every token tile against it (at most 16 token rows: x stays in cache).
    float d[MAX_BLOCKS], mins[MAX_BLOCKS];  // row n's scales and minimums as floats
    for (int64_t n = n0; n < n1; ++n) {
      halves_to_floats(w.d + n * nb, nb, d);
      if (w.q4) halves_to_floats(w.m + n * nb, nb, mins);
      for (int64_t m = m0; m < m1; m += MT) {
        const int rows = static_cast<int>(std::min<int64_t>(MT, m1 - m));
        const float* xm = x + m * K;
        float* out = y + m * ldy + n;
        if (w.q4) {
          dot_row<true>(xm, K, rows, w.qs + n * rb, d, mins, xsum + m * nb * 8, nb, out, ldy);
        } else {
          dot_row<false>(xm, K, rows, w.qs + n * rb, d, nullptr, nullptr, nb, out, ldy);
        }
      }
    }
    return;
  }
  // More rows: decode the item's weight rows once (w = d q + m), then register tiles of TW weight rows x
  // TR token rows over them.
  for (int64_t n = n0; n < n1; ++n) decode_row(w, n, wbuf + (n - n0) * K);
  for (int64_t m = m0; m < m1; m += TR) {
    const int rows = static_cast<int>(std::min<int64_t>(TR, m1 - m));
    for (int64_t n = n0; n < n1; n += TW) {
      const float* wr = wbuf + (n - n0) * K;
      float* out = y + m * ldy + n;
      const float* xm = x + m * K;
      switch (std::min<int64_t>(TW, n1 - n)) {
        case 1: dot_tile_rows<1>(xm, K, rows, wr, K, K, out, ldy); break;
        case 2: dot_tile_rows<2>(xm, K, rows, wr, K, K, out, ldy); break;
        case 3: dot_tile_rows<3>(xm, K, rows, wr, K, K, out, ldy); break;
        default: dot_tile_rows<4>(xm, K, rows, wr, K, K, out, ldy); break;
      }
    }
  }
}

// Items of a [M, N] output: (token block of ≤ MB rows) x (NT output rows, or groups of 16 for n16), output
// tiles outermost: a thread's contiguous share of items then holds whole tiles with all their token
// blocks (a last, short token block lands on every thread alike). item_bounds gives an item's range.
// n16 items: one group of 16 outputs for a few token rows (as many items as possible to share out),
// four groups for many (each chunk of token rows then meets four groups while it sits in L1).
inline int64_t item_width(const QMatrix& w, int64_t M) { return w.n16 ? (M <= DECODE_ONCE_ROWS ? G16 : 4 * G16) : NT; }

inline int64_t linear_items(int64_t M, const QMatrix& w) {
  const int64_t width = item_width(w, M);
  return ((M + MB - 1) / MB) * ((w.N + width - 1) / width);
}

inline void item_bounds(int64_t item, int64_t M, const QMatrix& w, int64_t& m0, int64_t& m1, int64_t& n0, int64_t& n1) {
  const int64_t width = item_width(w, M), m_blocks = (M + MB - 1) / MB;
  m0 = item % m_blocks * MB;
  m1 = std::min(M, m0 + MB);
  n0 = item / m_blocks * width;
  n1 = std::min(w.N, n0 + width);
}

// y[m, n] for one item. wbuf: NT*K floats of scratch (rows layout, more than DECODE_ONCE_ROWS rows).
inline void run_linear_item(int64_t item, const LinearInput& in, const QMatrix& w, float* y, int64_t ldy, float* wbuf) {
  int64_t m0, m1, n0, n1;
  item_bounds(item, in.M, w, m0, m1, n0, n1);
  if (is_k_quant(w.kind))
    return visit_k_kind(w.kind, [&](auto kind) {
      group_item16_k<decltype(kind)::value>(in.x16, m0, m1, w.qs, w.d, w.sub, n0 / G16, n1 / G16, y, ldy);
    });
  if (w.n16) {
    if (w.q4) group_item16<true>(in.x16, m0, m1, w.qs, w.d, w.m, n0 / G16, n1 / G16, y, ldy);
    else group_item16<false>(in.x16, m0, m1, w.qs, w.d, nullptr, n0 / G16, n1 / G16, y, ldy);
    return;
  }
  linear_item(in.x, in.M, m0, m1, w, in.xsum, n0, n1, y, ldy, wbuf);
}

}  // namespace kvyard
