// A fused matrix (q/k/v, gate/up) whose parts are kept in different block kinds (backend/quant.py's
// StackedWeight: a Q4_K_M file's Q6_K v beside a Q4_K q and k): up to MAX_PARTS QMatrix parts stacked
// along the output rows, each computed by its own kind's kernel into its own columns of one output.
// Each part gets its own prepared input (Q6_K pairs its int16 activations differently from the other
// n16 kinds), so every output has the bits it would have were its part the whole matrix: the op-by-op
// path (one kernel call per part) and the fused decode step agree bit for bit.
#pragma once
#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "qlinear.h"

namespace kvyard {

constexpr int MAX_PARTS = 4;

struct StackedMatrix {
  QMatrix part[MAX_PARTS];
  int64_t row0[MAX_PARTS] = {};  // part p holds output rows [row0[p], row0[p] + part[p].N)
  int parts = 0;
  int64_t N = 0, K = 0;
};

inline StackedMatrix stack_parts(const std::vector<QMatrix>& parts) {
  TORCH_CHECK(!parts.empty() && static_cast<int>(parts.size()) <= MAX_PARTS, "a stacked matrix has 1 to ",
              MAX_PARTS, " parts");
  StackedMatrix s;
  s.K = parts[0].K;
  for (const QMatrix& p : parts) {
    TORCH_CHECK(p.K == s.K, "stacked parts must have the same width");
    s.part[s.parts] = p;
    s.row0[s.parts++] = s.N;
    s.N += p.N;
  }
  return s;
}

// The prepared inputs, one per part (LinearInput of qlinear.h).
struct StackedInput {
  LinearInput part[MAX_PARTS];
};

inline int64_t input_scratch(const StackedMatrix& w, int64_t M) {
  int64_t total = 0;
  for (int p = 0; p < w.parts; ++p) total += input_scratch(w.part[p], M);
  return total;
}

// Rows [m0, m1) of every part's input, each part in its own span of scratch.
inline StackedInput prepare_input(const StackedMatrix& w, const float* x, int64_t M, int64_t m0, int64_t m1,
                                  float* scratch) {
  StackedInput in;
  for (int p = 0; p < w.parts; ++p) {
    in.part[p] = prepare_input(w.part[p], x, M, m0, m1, scratch);
    scratch += input_scratch(w.part[p], M);
  }
  return in;
}

// A single matrix seen as a stack of one, so the fused step's linear takes either.
inline int stack_size(const QMatrix&) { return 1; }
inline int stack_size(const StackedMatrix& w) { return w.parts; }
inline const QMatrix& stack_part(const QMatrix& w, int) { return w; }
inline const QMatrix& stack_part(const StackedMatrix& w, int p) { return w.part[p]; }
inline int64_t stack_row0(const QMatrix&, int) { return 0; }
inline int64_t stack_row0(const StackedMatrix& w, int p) { return w.row0[p]; }
inline const LinearInput& stack_input(const LinearInput& in, int) { return in; }
inline const LinearInput& stack_input(const StackedInput& in, int p) { return in.part[p]; }

}  // namespace kvyard
