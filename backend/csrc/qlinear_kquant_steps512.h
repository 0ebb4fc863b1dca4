// The K-quant step loops without VBMI (qlinear_kquant.h's layout and float order). No include guard:
// qlinear_kquant.h includes this file twice, in namespaces vnni and bw, each with qlinear_vnni.h's dot16.

// y[r, 0..15] for R token rows against one group of 16 output rows of a K-quant matrix (qlinear_vnni.h's
// group_rows16 for Q4_K / Q5_K / Q6_K). codes, d, sub: this group's. The portable decode (no VBMI); its step loops
// unrolled as qlinear_vnni.h's. Each block's (Q6_K: each half's) dots carry their sub-scales into one integer
// sum per row (qlinear_kquant.h: on the dots for few rows, on the weights for more), which meets the float
// part once every kFloatSpan blocks; Q4_K's and Q5_K's minimum terms are a second float chain, added at the
// end (q4k_minimum_chain).
template <BlockKind KIND, int R>
inline void group_rows16_k(const uint8_t* codes, const half_t* d, const uint8_t* sub, int64_t nb, const int32_t* xq,
                           const float* xs, const float* xsum, int64_t ldq, int64_t lds, float* y, int64_t ldy) {
  using T = KTraits<KIND>;
  constexpr bool fold = R > kMulDotsRows;
  constexpr int64_t code_bytes = T::code_bytes, halves = T::q6 ? 2 : 1, steps = 16 / halves;
  __m512 acc[R];
  __m512i whole[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_ahead<R>(codes + (b + kAhead) * code_bytes, code_bytes);
    if (b % 2 == 0) prefetch_ahead<R>(sub + (b + kAhead) * 32, 64);
    if (b % kFloatSpan<KIND> == 0)
      for (int r = 0; r < R; ++r) whole[r] = _mm512_setzero_si512();
    for (int64_t h = 0; h < halves; ++h) {
      const uint8_t* sc = half_scales<KIND>(sub, b, h);
      __m512i dot[R];
      for (int r = 0; r < R; ++r) dot[r] = fold ? whole[r] : _mm512_setzero_si512();
#pragma GCC unroll 16
      for (int64_t j = h * steps; j < h * steps + steps; ++j) {
        __m512i w = k_weights<KIND>(codes, b, j);
        if constexpr (fold) w = _mm512_mullo_epi16(w, sub_pairs<T::signed_sub>(sc));
        for (int r = 0; r < R; ++r) dot[r] = dot16(dot[r], w, _mm512_set1_epi32(xq[r * ldq + b * 16 + j]));
      }
      for (int r = 0; r < R; ++r)
        whole[r] = fold ? dot[r] : _mm512_add_epi32(whole[r], _mm512_mullo_epi32(dot[r], sub_lanes<T::signed_sub>(sc)));
    }
    if (b % kFloatSpan<KIND> == kFloatSpan<KIND> - 1)
      super_sums<R>(whole, super_scale<KIND>(d, b / SUPER), xs + b / SUPER * SUPER, lds, acc);
  }
  if constexpr (T::minimums) q4k_minimum_chain<R>(d, sub, nb, xsum, lds, acc);
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

// group_rows16_k over weights already decoded with their sub-scales (decode_group_k, group_item16_k):
// step j of block b is wp[b * 16 + j]. The same integer sums and float chain, hence the same bits.
template <BlockKind KIND, int R>
inline void group_rows16_k_decoded(const __m512i* wp, const half_t* d, const uint8_t* sub, int64_t nb,
                                  const int32_t* xq, const float* xs, const float* xsum, int64_t ldq, int64_t lds,
                                  float* y, int64_t ldy) {
  __m512 acc[R];
  __m512i whole[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (b % kFloatSpan<KIND> == 0)
      for (int r = 0; r < R; ++r) whole[r] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int64_t j = 0; j < 16; ++j) {
      const __m512i w = _mm512_load_si512(wp + b * 16 + j);
      for (int r = 0; r < R; ++r) whole[r] = dot16(whole[r], w, _mm512_set1_epi32(xq[r * ldq + b * 16 + j]));
    }
    if (b % kFloatSpan<KIND> == kFloatSpan<KIND> - 1)
      super_sums<R>(whole, super_scale<KIND>(d, b / SUPER), xs + b / SUPER * SUPER, lds, acc);
  }
  if constexpr (KTraits<KIND>::minimums) q4k_minimum_chain<R>(d, sub, nb, xsum, lds, acc);
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

// Two groups' decoded weights against the same R token rows at once: each activation pair read once for 32
// output rows instead of 16 (a bare loop of vpdpwssd over decoded weights: 4.0 G a second with one group and
// 11 rows, 4.5 G with two and 8). The float accumulators wait in memory between the float steps, so the 2R
// integer sums keep the registers. The same integer sums and float chains as group_rows16_k_decoded: the
// same bits. y: the first group's outputs, the second's 16 floats on.
template <BlockKind KIND, int R>
inline void group_pair_rows16_k_decoded(const __m512i* wp0, const __m512i* wp1, const half_t* d0, const half_t* d1,
                                        const uint8_t* sub0, const uint8_t* sub1, int64_t nb, const int32_t* xq,
                                        const float* xs, const float* xsum, int64_t ldq, int64_t lds, float* y,
                                        int64_t ldy) {
  alignas(64) float acc_mem[2][R][16] = {};
  __m512i whole0[R], whole1[R];
  for (int64_t b = 0; b < nb; ++b) {
    if (b % kFloatSpan<KIND> == 0)
      for (int r = 0; r < R; ++r) whole0[r] = whole1[r] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int64_t j = 0; j < 16; ++j) {
      const __m512i w0 = _mm512_load_si512(wp0 + b * 16 + j), w1 = _mm512_load_si512(wp1 + b * 16 + j);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_set1_epi32(xq[r * ldq + b * 16 + j]);
        whole0[r] = dot16(whole0[r], w0, xv);
        whole1[r] = dot16(whole1[r], w1, xv);
      }
    }
    if (b % kFloatSpan<KIND> == kFloatSpan<KIND> - 1) {
      const int64_t sb = b / SUPER;
      __m512 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm512_load_ps(acc_mem[0][r]);
      super_sums<R>(whole0, super_scale<KIND>(d0, sb), xs + sb * SUPER, lds, acc);
      for (int r = 0; r < R; ++r) _mm512_store_ps(acc_mem[0][r], acc[r]);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_load_ps(acc_mem[1][r]);
      super_sums<R>(whole1, super_scale<KIND>(d1, sb), xs + sb * SUPER, lds, acc);
      for (int r = 0; r < R; ++r) _mm512_store_ps(acc_mem[1][r], acc[r]);
    }
  }
  for (int half = 0; half < 2; ++half) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_load_ps(acc_mem[half][r]);
    if constexpr (KTraits<KIND>::minimums)
      q4k_minimum_chain<R>(half ? d1 : d0, half ? sub1 : sub0, nb, xsum, lds, acc);
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy + 16 * half, acc[r]);
  }
}

constexpr int64_t kPairChunkRows = 8;  // the most rows group_pair_rows16_k_decoded carries (2 x 8 integer sums)

// Token rows [m0, m1) against groups [g0, g1) (qlinear_kquant.h's group_item16_k): more rows than one chunk
// over two groups' weights decoded once at a time, fewer decoding as they go.
template <BlockKind KIND>
void group_item16_k(const Int16Rows& x, int64_t m0, int64_t m1, const uint8_t* qs, const half_t* d, const uint8_t* sub,
                    int64_t g0, int64_t g1, float* y, int64_t ldy) {
  const int64_t nb = x.nb, ldq = nb * 16, nsb = nb / SUPER;
  constexpr int64_t code_bytes = KTraits<KIND>::code_bytes, d_halves = KTraits<KIND>::d_halves;
  if (m1 - m0 > kDecodeAsYouGoRows) {
    // Many rows: the weights of two groups at a time decoded once (with their sub-scales) into this thread's
    // scratch, then every chunk of at most kPairChunkRows rows against both; an odd last group alone.
    auto decode = [&](int64_t g, __m512i* wp) { decode_group_k<KIND>(qs + g * nb * code_bytes, sub + g * nb * 32, nb, wp); };
    thread_local std::vector<Lanes16> scratch;
    if (scratch.size() < static_cast<size_t>(2 * nb * 16)) scratch.resize(2 * nb * 16);
    auto* wp0 = reinterpret_cast<__m512i*>(scratch.data());
    __m512i* wp1 = wp0 + nb * 16;
    for (int64_t g = g0; g < g1; g += 2) {
      if (g + 1 == g1) {
        walk_decoded_groups(x, m0, m1, g, g1, y, ldy, decode, [&](auto rows, int64_t one, const __m512i* wp, const int32_t* xq,
                                                                   const float* xs, const float* xsum, float* out) {
          group_rows16_k_decoded<KIND, decltype(rows)::value>(wp, d + one * nsb * d_halves, sub + one * nb * 32, nb, xq,
                                                             xs, xsum, ldq, nb, out, ldy);
        });
        break;
      }
      decode(g, wp0);
      decode(g + 1, wp1);
      const half_t* dg = d + g * nsb * d_halves;
      const uint8_t* sg = sub + g * nb * 32;
      auto pair = [&](auto rows, int64_t, const int32_t* xq, const float* xs, const float* xsum, float* out) {
        group_pair_rows16_k_decoded<KIND, decltype(rows)::value>(wp0, wp1, dg, dg + nsb * d_halves, sg, sg + nb * 32, nb,
                                                                 xq, xs, xsum, ldq, nb, out, ldy);
      };
      for (int64_t m = m0; m < m1;) {
        const int64_t rows = chunk_rows(m1 - m, kPairChunkRows);
        chunk_kernel<static_cast<int>(kPairChunkRows)>(rows, pair, g, x.q + m * ldq, x.s + m * nb, x.sum + m * nb,
                                                       y + m * ldy + g * G16);
        m += rows;
      }
    }
    return;
  }
  walk_row_chunks(x, m0, m1, g0, g1, y, ldy, [&](auto rows, int64_t g, const int32_t* xq, const float* xs,
                                                  const float* xsum, float* out) {
    group_rows16_k<KIND, decltype(rows)::value>(qs + g * nb * code_bytes, d + g * nsb * d_halves, sub + g * nb * 32,
                                                nb, xq, xs, xsum, ldq, nb, out, ldy);
  });
}
