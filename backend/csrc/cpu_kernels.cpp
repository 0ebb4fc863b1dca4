// kvyard's CPU kernels (AVX2 + FMA, at::parallel_for): the decode-time hot path of backend/model.py.
//
// Weights stay in the GGUF's own block formats, repacked once at load (backend/quant.py):
//   Q4_1: per 32 weights along K a float scale d, a float minimum m and 16 bytes of 4-bit codes;
//         byte j of a block holds weight j (low nibble) and weight j + 16 (high nibble); w = d*q + m.
//   Q8_0: per 32 weights a float scale d and 32 signed bytes; w = d*q.
// Activations stay float32, so a linear here computes the same numbers as F.linear over the
// float32 dequantization (the reference), up to the order of the float additions, while reading
// 5-8x fewer bytes of weights per token.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int QK = 32;       // weights per quant block
constexpr int MT = 8;        // token rows per micro-tile (accumulators kept in registers)
constexpr int64_t NT = 8;    // output rows per parallel work item
// Past this many rows a work item decodes its weight rows once and runs register tiles over them (1.1-1.5x
// at 32-64 rows); up to it the decode to memory costs more than it saves (0.7-0.85x at 5-8 rows).
constexpr int64_t DECODE_ONCE_ROWS = 16;
constexpr int64_t TW = 4, TR = 3;         // register tile: weight rows x token rows (dot_tile)

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// The KV cache is float32 or float16 (KV_CACHE_DTYPE): 8 values of a cache row as floats, and back.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void store_row(const float* src, float* dst, int64_t n) { std::copy(src, src + n, dst); }
inline void store_row(const float* src, at::Half* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) dst[i] = static_cast<at::Half>(src[i]);
}

void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.device().is_cpu() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.scalar_type() == v_cache.scalar_type() &&
              (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kHalf),
              "KV caches must be contiguous float32 or float16 CPU tensors");
}

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

// Row n of a quantized matrix as float32 into out (K = nb * 32 floats).
inline void decode_row(const uint8_t* qp, const float* dp, const float* mp, int64_t n, int64_t nb, bool q4,
                       float* out) {
  const int64_t row_bytes = q4 ? nb * 16 : nb * 32;
  __m256 w[4];
  for (int64_t b = 0; b < nb; ++b) {
    if (q4) unpack_q4(qp + n * row_bytes + b * 16, w);
    else unpack_q8(reinterpret_cast<const int8_t*>(qp) + n * row_bytes + b * 32, w);
    const __m256 scale = _mm256_set1_ps(dp[n * nb + b]);
    const __m256 shift = _mm256_set1_ps(q4 ? mp[n * nb + b] : 0.f);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + b * QK + 8 * i, _mm256_fmadd_ps(w[i], scale, shift));
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

void check_cpu_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
              name, " must be a contiguous float32 CPU tensor");
}

// x: [M, K] float32; qs: [N, K/2] uint8 (Q4_1) or [N, K] int8 (Q8_0); d, mins: [N, K/32] float32.
// bias: [N] or empty; residual: [M, N] or empty (added to the result). → [M, N] float32.
template <bool Q4>
at::Tensor qlinear(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& mins,
                   const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual) {
  const at::Tensor x = x_in.contiguous();
  check_cpu_f32(x, "x");
  check_cpu_f32(d, "d");
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = d.size(0), nb = d.size(1);
  TORCH_CHECK(K == nb * QK, "x has ", K, " columns, the weight ", nb * QK);
  TORCH_CHECK(qs.is_contiguous() && qs.size(0) == N && qs.size(1) == (Q4 ? K / 2 : K), "bad codes shape");
  if (Q4) check_cpu_f32(mins, "mins");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = static_cast<const uint8_t*>(qs.data_ptr());
  const float* dp = d.data_ptr<float>();
  const float* mp = Q4 ? mins.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = Q4 ? K / 2 : K;

  // Per-block 8-lane partial sums of x: the minimum's share of every Q4_1 dot product.
  std::vector<float> xsum;
  if (Q4 && M <= DECODE_ONCE_ROWS) {
    xsum.resize(M * nb * 8);
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t b = 0; b < nb; ++b) {
          const float* xb = xp + m * K + b * QK;
          __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                   _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
          _mm256_storeu_ps(xsum.data() + (m * nb + b) * 8, s);
        }
    });
  }
  const float* xs = Q4 ? xsum.data() : nullptr;
  // Work items: (token block of ≤ 64 rows, NT output rows); a token block's x stays in L2 while the
  // weights stream past it.
  constexpr int64_t MB = 64;
  const int64_t n_tiles = (N + NT - 1) / NT, m_blocks = (M + MB - 1) / MB;
  at::parallel_for(0, n_tiles * m_blocks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t mb = item / n_tiles, nt = item % n_tiles;
      const int64_t m_end = std::min(M, (mb + 1) * MB), n_end = std::min(N, (nt + 1) * NT);
      if (M <= DECODE_ONCE_ROWS) {
        // Token tile outside, weight rows inside: the tile's x stays in L1 while NT rows stream past it
        // (the other order re-read all of x from L2 for every row).
        for (int64_t m = mb * MB; m < m_end; m += MT) {
          const int rows = static_cast<int>(std::min<int64_t>(MT, m_end - m));
          for (int64_t n = nt * NT; n < n_end; ++n)
            dot_row<Q4>(xp + m * K, K, rows, qp + n * row_bytes, dp + n * nb, Q4 ? mp + n * nb : nullptr,
                        Q4 ? xs + m * nb * 8 : nullptr, nb, yp + m * N + n, N);
        }
        continue;
      }
      // More rows: decode the item's NT weight rows once (w = d q + m), then run register tiles of TW
      // weight rows x TR token rows over them.
      thread_local std::vector<float> wbuf;
      wbuf.resize(NT * K);
      for (int64_t n = nt * NT; n < n_end; ++n) decode_row(qp, dp, mp, n, nb, Q4, wbuf.data() + (n - nt * NT) * K);
      for (int64_t m = mb * MB; m < m_end; m += TR) {
        const int rows = static_cast<int>(std::min<int64_t>(TR, m_end - m));
        for (int64_t n = nt * NT; n < n_end; n += TW) {
          const float* w = wbuf.data() + (n - nt * NT) * K;
          float* out = yp + m * N + n;
          const float* xm = xp + m * K;
          switch (std::min<int64_t>(TW, n_end - n)) {
            case 1: dot_tile_rows<1>(xm, K, rows, w, K, K, out, N); break;
            case 2: dot_tile_rows<2>(xm, K, rows, w, K, K, out, N); break;
            case 3: dot_tile_rows<3>(xm, K, rows, w, K, K, out, N); break;
            default: dot_tile_rows<4>(xm, K, rows, w, K, K, out, N); break;
          }
        }
      }
    }
  });
  if (bias && bias->defined()) y.add_(*bias);
  if (residual && residual->defined()) y.add_(*residual);
  return y;
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& mins,
                       const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual) {
  return qlinear<true>(x, qs, d, mins, bias, residual);
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                       const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual) {
  return qlinear<false>(x, qs, d, at::Tensor(), bias, residual);
}

// Rows `ids` of a quantized matrix, dequantized: the embedding lookup. → [T, K] float32.
at::Tensor dequant_rows(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& mins,
                        const at::Tensor& ids_in, bool q4) {
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t T = ids.size(0), N = d.size(0), nb = d.size(1), K = nb * QK;
  at::Tensor out = at::empty({T, K}, d.options());
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < N, "row id out of range");
  const uint8_t* qp = static_cast<const uint8_t*>(qs.data_ptr());
  const float* dp = d.data_ptr<float>();
  const float* mp = q4 ? mins.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) decode_row(qp, dp, mp, ip[t], nb, q4, op + t * K);
  });
  return out;
}

// The whole matrix, dequantized into out: [N, K] float32 (prefill-sized batches use the BLAS GEMM on it).
void dequantize_into(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& mins, at::Tensor out, bool q4) {
  const int64_t N = d.size(0), nb = d.size(1), K = nb * QK;
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat && out.size(0) == N && out.size(1) == K,
              "out must be a contiguous float32 [N, K]");
  const uint8_t* qp = static_cast<const uint8_t*>(qs.data_ptr());
  const float* dp = d.data_ptr<float>();
  const float* mp = q4 ? mins.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) decode_row(qp, dp, mp, n, nb, q4, op + n * K);
  });
}

// x: [T, D] → x * rsqrt(mean(x²) + eps) * w, float32 throughout (as the reference does for float32).
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w, double eps) {
  const at::Tensor x = x_in.contiguous();
  check_cpu_f32(x, "x");
  check_cpu_f32(w, "w");
  const int64_t T = x.size(0), D = x.size(1);
  at::Tensor y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* r = xp + t * D;
      double ss = 0.0;
      for (int64_t i = 0; i < D; ++i) ss += static_cast<double>(r[i]) * r[i];
      const float inv = 1.0f / std::sqrt(static_cast<float>(ss / D) + static_cast<float>(eps));
      for (int64_t i = 0; i < D; ++i) yp[t * D + i] = wp[i] * (r[i] * inv);
    }
  });
  return y;
}

// gate_up: [T, 2F] → silu(gate) * up: [T, F].
at::Tensor silu_mul(const at::Tensor& gu_in) {
  const at::Tensor gu = gu_in.contiguous();
  check_cpu_f32(gu, "gate_up");
  const int64_t T = gu.size(0), F = gu.size(1) / 2;
  at::Tensor y = at::empty({T, F}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t i = 0; i < F; ++i) {
        const float g = gp[t * 2 * F + i];
        yp[t * F + i] = g / (1.0f + std::exp(-g)) * gp[t * 2 * F + F + i];
      }
  });
  return y;
}

// qkv: [T, (H + 2 Hkv) d]. Rotates q and k (pairs (i, i + d/2), the Hugging Face layout), writes
// k and v into the layer's cache at `slots`, and returns q: [T, H, d].
at::Tensor rope_store(const at::Tensor& qkv_in, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots_in,
                      int64_t n_heads, int64_t n_kv) {
  const at::Tensor qkv = qkv_in.contiguous();
  check_cpu_f32(qkv, "qkv");
  check_cpu_f32(cos, "cos");
  check_cpu_f32(sin, "sin");
  check_cache(k_cache, v_cache);
  const at::Tensor slots = slots_in.to(at::kLong).contiguous();
  const int64_t T = qkv.size(0), d = k_cache.size(2), half = d / 2, W = qkv.size(1);
  TORCH_CHECK(W == (n_heads + 2 * n_kv) * d, "qkv width does not match the heads");
  at::Tensor q = at::empty({T, n_heads, d}, qkv.options());
  const float* in = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  float* qp = q.data_ptr<float>();
  const int64_t S = k_cache.size(0);
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < S, "slot out of range");
  auto run = [&](auto* kc, auto* vc) {
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> krot(d);
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = in + t * W;
      const float* c = cp + t * half;
      const float* s = sp + t * half;
      auto rotate = [&](const float* src, float* dst) {
        for (int64_t i = 0; i < half; ++i) {
          const float a = src[i], b = src[i + half];
          dst[i] = a * c[i] - b * s[i];
          dst[i + half] = b * c[i] + a * s[i];
        }
      };
      for (int64_t h = 0; h < n_heads; ++h) rotate(row + h * d, qp + (t * n_heads + h) * d);
      for (int64_t h = 0; h < n_kv; ++h) {
        rotate(row + (n_heads + h) * d, krot.data());
        store_row(krot.data(), kc + (slot[t] * n_kv + h) * d, d);
      }
      store_row(row + (n_heads + n_kv) * d, vc + slot[t] * n_kv * d, n_kv * d);
    }
  });
  };
  if (k_cache.scalar_type() == at::kHalf) run(k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>());
  else run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  return q;
}

// e^x for 8 floats (x ≤ 0 here: scores minus their max): 2^n · p(r) with x = n ln2 + r, |r| ≤ ln2/2,
// p a degree-6 Taylor polynomial (relative error < 2e-7 on that range).
inline __m256 exp_ps(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  const __m256 rr = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// The 8 lane-sums of a[0..7], as one vector (a transposed horizontal add).
inline __m256 hsum8(const __m256 a[8]) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  // h0 = [s0 s1 s2 s3 | s0' s1' s2' s3'] (low/high 128-bit halves of each sum), same for h1.
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

// Decode attention straight from the paged cache (no gather): q: [B, H, d]; caches: [S, Hkv, d];
// block_table: [B, nblk] int64; lens: [B] keys each row sees. → [B, H, d].
at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& table_in, const at::Tensor& lens_in, int64_t block_size,
                            double scale) {
  const at::Tensor q = q_in.contiguous();
  check_cpu_f32(q, "q");
  check_cache(k_cache, v_cache);
  const at::Tensor table = table_in.to(at::kLong).contiguous();
  const at::Tensor lens = lens_in.to(at::kLong).contiguous();
  const int64_t B = q.size(0), H = q.size(1), d = q.size(2), Hkv = k_cache.size(1);
  const int64_t group = H / Hkv, nblk = table.size(1), S = k_cache.size(0);
  TORCH_CHECK(k_cache.size(2) == d && H % Hkv == 0, "q and the cache disagree on heads");
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= nblk * block_size, "bad key count");
    for (int64_t j = 0; j < (lp[b] + block_size - 1) / block_size; ++j)
      TORCH_CHECK(tp[b * nblk + j] >= 0 && (tp[b * nblk + j] + 1) * block_size <= S, "block out of range");
  }
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  auto run = [&](auto nv_const, const auto* kc, const auto* vc) {
  constexpr int64_t nv = decltype(nv_const)::value;  // d / 8, a constant so the sums stay in registers
  constexpr int64_t KB = 32;  // keys per V pass: their rows stay in L1 while each head of the group reads them
  // One work item per (row, KV head): the `group` query heads that share it read each K and V row from
  // memory once (the later heads find it in L1), instead of once per query head.
  at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;  // [group][n rounded up to 8]
    std::vector<int64_t> slots;
    std::vector<float> partial;  // [group][d]: the V sums between key passes
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = item / Hkv, kvh = item % Hkv, n = lp[b], np = (n + 7) / 8 * 8;
      scores.resize(group * np);
      partial.assign(group * d, 0.f);
      slots.resize(n);  // cache row of each key, walked block by block (no division per key)
      for (int64_t p = 0, j = 0; p < n; ++j)
        for (int64_t o = 0, base = tp[b * nblk + j] * block_size; o < block_size && p < n; ++o, ++p)
          slots[p] = base + o;
      for (int64_t p = 0; p < n; p += 8) {
        for (int64_t g = 0; g < group; ++g) {
          const float* qh = qp + (b * H + kvh * group + g) * d;
          __m256 acc[8];
          for (int j = 0; j < 8; ++j) {
            __m256 a = _mm256_setzero_ps();
            if (p + j < n) {
              const auto* k = kc + (slots[p + j] * Hkv + kvh) * d;
              for (int64_t i = 0; i < nv; ++i)
                a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * i), load8(k + 8 * i), a);
            }
            acc[j] = a;
          }
          _mm256_storeu_ps(scores.data() + g * np + p, _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(sc)));
        }
      }
      std::vector<float> inv(group);
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * np;
        float mx = sg[0];
        for (int64_t p = 1; p < n; ++p) mx = std::max(mx, sg[p]);
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 vsum = _mm256_setzero_ps();
        for (int64_t p = 0; p < n; p += 8) {
          __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(sg + p), vmx));
          if (p + 8 > n) {  // zero the lanes past the last key
            alignas(32) float lane[8];
            _mm256_store_ps(lane, e);
            for (int64_t j = n - p; j < 8; ++j) lane[j] = 0.f;
            e = _mm256_load_ps(lane);
          }
          _mm256_storeu_ps(sg + p, e);
          vsum = _mm256_add_ps(vsum, e);
        }
        inv[g] = 1.0f / hsum(vsum);
      }
      for (int64_t p0 = 0; p0 < n; p0 += KB) {
        const int64_t p1 = std::min(n, p0 + KB);
        for (int64_t g = 0; g < group; ++g) {
          const float* sg = scores.data() + g * np;
          float* part = partial.data() + g * d;
          __m256 acc[nv];
          for (int64_t i = 0; i < nv; ++i) acc[i] = _mm256_loadu_ps(part + 8 * i);
          for (int64_t p = p0; p < p1; ++p) {
            const auto* v = vc + (slots[p] * Hkv + kvh) * d;
            const __m256 wgt = _mm256_set1_ps(sg[p]);
            for (int64_t i = 0; i < nv; ++i) acc[i] = _mm256_fmadd_ps(wgt, load8(v + 8 * i), acc[i]);
          }
          for (int64_t i = 0; i < nv; ++i) _mm256_storeu_ps(part + 8 * i, acc[i]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* o = op + (b * H + kvh * group + g) * d;
        const __m256 vinv = _mm256_set1_ps(inv[g]);
        for (int64_t i = 0; i < nv; ++i)
          _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(_mm256_loadu_ps(partial.data() + g * d + 8 * i), vinv));
      }
    }
  });
  };
  auto dispatch = [&](const auto* kc, const auto* vc) {
    switch (d) {
      case 64: run(std::integral_constant<int64_t, 8>{}, kc, vc); break;
      case 128: run(std::integral_constant<int64_t, 16>{}, kc, vc); break;
      case 32: run(std::integral_constant<int64_t, 4>{}, kc, vc); break;
      case 96: run(std::integral_constant<int64_t, 12>{}, kc, vc); break;
      default: TORCH_CHECK(false, "decode_attention supports head_dim 32, 64, 96 or 128, not ", d);
    }
  };
  if (k_cache.scalar_type() == at::kHalf) dispatch(k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>());
  else dispatch(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  return out;
}

}  // namespace

// Every kernel lets go of the GIL: the backend's asyncio thread (gRPC streaming) runs meanwhile.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_1_linear", &q4_1_linear, "x @ dequant(Q4_1)^T (+ bias) (+ residual)", py::call_guard<py::gil_scoped_release>());
  m.def("q8_0_linear", &q8_0_linear, "x @ dequant(Q8_0)^T (+ bias) (+ residual)", py::call_guard<py::gil_scoped_release>());
  m.def("dequant_rows", &dequant_rows, "rows of a Q4_1/Q8_0 matrix as float32", py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_into", &dequantize_into, "a whole Q4_1/Q8_0 matrix into a float32 buffer", py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm, float32", py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "silu(gate) * up", py::call_guard<py::gil_scoped_release>());
  m.def("rope_store", &rope_store, "RoPE on q and k, k and v into the paged cache; returns q", py::call_guard<py::gil_scoped_release>());
  m.def("decode_attention", &decode_attention, "single-query attention over paged KV blocks", py::call_guard<py::gil_scoped_release>());
}
