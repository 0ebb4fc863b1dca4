"""A tiny random LLaVA (CLIP tower + MLP projector + Llama) from its Hugging Face directory against
transformers' LlavaForConditionalGeneration on the same picture and prompt: our Pillow preprocessing
against transformers' CLIP image processor, then the engine's logits (float32, within 2e-3) and greedy
tokens; the same image again is a prefix-cache hit and no second tower pass, a different image behind the
same placeholder tokens is not."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch

from backend.engine import Engine, GenerationRequest
from backend.engine_types import ImageInput
from backend.image_preprocess import decode_image, pixels
from backend.sequence import StopConditions
from kvyard.block_keys import block_cache_keys, image_block_salts
from kvyard.errors import RequestError
from kvyard.sampling_params import SamplingParams
from kvyard.vision_config import image_spans
from tests.backend.conftest import build_engine, greedy_run
from tests.support.tiny_vision import TinyLlava, load_vision_model, png_bytes, save_llava_dir, tiny_llava

ATOL = 2e-3
STEPS = 8


class Served:
    def __init__(self, tiny: TinyLlava, path: Path) -> None:
        self.tiny, self.path = tiny, path
        self.config, self.model, self.tower = load_vision_model(path)

    def engine(self) -> Engine:
        engine = build_engine(self.model, self.config, num_blocks=32, block_size=8, max_num_batched_tokens=64)
        engine.vision, engine.tower = self.config.vision, self.tower
        return engine

    def image(self, data: bytes) -> ImageInput:
        assert self.config.vision is not None
        return ImageInput(hashlib.sha256(data).digest(), pixels(decode_image(data), self.config.vision.preprocess))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    tiny = tiny_llava()
    return Served(tiny, save_llava_dir(tiny, tmp_path_factory.mktemp("llava")))


def prompt(tiny: TinyLlava) -> list[int]:
    text = torch.randint(10, 500, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    return text[:5] + [tiny.image_token_id] * tiny.image_tokens + text[5:]


def hf_greedy(tiny: TinyLlava, ids: list[int], pixel_values: torch.Tensor) -> tuple[list[int], list[torch.Tensor]]:
    tokens, logits = [], []
    with torch.inference_mode():
        out = tiny.hf_model(input_ids=torch.tensor([ids]), pixel_values=pixel_values, use_cache=True)
        for _ in range(STEPS):
            row = out.logits[0, -1].float()
            tokens.append(int(row.argmax()))
            logits.append(row)
            out = tiny.hf_model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                                use_cache=True)
    return tokens, logits


def engine_run(engine: Engine, request_id: str, ids: list[int], images: list[ImageInput]) -> tuple[list[int], list[torch.Tensor], int]:
    return greedy_run(engine, GenerationRequest(request_id, list(ids), SamplingParams(),
                                               StopConditions(max_new_tokens=STEPS, ignore_eos=True), images=images))


def hf_pixels(path: Path, data: bytes) -> torch.Tensor:
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    processor: Any = CLIPImageProcessorPil.from_pretrained(str(path))
    return processor(images=[decode_image(data)], return_tensors="pt")["pixel_values"]


@pytest.mark.parametrize("size", [(80, 60), (56, 56), (33, 97)])
def test_preprocessing_matches_transformers(served: Served, size: tuple[int, int]) -> None:
    data = png_bytes(*size, seed=sum(size))
    ours = served.image(data).pixels
    assert ours is not None
    theirs = hf_pixels(served.path, data)[0]
    assert ours.shape == theirs.shape == (3, 56, 56)
    assert float((ours - theirs).abs().max()) < 1e-4


def test_logits_and_tokens_match_transformers_then_cache(served: Served) -> None:
    data = png_bytes(80, 60, seed=1)
    ids = prompt(served.tiny)
    theirs, their_logits = hf_greedy(served.tiny, ids, hf_pixels(served.path, data))
    engine = served.engine()
    runs = served.tower.tower_runs
    for request_id in ("cold", "again"):
        ours, our_logits, reuse = engine_run(engine, request_id, ids, [served.image(data)])
        for step, (a, b) in enumerate(zip(our_logits, their_logits)):
            diff = float((a - b).abs().max())
            assert diff <= ATOL, f"{request_id} step {step}: max |logit diff| {diff:.2e}"
        assert ours == theirs, request_id
        # 28 prompt tokens in blocks of 8: the second run reuses the 3 full blocks (24 tokens)
        assert reuse == (0 if request_id == "cold" else 24)
    assert served.tower.tower_runs == runs + 1  # the second run's embeddings came from the cache
    # The frontend's keys for the master (kvyard.block_keys with the image salts) are the ones the pool holds;
    # the same tokens keyed without the image are not.
    assert served.config.vision is not None
    salts = image_block_salts(image_spans(ids, served.config.vision), [hashlib.sha256(data).digest()], 8)
    held = set(engine.scheduler.block_pool.cached_keys())
    assert set(block_cache_keys(ids, 8, salts=salts)) <= held
    assert not set(block_cache_keys(ids, 8)) & held
    assert float(torch.stack(their_logits).std()) > 0.3

    other = png_bytes(80, 60, seed=2)
    theirs2, _ = hf_greedy(served.tiny, ids, hf_pixels(served.path, other))
    ours2, _, reuse2 = engine_run(engine, "other", ids, [served.image(other)])
    assert reuse2 == 0  # the image starts in the first block: nothing before it to share
    assert ours2 == theirs2


def test_images_and_placeholders_must_pair(served: Served) -> None:
    engine = served.engine()
    ids = prompt(served.tiny)
    image = served.image(png_bytes(20, 20))
    stop = StopConditions(max_new_tokens=2)
    with pytest.raises(RequestError, match="placeholders for 1 image"):
        engine.validate(GenerationRequest("two", ids, SamplingParams(), stop, images=[image, image]))
    with pytest.raises(RequestError, match="not a multiple"):
        engine.validate(GenerationRequest("short", ids[:-8], SamplingParams(), stop, images=[image]))
    text_only = served.engine()
    text_only.vision = text_only.tower = None
    with pytest.raises(RequestError, match="takes no images"):
        text_only.validate(GenerationRequest("text", ids, SamplingParams(), stop, images=[image]))
