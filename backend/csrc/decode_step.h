// A whole decode step (every row of the batch one new token) in one call and one OpenMP team: the same
// ops as backend/model.py's LlamaModel.forward, layer by layer, with a barrier between ops instead of a
// Python call, a tensor allocation and a fork/join per op (~300 of them a step). The ops are the kernels
// cpu_kernels.cpp binds one by one, split over threads the same way, so the logits are bit-identical to
// the per-op path (tests/backend/test_fused_decode.py). backend/ops.py's KernelOps.fused_decoder builds it.
#pragma once
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/extension.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "decode_weights.h"
#include "layer_ops.h"
#include "lora_step.h"
#include "qlinear.h"
#include "qlinear_stack.h"
#include "tensors.h"

namespace kvyard {

class FusedDecoder {
 public:
  // Where a step's time goes (benchmarks/step_profile.py): thread 0's time between barriers, summed.
  enum Phase { EMBED, NORM, QKV, ROPE_STORE, ATTENTION, O, GATE_UP, SILU, DOWN, LM_HEAD, LORA, PHASES };
  static constexpr const char* PHASE_NAMES[PHASES] = {"embed", "rms_norm", "qkv", "rope_store", "attention",
                                                      "o", "gate_up", "silu_mul", "down", "lm_head", "lora"};

  // windows: per layer, the keys a query sees (a sliding window, itself included; 0: all).
  FusedDecoder(int64_t n_heads, int64_t n_kv, int64_t head_dim, double eps, ModelTensors tensors,
               std::vector<int64_t> windows)
      : H_(n_heads), Hkv_(n_kv), d_(head_dim), eps_(static_cast<float>(eps)),
        scale_(static_cast<float>(std::pow(static_cast<double>(head_dim), -0.5))),  // as Python's d ** -0.5
        tensors_(std::move(tensors)), windows_(std::move(windows)) {
    TORCH_CHECK(H_ > 0 && Hkv_ > 0 && H_ % Hkv_ == 0 && H_ / Hkv_ <= 64, "bad head counts");
    TORCH_CHECK(d_ == 32 || d_ == 64 || d_ == 96 || d_ == 128, "head_dim must be 32, 64, 96 or 128");
    embed_ = matrix(tensors_.embed);
    norm_ = vector_of(tensors_.norm, embed_.K, "norm");
    lm_head_ = matrix(tensors_.lm_head);
    D_ = embed_.K;
    TORCH_CHECK(lm_head_.K == D_, "lm_head and embedding widths differ");
    const int64_t L = static_cast<int64_t>(tensors_.layers.size());
    for (int64_t l = 0; l < L; ++l) {
      const LayerTensors& t = tensors_.layers[l];
      LayerWeights w;
      w.attn_norm = vector_of(t.attn_norm, D_, "attn_norm");
      w.qkv = stacked(t.qkv);
      w.qkv_bias = t.qkv_bias.numel() ? vector_of(t.qkv_bias, w.qkv.N, "qkv_bias") : nullptr;
      TORCH_CHECK(t.q_norm.numel() == t.k_norm.numel(), "layer ", l, ": q_norm and k_norm come together");
      w.q_norm = t.q_norm.numel() ? vector_of(t.q_norm, d_, "q_norm") : nullptr;
      w.k_norm = t.k_norm.numel() ? vector_of(t.k_norm, d_, "k_norm") : nullptr;
      w.o = matrix(t.o);
      w.ffn_norm = vector_of(t.ffn_norm, D_, "ffn_norm");
      w.gate_up = stacked(t.gate_up);
      w.down = matrix(t.down);
      TORCH_CHECK(w.qkv.K == D_ && w.qkv.N == (H_ + 2 * Hkv_) * d_ && w.o.K == H_ * d_ && w.o.N == D_ &&
                  w.gate_up.K == D_ && w.gate_up.N % 2 == 0 && w.down.K == w.gate_up.N / 2 && w.down.N == D_,
                  "layer ", l, ": weight shapes do not fit the model");
      layers_.push_back(w);
    }
    TORCH_CHECK(static_cast<int64_t>(windows_.size()) == L, "one attention window per layer");
    for (int64_t w : windows_) TORCH_CHECK(w >= 0, "windows must be >= 0");
  }

  // ids, positions, slots: [B] int64 (every row decodes one token); table: [B, nblk] int64 KV blocks;
  // lens: [B] keys each row sees; cos, sin: [P, d/2] float32 RoPE tables (indexed by position); cache:
  // [L, 2, S, Hkv, d] float32 or float16; rows: [R] rows whose logits are wanted → logits [R, V] float32.
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& slots,
                     const at::Tensor& table, const at::Tensor& lens, const at::Tensor& cos, const at::Tensor& sin,
                     at::Tensor cache, int64_t block_size, const at::Tensor& rows) {
    StepLoras none;
    return step(ids, positions, slots, table, lens, cos, sin, std::move(cache), block_size, rows, none);
  }

  // forward with LoRA adapters (lora_step.h): owners [B] int64, each row's index into adapters (-1: none).
  at::Tensor forward_lora(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& slots,
                          const at::Tensor& table, const at::Tensor& lens, const at::Tensor& cos, const at::Tensor& sin,
                          at::Tensor cache, int64_t block_size, const at::Tensor& rows,
                          const std::vector<LoraWeights*>& adapters, const at::Tensor& owners_in) {
    const at::Tensor owners = owners_in.to(at::kLong).contiguous();
    TORCH_CHECK(owners.dim() == 1 && owners.size(0) == ids.size(0), "one adapter index per row");
    StepLoras loras;
    loras.adapters.assign(adapters.begin(), adapters.end());
    loras.rows.resize(adapters.size());
    const int64_t* owner = owners.data_ptr<int64_t>();
    for (int64_t b = 0; b < owners.size(0); ++b) {
      TORCH_CHECK(owner[b] >= -1 && owner[b] < static_cast<int64_t>(adapters.size()), "adapter index out of range");
      if (owner[b] >= 0) loras.rows[owner[b]].push_back(b);
    }
    check_loras(loras);
    return step(ids, positions, slots, table, lens, cos, sin, std::move(cache), block_size, rows, loras);
  }

 private:
  at::Tensor step(const at::Tensor& ids_in, const at::Tensor& positions_in, const at::Tensor& slots_in,
                  const at::Tensor& table_in, const at::Tensor& lens_in, const at::Tensor& cos, const at::Tensor& sin,
                  at::Tensor cache, int64_t block_size, const at::Tensor& rows_in, StepLoras& loras) {
    const at::Tensor ids = ids_in.to(at::kLong).contiguous(), positions = positions_in.to(at::kLong).contiguous();
    const at::Tensor slots = slots_in.to(at::kLong).contiguous(), table = table_in.to(at::kLong).contiguous();
    const at::Tensor lens = lens_in.to(at::kLong).contiguous(), rows = rows_in.to(at::kLong).contiguous();
    const int64_t B = ids.size(0), R = rows.size(0), L = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(B > 0 && positions.size(0) == B && slots.size(0) == B && lens.size(0) == B && table.dim() == 2 &&
                table.size(0) == B, "one id, position, slot, length and block-table row per decode row");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                sin.scalar_type() == at::kFloat && cos.size(1) == d_ / 2 && sin.sizes() == cos.sizes(),
                "cos and sin must be contiguous float32 [P, head_dim/2]");
    TORCH_CHECK(cache.is_contiguous() && cache.dim() == 5 && cache.size(0) == L && cache.size(1) == 2 &&
                cache.size(3) == Hkv_ && cache.size(4) == d_ &&
                (cache.scalar_type() == at::kFloat || cache.scalar_type() == at::kHalf),
                "cache must be a contiguous float32/float16 [layers, 2, slots, kv heads, head_dim]");
    const int64_t S = cache.size(2), nblk = table.size(1), P = cos.size(0);
    const int64_t *ip = ids.data_ptr<int64_t>(), *pp = positions.data_ptr<int64_t>(), *sp = slots.data_ptr<int64_t>();
    const int64_t *tp = table.data_ptr<int64_t>(), *lp = lens.data_ptr<int64_t>(), *rp = rows.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(ip[b] >= 0 && ip[b] < embed_.N, "token id out of range");
      TORCH_CHECK(pp[b] >= 0 && pp[b] < P, "position out of range");
      TORCH_CHECK(sp[b] >= 0 && sp[b] < S, "slot out of range");
      TORCH_CHECK(lp[b] >= 1 && lp[b] <= nblk * block_size, "bad key count");
      for (int64_t j = 0; j < (lp[b] + block_size - 1) / block_size; ++j)
        TORCH_CHECK(tp[b * nblk + j] >= 0 && (tp[b * nblk + j] + 1) * block_size <= S, "block out of range");
    }
    for (int64_t r = 0; r < R; ++r) TORCH_CHECK(rp[r] >= 0 && rp[r] < B, "logits row out of range");

    const int64_t W = layers_.empty() ? 0 : layers_[0].qkv.N, F2 = layers_.empty() ? 0 : layers_[0].gate_up.N;
    x_.resize(B * D_);
    h_.resize(B * D_);
    tmp_.resize(B * D_);
    qkv_.resize(B * W);
    q_.resize(B * H_ * d_);
    attn_.resize(B * H_ * d_);
    gu_.resize(B * F2);
    act_.resize(B * F2 / 2);
    int64_t input_size = input_scratch(lm_head_, std::max<int64_t>(R, 1));
    for (const LayerWeights& w : layers_) {
      for (const StackedMatrix* m : {&w.qkv, &w.gate_up}) input_size = std::max(input_size, input_scratch(*m, B));
      for (const QMatrix* m : {&w.o, &w.down}) input_size = std::max(input_size, input_scratch(*m, B));
    }
    input_.resize(input_size);
    if (loras.any()) loras.t.resize(B * loras.max_rank);
    at::Tensor logits = at::empty({R, lm_head_.N}, cos.options());
    const int team = at::get_num_threads();
    if (static_cast<int>(scratch_.size()) < team) scratch_.resize(team);

    auto run = [&](auto* kc0) {
      using T = std::remove_pointer_t<decltype(kc0)>;
      const int64_t layer_stride = 2 * S * Hkv_ * d_;  // elements per layer in the cache
#pragma omp parallel num_threads(team)
      {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        ThreadScratch& sc = scratch_[tid];
        if (profiling_ && tid == 0) last_mark_ = omp_get_wtime();
        int64_t b0, b1;
        split_range(B, tid, nt, b0, b1);
        for (int64_t b = b0; b < b1; ++b) decode_row(embed_, ip[b], x_.data() + b * D_);
#pragma omp barrier
        mark(tid, EMBED);
        for (int64_t l = 0; l < L; ++l) {
          const LayerWeights& w = layers_[l];
          T* kc = kc0 + l * layer_stride;
          T* vc = kc + S * Hkv_ * d_;
          for (int64_t b = b0; b < b1; ++b) rms_norm_row(x_.data() + b * D_, w.attn_norm, D_, eps_, h_.data() + b * D_);
#pragma omp barrier
          mark(tid, NORM);
          if (loras.any()) lora_shrink(loras, h_.data(), D_, l, LORA_QKV, tid, nt);
          linear(h_.data(), B, w.qkv, w.qkv_bias, qkv_.data(), nullptr, sc, tid, nt);
#pragma omp barrier
          mark(tid, QKV);
          if (loras.any()) lora_expand_rows(loras, qkv_.data(), W, l, LORA_QKV, b0, b1);  // RoPE: same rows
          for (int64_t b = b0; b < b1; ++b) {
            const float* c = cos.data_ptr<float>() + pp[b] * (d_ / 2);
            const float* s = sin.data_ptr<float>() + pp[b] * (d_ / 2);
            sc.krot.resize(d_);
            float* row = qkv_.data() + b * W;
            if (w.q_norm) qk_norm_row(row, w.q_norm, w.k_norm, H_, Hkv_, d_, eps_);
            rope_store_row(row, c, s, H_, Hkv_, d_, sp[b], q_.data() + b * H_ * d_, kc, vc,
                           sc.krot.data());
          }
#pragma omp barrier
          mark(tid, ROPE_STORE);
          int64_t i0, i1;
          const HeadItems items(B, Hkv_, nt);
          split_range(items.count(), tid, nt, i0, i1);
          const DecodeHeads heads{q_.data(), attn_.data(), H_, d_, scale_};
          const auto kv = paged_kv<T>(kc, vc, tp, nblk, block_size, Hkv_);
          for (int64_t i = i0; i < i1; ++i)
            attend(heads, kv, items.row(i), items.first(i), items.last(i), lp[items.row(i)], windows_[l],
                   sc.attention);
#pragma omp barrier
          mark(tid, ATTENTION);
          if (loras.any()) lora_shrink(loras, attn_.data(), H_ * d_, l, LORA_O, tid, nt);
          linear(attn_.data(), B, w.o, nullptr, tmp_.data(), x_.data(), sc, tid, nt);
#pragma omp barrier
          mark(tid, O);
          if (loras.any()) lora_expand_rows(loras, x_.data(), D_, l, LORA_O, b0, b1);  // the norm: same rows
          for (int64_t b = b0; b < b1; ++b) rms_norm_row(x_.data() + b * D_, w.ffn_norm, D_, eps_, h_.data() + b * D_);
#pragma omp barrier
          mark(tid, NORM);
          if (loras.any()) lora_shrink(loras, h_.data(), D_, l, LORA_GATE_UP, tid, nt);
          linear(h_.data(), B, w.gate_up, nullptr, gu_.data(), nullptr, sc, tid, nt);
#pragma omp barrier
          mark(tid, GATE_UP);
          if (loras.any()) lora_expand_all(loras, gu_.data(), F2, l, LORA_GATE_UP, tid, nt);
          silu(B, F2 / 2, tid, nt);
#pragma omp barrier
          mark(tid, SILU);
          if (loras.any()) lora_shrink(loras, act_.data(), F2 / 2, l, LORA_DOWN, tid, nt);
          linear(act_.data(), B, w.down, nullptr, tmp_.data(), x_.data(), sc, tid, nt);
#pragma omp barrier
          mark(tid, DOWN);
          if (loras.any()) lora_expand_rows(loras, x_.data(), D_, l, LORA_DOWN, b0, b1);  // the next norm
        }
        if (loras.any()) {  // the final norm reads the logits rows, not this thread's
#pragma omp barrier
        }
        int64_t r0, r1;
        split_range(R, tid, nt, r0, r1);
        for (int64_t r = r0; r < r1; ++r) rms_norm_row(x_.data() + rp[r] * D_, norm_, D_, eps_, h_.data() + r * D_);
#pragma omp barrier
        mark(tid, NORM);
        linear(h_.data(), R, lm_head_, nullptr, logits.data_ptr<float>(), nullptr, sc, tid, nt);
#pragma omp barrier
        mark(tid, LM_HEAD);
      }
    };
    if (cache.scalar_type() == at::kHalf) run(reinterpret_cast<half_t*>(cache.data_ptr<at::Half>()));
    else run(cache.data_ptr<float>());
    return logits;
  }

 public:
  // On: every step adds its phases' seconds to profile(); off (the default): one branch per barrier.
  void set_profiling(bool on) {
    profiling_ = on;
    std::fill(std::begin(phase_s_), std::end(phase_s_), 0.0);
  }

  std::map<std::string, double> profile() const {
    std::map<std::string, double> out;
    for (int p = 0; p < PHASES; ++p) out[PHASE_NAMES[p]] = phase_s_[p];
    return out;
  }

 private:
  // Adapters' shapes against the model's; the scratch's width.
  void check_loras(StepLoras& s) const {
    const int64_t L = static_cast<int64_t>(layers_.size());
    for (const LoraWeights* a : s.adapters) {
      TORCH_CHECK(a != nullptr && a->layers() == L, "LoRA weights for ", L, " layers expected");
      for (int64_t l = 0; l < L; ++l) {
        const LayerWeights& w = layers_[l];
        const int64_t ins[LORA_TARGETS] = {D_, H_ * d_, D_, w.down.K}, outs[LORA_TARGETS] = {w.qkv.N, D_, w.gate_up.N, D_};
        for (int t = 0; t < LORA_TARGETS; ++t) {
          if (!a->has(l, t)) continue;
          TORCH_CHECK(a->in(l, t) == ins[t] && a->out(l, t) == outs[t], "layer ", l, ": LoRA shapes do not fit the model");
          s.max_rank = std::max(s.max_rank, a->rank(l, t));
        }
      }
    }
  }

  // The expansion of a projection's LoRA terms: every thread's share, then a barrier (the next op reads y).
  void lora_expand_all(const StepLoras& s, float* y, int64_t N, int64_t layer, int target, int tid, int nt) {
    lora_expand(s, y, N, layer, target, tid, nt);
#pragma omp barrier
    mark(tid, LORA);
  }

  void mark(int tid, Phase phase) {
    if (!profiling_ || tid != 0) return;
    const double now = omp_get_wtime();
    phase_s_[phase] += now - last_mark_;
    last_mark_ = now;
  }

  static QMatrix matrix(const BlockTensors& b) {
    TORCH_CHECK(b.parts.empty(), "a stacked matrix where one matrix is expected");
    return as_matrix(b.qs, b.d, b.m, b.m.numel() > 0);
  }

  static StackedMatrix stacked(const BlockTensors& b) {
    std::vector<QMatrix> parts;
    if (b.parts.empty()) parts.push_back(matrix(b));
    for (const BlockTensors& p : b.parts) parts.push_back(matrix(p));
    return stack_parts(parts);
  }

  static const float* vector_of(const at::Tensor& t, int64_t n, const char* name) {
    TORCH_CHECK(t.is_contiguous() && t.scalar_type() == at::kFloat && t.numel() == n, name,
                ": a contiguous float32 vector of ", n);
    return t.data_ptr<float>();
  }

  // This thread's share of y = x w^T (+ bias) for M rows, then x_res += y on the same outputs when
  // x_res is given (the residual: (dot + bias) + residual, as the per-op path adds them). Called by every
  // thread of the team: what the input needs (block sums, int16 rows) is prepared once into input_. A
  // stacked matrix's parts are each shared out over the team on their own (their kinds differ in cost).
  template <class Matrix>
  void linear(const float* x, int64_t M, const Matrix& w, const float* bias, float* y, float* x_res,
              ThreadScratch& sc, int tid, int nt) {
    decltype(prepare_input(w, x, M, 0, 0, nullptr)) in;
    if (M <= 2) {  // one or two rows: each thread prepares them itself, cheaper than a barrier
      sc.input.resize(input_scratch(w, M));
      in = prepare_input(w, x, M, 0, M, sc.input.data());
    } else {
      int64_t m0, m1;
      split_range(M, tid, nt, m0, m1);
      in = prepare_input(w, x, M, m0, m1, input_.data());
#pragma omp barrier
    }
    if (M > DECODE_ONCE_ROWS) sc.wbuf.resize(NT * w.K);  // rows layout: decoded weight rows
    for (int p = 0; p < stack_size(w); ++p) {
      const QMatrix& part = stack_part(w, p);
      const int64_t c0 = stack_row0(w, p);  // the part's first output column
      int64_t i0, i1;
      split_range(linear_items(M, part), tid, nt, i0, i1);
      for (int64_t item = i0; item < i1; ++item) {
        run_linear_item(item, stack_input(in, p), part, y + c0, w.N, sc.wbuf.data());
        if (!bias && !x_res) continue;
        int64_t m0, m1, n0, n1;
        item_bounds(item, M, part, m0, m1, n0, n1);
        for (int64_t m = m0; m < m1; ++m)
          for (int64_t n = c0 + n0; n < c0 + n1; ++n) {
            float v = y[m * w.N + n];
            if (bias) v += bias[n];
            if (x_res) x_res[m * w.N + n] += v;
            else y[m * w.N + n] = v;
          }
      }
    }
  }

  // silu(gate) * up for B rows of gu_ → act_, in chunks of 256 columns spread over the team.
  void silu(int64_t B, int64_t F, int tid, int nt) {
    constexpr int64_t C = 256;
    const int64_t chunks = (F + C - 1) / C;
    int64_t i0, i1;
    split_range(B * chunks, tid, nt, i0, i1);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / chunks, c0 = (i % chunks) * C, n = std::min(C, F - c0);
      silu_mul_cols(gu_.data() + b * 2 * F, F, c0, n, act_.data() + b * F);
    }
  }

  int64_t H_, Hkv_, d_;
  float eps_, scale_;
  ModelTensors tensors_;
  std::vector<int64_t> windows_;
  QMatrix embed_, lm_head_;
  const float* norm_ = nullptr;
  int64_t D_ = 0;
  std::vector<LayerWeights> layers_;
  std::vector<float> x_, h_, tmp_, qkv_, q_, attn_, gu_, act_;  // [B, ...] activations of the step
  std::vector<float> input_;  // a linear's prepared input (block sums or int16 rows), shared by the team
  std::vector<ThreadScratch> scratch_;
  bool profiling_ = false;
  double phase_s_[PHASES] = {};
  double last_mark_ = 0.0;
};

}  // namespace kvyard
