"""backend/cuda_graphs.py's padding and caching on the CPU, with an eager stand-in for the capture (each
"replay" reruns the recorded step on the static buffers). tests/backend/test_cuda_families.py checks real
graphs on a GPU against transformers.

Several requests of different lengths decode together through the Engine (batches of 5, 4, 3... rows, block
tables of 2 to 4 blocks, a sliding window), once op by op and once through the padded static buffers: the same
tokens and the same logits. A padding row that wrote anywhere but its row 0's slot, or a block table padded
wrongly, changes another sequence's keys and fails this."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from backend.config import BackendConfig
from backend.cuda_graphs import ROW_BUCKETS, GraphedDecoder
from backend.engine import Engine, GenerationRequest
from backend.model import LlamaModel
from backend.ops import DENSE_ROWS, TorchOps
from backend.sequence import StopConditions
from backend.weights import load_weights
from kvyard.model_config import load_model_config
from kvyard.sampling_params import SamplingParams
from tests.backend.conftest import CPU, LogitsRecorder, build_engine
from tests.support.tiny_models import save_hf_dir, tiny_model

LENGTHS = (5, 9, 17, 30, 41)  # prompts: 1 to 3 blocks of 16, so block tables of 1 to 4 as they decode
STEPS = (12, 7, 20, 3, 9)     # each finishes at its own step: the batch shrinks 5 → 4 → 3 → 2 → 1


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    path = save_hf_dir(tiny_model("mistral", sliding_window=24, max_positions=128), tmp_path_factory.mktemp("m"))
    config = load_model_config(path)
    return LlamaModel(config, load_weights(path, config, torch.float32, CPU), ops=TorchOps())


class EagerCapture:
    """Stands in for cuda_capture: "replaying" reruns the step on the graph's static buffers."""

    def __init__(self, fail: bool = False) -> None:
        self.captured = 0
        self.fail = fail

    def __call__(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        if self.fail:
            raise RuntimeError("capture refused")
        self.captured += 1
        return fn


def decode_all(engine: Engine) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(3)
    recorder = LogitsRecorder(engine)
    for i, (n, steps) in enumerate(zip(LENGTHS, STEPS)):
        ids = torch.randint(10, 200, (n,), generator=gen).tolist()
        engine.add(GenerationRequest(f"r{i}", ids, SamplingParams(),
                                     StopConditions(max_new_tokens=steps, ignore_eos=True)))
    tokens: dict[str, list[int]] = {}
    while engine.has_work:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).append(out.token_id)
    recorder.close()
    return tokens, recorder.by_request


def test_padded_static_steps_compute_the_eager_steps(model: LlamaModel) -> None:
    assert model.graphs is None  # never on the CPU by itself
    eager_tokens, eager_logits = decode_all(build_engine(model, model.config, num_blocks=64))
    capture = EagerCapture()
    model.graphs = GraphedDecoder(model._decode_step, CPU, DENSE_ROWS, capture=capture)
    try:
        engine = build_engine(model, model.config, num_blocks=64)
        tokens, logits = decode_all(engine)
        assert model.graphs.num_graphs == capture.captured
        shapes = {key[:2] for key in model.graphs._graphs}
    finally:
        model.graphs = None
    assert tokens == eager_tokens
    assert {r: len(t) for r, t in tokens.items()} == {f"r{i}": s for i, s in enumerate(STEPS)}
    for request_id, rows in eager_logits.items():
        for step, (a, b) in enumerate(zip(rows, logits[request_id])):
            assert torch.allclose(a, b, atol=1e-4, rtol=0), (request_id, step, float((a - b).abs().max()))
    # Padded shapes were met: 5 rows ran as 8, 3 as 4; block tables of 3 as 4.
    assert (8, 2) in shapes or (8, 4) in shapes, shapes
    assert any(rows == 4 for rows, _ in shapes) and any(blocks == 4 for _, blocks in shapes), shapes
    assert all(rows in ROW_BUCKETS and blocks & (blocks - 1) == 0 for rows, blocks in shapes), shapes


def test_long_block_tables_run_eagerly(model: LlamaModel) -> None:
    """Past max_blocks (MAX_GRAPH_BLOCKS) a step runs op by op: the rows that reach 3 and 4 blocks here."""
    eager_tokens, eager_logits = decode_all(build_engine(model, model.config, num_blocks=64))
    model.graphs = GraphedDecoder(model._decode_step, CPU, DENSE_ROWS, capture=EagerCapture(), max_blocks=2)
    try:
        tokens, logits = decode_all(build_engine(model, model.config, num_blocks=64))
        shapes = {key[:2] for key in model.graphs._graphs}
    finally:
        model.graphs = None
    assert shapes and max(blocks for _, blocks in shapes) == 2, shapes
    assert tokens == eager_tokens
    assert all(torch.allclose(a, b, atol=1e-4, rtol=0) for r in eager_logits for a, b in zip(eager_logits[r], logits[r]))


def test_a_failed_capture_serves_eagerly(model: LlamaModel) -> None:
    eager_tokens, _ = decode_all(build_engine(model, model.config, num_blocks=64))
    model.graphs = GraphedDecoder(model._decode_step, CPU, DENSE_ROWS, capture=EagerCapture(fail=True))
    try:
        tokens, _ = decode_all(build_engine(model, model.config, num_blocks=64))
        assert not model.graphs.enabled and model.graphs.num_graphs == 0
    finally:
        model.graphs = None
    assert tokens == eager_tokens


def test_cuda_graphs_setting(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = save_hf_dir(tiny_model("qwen2", tie=True), tmp_path_factory.mktemp("q"))
    base = {"CHECKPOINT_PATH": str(path), "DEVICE": "cpu"}
    assert BackendConfig.from_env(base).cuda_graphs is False
    assert BackendConfig.from_env({**base, "CUDA_GRAPHS": "0"}).cuda_graphs is False
    with pytest.raises(ValueError, match="CUDA_GRAPHS=1 needs DEVICE=cuda"):
        BackendConfig.from_env({**base, "CUDA_GRAPHS": "1"})
    with pytest.raises(ValueError, match="CUDA_GRAPHS"):
        BackendConfig.from_env({**base, "CUDA_GRAPHS": "yes"})
