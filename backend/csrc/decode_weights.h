// What a fused decode step (decode_step.h) holds of the model: the tensors backend/ops.py hands over, by name,
// the raw views the step's ops read, and each thread's scratch.
#pragma once

#include <torch/extension.h>

#include <vector>

#include "layer_ops.h"
#include "qlinear.h"
#include "qlinear_stack.h"

namespace kvyard {

// The weights as backend/ops.py hands them over, by name (KernelOps.fused_decoder builds them field for
// field). Held by FusedDecoder, so the pointers its views below keep stay valid.
struct BlockTensors {  // one matrix in GGUF blocks (tensors.h as_matrix)
  at::Tensor qs, d, m;  // codes, scales, minimums (empty for Q8_0; the K-quants' sub-scales)
  std::vector<BlockTensors> parts;  // instead, a stack of matrices of different kinds (qlinear_stack.h)
};

struct LayerTensors {
  at::Tensor attn_norm;
  BlockTensors qkv;
  at::Tensor qkv_bias;  // empty when the model has none
  at::Tensor q_norm, k_norm;  // [d] each, Qwen3's per-head RMSNorm of q and k before RoPE; empty when none
  BlockTensors o;
  at::Tensor ffn_norm;
  BlockTensors gate_up, down;
};

struct ModelTensors {
  BlockTensors embed;
  at::Tensor norm;
  BlockTensors lm_head;
  std::vector<LayerTensors> layers;
};

struct LayerWeights {
  const float* attn_norm;
  StackedMatrix qkv;       // fused matrices: parts of different kinds possible
  const float* qkv_bias;  // nullptr when the model has none
  const float* q_norm;    // nullptr when the model has none (then k_norm too)
  const float* k_norm;
  QMatrix o;
  const float* ffn_norm;
  StackedMatrix gate_up;
  QMatrix down;
};

// Per-thread scratch, reused across steps.
struct ThreadScratch {
  std::vector<float> input;  // a linear's prepared input when this thread prepares all of it (1-2 rows)
  std::vector<float> wbuf;   // NT decoded weight rows (many rows)
  std::vector<float> krot;   // one rotated K head
  AttentionScratch attention;
};

}  // namespace kvyard
