// The tensor-level entry points of gemm_bf16.h (bound in cpu_kernels.cpp): they check the operands, split
// the output columns into panels over at::parallel_for and release brgemm's tile state after each thread's
// last call.
#pragma once
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <memory>

#include "gemm_bf16.h"
#include "tensors.h"

namespace kvyard {

// A thread's working buffers, every element written before it is read: no zero fill (a std::vector would zero
// 4 MB per thread and call for an 8192-deep panel).
template <typename T>
std::unique_ptr<T[]> scratch(int64_t n) {
  return std::unique_ptr<T[]>(new T[n]);
}

// Panels of at most `most` groups of 16 columns, as many as a multiple of the threads (36 groups, 2 threads,
// at most 16: 4 panels of 9) → groups per panel.
inline int64_t panel_size(int64_t groups, int64_t most) {
  const int64_t threads = at::get_num_threads();
  const int64_t panels = (groups + most * threads - 1) / (most * threads) * threads;
  return (groups + panels - 1) / panels;
}

inline QMatrix gemm_operands(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                             const at::Tensor& mins, bool q4, int64_t rows, int64_t depth) {
  const QMatrix w = as_matrix(qs, d, mins, q4);
  TORCH_CHECK(w.n16, "an n16 matrix");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.dim() == 2 &&
              x.size(1) == w.K, "x must be a contiguous bfloat16 [M, K]");
  TORCH_CHECK(rows > 0 && depth > 0 && depth % QK == 0, "rows > 0, depth a positive multiple of 32");
  return w;
}

// x [M, K] bfloat16 @ W^T for an n16 matrix (any kind) on brgemm's bfloat16 tiles (+ bias) (+ residual) →
// [M, N] float32, or into out (a float32 [M, N] view whose rows may be strided: one part of a stacked
// matrix's output). gemm_bf16.h; prefill chunks where the CPU has AMX-BF16, backend/ops.py.
inline at::Tensor n16_gemm_bf16(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                                const at::Tensor& mins, bool q4, int64_t rows, int64_t depth,
                                const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                                const c10::optional<at::Tensor>& out, int64_t panel_groups) {
  const QMatrix w = gemm_operands(x, qs, d, mins, q4, rows, depth);
  TORCH_CHECK(panel_groups > 0, "panel_groups > 0");
  const int64_t M = x.size(0), groups = w.N / G16, per = panel_size(groups, panel_groups);
  at::Tensor y = out ? *out : at::empty({M, w.N}, x.options().dtype(at::kFloat));
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.dim() == 2 && y.size(0) == M && y.size(1) == w.N && y.stride(1) == 1,
              "out must be a float32 [M, N] with unit column stride");
  Epilogue e;
  if (bias) {
    check_cpu_f32(*bias, "bias");
    TORCH_CHECK(bias->numel() == w.N, "bias must have N values");
    e.bias = bias->data_ptr<float>();
  }
  if (residual) {
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->dim() == 2 && residual->size(0) == M &&
                residual->size(1) == w.N && residual->stride(1) == 1, "residual must be a float32 [M, N]");
    e.residual = residual->data_ptr<float>();
    e.ld_res = residual->stride(0);
  }
  const auto* xp = x.data_ptr<at::BFloat16>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (groups + per - 1) / per, 1, [&](int64_t p0, int64_t p1) {
    const auto f32 = scratch<float>(CHUNK_BLOCKS * QK * G16 * per);
    const auto packed = scratch<uint16_t>(w.K * G16 * per);
    for (int64_t p = p0; p < p1; ++p)
      gemm_bf16_groups(w, xp, M, p * per, std::min(groups, (p + 1) * per), yp, y.stride(0), e, f32.get(),
                       packed.get(), rows, depth);
    at::native::cpublas::brgemm_release();
  });
  return y;
}

// silu(x @ gate^T) * (x @ up^T) for a gate_up n16 matrix (gate's F rows, then up's; F a multiple of 16) on
// brgemm's bfloat16 tiles → [M, F] float32: linear + silu_mul without the [M, 2F] product in memory.
inline at::Tensor n16_gemm_bf16_silu(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                                     const at::Tensor& mins, bool q4, int64_t rows, int64_t depth,
                                     int64_t panel_groups) {
  const QMatrix w = gemm_operands(x, qs, d, mins, q4, rows, depth);
  TORCH_CHECK(w.N % (2 * G16) == 0, "gate_up's halves must be whole groups of 16 rows");
  TORCH_CHECK(panel_groups > 0, "panel_groups > 0");
  const int64_t M = x.size(0), F = w.N / 2, groups = F / G16, per = panel_size(groups, panel_groups);
  at::Tensor y = at::empty({M, F}, x.options().dtype(at::kFloat));
  const auto* xp = x.data_ptr<at::BFloat16>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (groups + per - 1) / per, 1, [&](int64_t p0, int64_t p1) {
    const auto f32 = scratch<float>(CHUNK_BLOCKS * QK * G16 * per), c = scratch<float>(rows * 2 * G16 * per);
    const auto packed = scratch<uint16_t>(2 * w.K * G16 * per);
    for (int64_t p = p0; p < p1; ++p)
      gemm_bf16_silu_groups(w, xp, M, p * per, std::min(groups, (p + 1) * per), yp, f32.get(), packed.get(),
                            c.get(), rows, depth);
    at::native::cpublas::brgemm_release();
  });
  return y;
}

}  // namespace kvyard
