"""backend/model.py keeps a float32 CPU model's layer matrices column-major (W^T contiguous, seen as W),
which torch's GEMM runs faster for a few rows; the logits are those of the row-major weights."""
from __future__ import annotations

import torch

from backend.engine import GenerationRequest
from backend.model import LlamaModel
from backend.sequence import StopConditions
from kvyard.model_config import ModelConfig
from kvyard.sampling_params import SamplingParams
from tests.backend.conftest import build_engine, greedy_run


def test_layer_matrices_are_column_major_and_answer_the_same(model_f32: LlamaModel, model_config: ModelConfig) -> None:
    mats = {n: w for n, w in model_f32.w.items() if n.startswith("layers.") and isinstance(w, torch.Tensor) and w.dim() == 2}
    assert mats and all(w.stride() == (1, w.shape[0]) for w in mats.values())
    row_major = LlamaModel(model_config, dict(model_f32.w))
    row_major.w = {n: w.contiguous() for n, w in row_major.w.items()}  # as before the change
    prompt = list(range(20, 57))  # 37 rows, then decode steps of one
    runs = [greedy_run(build_engine(m, model_config), GenerationRequest(
        "r", prompt, SamplingParams(), StopConditions(max_new_tokens=4, ignore_eos=True))) for m in (model_f32, row_major)]
    (ours, our_logits, _), (theirs, their_logits, _) = runs
    assert ours == theirs
    assert all(float((a - b).abs().max()) < 1e-4 for a, b in zip(our_logits, their_logits))
