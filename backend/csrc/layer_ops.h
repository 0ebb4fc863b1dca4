// The per-row operations of a decoder layer other than the linears (float32 activations): RMSNorm,
// SiLU·up, RoPE + the K/V store into the paged cache, and single-query attention over the paged blocks.
// Each works on one token row or one (row, KV head) item, so a caller can spread them over threads.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention512.h"
#include "simd.h"

namespace kvyard {

// One row: y = x * rsqrt(mean(x²) + eps) * w (the sum of squares in double, as before; D floats).
inline void rms_norm_row(const float* x, const float* w, int64_t D, float eps, float* y) {
  double ss = 0.0;
  for (int64_t i = 0; i < D; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = 1.0f / std::sqrt(static_cast<float>(ss / D) + eps);
  for (int64_t i = 0; i < D; ++i) y[i] = w[i] * (x[i] * inv);
}

// Qwen3: each q head and each k head of one row of qkv [(H + 2 Hkv) d] RMS-normed in place before RoPE, head by
// head as the op path's rms_norm over [T * heads, d] rows (v left as it is).
inline void qk_norm_row(float* row, const float* q_norm, const float* k_norm, int64_t n_heads, int64_t n_kv, int64_t d,
                        float eps) {
  for (int64_t h = 0; h < n_heads; ++h) rms_norm_row(row + h * d, q_norm, d, eps, row + h * d);
  for (int64_t h = n_heads; h < n_heads + n_kv; ++h) rms_norm_row(row + h * d, k_norm, d, eps, row + h * d);
}

// Columns [c0, c0 + n) of one row of gate_up [2F] → silu(gate) * up into y [F] (c0 a multiple of 8, so a
// row done in pieces rounds exactly as a row done whole); sigmoid from e^-|g|, which never overflows.
inline void silu_mul_cols(const float* gu, int64_t F, int64_t c0, int64_t n, float* y) {
  const float* up = gu + F;
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  int64_t i = c0;
  for (; i + 8 <= c0 + n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gu + i);
    const __m256 e = exp_ps(_mm256_or_ps(g, sign));  // e^-|g|
    const __m256 num = _mm256_blendv_ps(one, e, g);  // g < 0: e^g / (1 + e^g); else 1 / (1 + e^-g)
    const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, e));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i)));
  }
  for (; i < c0 + n; ++i) y[i] = gu[i] / (1.0f + std::exp(-gu[i])) * up[i];
}

// One token row of qkv [(H + 2 Hkv) d]: rotates q and k (pairs (i, i + d/2), the Hugging Face layout),
// writes q to q_out [H, d] and k, v into cache row `slot` (caches [S, Hkv, d]). cos, sin: [d/2].
template <typename T>
inline void rope_store_row(const float* row, const float* c, const float* s, int64_t n_heads, int64_t n_kv,
                           int64_t d, int64_t slot, float* q_out, T* k_cache, T* v_cache, float* krot) {
  const int64_t half = d / 2;
  auto rotate = [&](const float* src, float* dst) {
    for (int64_t i = 0; i < half; ++i) {
      const float a = src[i], b = src[i + half];
      dst[i] = a * c[i] - b * s[i];
      dst[i + half] = b * c[i] + a * s[i];
    }
  };
  for (int64_t h = 0; h < n_heads; ++h) rotate(row + h * d, q_out + h * d);
  for (int64_t h = 0; h < n_kv; ++h) {
    rotate(row + (n_heads + h) * d, krot);
    store_row(krot, k_cache + (slot * n_kv + h) * d, d);
  }
  store_row(row + (n_heads + n_kv) * d, v_cache + slot * n_kv * d, n_kv * d);
}

// Scratch one thread reuses across attention items.
struct AttentionScratch {
  std::vector<float> scores;   // [group][keys rounded up to 8]
  std::vector<int64_t> slots;  // cache row of each key
  std::vector<float> partial;  // [heads][group][d]: the V sums between key passes
  std::vector<float> inv;      // [heads][group]: 1 / each query head's softmax denominator
};

// Decode attention for one (row b, KV heads [kvh0, kvh1)) item straight from the paged cache (no gather):
// the `group` query heads that share a KV head read each K and V row from memory once (the later heads
// find it in L1; with AVX-512, attention512.h widens each row once for several heads). Both passes walk
// the keys 8 (K) or KB (V) at a time and, within those, the item's KV heads in turn: a cache row holds
// every KV head of its slot side by side (Hkv * d values, 4 KB for 32 heads of 64 in float16), so the
// reads run forward through each row instead of jumping a row per key for each head (one head's d values
// per page: latency-bound, 6 GB/s at 32 rows of 300 keys). Each head's numbers are computed in the same
// order whatever the item's head range. q: [B, H, d]; caches [S, Hkv, d]; table: [B, nblk]; the row sees
// keys [first, last) (a sliding window starts past 0; both passes walk only those keys' slots);
// out: [B, H, d]. NV = d / 8, a constant so the sums stay in registers.
template <int64_t NV, typename T>
inline void attend_item(const float* q, const T* kc, const T* vc, const int64_t* table, int64_t nblk,
                        int64_t block_size, int64_t H, int64_t Hkv, int64_t b, int64_t kvh0, int64_t kvh1,
                        int64_t first, int64_t last, float scale, float* out, AttentionScratch& s) {
  constexpr int64_t d = NV * 8;
  constexpr int64_t KB = 32;  // keys per V pass: their rows stay in L1 while each head of the group reads them
  const int64_t n = last - first, group = H / Hkv, np = (n + 7) / 8 * 8, heads = kvh1 - kvh0;
  const int64_t hs = group * np;  // one KV head's scores
  s.scores.resize(heads * hs);
  s.partial.assign(heads * group * d, 0.f);
  s.slots.resize(n);  // walked block by block (no division per key)
  for (int64_t p = 0, j = first / block_size, o0 = first % block_size; p < n; ++j, o0 = 0)
    for (int64_t o = o0, base = table[b * nblk + j] * block_size; o < block_size && p < n; ++o, ++p)
      s.slots[p] = base + o;
  const int64_t span = heads * d * static_cast<int64_t>(sizeof(T));  // bytes of the item's heads in a row
  auto prefetch = [&](const T* cache, int64_t p0, int64_t p1) {  // the item's part of keys [p0, p1)'s rows
    for (int64_t p = p0; p < std::min(p1, n); ++p) {
      const char* row = reinterpret_cast<const char*>(cache + (s.slots[p] * Hkv + kvh0) * d);
      for (int64_t o = 0; o < span; o += 64) _mm_prefetch(row + o, _MM_HINT_T0);
    }
  };
  prefetch(kc, 0, 16);  // then 16 keys ahead of the scores, KB ahead of the V sums
  for (int64_t p = 0; p < n; p += 8) {
    const int64_t cnt = std::min<int64_t>(8, n - p);
    prefetch(kc, p + 16, p + 24);
    for (int64_t kvh = kvh0; kvh < kvh1; ++kvh) {
      const float* qg = q + (b * H + kvh * group) * d;  // the group's query heads, one after another
      float* sh = s.scores.data() + (kvh - kvh0) * hs + p;
      if (avx512_on()) {
        scores512<NV / 2, T>(qg, kc, s.slots.data() + p, cnt, Hkv, kvh, scale, sh, np, group);
        continue;
      }
      for (int64_t g = 0; g < group; ++g) {
        const float* qh = qg + g * d;
        __m256 acc[8];
        for (int j = 0; j < 8; ++j) {
          __m256 a = _mm256_setzero_ps();
          if (j < cnt) {
            const T* k = kc + (s.slots[p + j] * Hkv + kvh) * d;
            for (int64_t i = 0; i < NV; ++i) a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * i), load8(k + 8 * i), a);
          }
          acc[j] = a;
        }
        _mm256_storeu_ps(sh + g * np, _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale)));
      }
    }
  }
  s.inv.resize(heads * group);
  for (int64_t g = 0; g < heads * group; ++g) {
    float* sg = s.scores.data() + g * np;
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
    s.inv[g] = 1.0f / hsum(vsum);
  }
  prefetch(vc, 0, KB);
  for (int64_t p0 = 0; p0 < n; p0 += KB) {
    const int64_t p1 = std::min(n, p0 + KB);
    prefetch(vc, p0 + KB, p0 + 2 * KB);
    for (int64_t kvh = kvh0; kvh < kvh1; ++kvh) {
      const float* sh = s.scores.data() + (kvh - kvh0) * hs;
      float* ph = s.partial.data() + (kvh - kvh0) * group * d;
      if (avx512_on()) {
        values512<NV / 2, T>(sh + p0, np, vc, s.slots.data() + p0, p1 - p0, Hkv, kvh, ph, group);
        continue;
      }
      for (int64_t g = 0; g < group; ++g) {
        const float* sg = sh + g * np;
        float* part = ph + g * d;
        __m256 acc[NV];
        for (int64_t i = 0; i < NV; ++i) acc[i] = _mm256_loadu_ps(part + 8 * i);
        for (int64_t p = p0; p < p1; ++p) {
          const T* v = vc + (s.slots[p] * Hkv + kvh) * d;
          const __m256 wgt = _mm256_set1_ps(sg[p]);
          for (int64_t i = 0; i < NV; ++i) acc[i] = _mm256_fmadd_ps(wgt, load8(v + 8 * i), acc[i]);
        }
        for (int64_t i = 0; i < NV; ++i) _mm256_storeu_ps(part + 8 * i, acc[i]);
      }
    }
  }
  for (int64_t g = 0; g < heads * group; ++g) {
    float* o = out + (b * H + kvh0 * group + g) * d;
    const __m256 vinv = _mm256_set1_ps(s.inv[g]);
    for (int64_t i = 0; i < NV; ++i)
      _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(_mm256_loadu_ps(s.partial.data() + g * d + 8 * i), vinv));
  }
}

// The paged KV cache as decode attention reads it: K and V rows [S, Hkv, d] (one layer's), and each
// query row's block ids, table: [B, nblk].
template <typename T>
struct PagedKV {
  const T* k;
  const T* v;
  const int64_t* table;
  int64_t nblk, block_size, Hkv;
};

template <typename T>
inline PagedKV<T> paged_kv(const T* k, const T* v, const int64_t* table, int64_t nblk, int64_t block_size,
                           int64_t Hkv) {
  return {k, v, table, nblk, block_size, Hkv};
}

// The decode queries and where their answers go: q, out: [B, H, d]; scale: the softmax's.
struct DecodeHeads {
  const float* q;
  float* out;
  int64_t H, d;
  float scale;
};

// Decode attention's work items: row b's KV heads split into `split` ranges (item i: row i / split, range
// i % split), enough items for every thread to have a few when few rows decode, whole rows otherwise.
struct HeadItems {
  int64_t rows, Hkv, split;
  HeadItems(int64_t B, int64_t hkv, int64_t threads)
      : rows(B), Hkv(hkv), split(std::clamp<int64_t>((2 * threads + B - 1) / B, 1, hkv)) {}
  int64_t count() const { return rows * split; }
  int64_t row(int64_t i) const { return i / split; }
  int64_t first(int64_t i) const { return i % split * Hkv / split; }
  int64_t last(int64_t i) const { return (i % split + 1) * Hkv / split; }
};

// attend_item with the head size as a run-time value (32, 64, 96 or 128; false for any other), for query
// row b's KV heads [kvh0, kvh1) over the last `window` of the n keys it sees (window 0: all of them).
template <typename T>
inline bool attend(const DecodeHeads& h, const PagedKV<T>& kv, int64_t b, int64_t kvh0, int64_t kvh1, int64_t n,
                   int64_t window, AttentionScratch& s) {
  const int64_t f = window > 0 && n > window ? n - window : 0;
  auto item = [&](auto nv) {
    attend_item<decltype(nv)::value>(h.q, kv.k, kv.v, kv.table, kv.nblk, kv.block_size, h.H, kv.Hkv, b, kvh0, kvh1,
                                     f, n, h.scale, h.out, s);
    return true;
  };
  switch (h.d) {
    case 64: return item(std::integral_constant<int64_t, 8>{});
    case 128: return item(std::integral_constant<int64_t, 16>{});
    case 32: return item(std::integral_constant<int64_t, 4>{});
    case 96: return item(std::integral_constant<int64_t, 12>{});
    default: return false;
  }
}

}  // namespace kvyard
