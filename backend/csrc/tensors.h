// Torch tensors as the kernels see them: checks and raw views (weights, caches, activations).
#pragma once
#include <torch/extension.h>

#include "qlinear.h"
#include "simd.h"

namespace kvyard {

inline void check_cpu_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
              name, " must be a contiguous float32 CPU tensor");
}

inline void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.device().is_cpu() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.scalar_type() == v_cache.scalar_type() &&
              (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kHalf),
              "KV caches must be contiguous float32 or float16 CPU tensors");
}

// A cache tensor's rows as floats or float16 bits, for the templated kernels.
template <typename F>
inline void with_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, F&& f) {
  if (k_cache.scalar_type() == at::kHalf)
    f(reinterpret_cast<half_t*>(k_cache.data_ptr<at::Half>()), reinterpret_cast<half_t*>(v_cache.data_ptr<at::Half>()));
  else
    f(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
}

// A weight's tensors as the kernels see them. Rows layout: qs [N, K/2 or K], d and mins [N, K/32].
// n16 layout (qlinear_vnni.h): qs [G, K/32, 16, 16] (Q4_1) or [G, K/32, 16, 16, 2] (Q8_0), d and mins
// [G, K/32, 16] (int16 activations: AVX-512 or AVX2). The K-quants (qlinear_kquant.h, n16 only) are told
// apart by their sub-scales in mins' place: uint8 [G, K/32, 2, 16] for Q4_K and Q5_K (code rows 16 and 20 a
// block; Q5_K8: 32), int8 for Q6_K and Q6_K8 (code rows 24 and 32) (q4 false).
inline QMatrix as_matrix(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& mins, bool q4) {
  TORCH_CHECK(d.device().is_cpu() && d.scalar_type() == at::kHalf && d.is_contiguous() && qs.is_contiguous(),
              "weights must be contiguous CPU tensors with float16 scales");
  QMatrix w;
  const bool kquant = mins.defined() && (mins.scalar_type() == at::kByte || mins.scalar_type() == at::kChar);
  const int64_t code_rows = qs.dim() == 4 ? qs.size(2) : 0;
  w.kind = kquant ? (mins.scalar_type() == at::kChar ? (code_rows == 32 ? BlockKind::Q6_K8 : BlockKind::Q6_K)
                     : code_rows == 20 ? BlockKind::Q5_K : code_rows == 32 ? BlockKind::Q5_K8 : BlockKind::Q4_K)
                  : (q4 ? BlockKind::Q4_1 : BlockKind::Q8_0);
  w.q4 = w.kind == BlockKind::Q4_1;
  w.n16 = qs.dim() > 2;
  if (kquant) {
    TORCH_CHECK(w.n16, "K-quant blocks are served in the n16 layout");
    const bool q4k = !is_q6(w.kind);  // Q4_K or Q5_K: d and dmin
    TORCH_CHECK(qs.dim() == 4 && code_rows == k_code_bytes(w.kind) / 16 && qs.size(3) == G16 && qs.size(1) % SUPER == 0 &&
                mins.is_contiguous() && mins.dim() == 4 && mins.size(0) == qs.size(0) && mins.size(1) == qs.size(1) &&
                mins.size(2) == 2 && mins.size(3) == G16 && d.size(0) == qs.size(0) && d.size(1) == qs.size(1) / SUPER &&
                d.dim() == (q4k ? 4 : 3) && d.size(-1) == G16 && (!q4k || d.size(2) == 2), "bad K-quant weight shapes");
    w.N = qs.size(0) * G16;
    w.K = qs.size(1) * QK;
    w.sub = static_cast<const uint8_t*>(mins.data_ptr());
  } else if (w.n16) {
    TORCH_CHECK(d.dim() == 3 && d.size(2) == G16 && qs.size(0) == d.size(0) && qs.size(1) == d.size(1) &&
                qs.size(2) == 16 && qs.size(3) == G16 && qs.dim() == (q4 ? 4 : 5), "bad n16 weight shapes");
    w.N = d.size(0) * G16;
    w.K = d.size(1) * QK;
  } else {
    TORCH_CHECK(d.dim() == 2, "d must be [N, K/32]");
    w.N = d.size(0);
    w.K = d.size(1) * QK;
    TORCH_CHECK(qs.dim() == 2 && qs.size(0) == w.N && qs.size(1) == w.row_bytes(), "bad codes shape");
  }
  TORCH_CHECK(w.K <= MAX_K, "rows of more than ", MAX_K, " weights are not supported");
  if (w.q4) {
    TORCH_CHECK(mins.scalar_type() == at::kHalf && mins.is_contiguous() && mins.sizes() == d.sizes(),
                "mins must be float16 and match d");
  }
  w.qs = static_cast<const uint8_t*>(qs.data_ptr());
  w.d = reinterpret_cast<const half_t*>(d.data_ptr<at::Half>());
  w.m = w.q4 ? reinterpret_cast<const half_t*>(mins.data_ptr<at::Half>()) : nullptr;
  return w;
}

}  // namespace kvyard
