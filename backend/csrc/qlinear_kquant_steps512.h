// The K-quant step loops without VBMI (qlinear_kquant.h's layout and float order). No include guard:
// qlinear_kquant.h includes this file twice, in namespaces vnni and bw, each with qlinear_vnni.h's dot16.

// y[r, 0..15] for R token rows against one group of 16 output rows of a K-quant matrix (qlinear_vnni.h's
// group_rows16 for Q4_K / Q6_K). codes, d, sub: this group's. The portable decode (no VBMI); its step loops
// unrolled as qlinear_vnni.h's.
template <BlockKind KIND, int R>
inline void group_rows16_k(const uint8_t* codes, const half_t* d, const uint8_t* sub, int64_t nb, const int32_t* xq,
                           const float* xs, const float* xsum, int64_t ldq, int64_t lds, float* y, int64_t ldy) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  constexpr int64_t code_bytes = KIND == BlockKind::Q4_K ? 256 : 384;  // a block's codes for the 16 rows
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t sb = b / SUPER;
    prefetch_ahead<R>(codes + (b + kAhead) * code_bytes, code_bytes);
    if (b % 2 == 0) prefetch_ahead<R>(sub + (b + kAhead) * 32, 64);
    if constexpr (KIND == BlockKind::Q4_K) {
      __m512i dot[R];
      for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
#pragma GCC unroll 16
      for (int64_t j = 0; j < 16; ++j) {
        const __m512i w = group_weights<true>(codes, b, j);
        for (int r = 0; r < R; ++r) dot[r] = dot16(dot[r], w, _mm512_set1_epi32(xq[r * ldq + b * 16 + j]));
      }
      kquant_block_sums<KIND, R>(dot, nullptr, d, sub, b, sb, xs, xsum, lds, acc);
    } else {
      const uint8_t* cb = codes + b * 384;
      __m512i dot[2][R];
      for (int64_t half = 0; half < 2; ++half) {  // k 0-15, then 16-31: each with its own scale
        for (int r = 0; r < R; ++r) dot[half][r] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int64_t j = 8 * half; j < 8 * half + 8; ++j) {
          const __m512i w = q6_weights(cb, j);
          for (int r = 0; r < R; ++r)
            dot[half][r] = dot16(dot[half][r], w, _mm512_set1_epi32(xq[r * ldq + b * 16 + j]));
        }
      }
      kquant_block_sums<KIND, R>(dot[0], dot[1], d, sub, b, sb, xs, xsum, lds, acc);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}


// group_rows16_k over weights already decoded (decode_group_k, walk_decoded_groups): step j of block b is wp[b * 16 + j]. The same
// integer dots and float chain, hence the same bits; Q6_K adds each half's float part as the half ends (the
// same order as kquant_block_sums), so only R dot registers are live.
template <BlockKind KIND, int R>
inline void group_rows16_k_decoded(const __m512i* wp, const half_t* d, const uint8_t* sub, int64_t nb,
                                  const int32_t* xq, const float* xs, const float* xsum, int64_t ldq, int64_t lds,
                                  float* y, int64_t ldy) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t sb = b / SUPER;
    constexpr int64_t halves = KIND == BlockKind::Q4_K ? 1 : 2, steps = 16 / halves;
    for (int64_t h = 0; h < halves; ++h) {
      __m512i dot[R];
      for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
#pragma GCC unroll 16
      for (int64_t j = h * steps; j < h * steps + steps; ++j) {
        const __m512i w = _mm512_load_si512(wp + b * 16 + j);
        for (int r = 0; r < R; ++r) dot[r] = dot16(dot[r], w, _mm512_set1_epi32(xq[r * ldq + b * 16 + j]));
      }
      if constexpr (KIND == BlockKind::Q4_K) kquant_block_sums<KIND, R>(dot, nullptr, d, sub, b, sb, xs, xsum, lds, acc);
      else q6k_half_sums<R>(dot, d, sub, b, sb, h, xs, lds, acc);
    }
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
        x, m0, m1, g0, g1, y, ldy, [&](int64_t g, __m512i* wp) { decode_group_k<KIND>(qs + g * nb * code_bytes, nb, wp); },
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
