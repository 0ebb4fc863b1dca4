// The tensor-level entry points of flash_bf16.h (bound in cpu_kernels.cpp): they check the operands and hand the
// kernel each operand's rows, strided or in the paged cache, in the dtype they are stored in.
#pragma once
#include <ATen/native/CPUBlas.h>
#include <torch/extension.h>

#include <cstdint>

#include "flash_bf16.h"
#include "simd.h"

namespace kvyard {

inline void check_flash(const at::Tensor& q) {
  TORCH_CHECK(cpu_has_avx512() && __builtin_cpu_supports("avx512bf16") && at::native::cpublas::could_pack(at::kBFloat16),
              "flash attention needs AVX-512 (BF16) and AMX-BF16 (torch's brgemm)");
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be a CPU tensor [rows, heads, d], each row's heads contiguous");
  TORCH_CHECK(q.size(2) % 32 == 0 && q.size(2) <= 512, "the head size must be a multiple of 32, at most 512");
}

// q [Q, H, d], k and v [N, Hkv, d] bfloat16 (d contiguous, heads d apart, rows at any stride) → attention,
// [Q, H, d] bfloat16 (flash_bf16.h). causal: query i at position start + i sees keys 0..start + i, N = start + Q.
inline at::Tensor flash_attention_bf16_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t start,
                                   bool causal, double scale, int64_t q_block, int64_t k_block) {
  check_flash(q);
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16 && t->dim() == 3 && t->stride(2) == 1 &&
                t->stride(1) == t->size(2), "q, k and v must be bfloat16 CPU tensors [rows, heads, d], each row's "
                "heads contiguous");
  const int64_t Q = q.size(0), H = q.size(1), d = q.size(2), N = k.size(0), Hkv = k.size(1);
  TORCH_CHECK(k.size(2) == d && v.size(2) == d && v.size(0) == N && v.size(1) == Hkv,
              "k and v must both be [N, Hkv, d], d as q's");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "the query heads must be a multiple of the KV heads");
  TORCH_CHECK(Q > 0 && N > 0 && start >= 0 && (!causal || N == start + Q), "causal: N must be start + Q");
  TORCH_CHECK(q_block > 0 && k_block > 0 && k_block % 32 == 0, "q_block > 0, k_block a positive multiple of 32");
  at::Tensor out = at::empty({Q, H, d}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const auto *kp = k.data_ptr<at::BFloat16>(), *vp = v.data_ptr<at::BFloat16>();
  const int64_t ldk = k.stride(0), ldv = v.stride(0);
  flash_attention(q.data_ptr<at::BFloat16>(), q.stride(0), [&](int64_t j, int64_t g) { return kp + j * ldk + g * d; },
                  [&](int64_t j, int64_t g) { return vp + j * ldv + g * d; }, out.data_ptr<at::BFloat16>(), H * d, Q,
                  N, H, Hkv, d, start, causal, static_cast<float>(scale), q_block, k_block);
  return out;
}

// A prefill chunk's causal attention straight from the paged cache: q [Q, H, d] float32 or bfloat16 (rows at any
// stride), caches [S, Hkv, d] float16, bfloat16 or float32, blocks holding keys 0..start + Q - 1 → [Q, H, d] in q's dtype,
// or into out (q's dtype and shape, rows at any stride). Every operand is rounded to bfloat16 as it is read.
inline at::Tensor flash_attention_paged(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& blocks_in, int64_t block_size, int64_t start, double scale,
                                 const c10::optional<at::Tensor>& out_in) {
  check_flash(q);
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "q must be float32 or bfloat16");
  TORCH_CHECK(k_cache.device().is_cpu() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.scalar_type() == v_cache.scalar_type() && k_cache.sizes() == v_cache.sizes() &&
              (k_cache.scalar_type() == at::kHalf || k_cache.scalar_type() == at::kBFloat16 ||
               k_cache.scalar_type() == at::kFloat) && k_cache.dim() == 3,
              "the KV caches must be contiguous float16, bfloat16 or float32 CPU tensors [slots, Hkv, d]");
  const int64_t Q = q.size(0), H = q.size(1), d = q.size(2), Hkv = k_cache.size(1), S = k_cache.size(0);
  TORCH_CHECK(k_cache.size(2) == d && Hkv > 0 && H % Hkv == 0, "q and the cache disagree on heads");
  const int64_t N = start + Q;
  TORCH_CHECK(Q > 0 && start >= 0 && block_size > 0, "bad flash attention arguments");
  const at::Tensor blocks = blocks_in.to(at::kLong).contiguous();
  TORCH_CHECK(blocks.numel() * block_size >= N, "fewer blocks than keys");
  const int64_t* bp = blocks.data_ptr<int64_t>();
  for (int64_t b = 0; b < (N + block_size - 1) / block_size; ++b)
    TORCH_CHECK(bp[b] >= 0 && (bp[b] + 1) * block_size <= S, "block out of range");
  at::Tensor out = out_in ? *out_in : at::empty({Q, H, d}, q.options().memory_format(at::MemoryFormat::Contiguous));
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && out.dim() == 3 && out.size(0) == Q && out.size(1) == H &&
              out.size(2) == d && out.stride(2) == 1 && out.stride(1) == d, "out must be q's dtype and shape");
  const int64_t row = Hkv * d;
  auto slot = [=](int64_t j) { return (bp[j / block_size] * block_size + j % block_size) * row; };
  auto run = [&](auto* qp, auto* op, auto* kc, auto* vc) {
    flash_attention(qp, q.stride(0), [&](int64_t j, int64_t g) { return kc + slot(j) + g * d; },
                    [&](int64_t j, int64_t g) { return vc + slot(j) + g * d; }, op, out.stride(0), Q, N, H, Hkv, d,
                    start, true, static_cast<float>(scale));
  };
  auto with_q = [&](auto* kc, auto* vc) {
    if (q.scalar_type() == at::kFloat)
      run(q.data_ptr<float>(), out.data_ptr<float>(), kc, vc);
    else
      run(q.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), kc, vc);
  };
  if (k_cache.scalar_type() == at::kHalf)
    with_q(k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>());
  else if (k_cache.scalar_type() == at::kFloat)
    with_q(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  else
    with_q(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>());
  return out;
}

}  // namespace kvyard
