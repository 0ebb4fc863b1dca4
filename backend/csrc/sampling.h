// The common case of backend/sampler.py in one pass over each row's logits: greedy (argmax) or a draw
// from softmax(logits / T) by inverse CDF (the first token whose cumulative mass exceeds u × total), with
// no top-k/top-p/min-p filter. Sums run in double, so the tail of a 50k-token vocabulary keeps its mass.
// And a grammar's token bitmask applied to a row (mask_row): what PyTorch does in ~10 ops per row, one pass.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace kvyard {

// Index of the largest value (the first one on ties, as torch.argmax); -1 when the row holds a NaN.
inline int64_t argmax_row(const float* x, int64_t V) {
  __m256 vmax = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    vmax = _mm256_max_ps(vmax, v);
  }
  if (_mm256_movemask_ps(nan)) return -1;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float best = lanes[0];
  for (int j = 1; j < 8; ++j) best = std::max(best, lanes[j]);
  for (; i < V; ++i) {
    if (std::isnan(x[i])) return -1;
    best = std::max(best, x[i]);
  }
  for (i = 0; i < V; ++i)
    if (x[i] == best) return i;
  return -1;
}

// One row: t > 0 the temperature, u in [0, 1) this row's uniform draw; e: V floats of scratch.
// -1 when the row cannot be sampled (a NaN, or an infinite largest logit).
inline int64_t draw_row(const float* x, int64_t V, float t, float u, float* e) {
  const int64_t top = argmax_row(x, V);
  if (top < 0 || !std::isfinite(x[top])) return -1;
  const __m256 vmax = _mm256_set1_ps(x[top]), inv_t = _mm256_set1_ps(1.0f / t);
  constexpr int64_t CHUNK = 64;  // float partial sums per chunk, chunk sums in double
  std::vector<double> chunk_sum((V + CHUNK - 1) / CHUNK);
  double total = 0.0;
  for (int64_t c = 0; c < V; c += CHUNK) {
    double s = 0.0;
    int64_t i = c;
    const int64_t end = std::min(V, c + CHUNK);
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= end; i += 8) {
      const __m256 p = exp_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmax), inv_t));
      _mm256_storeu_ps(e + i, p);
      acc = _mm256_add_ps(acc, p);
    }
    s = hsum(acc);
    for (; i < end; ++i) {
      e[i] = std::exp((x[i] - x[top]) / t);
      s += e[i];
    }
    chunk_sum[c / CHUNK] = s;
    total += s;
  }
  const double target = static_cast<double>(u) * total;
  double run = 0.0;
  for (int64_t c = 0; c < V; c += CHUNK) {
    const double s = chunk_sum[c / CHUNK];
    if (run + s <= target) {
      run += s;
      continue;
    }
    for (int64_t i = c; i < std::min(V, c + CHUNK); ++i) {
      run += e[i];
      if (run > target) return i;
    }
  }
  return top;  // u × total rounded past the last token's mass: the mode, never an out-of-range id
}

// Sets x[i] = -inf for every token i whose bit is clear in `mask` (bit i % 32 of 32-bit word i / 32, as
// llguidance writes it; on a little-endian CPU that is bit i % 8 of byte i / 8). Tokens past the mask's
// 32 × W bits are masked too.
inline void mask_row(float* x, int64_t V, const int32_t* mask, int64_t W) {
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(mask);
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  const int64_t covered = std::min(V, W * 32);
  int64_t i = 0;
  for (; i + 8 <= covered; i += 8) {
    const uint8_t b = bytes[i / 8];
    if (b == 0xFF) continue;  // all eight allowed: leave them
    const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(b), bit), bit);
    _mm256_storeu_ps(x + i, _mm256_blendv_ps(ninf, _mm256_loadu_ps(x + i), _mm256_castsi256_ps(on)));
  }
  for (; i < covered; ++i)
    if (!((bytes[i / 8] >> (i % 8)) & 1)) x[i] = -INFINITY;
  for (; i < V; ++i) x[i] = -INFINITY;
}

}  // namespace kvyard
