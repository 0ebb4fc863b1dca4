// LoRA adapters inside the fused decode step (decode_step.h): each row that uses an adapter gets
// (x · Aᵀ) · Bᵀ added beside the base projection, with its own adapter's matrices only. Per row and
// projection: one dot product per rank column (t = A x, split over the team by (adapter, column)), then
// y += Bᵀ-rows weighted by t (split by (adapter, 16 outputs), or by the thread's own rows where the next op
// reads y by those rows, saving a barrier). A row's sums run in the same order whatever the
// batch or the thread count, so a row's answer does not depend on its neighbours (the mixed batch = alone
// test). Steps without adapter rows never reach this code, so base steps keep their bits.
#pragma once
#include <torch/extension.h>

#include <algorithm>
#include <vector>

#include "simd.h"

namespace kvyard {

// The fused step's projections, in the order backend/lora_weights.py names them.
enum LoraTarget { LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN, LORA_TARGETS };

// One adapter's matrices, per layer and projection (float32, contiguous): A [R, in] and B transposed
// [R, out], B already scaled; R = 0 where the adapter leaves that projection alone. Held, so the pointers
// stay valid while a step runs. Per 16 outputs, the rank columns whose B is not all zero there (an adapter
// of q only has a block-diagonal B over q/k/v: its k and v outputs need none).
class LoraWeights {
 public:
  static constexpr int64_t C = 16;  // outputs per expansion chunk

  // a, bt: layers × LORA_TARGETS tensors, layer-major (empty tensors where the adapter has none).
  LoraWeights(std::vector<at::Tensor> a, std::vector<at::Tensor> bt) : a_(std::move(a)), bt_(std::move(bt)) {
    TORCH_CHECK(a_.size() == bt_.size() && a_.size() % LORA_TARGETS == 0, "one A and one B per layer and projection");
    cols_.resize(a_.size());
    for (size_t i = 0; i < a_.size(); ++i) {
      if (a_[i].numel() == 0 && bt_[i].numel() == 0) continue;
      TORCH_CHECK(a_[i].dim() == 2 && bt_[i].dim() == 2 && a_[i].size(0) == bt_[i].size(0) &&
                  a_[i].scalar_type() == at::kFloat && bt_[i].scalar_type() == at::kFloat &&
                  a_[i].is_contiguous() && bt_[i].is_contiguous(),
                  "LoRA A [R, in] and B transposed [R, out]: contiguous float32 with one rank");
      const int64_t R = bt_[i].size(0), N = bt_[i].size(1);
      const float* bt = bt_[i].data_ptr<float>();
      for (int64_t n0 = 0; n0 < N; n0 += C) {
        int32_t lo = static_cast<int32_t>(R), hi = 0;
        for (int64_t j = 0; j < R; ++j)
          for (int64_t n = n0; n < std::min(n0 + C, N); ++n)
            if (bt[j * N + n] != 0.0f) {
              lo = std::min<int32_t>(lo, j);
              hi = static_cast<int32_t>(j + 1);
            }
        cols_[i].emplace_back(lo, std::max(lo, hi));
      }
    }
  }

  int64_t layers() const { return static_cast<int64_t>(a_.size()) / LORA_TARGETS; }
  int64_t rank(int64_t layer, int target) const { return a_[layer * LORA_TARGETS + target].size(0); }
  int64_t in(int64_t layer, int target) const { return a_[layer * LORA_TARGETS + target].size(1); }
  int64_t out(int64_t layer, int target) const { return bt_[layer * LORA_TARGETS + target].size(1); }
  bool has(int64_t layer, int target) const { return a_[layer * LORA_TARGETS + target].numel() > 0; }
  const float* a(int64_t layer, int target) const { return a_[layer * LORA_TARGETS + target].data_ptr<float>(); }
  const float* bt(int64_t layer, int target) const { return bt_[layer * LORA_TARGETS + target].data_ptr<float>(); }
  // The rank columns [first, second) that reach outputs [16 c, 16 c + 16).
  std::pair<int32_t, int32_t> cols(int64_t layer, int target, int64_t c) const {
    return cols_[layer * LORA_TARGETS + target][c];
  }

 private:
  std::vector<at::Tensor> a_, bt_;
  std::vector<std::vector<std::pair<int32_t, int32_t>>> cols_;
};

// A step's adapters, the rows of each, and the rank-column scratch.
struct StepLoras {
  std::vector<const LoraWeights*> adapters;
  std::vector<std::vector<int64_t>> rows;  // per adapter, the rows using it (ascending)
  std::vector<float> t;                    // [B, max rank]: each row's x · Aᵀ
  int64_t max_rank = 0;

  bool any() const { return !adapters.empty(); }
  int64_t rank(size_t k, int64_t layer, int target) const {
    return rows[k].empty() || !adapters[k]->has(layer, target) ? 0 : adapters[k]->rank(layer, target);
  }
};

constexpr int LORA_GROUP = 6;  // rows of one adapter computed together (their accumulators stay in registers)

// t[row, j] = A[j] · x[row] for G rows: one pass over A[j]; each row's sum in the same order whatever G.
template <int G>
inline void shrink_rows(const float* aj, const float* x, const int64_t* rows, int64_t K, float* t, int64_t ts,
                        int64_t j) {
  __m256 acc[G];
  for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= K; i += 8) {
    const __m256 a = _mm256_loadu_ps(aj + i);
    for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(a, _mm256_loadu_ps(x + rows[g] * K + i), acc[g]);
  }
  for (int g = 0; g < G; ++g) {
    float s = hsum(acc[g]);
    for (int64_t r = i; r < K; ++r) s += aj[r] * x[rows[g] * K + r];
    t[rows[g] * ts + j] = s;
  }
}

// y[row, n0 .. n0+16) += Σ_{j in [j0, j1)} t[row, j] · Bᵀ[j, n] for G rows: one pass over those Bᵀ rows.
template <int G>
inline void expand_rows(const float* bt, int64_t N, int64_t n0, int32_t j0, int32_t j1, const int64_t* rows,
                        const float* t, int64_t ts, float* y) {
  __m256 lo[G], hi[G];
  for (int g = 0; g < G; ++g) lo[g] = hi[g] = _mm256_setzero_ps();
  for (int32_t j = j0; j < j1; ++j) {
    const __m256 b0 = _mm256_loadu_ps(bt + j * N + n0), b1 = _mm256_loadu_ps(bt + j * N + n0 + 8);
    for (int g = 0; g < G; ++g) {
      const __m256 tj = _mm256_set1_ps(t[rows[g] * ts + j]);
      lo[g] = _mm256_fmadd_ps(tj, b0, lo[g]);
      hi[g] = _mm256_fmadd_ps(tj, b1, hi[g]);
    }
  }
  for (int g = 0; g < G; ++g) {
    float* yr = y + rows[g] * N + n0;
    _mm256_storeu_ps(yr, _mm256_add_ps(_mm256_loadu_ps(yr), lo[g]));
    _mm256_storeu_ps(yr + 8, _mm256_add_ps(_mm256_loadu_ps(yr + 8), hi[g]));
  }
}

// Calls f.template operator()<G>(rows, G) over `rows` in groups of at most LORA_GROUP.
template <typename F>
inline void in_groups(const std::vector<int64_t>& rows, F&& f) {
  for (size_t g0 = 0; g0 < rows.size(); g0 += LORA_GROUP) {
    const int64_t* r = rows.data() + g0;
    switch (std::min<size_t>(LORA_GROUP, rows.size() - g0)) {
      case 1: f.template operator()<1>(r); break;
      case 2: f.template operator()<2>(r); break;
      case 3: f.template operator()<3>(r); break;
      case 4: f.template operator()<4>(r); break;
      case 5: f.template operator()<5>(r); break;
      default: f.template operator()<6>(r); break;
    }
  }
}

// This thread's share of t[b, j] = x[b] · A[j] for every row with an adapter on (layer, target), split by
// (adapter, rank column). x: [B, K] with K the projection's input width.
inline void lora_shrink(StepLoras& s, const float* x, int64_t K, int64_t layer, int target, int tid, int nt) {
  int64_t total = 0;
  for (size_t k = 0; k < s.adapters.size(); ++k) total += s.rank(k, layer, target);
  int64_t i0, i1;
  split_range(total, tid, nt, i0, i1);
  int64_t first = 0;  // the flat index of adapter k's first column
  for (size_t k = 0; k < s.adapters.size() && first < i1; ++k) {
    const int64_t r = s.rank(k, layer, target);
    const int64_t j0 = std::max<int64_t>(i0 - first, 0), j1 = std::min<int64_t>(i1 - first, r);
    const float* a = r ? s.adapters[k]->a(layer, target) : nullptr;
    for (int64_t j = j0; j < j1; ++j)
      in_groups(s.rows[k], [&]<int G>(const int64_t* rows) {
        shrink_rows<G>(a + j * K, x, rows, K, s.t.data(), s.max_rank, j);
      });
    first += r;
  }
}

// This thread's share of y[b, n] += Σ_j t[b, j] · Bᵀ[j, n], split by (adapter, 16 outputs).
// y: [B, N] with N the projection's output width.
inline void lora_expand(const StepLoras& s, float* y, int64_t N, int64_t layer, int target, int tid, int nt) {
  constexpr int64_t C = LoraWeights::C;
  const int64_t chunks = (N + C - 1) / C;
  int64_t i0, i1;
  split_range(static_cast<int64_t>(s.adapters.size()) * chunks, tid, nt, i0, i1);
  for (int64_t i = i0; i < i1; ++i) {
    const size_t k = i / chunks;
    const int64_t c = i % chunks, n0 = c * C;
    if (s.rank(k, layer, target) == 0) continue;
    const LoraWeights& w = *s.adapters[k];
    const auto [j0, j1] = w.cols(layer, target, c);
    if (j0 >= j1) continue;
    const float* bt = w.bt(layer, target);
    if (n0 + C <= N) {
      in_groups(s.rows[k], [&]<int G>(const int64_t* rows) {
        expand_rows<G>(bt, N, n0, j0, j1, rows, s.t.data(), s.max_rank, y);
      });
      continue;
    }
    for (int64_t b : s.rows[k])
      for (int64_t n = n0; n < N; ++n) {
        float acc = 0.0f;
        for (int32_t j = j0; j < j1; ++j) acc += s.t[b * s.max_rank + j] * bt[j * N + n];
        y[b * N + n] += acc;
      }
  }
}

// This thread's rows [b0, b1) of y[b, n] += Σ_j t[b, j] · Bᵀ[j, n], every output: when the next op reads
// y by the same rows (RoPE, the norms), no barrier is needed between them.
inline void lora_expand_rows(const StepLoras& s, float* y, int64_t N, int64_t layer, int target, int64_t b0,
                             int64_t b1) {
  constexpr int64_t C = LoraWeights::C;
  std::vector<int64_t> mine;
  for (size_t k = 0; k < s.adapters.size(); ++k) {
    if (s.rank(k, layer, target) == 0) continue;
    mine.clear();
    for (int64_t b : s.rows[k])
      if (b0 <= b && b < b1) mine.push_back(b);
    if (mine.empty()) continue;
    const LoraWeights& w = *s.adapters[k];
    const float* bt = w.bt(layer, target);
    for (int64_t n0 = 0; n0 < N; n0 += C) {
      const auto [j0, j1] = w.cols(layer, target, n0 / C);
      if (j0 >= j1) continue;
      if (n0 + C <= N) {
        in_groups(mine, [&]<int G>(const int64_t* rows) {
          expand_rows<G>(bt, N, n0, j0, j1, rows, s.t.data(), s.max_rank, y);
        });
        continue;
      }
      for (int64_t b : mine)
        for (int64_t n = n0; n < N; ++n) {
          float acc = 0.0f;
          for (int32_t j = j0; j < j1; ++j) acc += s.t[b * s.max_rank + j] * bt[j * N + n];
          y[b * N + n] += acc;
        }
    }
  }
}

}  // namespace kvyard
