// Prefill attention on AMX-BF16 tiles: bfloat16 q, k, v → bfloat16 out, float32 sums and softmax, one pass over
// the keys per block of query rows (online softmax). Both products run on torch's brgemm (at::native::cpublas,
// oneDNN's micro-kernel): S = Q·Kᵀ for a block of FLASH_Q rows against FLASH_K keys, then O += P·V with P the
// block's probabilities rounded to bfloat16. Each KV head's keys and values are packed once per call into the
// tiles' pair layout (Kᵀ: [d/2][FLASH_K][2] per key block; V: [FLASH_K/2][d][2]) and shared by the query heads
// of its group (GQA). torch's CPU flash kernel computes the same (bfloat16 P, float32 sums) with more passes over
// each block of scores; here the scale, the mask, the row max, e^x, the row sum and the bfloat16 P are one pass.
// The operands may come in other types (float32 q and out, a float16 paged cache): each is rounded to bfloat16 as
// it is copied into the block buffers and the packed keys and values, with no converted copy in memory.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>

#include <immintrin.h>

namespace kvyard {

constexpr int64_t FLASH_Q = 128; // query rows per block (the default)
constexpr int64_t FLASH_K = 256; // keys per block (the default; a multiple of 32)

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c")

// d values (a multiple of 16) rounded to bfloat16 bits: bfloat16 as they are, float16 and float32 widened then
// rounded to nearest even (as torch's .to(torch.bfloat16)).
inline void row_bf16(const at::BFloat16* src, int64_t d, uint16_t* dst) { std::memcpy(dst, src, d * 2); }
inline void row_bf16(const float* src, int64_t d, uint16_t* dst) {
  for (int64_t c = 0; c < d; c += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + c)));
}
inline void row_bf16(const at::Half* src, int64_t d, uint16_t* dst) {
  for (int64_t c = 0; c < d; c += 16) {
    const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + c)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c), (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// Kᵀ of one KV head for one key block: dst[d/2][kbs] as 32-bit pairs (the two bfloat16 of a pair are consecutive
// in a key row, so a pair is one uint32). row(j) → key j's d values; keys past n are zero.
template <typename Row>
inline void pack_keys(Row row, int64_t n, int64_t d, int64_t kbs, uint32_t* dst) {
  const int64_t pairs = d / 2;
  alignas(64) uint16_t buf[512];
  const auto* buf32 = reinterpret_cast<const uint32_t*>(buf);
  for (int64_t j = 0; j < kbs; ++j) {
    if (j < n) {
      row_bf16(row(j), d, buf);
      for (int64_t p = 0; p < pairs; ++p) dst[p * kbs + j] = buf32[p];
    } else {
      for (int64_t p = 0; p < pairs; ++p) dst[p * kbs + j] = 0;
    }
  }
}

// V of one KV head for one key block: dst[kbs/2][d][2] (rows 2p and 2p + 1 interleaved). Rows past n are zero
// (their probabilities are zero, and 0 · garbage could be NaN).
template <typename Row>
inline void pack_values(Row row, int64_t n, int64_t d, int64_t kbs, uint16_t* dst) {
  alignas(64) uint16_t a[512], b[512];
  for (int64_t p = 0; p < kbs / 2; ++p) {
    const int64_t r0 = 2 * p, r1 = r0 + 1;
    if (r0 < n) row_bf16(row(r0), d, a); else std::memset(a, 0, d * 2);
    if (r1 < n) row_bf16(row(r1), d, b); else std::memset(b, 0, d * 2);
    uint16_t* out = dst + p * d * 2;
    for (int64_t c = 0; c < d; ++c) {
      out[2 * c] = a[c];
      out[2 * c + 1] = b[c];
    }
  }
}


// 2^t for 16 floats t ≤ 0: 2^n · p(f), t = n + f, |f| ≤ 1/2, p of degree 5 (Taylor; relative error ~3e-6, far below the
// bfloat16 the probabilities are rounded to); t below -126 gives 0 or a denormal.
inline __m512 exp2_le0(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558146e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 live_lanes(int64_t n, int64_t c) {
  return n - c >= 16 ? 0xFFFF : n > c ? static_cast<__mmask16>((1u << (n - c)) - 1) : 0;
}

// One block of scores s [rows][kbs] (unscaled; the first `width` columns computed, a multiple of 32): row r sees its
// first visible(r) keys of the block. Updates the
// row's running max m (in units of log2: scale · log2(e) · s) and sum l, rescales its output row o [d] when the max
// moved, and writes p [rows][kbs] bfloat16 (zero past the visible keys). One read of the scores for the max and
// one for e^x, the sum and the bfloat16 P.
template <typename Visible>
inline void softmax_block(const float* s, int64_t rows, int64_t kbs, int64_t width, float scale, Visible visible,
                          float* m, float* l, float* o, int64_t d, bool first, uint16_t* p) {
  const float c2 = scale * 1.44269504088896341f;  // e^(scale·s) = 2^(c2·s)
  const __m512 vc = _mm512_set1_ps(c2), ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(width, visible(r)));
    const float* sr = s + r * kbs;
    uint16_t* pr = p + r * kbs;
    if (n == 0) {  // every key of this block is in the row's future
      std::memset(pr, 0, width * sizeof(uint16_t));
      continue;
    }
    __m512 vmax = ninf;
    for (int64_t c = 0; c < n; c += 16) vmax = _mm512_mask_max_ps(vmax, live_lanes(n, c), vmax, _mm512_loadu_ps(sr + c));
    const float block_max = _mm512_reduce_max_ps(vmax) * c2, mnew = first ? block_max : std::max(m[r], block_max);
    const __m512 vm = _mm512_set1_ps(mnew);
    __m512 vsum = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c < n; c += 16) {
      const __m512 e = _mm512_maskz_mov_ps(live_lanes(n, c), exp2_le0(_mm512_fmsub_ps(_mm512_loadu_ps(sr + c), vc, vm)));
      vsum = _mm512_add_ps(vsum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + c), (__m256i)_mm512_cvtneps_pbh(e));
    }
    for (; c < width; c += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + c), _mm256_setzero_si256());
    const float alpha = first ? 0.0f : std::exp2(m[r] - mnew);
    l[r] = (first ? 0.0f : l[r] * alpha) + _mm512_reduce_add_ps(vsum);
    m[r] = mnew;
    if (!first && alpha != 1.0f) {
      float* orow = o + r * d;
      const __m512 va = _mm512_set1_ps(alpha);
      for (int64_t c = 0; c < d; c += 16) _mm512_storeu_ps(orow + c, _mm512_mul_ps(_mm512_loadu_ps(orow + c), va));
    }
  }
}

// o [rows][d] float32 / l → out rows (row stride ldo), bfloat16 or float32.
inline void finish_block(const float* o, const float* l, int64_t rows, int64_t d, at::BFloat16* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
    for (int64_t c = 0; c < d; c += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + c),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + r * d + c), inv)));
  }
}
inline void finish_block(const float* o, const float* l, int64_t rows, int64_t d, float* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
    for (int64_t c = 0; c < d; c += 16) _mm512_storeu_ps(out + r * ldo + c, _mm512_mul_ps(_mm512_loadu_ps(o + r * d + c), inv));
  }
}

#pragma GCC pop_options

// q [Q][H][d] (row stride ldq, heads d apart) → out [Q][H][d] (row stride ldo); krow(j, g) and vrow(j, g) → key /
// value j's d values for KV head g. causal: query i sits at position start + i and sees keys 0..start + i (N =
// start + Q); else every query sees all N keys. d a multiple of 32 (at most 512), H a multiple of Hkv.
template <typename TQ, typename TO, typename KRow, typename VRow>
inline void flash_attention(const TQ* q, int64_t ldq, KRow krow, VRow vrow, TO* out, int64_t ldo, int64_t Q, int64_t N,
                            int64_t H, int64_t Hkv, int64_t d, int64_t start, bool causal, float scale,
                            int64_t qbs = FLASH_Q, int64_t kbs = FLASH_K) {
  const int64_t kblocks = (N + kbs - 1) / kbs, per_head = kblocks * kbs * d, group = H / Hkv;
  std::unique_ptr<uint16_t[]> kp(new uint16_t[Hkv * per_head]), vp(new uint16_t[Hkv * per_head]);
  at::parallel_for(0, Hkv * kblocks, 1, [&](int64_t i0, int64_t i1) {  // pack, a key block of a head at a time
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = i / kblocks, b0 = i % kblocks * kbs, n = std::min(kbs, N - b0);
      pack_keys([&](int64_t j) { return krow(b0 + j, g); }, n, d, kbs,
                reinterpret_cast<uint32_t*>(kp.get() + g * per_head + b0 * d));
      pack_values([&](int64_t j) { return vrow(b0 + j, g); }, n, d, kbs, vp.get() + g * per_head + b0 * d);
    }
  });
  const int64_t qblocks = (Q + qbs - 1) / qbs;
  const auto* kb = reinterpret_cast<const at::BFloat16*>(kp.get());
  const auto* vb = reinterpret_cast<const at::BFloat16*>(vp.get());
  // Items head-major, so the two threads' halves cost alike under a causal mask.
  at::parallel_for(0, H * qblocks, 1, [&](int64_t i0, int64_t i1) {
    std::unique_ptr<float[]> s(new float[qbs * kbs]), o(new float[qbs * d]), mb(new float[qbs]), lb(new float[qbs]);
    std::unique_ptr<uint16_t[]> p(new uint16_t[qbs * kbs]), qb(new uint16_t[qbs * d]);
    float *m = mb.get(), *l = lb.get();
    const auto* a = reinterpret_cast<const at::BFloat16*>(qb.get());
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i / qblocks, q0 = i % qblocks * qbs, rows = std::min(qbs, Q - q0), g = h / group;
      for (int64_t r = 0; r < rows; ++r) row_bf16(q + (q0 + r) * ldq + h * d, d, qb.get() + r * d);
      const int64_t kend = causal ? std::min(N, start + q0 + rows) : N;
      for (int64_t b0 = 0; b0 < kend; b0 += kbs) {
        // Only the columns some row of the block sees (whole pairs of 16: the packed keys past N are zero).
        const bool first = b0 == 0;
        const int64_t limit = kend - b0, base = start + q0 - b0 + 1, width = std::min(kbs, (limit + 31) / 32 * 32);
        at::native::cpublas::brgemm(rows, width, d, d, kbs, kbs, false, a, kb + g * per_head + b0 * d, s.get(), true);
        if (causal)
          softmax_block(s.get(), rows, kbs, width, scale, [&](int64_t r) { return base + r; }, m, l, o.get(), d, first,
                        p.get());
        else
          softmax_block(s.get(), rows, kbs, width, scale, [&](int64_t) { return limit; }, m, l, o.get(), d, first,
                        p.get());
        at::native::cpublas::brgemm(rows, d, width, kbs, d, d, !first,
                                    reinterpret_cast<const at::BFloat16*>(p.get()), vb + g * per_head + b0 * d,
                                    o.get(), true);
      }
      finish_block(o.get(), l, rows, d, out + q0 * ldo + h * d, ldo);
    }
    at::native::cpublas::brgemm_release();
  });
}

}  // namespace kvyard
