"""An image whose embedding the tower already holds skips the gRPC edge's decode and patches (only its hash
and, for Qwen-VL, its header's size → grid); the engine still answers the same, and an image evicted between
the edge's look and the engine's preprocesses its file there."""
from __future__ import annotations

import hashlib

import pytest
import torch

import backend.image_preprocess as image_preprocess
from backend.engine import GenerationRequest
from backend.image_preprocess import image_input, prompt_images
from backend.sequence import StopConditions
from kvyard.errors import RequestError
from kvyard.qwen_vl_config import QwenVisionConfig
from kvyard.sampling_params import SamplingParams
from tests.backend.conftest import build_engine, greedy_run
from tests.support.tiny_qwen_vl import save_qwen_vl_dir, tiny_qwen_vl
from tests.support.tiny_vision import load_vision_model, png_bytes


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    tiny = tiny_qwen_vl("qwen2_5_vl")
    config, model, tower = load_vision_model(save_qwen_vl_dir(tiny, tmp_path_factory.mktemp("qwen")))
    assert isinstance(config.vision, QwenVisionConfig)
    return tiny, config, model, tower


def test_a_known_digest_is_not_decoded(monkeypatch: pytest.MonkeyPatch, served) -> None:  # type: ignore[no-untyped-def]
    _, config, _, _ = served
    data = png_bytes(140, 84, seed=1)
    full = image_input(data, config.vision)
    digest = hashlib.sha256(data).digest()
    monkeypatch.setattr(image_preprocess, "decode_image", lambda *a: pytest.fail("decoded a cached image"))
    [skipped] = prompt_images([data], config.vision, frozenset({digest}))
    assert skipped.pixels is None and skipped.file == data
    assert (skipped.digest, skipped.grid) == (full.digest, full.grid)
    with pytest.raises(RequestError, match="images\\[0\\]"):  # still a 400 for a file that is no picture
        prompt_images([b"not a picture"], config.vision, frozenset({hashlib.sha256(b"not a picture").digest()}))


def test_same_answer_and_evicted_images_are_preprocessed(served) -> None:  # type: ignore[no-untyped-def]
    tiny, config, model, tower = served
    data = png_bytes(140, 84, seed=2)
    digest = hashlib.sha256(data).digest()
    full = image_input(data, config.vision)
    pad = [tiny.id("<|image_pad|>")] * config.vision.num_tokens(140, 84)
    ids = [20, 21, tiny.id("<|vision_start|>"), *pad, tiny.id("<|vision_end|>"), 30, 31, 32]

    def run(name: str, engine_images: list) -> tuple[list[int], list[torch.Tensor]]:  # type: ignore[type-arg]
        engine = build_engine(model, config, num_blocks=48, block_size=8, max_num_batched_tokens=64)
        engine.vision, engine.tower = config.vision, tower
        tokens, logits, _ = greedy_run(engine, GenerationRequest(name, list(ids), SamplingParams(),
                                                                 StopConditions(max_new_tokens=3, ignore_eos=True),
                                                                 images=engine_images))
        return tokens, logits

    tower.cache.clear()
    tower.cached_bytes = 0
    tokens, logits = run("cold", [full])
    assert digest in tower.known
    runs = tower.tower_runs
    skipped = image_input(data, config.vision, cached=tower.known)
    assert skipped.pixels is None
    again, again_logits = run("cached", [skipped])
    assert again == tokens and tower.tower_runs == runs
    assert all(torch.equal(a, b) for a, b in zip(logits, again_logits))
    tower.cache.clear()  # evicted after the edge looked: the engine preprocesses the file itself
    tower.cached_bytes = 0
    evicted, evicted_logits = run("evicted", [skipped])
    assert evicted == tokens and tower.tower_runs == runs + 1
    assert all(float((a - b).abs().max()) < 1e-5 for a, b in zip(logits, evicted_logits))


def test_known_follows_the_cache(served) -> None:  # type: ignore[no-untyped-def]
    _, config, _, tower = served
    images = [image_input(png_bytes(56, 56, seed=s), config.vision) for s in range(3)]
    budget, tower.cache_bytes = tower.cache_bytes, 1  # one embedding at a time
    try:
        for im in images:
            tower.embed(im.digest, im.pixels, im.grid)
            assert tower.known == frozenset({im.digest})
    finally:
        tower.cache_bytes = budget
