// The K-quant step loops without VBMI (qlinear_kquant.h's layout and float order). No include guard:
// qlinear_kquant.h includes this file twice, in namespaces vnni and bw, each with qlinear_vnni.h's dot16.

// y[r, 0..15] for R token rows against one group of 16 output rows of a K-quant matrix (qlinear_vnni.h's
// group_rows16 for Q4_K / Q6_K). codes, d, sub: this group's. The portable decode (no VBMI); its step loops
// unrolled as qlinear_vnni.h's. Each block's (Q6_K: each half's) dots carry their sub-scales into one integer
// sum per row (qlinear_kquant.h: on the dots for few rows, on the weights for more), which meets the float
// part once a super-block (Q4_K, after its eight minimum terms) or every 64 weights (Q6_K).
template <BlockKind KIND, int R>
inline void group_rows16_k(const uint8_t* codes, const half_t* d, const uint8_t* sub, int64_t nb, const int32_t* xq,
                           const float* xs, const float* xsum, int64_t ldq, int64_t lds, float* y, int64_t ldy) {
  constexpr bool Q4 = KIND == BlockKind::Q4_K, fold = R > kMulDotsRows;
  constexpr int64_t code_bytes = Q4 ? 256 : 384, halves = Q4 ? 1 : 2, steps = 16 / halves;
  __m512 acc[R];
  __m512i whole[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_ahead<R>(codes + (b + kAhead) * code_bytes, code_bytes);
    if (b % 2 == 0) prefetch_ahead<R>(sub + (b + kAhead) * 32, 64);
    if (b % kFloatSpan<KIND> == 0)
      for (int r = 0; r < R; ++r) whole[r] = _mm512_setzero_si512();
    if constexpr (Q4) q4k_minimums<R>(d, sub, b, xsum, lds, acc);
    for (int64_t h = 0; h < halves; ++h) {
      const uint8_t* sc = half_scales<KIND>(sub, b, h);
      __m512i dot[R];
      for (int r = 0; r < R; ++r) dot[r] = fold ? whole[r] : _mm512_setzero_si512();
#pragma GCC unroll 16
      for (int64_t j = h * steps; j < h * steps + steps; ++j) {
        __m512i w = Q4 ? group_weights<true>(codes, b, j) : q6_weights(codes + b * 384, j);
        if constexpr (fold) w = _mm512_mullo_epi16(w, sub_pairs<!Q4>(sc));
        for (int r = 0; r < R; ++r) dot[r] = dot16(dot[r], w, _mm512_set1_epi32(xq[r * ldq + b * 16 + j]));
      }
      for (int r = 0; r < R; ++r)
        whole[r] = fold ? dot[r] : _mm512_add_epi32(whole[r], _mm512_mullo_epi32(dot[r], sub_lanes<!Q4>(sc)));
    }
    if (b % kFloatSpan<KIND> == kFloatSpan<KIND> - 1)
      super_sums<R>(whole, super_scale<KIND>(d, b / SUPER), xs + b / SUPER * SUPER, lds, acc);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

// group_rows16_k over weights already decoded with their sub-scales (decode_group_k, walk_decoded_groups):
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
    if constexpr (KIND == BlockKind::Q4_K) q4k_minimums<R>(d, sub, b, xsum, lds, acc);
#pragma GCC unroll 16
    for (int64_t j = 0; j < 16; ++j) {
      const __m512i w = _mm512_load_si512(wp + b * 16 + j);
      for (int r = 0; r < R; ++r) whole[r] = dot16(whole[r], w, _mm512_set1_epi32(xq[r * ldq + b * 16 + j]));
    }
    if (b % kFloatSpan<KIND> == kFloatSpan<KIND> - 1)
      super_sums<R>(whole, super_scale<KIND>(d, b / SUPER), xs + b / SUPER * SUPER, lds, acc);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

// Token rows [m0, m1) against groups [g0, g1) (qlinear_kquant.h's group_item16_k): more rows than one chunk
// over each group's weights decoded once (walk_decoded_groups), fewer decoding as they go.
template <BlockKind KIND>
void group_item16_k(const Int16Rows& x, int64_t m0, int64_t m1, const uint8_t* qs, const half_t* d, const uint8_t* sub,
                    int64_t g0, int64_t g1, float* y, int64_t ldy) {
  const int64_t nb = x.nb, ldq = nb * 16, nsb = nb / SUPER;
  const int64_t code_bytes = KIND == BlockKind::Q4_K ? 256 : 384, d_halves = KIND == BlockKind::Q4_K ? 32 : 16;
  if (m1 - m0 > kChunkRows) {
    return walk_decoded_groups(
        x, m0, m1, g0, g1, y, ldy, [&](int64_t g, __m512i* wp) { decode_group_k<KIND>(qs + g * nb * code_bytes, sub + g * nb * 32, nb, wp); },
        [&](auto rows, int64_t g, const __m512i* wp, const int32_t* xq, const float* xs, const float* xsum, float* out) {
          group_rows16_k_decoded<KIND, decltype(rows)::value>(wp, d + g * nsb * d_halves, sub + g * nb * 32, nb, xq,
                                                             xs, xsum, ldq, nb, out, ldy);
        });
  }
  walk_row_chunks(x, m0, m1, g0, g1, y, ldy, [&](auto rows, int64_t g, const int32_t* xq, const float* xs,
                                                  const float* xsum, float* out) {
    group_rows16_k<KIND, decltype(rows)::value>(qs + g * nb * code_bytes, d + g * nsb * d_halves, sub + g * nb * 32,
                                                nb, xq, xs, xsum, ldq, nb, out, ldy);
  });
}
