// The n16 Q4_1 / Q8_0 step loops on 512 bits (qlinear_vnni.h's layout and arithmetic). No include guard:
// qlinear_vnni.h includes this file twice, in namespace vnni under the AVX-512 VNNI target and in namespace
// bw under plain AVX-512, each with its own dot16(acc, w, x) = acc + the lane's two int16 products.

// y[r, 0..15] for R token rows of x (rows of ldq words and lds scales) against one group of 16 rows. DECODED:
// the group's weights already decoded, step j of block b at wp[b * 16 + j] (walk_decoded_groups; codes unused).
template <bool Q4, int R, bool DECODED = false>
inline void group_rows16(const uint8_t* codes, const half_t* d, const half_t* mins, int64_t nb, const int32_t* xq,
                         const float* xs, const float* xsum, int64_t ldq, int64_t lds, float* y, int64_t ldy,
                         const __m512i* wp = nullptr) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  constexpr int64_t code_bytes = Q4 ? 256 : 512;  // a block's codes for the 16 rows
  for (int64_t b = 0; b < nb; ++b) {
    if (!DECODED) prefetch_ahead<R>(codes + (b + kAhead) * code_bytes, code_bytes);
    if (b % 2 == 0) prefetch_ahead<R>(d + (b + kAhead) * 16, 64);
    if (Q4 && b % 2 == 0) prefetch_ahead<R>(mins + (b + kAhead) * 16, 64);
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    // Unrolled: as a loop, GCC copies every accumulator twice a step (1.1-1.6x at 1-32 rows, Ice Lake).
#pragma GCC unroll 16
    for (int64_t j = 0; j < 16; ++j) {
      const __m512i w = DECODED ? _mm512_load_si512(wp + b * 16 + j) : group_weights<Q4>(codes, b, j);
      for (int r = 0; r < R; ++r) dot[r] = dot16(dot[r], w, _mm512_set1_epi32(xq[r * ldq + b * 16 + j]));
    }
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + b * 16)));
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(dv, _mm512_set1_ps(xs[r * lds + b])), acc[r]);
    if constexpr (Q4) {
      const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins + b * 16)));
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsum[r * lds + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

template <bool Q4>
void group_item16_512(const Int16Rows& x, int64_t m0, int64_t m1, const uint8_t* qs, const half_t* d,
                      const half_t* mins, int64_t g0, int64_t g1, float* y, int64_t ldy) {
  const int64_t nb = x.nb, ldq = nb * 16, code_bytes = Q4 ? 256 : 512;
  if (m1 - m0 > kChunkRows) {  // more rows than one chunk: each group's weights decoded once
    return walk_decoded_groups(
        x, m0, m1, g0, g1, y, ldy,
        [&](int64_t g, __m512i* wp) {
          for (int64_t k = 0; k < nb * 16; ++k) wp[k] = group_weights<Q4>(qs + g * nb * code_bytes, k / 16, k % 16);
        },
        [&](auto rows, int64_t g, const __m512i* wp, const int32_t* xq, const float* xs, const float* xsum, float* out) {
          group_rows16<Q4, decltype(rows)::value, true>(nullptr, d + g * nb * 16, Q4 ? mins + g * nb * 16 : nullptr, nb,
                                                        xq, xs, xsum, ldq, nb, out, ldy, wp);
        });
  }
  walk_row_chunks(x, m0, m1, g0, g1, y, ldy, [&](auto rows, int64_t g, const int32_t* xq, const float* xs,
                                                  const float* xsum, float* out) {
    group_rows16<Q4, decltype(rows)::value>(qs + g * nb * code_bytes, d + g * nb * 16,
                                            Q4 ? mins + g * nb * 16 : nullptr, nb, xq, xs, xsum, ldq, nb, out, ldy);
  });
}

