// kvyard's CPU kernels (AVX2 + FMA + F16C) bound for Python: the decode-time hot path of backend/model.py.
// The arithmetic lives in the headers beside this file, by stage (qlinear.h: linears over the GGUF's
// blocks; layer_ops.h: norms, SiLU, RoPE + KV store, attention; decode_step.h: a whole decode step in
// one call; sampling.h: greedy and temperature draws, grammar masks). This file checks the tensors, spreads the work over at::parallel_for and binds the ops.
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bf16_rows.h"
#include "decode_step.h"
#include "dequant_n16.h"
#include "encoder_attention.h"
#include "encoder_norm.h"
#include "flash_bf16_ops.h"
#include "gemm_bf16_ops.h"
#include "isa_switches.h"
#include "layer_ops.h"
#include "prefill_attention.h"
#include "qlinear.h"
#include "sampling.h"
#include "tensors.h"

namespace {

using namespace kvyard;

// x: [M, K] float32 → x @ W^T (+ bias) (+ residual): [M, N] float32.
at::Tensor qlinear(const at::Tensor& x_in, const QMatrix& w, const c10::optional<at::Tensor>& bias,
                   const c10::optional<at::Tensor>& residual) {
  const at::Tensor x = x_in.contiguous();
  check_cpu_f32(x, "x");
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  const int64_t M = x.size(0);
  TORCH_CHECK(x.size(1) == w.K, "x has ", x.size(1), " columns, the weight ", w.K);
  at::Tensor y = at::empty({M, w.N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::vector<float> scratch(input_scratch(w, M));
  LinearInput in = prepare_input(w, xp, M, 0, 0, scratch.data());  // the pointers; rows filled below
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) { prepare_input(w, xp, M, m0, m1, scratch.data()); });
  at::parallel_for(0, linear_items(M, w), 1, [&](int64_t i0, int64_t i1) {
    thread_local std::vector<float> wbuf;
    if (!w.n16 && M > DECODE_ONCE_ROWS) wbuf.resize(NT * w.K);
    for (int64_t item = i0; item < i1; ++item) run_linear_item(item, in, w, yp, w.N, wbuf.data());
  });
  if (bias && bias->defined()) y.add_(*bias);
  if (residual && residual->defined()) y.add_(*residual);
  return y;
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& mins,
                       const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual) {
  return qlinear(x, as_matrix(qs, d, mins, true), bias, residual);
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                       const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual) {
  return qlinear(x, as_matrix(qs, d, at::Tensor(), false), bias, residual);
}

// Q4_K / Q6_K blocks in the n16 layout (qlinear_kquant.h): sub is the sub-scales, uint8 (Q4_K) or int8 (Q6_K).
at::Tensor kquant_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& sub,
                         const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(sub.scalar_type() == at::kByte || sub.scalar_type() == at::kChar, "sub must be uint8 or int8");
  return qlinear(x, as_matrix(qs, d, sub, false), bias, residual);
}

// Rows `ids` of a quantized matrix, dequantized: the embedding lookup. → [T, K] float32.
at::Tensor dequant_rows(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& mins,
                        const at::Tensor& ids_in, bool q4) {
  const QMatrix w = as_matrix(qs, d, mins, q4);
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t T = ids.size(0);
  at::Tensor out = at::empty({T, w.K}, d.options().dtype(at::kFloat));
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < w.N, "row id out of range");
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) decode_row(w, ip[t], op + t * w.K);
  });
  return out;
}

// The whole matrix, dequantized into out: [N, K] float32 (prefill-sized batches use the BLAS GEMM on it).
void dequantize_into(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& mins, at::Tensor out, bool q4) {
  const QMatrix w = as_matrix(qs, d, mins, q4);
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat && out.size(0) == w.N && out.size(1) == w.K,
              "out must be a contiguous float32 [N, K]");
  float* op = out.data_ptr<float>();
  at::parallel_for(0, w.N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) decode_row(w, n, op + n * w.K);
  });
}

// Output rows [16 g0, 16 g1) of an n16 matrix (any kind), dequantized and transposed into out: [K, 16 (g1 - g0)]
// float32 (prefill-sized batches hand it to the GEMM, backend/ops.py).
void dequantize_n16_t(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& mins, at::Tensor out,
                      int64_t g0, int64_t g1, bool q4) {
  const QMatrix w = as_matrix(qs, d, mins, q4);
  TORCH_CHECK(w.n16, "an n16 matrix");
  TORCH_CHECK(0 <= g0 && g0 < g1 && g1 * G16 <= w.N, "groups out of range");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == w.K &&
              out.size(1) == (g1 - g0) * G16, "out must be a contiguous float32 [K, 16 groups]");
  float* op = out.data_ptr<float>();
  const int64_t ldo = out.size(1);
  at::parallel_for(g0, g1, 1, [&](int64_t a, int64_t b) { dequantize_groups_t(w, a, b, op + (a - g0) * G16, ldo); });
}

// x: [T, D] → x * rsqrt(mean(x²) + eps) * w, float32 throughout (as the reference does for float32).
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w, double eps) {
  const at::Tensor x = x_in.contiguous();
  check_cpu_f32(x, "x");
  check_cpu_f32(w, "w");
  const int64_t T = x.size(0), D = x.size(1);
  TORCH_CHECK(w.numel() == D, "w must have ", D, " values");
  at::Tensor y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) rms_norm_row(xp + t * D, wp, D, static_cast<float>(eps), yp + t * D);
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
    for (int64_t t = t0; t < t1; ++t) silu_mul_cols(gp + t * 2 * F, F, 0, F, yp + t * F);
  });
  return y;
}

// qkv: [T, (H + 2 Hkv) d]. Rotates q and k, writes k and v into the layer's cache at `slots`; → q: [T, H, d].
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
  const float *in = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  float* qp = q.data_ptr<float>();
  const int64_t S = k_cache.size(0);
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < S, "slot out of range");
  with_cache(k_cache, v_cache, [&](auto* kc, auto* vc) {
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      std::vector<float> krot(d);
      for (int64_t t = t0; t < t1; ++t)
        rope_store_row(in + t * W, cp + t * half, sp + t * half, n_heads, n_kv, d, slot[t], qp + t * n_heads * d,
                       kc, vc, krot.data());
    });
  });
  return q;
}

// Decode attention straight from the paged cache (no gather): q: [B, H, d]; caches: [S, Hkv, d];
// block_table: [B, nblk] int64; lens: [B] keys each row sees, of which the last `window` (0: all). → [B, H, d].
at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& table_in, const at::Tensor& lens_in, int64_t block_size,
                            double scale, int64_t window) {
  const at::Tensor q = q_in.contiguous();
  check_cpu_f32(q, "q");
  check_cache(k_cache, v_cache);
  const at::Tensor table = table_in.to(at::kLong).contiguous();
  const at::Tensor lens = lens_in.to(at::kLong).contiguous();
  const int64_t B = q.size(0), H = q.size(1), d = q.size(2), Hkv = k_cache.size(1);
  const int64_t nblk = table.size(1), S = k_cache.size(0);
  TORCH_CHECK(k_cache.size(2) == d && H % Hkv == 0 && H / Hkv <= 64, "q and the cache disagree on heads");
  TORCH_CHECK(d == 32 || d == 64 || d == 96 || d == 128, "decode_attention supports head_dim 32, 64, 96 or 128, not ", d);
  TORCH_CHECK(window >= 0, "window must be >= 0");
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
  const DecodeHeads heads{qp, op, H, d, static_cast<float>(scale)};
  with_cache(k_cache, v_cache, [&](auto* kc, auto* vc) {
    const auto kv = paged_kv(kc, vc, tp, nblk, block_size, Hkv);
    const HeadItems items(B, Hkv, at::get_num_threads());
    at::parallel_for(0, items.count(), 1, [&](int64_t i0, int64_t i1) {
      AttentionScratch s;
      for (int64_t i = i0; i < i1; ++i)
        attend(heads, kv, items.row(i), items.first(i), items.last(i), lp[items.row(i)], window, s);
    });
  });
  return out;
}

// A prefill chunk's causal attention over the paged cache (its cached prefix and itself), AVX-512 only:
// q: [T, H, d], the chunk's rows at positions start .. start + T - 1; blocks: [nblk] int64, the sequence's
// KV blocks in position order, holding its start + T keys; each row sees the last `window` of its keys
// (0: all). → [T, H, d].
at::Tensor prefill_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& blocks_in, int64_t block_size, int64_t start, double scale,
                             int64_t window) {
  TORCH_CHECK(cpu_has_avx512(), "prefill_attention needs AVX-512");
  const at::Tensor q = q_in.contiguous();
  check_cpu_f32(q, "q");
  check_cache(k_cache, v_cache);
  const at::Tensor blocks = blocks_in.to(at::kLong).contiguous();
  TORCH_CHECK(q.dim() == 3 && start >= 0 && window >= 0 && block_size > 0, "bad prefill attention arguments");
  const int64_t T = q.size(0), H = q.size(1), d = q.size(2), Hkv = k_cache.size(1), S = k_cache.size(0);
  TORCH_CHECK(k_cache.size(2) == d && H % Hkv == 0, "q and the cache disagree on heads");
  TORCH_CHECK(d == 32 || d == 64 || d == 96 || d == 128, "prefill_attention supports head_dim 32, 64, 96 or 128");
  const int64_t n = start + T, nkb = (n + 15) / 16, group = H / Hkv;
  TORCH_CHECK(blocks.numel() * block_size >= n, "fewer blocks than keys");
  const int64_t* bp = blocks.data_ptr<int64_t>();
  std::vector<int64_t> slots(n);
  for (int64_t p = 0; p < n; ++p) {
    const int64_t b = bp[p / block_size];
    TORCH_CHECK(b >= 0 && (b + 1) * block_size <= S, "block out of range");
    slots[p] = b * block_size + p % block_size;
  }
  at::Tensor out = at::empty_like(q);
  if (T == 0) return out;
  // The KV heads' keys widened to float32, as many heads per round as fit kScratch floats (all of them for
  // ordinary prompts: two parallel regions per call, not per head; a long prefix takes several rounds).
  constexpr int64_t kScratch = int64_t{8} << 20;
  const int64_t ksz = (nkb + 1) * 16 * d, vsz = nkb * 16 * d;  // kt: one zero panel past the last (pairs)
  const int64_t per_round = std::clamp<int64_t>(kScratch / (ksz + vsz), 1, Hkv);
  thread_local std::vector<float> kt, vf;  // reused by every call of this thread
  kt.resize(per_round * ksz);
  vf.resize(per_round * vsz);
  float *ktp = kt.data(), *vfp = vf.data();  // by pointer: inside the team's lambdas `kt` would be theirs
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int nt = at::get_num_threads();
  auto run = [&](auto nv, auto rows) {
    constexpr int64_t NV = decltype(nv)::value;
    constexpr int R = decltype(rows)::value;
    const int64_t chunks = (T * group + R - 1) / R, np = (nkb + 1) * 16;
    with_cache(k_cache, v_cache, [&](auto* kc, auto* vc) {
      for (int64_t h0 = 0; h0 < Hkv; h0 += per_round) {
        const int64_t hn = std::min(per_round, Hkv - h0);
        at::parallel_for(0, hn * (nkb + 1), 8, [&](int64_t i0, int64_t i1) {
          for (int64_t i = i0; i < i1; ++i) {
            const int64_t h = i / (nkb + 1), j = i % (nkb + 1);
            widen_keys(kc, vc, slots.data(), n, Hkv, h0 + h, d, j, j + 1, ktp + h * ksz, vfp + h * vsz);
          }
        });
        // Chunk c of each head to thread c % nt (later chunks see more keys: this spreads the triangle
        // evenly), head after head (a head's widened keys stay in each thread's L2 while it works on them).
        at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
          alignas(64) float qs[R * NV * 16];
          std::vector<float> sc(R * np);
          for (int64_t tid = t0; tid < t1; ++tid)
            for (int64_t h = 0; h < hn; ++h)
              for (int64_t c = tid; c < chunks; c += nt)
                attend_chunk<NV, R>(qp, T, H, group, h0 + h, c, start, window, static_cast<float>(scale),
                                    ktp + h * ksz, vfp + h * vsz, op, qs, sc.data(), np);
        });
      }
    });
  };
  switch (d) {
    case 32: run(std::integral_constant<int64_t, 2>{}, std::integral_constant<int, 6>{}); break;
    case 64: run(std::integral_constant<int64_t, 4>{}, std::integral_constant<int, 6>{}); break;
    case 96: run(std::integral_constant<int64_t, 6>{}, std::integral_constant<int, 6>{}); break;
    default: run(std::integral_constant<int64_t, 8>{}, std::integral_constant<int, 6>{}); break;
  }
  return out;
}

// x [n, D] float32, in place ← LayerNorm(float(y[:n]) + bias + x) · w + b (y: a GEMM's bfloat16 output, [≥ n, D]);
// xb (optional) [≥ n, D] bfloat16 ← x rounded, rows past n zero: the next GEMM's input (encoder_norm.h).
void residual_norm_bf16(const at::Tensor& y, const at::Tensor& bias, at::Tensor& x, const at::Tensor& w,
                        const at::Tensor& b, double eps, const c10::optional<at::Tensor>& xb) {
  TORCH_CHECK(cpu_has_avx512(), "residual_norm_bf16 needs AVX-512");
  check_cpu_f32(x, "x");
  check_cpu_f32(bias, "bias");
  check_cpu_f32(w, "w");
  check_cpu_f32(b, "b");
  TORCH_CHECK(x.dim() == 2, "x must be [n, D]");
  const int64_t n = x.size(0), D = x.size(1);
  TORCH_CHECK(D % 16 == 0, "D must be a multiple of 16, got ", D);
  TORCH_CHECK(bias.numel() == D && w.numel() == D && b.numel() == D, "bias, w and b must hold D = ", D, " floats");
  auto check_bf16 = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.dim() == 2 &&
                t.size(0) >= n && t.size(1) == D, name, " must be a contiguous bfloat16 CPU tensor [>= ", n, ", ", D, "]");
  };
  check_bf16(y, "y");
  uint16_t* xbp = nullptr;
  if (xb.has_value()) {
    check_bf16(*xb, "xb");
    xbp = reinterpret_cast<uint16_t*>(xb->data_ptr<at::BFloat16>());
    std::memset(xbp + n * D, 0, (xb->size(0) - n) * D * sizeof(uint16_t));
  }
  const uint16_t* yp = reinterpret_cast<const uint16_t*>(y.data_ptr<at::BFloat16>());
  float* xp = x.data_ptr<float>();
  const float *bp = bias.data_ptr<float>(), *wp = w.data_ptr<float>(), *bb = b.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      residual_norm_row(yp + r * D, bp, xp + r * D, wp, bb, D, e, xbp == nullptr ? nullptr : xbp + r * D);
  });
}

void check_bf16_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.dim() >= 1 &&
              t.size(-1) % 16 == 0, name, " must be a contiguous bfloat16 CPU tensor whose rows hold a multiple of 16");
  TORCH_CHECK(cpu_has_avx512(), "the bfloat16 row ops need AVX-512");
}

// x [..., D] bfloat16, w [D] bfloat16 → RMSNorm(x) · w, bfloat16, rounded where TorchOps.rms_norm rounds.
at::Tensor rms_norm_bf16(const at::Tensor& x_in, const at::Tensor& w, double eps) {
  const at::Tensor x = x_in.contiguous();
  check_bf16_rows(x, "x");
  check_bf16_rows(w, "w");
  const int64_t D = x.size(-1), rows = x.numel() / D;
  TORCH_CHECK(w.numel() == D, "w must hold ", D, " values");
  at::Tensor y = at::empty_like(x);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_norm_bf16_row(xp + r * D, wp, D, static_cast<float>(eps), yp + r * D);
  });
  return y;
}

// gate_up [T, 2F] bfloat16, in place on its gate half → silu(gate) · up as a [T, F] view, rounded where
// TorchOps.silu_mul rounds.
at::Tensor silu_mul_bf16_(at::Tensor& gate_up) {
  check_bf16_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 32 == 0, "gate_up must be [T, 2F], F a multiple of 16");
  const int64_t T = gate_up.size(0), F = gate_up.size(1) / 2;
  uint16_t* p = reinterpret_cast<uint16_t*>(gate_up.data_ptr<at::BFloat16>());
  at::parallel_for(0, T, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) silu_mul_bf16_row(p + r * 2 * F, F);
  });
  return gate_up.narrow(1, 0, F);
}

// qkv [T, (H + 2 Hkv) d] bfloat16; cos, sin [T, d/2] float32; caches [S, Hkv, d] bfloat16; slots [T] int64 →
// q [T, H, d] rotated; k rotated and v stored at their slots: TorchOps.rope_store's roundings, one pass.
at::Tensor rope_store_bf16(const at::Tensor& qkv_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                           at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots_in, int64_t n_heads,
                           int64_t n_kv) {
  const at::Tensor qkv = qkv_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const at::Tensor slots = slots_in.contiguous();
  check_bf16_rows(qkv, "qkv");
  check_cpu_f32(cos, "cos");
  check_cpu_f32(sin, "sin");
  const int64_t T = qkv.size(0), d = qkv.size(1) / (n_heads + 2 * n_kv), half = d / 2;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (n_heads + 2 * n_kv) * d && half % 16 == 0,
              "qkv must be [T, (H + 2 Hkv) d] with d a multiple of 32");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == T && cos.size(1) == half, "cos and sin must be [T, d/2]");
  for (const at::Tensor* c : {&k_cache, &v_cache})
    TORCH_CHECK(c->scalar_type() == at::kBFloat16 && c->is_contiguous() && c->dim() == 3 && c->size(1) == n_kv &&
                c->size(2) == d, "caches must be contiguous bfloat16 [S, Hkv, d]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == T, "slots must be [T] int64");
  const int64_t S = k_cache.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(0 <= sp[t] && sp[t] < S, "slot ", sp[t], " is outside the cache");
  at::Tensor q = at::empty({T, n_heads, d}, qkv.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(qkv.data_ptr<at::BFloat16>());
  uint16_t* qp = reinterpret_cast<uint16_t*>(q.data_ptr<at::BFloat16>());
  uint16_t* kp = reinterpret_cast<uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  uint16_t* vp = reinterpret_cast<uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  const float *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  const int64_t W = qkv.size(1);
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint16_t* row = xp + t * W;
      for (int64_t h = 0; h < n_heads; ++h) rope_bf16_head(row + h * d, cp + t * half, snp + t * half, half, qp + (t * n_heads + h) * d);
      for (int64_t h = 0; h < n_kv; ++h) {
        rope_bf16_head(row + (n_heads + h) * d, cp + t * half, snp + t * half, half, kp + (sp[t] * n_kv + h) * d);
        std::memcpy(vp + (sp[t] * n_kv + h) * d, row + (n_heads + n_kv + h) * d, d * sizeof(uint16_t));
      }
    }
  });
  return q;
}

// logits: [R, V] float32; temps: [R] (0: greedy); u: [R] uniform draws in [0, 1) → [R] int64 token ids.
at::Tensor sample_rows(const at::Tensor& logits_in, const at::Tensor& temps_in, const at::Tensor& u_in) {
  const at::Tensor logits = logits_in.contiguous(), temps = temps_in.contiguous(), u = u_in.contiguous();
  check_cpu_f32(logits, "logits");
  check_cpu_f32(temps, "temps");
  check_cpu_f32(u, "u");
  TORCH_CHECK(logits.dim() == 2 && temps.numel() == logits.size(0) && u.numel() == logits.size(0),
              "one temperature and one draw per row");
  const int64_t R = logits.size(0), V = logits.size(1);
  at::Tensor out = at::empty({R}, logits.options().dtype(at::kLong));
  const float *lp = logits.data_ptr<float>(), *tp = temps.data_ptr<float>(), *up = u.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> e(V);
    for (int64_t r = r0; r < r1; ++r)
      op[r] = tp[r] > 0.f ? draw_row(lp + r * V, V, tp[r], up[r], e.data()) : argmax_row(lp + r * V, V);
  });
  return out;
}

// logits: [S, V] float32, changed in place; rows: [C] int64 row indices; masks: [C, W] int32 bitmasks
// (row rows[c] keeps the tokens whose bit is set in masks[c], the others become -inf).
void mask_rows_(at::Tensor& logits, const at::Tensor& rows_in, const at::Tensor& masks_in) {
  const at::Tensor rows = rows_in.contiguous(), masks = masks_in.contiguous();
  check_cpu_f32(logits, "logits");
  TORCH_CHECK(logits.is_contiguous() && logits.dim() == 2, "logits must be a contiguous [S, V] tensor");
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kLong && rows.dim() == 1, "rows must be [C] int64");
  TORCH_CHECK(masks.device().is_cpu() && masks.scalar_type() == at::kInt && masks.dim() == 2 &&
                  masks.size(0) == rows.size(0), "masks must be [C, W] int32, one per row");
  const int64_t S = logits.size(0), V = logits.size(1), W = masks.size(1), C = rows.size(0);
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t c = 0; c < C; ++c) TORCH_CHECK(0 <= rp[c] && rp[c] < S, "row ", rp[c], " out of [0, ", S, ")");
  float* lp = logits.data_ptr<float>();
  const int32_t* mp = masks.data_ptr<int32_t>();
  at::parallel_for(0, C, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) mask_row(lp + rp[c] * V, V, mp + c * W, W);
  });
}

}  // namespace

// Every kernel lets go of the GIL: the backend's asyncio thread (gRPC streaming) runs meanwhile.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using py::call_guard;
  using release = py::gil_scoped_release;
  m.def("q4_1_linear", &q4_1_linear, "x @ dequant(Q4_1)^T (+ bias) (+ residual)", call_guard<release>());
  m.def("q8_0_linear", &q8_0_linear, "x @ dequant(Q8_0)^T (+ bias) (+ residual)", call_guard<release>());
  m.def("kquant_linear", &kquant_linear, "x @ dequant(Q4_K, Q5_K or Q6_K, n16)^T (+ bias) (+ residual)",
        call_guard<release>());
  m.def("dequant_rows", &dequant_rows, "rows of a block matrix as float32 (mins: K-quants' sub-scales)",
        call_guard<release>());
  m.def("dequantize_into", &dequantize_into, "a whole block matrix into a float32 buffer", call_guard<release>());
  m.def("dequantize_n16_t", &dequantize_n16_t, "groups of an n16 matrix as a float32 W^T tile", call_guard<release>());
  m.def("n16_gemm_bf16", &n16_gemm_bf16, "x (bfloat16) @ dequant(n16)^T on bfloat16 tiles, float32 sums and result",
        py::arg("x"), py::arg("qs"), py::arg("d"), py::arg("mins"), py::arg("q4"), py::arg("rows") = GEMM_ROWS,
        py::arg("depth") = GEMM_DEPTH, py::arg("bias") = py::none(), py::arg("residual") = py::none(),
        py::arg("out") = py::none(), py::arg("panel_groups") = PANEL_GROUPS, call_guard<release>());
  m.def("n16_gemm_bf16_silu", &n16_gemm_bf16_silu, "silu(x @ gate^T) * (x @ up^T) on bfloat16 tiles, float32",
        py::arg("x"), py::arg("qs"), py::arg("d"), py::arg("mins"), py::arg("q4"), py::arg("rows") = GEMM_ROWS,
        py::arg("depth") = GEMM_DEPTH, py::arg("panel_groups") = SILU_PANEL_GROUPS, call_guard<release>());
  m.def("could_brgemm_bf16", [] { return at::native::cpublas::could_pack(at::kBFloat16); },
        "whether torch's brgemm multiplies bfloat16 here (oneDNN's micro-kernels: AMX)");
  m.def("rms_norm", &rms_norm, "RMSNorm, float32", call_guard<release>());
  m.def("silu_mul", &silu_mul, "silu(gate) * up", call_guard<release>());
  m.def("rope_store", &rope_store, "RoPE on q and k, k and v into the paged cache; returns q", call_guard<release>());
  m.def("decode_attention", &decode_attention, "single-query attention over paged KV blocks (the last `window` keys)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"), py::arg("lens"),
        py::arg("block_size"), py::arg("scale"), py::arg("window") = 0, call_guard<release>());
  m.def("prefill_attention", &prefill_attention, "a prefill chunk's causal attention over paged KV blocks (AVX-512)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("blocks"), py::arg("block_size"),
        py::arg("start"), py::arg("scale"), py::arg("window") = 0, call_guard<release>());
  m.def("encoder_attention", &encoder_attention, "an encoder layer's attention over packed sequences (AVX-512)",
        py::arg("qkv"), py::arg("offsets"), py::arg("heads"), py::arg("scale"), call_guard<release>());
  m.def("residual_norm_bf16", &residual_norm_bf16, "an encoder's LayerNorm(GEMM output + bias + residual) in place, "
        "and its bfloat16 copy for the next GEMM (AVX-512)", py::arg("y"), py::arg("bias"), py::arg("x"), py::arg("w"),
        py::arg("b"), py::arg("eps"), py::arg("xb") = py::none(), call_guard<release>());
  m.def("rms_norm_bf16", &rms_norm_bf16, "RMSNorm of bfloat16 rows, one pass (AVX-512)", call_guard<release>());
  m.def("silu_mul_bf16_", &silu_mul_bf16_, "silu(gate) * up of bfloat16 rows, in place on the gate half (AVX-512)",
        call_guard<release>());
  m.def("rope_store_bf16", &rope_store_bf16, "RoPE on bfloat16 q and k, k and v into a bfloat16 paged cache; returns q "
        "(AVX-512)", call_guard<release>());
  m.def("flash_attention_bf16", &flash_attention_bf16_op, "prefill attention on AMX-BF16 tiles, bfloat16 in and out, "
        "float32 sums and softmax", py::arg("q"), py::arg("k"), py::arg("v"), py::arg("start"), py::arg("causal"),
        py::arg("scale"), py::arg("q_block") = FLASH_Q, py::arg("k_block") = FLASH_K, call_guard<release>());
  m.def("flash_attention_paged", &flash_attention_paged, "a prefill chunk's causal attention on AMX-BF16 tiles straight "
        "from the paged cache (float32 or bfloat16 q, float16 or bfloat16 cache)", py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("blocks"), py::arg("block_size"), py::arg("start"), py::arg("scale"),
        py::arg("out") = py::none(), call_guard<release>());
  m.def("has_avx512", &cpu_has_avx512, "whether this CPU runs the AVX-512 kernels (prefill_attention, the K-quant kernels)");
  m.def("cap_isa", &cap_isa, "the widest instruction set the kernels may use: 0 AVX2, 1 AVX-512 without VNNI, 2 native");
  m.def("has_vnni", &has_vnni, "whether this CPU has AVX-512 VNNI (vpdpwssd in the 512-bit int16 linears)");
  m.def("use_int16", &use_int16, "runs the n16 linears on the vnni, avx512 or avx2 code; returns the one before");
  m.def("use_avx512", &use_avx512, "512-bit linears on/off (where the CPU has them); returns the previous setting");
  m.def("use_vbmi", &use_vbmi, "the K-quant kernels' VBMI decode on/off (where the CPU has it); returns the previous setting");
  m.def("sample_rows", &sample_rows, "greedy or temperature draws, one per row", call_guard<release>());
  m.def("mask_rows_", &mask_rows_, "a grammar's token bitmask on each given row, in place", call_guard<release>());
  py::class_<BlockTensors>(m, "BlockTensors",
                           "one GGUF-block matrix: codes, scales, minimums (empty if none); or a stack of parts")
      .def(py::init<at::Tensor, at::Tensor, at::Tensor, std::vector<BlockTensors>>(), py::arg("qs"), py::arg("d"),
           py::arg("m"), py::arg("parts") = std::vector<BlockTensors>{});
  py::class_<LayerTensors>(m, "LayerTensors", "one layer's weights by name (qkv_bias, q_norm, k_norm empty if none)")
      .def(py::init<at::Tensor, BlockTensors, at::Tensor, at::Tensor, at::Tensor, BlockTensors, at::Tensor, BlockTensors,
                    BlockTensors>(),
           py::arg("attn_norm"), py::arg("qkv"), py::arg("qkv_bias"), py::arg("q_norm"), py::arg("k_norm"), py::arg("o"),
           py::arg("ffn_norm"), py::arg("gate_up"), py::arg("down"));
  py::class_<ModelTensors>(m, "ModelTensors", "the model's weights by name, its layers in order")
      .def(py::init<BlockTensors, at::Tensor, BlockTensors, std::vector<LayerTensors>>(), py::arg("embed"),
           py::arg("norm"), py::arg("lm_head"), py::arg("layers"));
  py::class_<LoraWeights>(m, "LoraWeights", "one LoRA adapter for FusedDecoder: A and B transposed per layer and "
                                            "projection (qkv, o, gate_up, down), empty where none")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>>(), py::arg("a"), py::arg("bt"));
  py::class_<FusedDecoder>(m, "FusedDecoder", "a whole decode step over GGUF-block weights in one call")
      .def(py::init<int64_t, int64_t, int64_t, double, ModelTensors, std::vector<int64_t>>(), py::arg("n_heads"),
           py::arg("n_kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("tensors"), py::arg("windows"))
      .def("forward", &FusedDecoder::forward, "logits of a decode-only step", call_guard<release>())
      .def("forward_lora", &FusedDecoder::forward_lora, "forward with LoRA adapters: forward's arguments, the "
           "step's adapters and each row's index into them (-1: none)", call_guard<release>())
      .def("set_profiling", &FusedDecoder::set_profiling, "time each phase of every step from now on (resets)")
      .def("profile", &FusedDecoder::profile, "seconds per phase since set_profiling(True)");
}
