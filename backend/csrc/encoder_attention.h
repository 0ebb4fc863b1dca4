// Bidirectional attention of an encoder layer (backend/encoder.py) over packed sequences, AVX-512: each
// (sequence, head) widens its keys into prefill_attention.h's float32 panels and scores groups of R query
// rows against all of that sequence's keys (attend_rows, keys [0, L) for every row). Sequences are not
// padded to the longest, and the whole layer is one parallel region of B × H items, where torch's SDPA over
// a padded batch ran at ~18 GFLOP/s and a per-sequence loop of small ops synchronised a thread team per op.
#pragma once
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "prefill_attention.h"
#include "tensors.h"

namespace kvyard {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

// Head h of one sequence's L packed rows (qkv: rows of 3 H d floats, q then k then v heads) → out rows
// (H d floats each). The scratch vectors are the calling thread's.
template <int64_t NV, int R>
inline void attend_sequence(const float* qkv, int64_t H, int64_t L, int64_t h, float scale, float* out,
                            std::vector<int64_t>& slots, std::vector<float>& kt, std::vector<float>& vf,
                            std::vector<float>& sc) {
  constexpr int64_t d = NV * 16;
  const int64_t D = H * d, nkb = (L + 15) / 16, np = (nkb + 1) * 16;
  slots.resize(L);
  for (int64_t p = 0; p < L; ++p) slots[p] = p;
  kt.resize((nkb + 1) * 16 * d);  // one zero panel past the last (attend_rows reads panels in pairs)
  vf.resize(nkb * 16 * d);
  sc.resize(R * np);
  // A row of 3D floats is a "cache row" of 3H heads: key head h is head H + h, value head h is 2H + h.
  widen_keys(qkv + D, qkv + 2 * D, slots.data(), L, 3 * H, h, d, 0, nkb + 1, kt.data(), vf.data());
  alignas(64) float qs[R * d];
  const float* rows[R];
  float* outs[R];
  RowKeys keys[R];
  for (int64_t c = 0; c < L; c += R) {
    for (int r = 0; r < R; ++r) {
      const int64_t t = std::min<int64_t>(c + r, L - 1);  // past the end: repeat the last row, store nothing
      const float* src = qkv + t * 3 * D + h * d;
      for (int64_t i = 0; i < d; i += 16)
        _mm512_storeu_ps(qs + r * d + i, _mm512_mul_ps(_mm512_loadu_ps(src + i), _mm512_set1_ps(scale)));
      rows[r] = qs + r * d;
      outs[r] = c + r < L ? out + (c + r) * D + h * d : nullptr;
      keys[r] = {0, L};
    }
    attend_rows<NV, R>(rows, keys, kt.data(), vf.data(), outs, sc.data(), np);
  }
}

#pragma GCC pop_options

// qkv: [N, 3 H d] float32, the packed rows of B sequences (sequence b: rows offsets[b] .. offsets[b + 1]);
// every row sees every row of its own sequence. → [N, H d].
inline at::Tensor encoder_attention(const at::Tensor& qkv_in, const at::Tensor& offsets_in, int64_t H, double scale) {
  TORCH_CHECK(cpu_has_avx512(), "encoder_attention needs AVX-512");
  const at::Tensor qkv = qkv_in.contiguous();
  check_cpu_f32(qkv, "qkv");
  const at::Tensor offsets = offsets_in.to(at::kLong).contiguous();
  TORCH_CHECK(qkv.dim() == 2 && H > 0 && qkv.size(1) % (3 * H) == 0 && offsets.dim() == 1 && offsets.numel() >= 1,
              "qkv must be [N, 3 H d] and offsets [B + 1]");
  const int64_t N = qkv.size(0), d = qkv.size(1) / (3 * H), B = offsets.numel() - 1;
  TORCH_CHECK(d == 32 || d == 64 || d == 96 || d == 128, "encoder_attention supports head_dim 32, 64, 96 or 128");
  const int64_t* op = offsets.data_ptr<int64_t>();
  TORCH_CHECK(op[0] == 0 && op[B] == N, "offsets must run from 0 to the number of rows");
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(op[b] <= op[b + 1], "offsets must not decrease");
  at::Tensor out = at::empty({N, H * d}, qkv.options());
  const float* qp = qkv.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  auto run = [&](auto nv) {
    constexpr int64_t NV = decltype(nv)::value;
    at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
      thread_local std::vector<int64_t> slots;
      thread_local std::vector<float> kt, vf, sc;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = i / H, L = op[b + 1] - op[b];
        if (L > 0)
          attend_sequence<NV, 6>(qp + op[b] * 3 * H * d, H, L, i % H, static_cast<float>(scale),
                                 outp + op[b] * H * d, slots, kt, vf, sc);
      }
    });
  };
  switch (d) {
    case 32: run(std::integral_constant<int64_t, 2>{}); break;
    case 64: run(std::integral_constant<int64_t, 4>{}); break;
    case 96: run(std::integral_constant<int64_t, 6>{}); break;
    default: run(std::integral_constant<int64_t, 8>{}); break;
  }
  return out;
}

}  // namespace kvyard
