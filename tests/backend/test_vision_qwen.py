"""Tiny random Qwen2.5-VL and Qwen2-VL checkpoints from their Hugging Face directories against transformers on
the same picture and prompt: our Pillow preprocessing (dynamic resolution, patches) against transformers'
Qwen2-VL image processor, then the engine's logits (float32, within 2e-3) and greedy tokens over 10 decode
steps (M-RoPE's 3-D image positions, then decode at index + rope_delta); a follow-up turn with the same image
is a prefix-cache hit that still matches transformers, and a run of the wrong length is refused."""
from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch

from backend.engine import Engine, GenerationRequest
from backend.engine_types import ImageInput
from backend.grpc_server import start_grpc_server
from backend.image_preprocess import decode_image, image_input
from backend.mrope import MropePositions
from backend.pb_convert import handover_request_from_pb
from backend.sequence import Sequence, StopConditions
from backend.vision_inputs import salt_images
from backend.vit_client import VitClient
from backend.vit_server import VitServicer
from kvyard.block_keys import block_cache_keys, image_block_salts
from kvyard.errors import RequestError
from kvyard.ports import free_port_block as free_port
from kvyard.qwen_vl_config import QwenVisionConfig
from kvyard.sampling_params import SamplingParams
from kvyard.vision_config import image_spans
from tests.backend.conftest import build_engine, greedy_run
from proto import model_rpc_pb2 as pb
from tests.support.tiny_qwen_vl import TinyQwenVL, save_qwen_vl_dir, tiny_qwen_vl
from tests.support.tiny_vision import load_vision_model, png_bytes

ATOL, STEPS = 2e-3, 10  # logits within ATOL (float32) over STEPS greedy decode steps


class Served:
    def __init__(self, tiny: TinyQwenVL, path: Path) -> None:
        self.tiny, self.path = tiny, path
        self.config, self.model, self.tower = load_vision_model(path)
        assert isinstance(self.config.vision, QwenVisionConfig)
        self.vision: QwenVisionConfig = self.config.vision

    def engine(self) -> Engine:
        engine = build_engine(self.model, self.config, num_blocks=48, block_size=8, max_num_batched_tokens=64)
        engine.vision, engine.tower = self.vision, self.tower
        return engine

    def image(self, data: bytes) -> ImageInput:
        return image_input(data, self.vision)

    def prompt(self, data: bytes, before: int = 5, after: int = 7) -> list[int]:
        img = decode_image(data)
        text = torch.randint(10, 400, (before + after,), generator=torch.Generator().manual_seed(3)).tolist()
        pad = [self.tiny.id("<|image_pad|>")] * self.vision.num_tokens(img.width, img.height)
        return text[:before] + [self.tiny.id("<|vision_start|>"), *pad, self.tiny.id("<|vision_end|>")] + text[before:]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Served:
    tiny = tiny_qwen_vl(request.param)
    # Qwen2-VL as the published checkpoints lay it out (flat config.json, visual.* tensors); 2.5 as transformers 5 saves it
    return Served(tiny, save_qwen_vl_dir(tiny, tmp_path_factory.mktemp(request.param),
                                         published_layout=request.param == "qwen2_vl"))


def hf_inputs(path: Path, *data: bytes) -> dict[str, torch.Tensor]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    processor: Any = Qwen2VLImageProcessorPil.from_pretrained(str(path))
    out = processor(images=[decode_image(d) for d in data], return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def hf_greedy(served: Served, ids: list[int], *data: bytes) -> tuple[list[int], list[torch.Tensor]]:
    model = served.tiny.hf_model
    model.model.rope_deltas = None  # transformers keeps the last prompt's delta on the model
    tokens, logits = [], []
    types = (torch.tensor([ids]) == served.vision.image_token_id).int()
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), mm_token_type_ids=types, use_cache=True, **hf_inputs(served.path, *data))
        for _ in range(STEPS):
            row = out.logits[0, -1].float()
            tokens.append(int(row.argmax()))
            logits.append(row)
            out = model(input_ids=torch.tensor([[tokens[-1]]]), cache=out.past_key_values, use_cache=True)
    return tokens, logits


def engine_run(engine: Engine, request_id: str, ids: list[int], images: list[ImageInput]) -> tuple[list[int], list[torch.Tensor], int]:
    return greedy_run(engine, GenerationRequest(request_id, list(ids), SamplingParams(),
                                               StopConditions(max_new_tokens=STEPS, ignore_eos=True), images=images))


def assert_close(ours: list[torch.Tensor], theirs: list[torch.Tensor], what: str) -> None:
    assert len(ours) == len(theirs) == STEPS
    for step, (a, b) in enumerate(zip(ours, theirs)):
        diff = float((a - b).abs().max())
        assert diff <= ATOL, f"{what} step {step}: max |logit diff| {diff:.2e}"


@pytest.mark.parametrize("size", [(140, 84), (40, 300), (333, 251)])
def test_preprocessing_matches_transformers(served: Served, size: tuple[int, int]) -> None:
    data = png_bytes(*size, seed=sum(size))
    ours = served.image(data)
    theirs = hf_inputs(served.path, data)
    assert ours.grid == tuple(theirs["image_grid_thw"][0].tolist())
    assert ours.pixels is not None and ours.pixels.shape == theirs["pixel_values"].shape
    assert float((ours.pixels - theirs["pixel_values"]).abs().max()) < 1e-4
    t, h, w = ours.grid
    assert served.vision.num_tokens(*size) == t * h * w // 4


def test_logits_and_tokens_match_transformers_then_cache(served: Served) -> None:
    data = png_bytes(140, 84, seed=1)  # 6×10 patches: 15 image tokens, M-RoPE delta 5 - 15 = -10
    ids = served.prompt(data)
    theirs, their_logits = hf_greedy(served, ids, data)
    engine = served.engine()
    runs = served.tower.tower_runs
    ours, our_logits, reuse = engine_run(engine, "cold", ids, [served.image(data)])
    assert_close(our_logits, their_logits, "cold")
    assert ours == theirs
    assert float(torch.stack(their_logits).std()) > 0.3

    # A follow-up turn: the first prompt, the answer, more text. Its prefix blocks come from the cache, its
    # image from the embedding cache, and the new tokens' positions still follow the image's delta.
    follow = ids + ours + [11, 12, 13, 14, 15]
    theirs2, their_logits2 = hf_greedy(served, follow, data)
    ours2, our_logits2, reuse2 = engine_run(engine, "follow-up", follow, [served.image(data)])
    assert reuse2 >= len(ids) // 8 * 8 and reuse == 0
    assert served.tower.tower_runs == runs + 1
    assert_close(our_logits2, their_logits2, "follow-up")
    assert ours2 == theirs2
    # The frontend's keys for the master (with the image salts) are the ones the pool holds.
    salts = image_block_salts(image_spans(ids, served.vision), [hashlib.sha256(data).digest()], 8)
    held = set(engine.scheduler.block_pool.cached_keys())
    assert set(block_cache_keys(ids, 8, salts=salts)) <= held
    assert not set(block_cache_keys(ids, 8)) & held


def test_two_images_of_different_sizes(served: Served) -> None:
    """Each image's positions start where the text before it ends; the delta adds up over both."""
    first, second = png_bytes(140, 84, seed=1), png_bytes(60, 130, seed=4)
    ids = served.prompt(first) + served.prompt(second, before=3, after=4)
    theirs, their_logits = hf_greedy(served, ids, first, second)
    ours, our_logits, _ = engine_run(served.engine(), "two", ids, [served.image(first), served.image(second)])
    assert_close(our_logits, their_logits, "two images")
    assert ours == theirs


def test_run_length_must_match_the_image(served: Served) -> None:
    engine = served.engine()
    data = png_bytes(140, 84, seed=1)
    ids = served.prompt(data)
    image = served.image(data)
    stop = StopConditions(max_new_tokens=2)
    short = [t for i, t in enumerate(ids) if not (t == served.vision.image_token_id and i % 5 == 0)]
    with pytest.raises(RequestError, match="but the image takes 15"):
        engine.validate(GenerationRequest("short", short, SamplingParams(), stop, images=[image]))
    with pytest.raises(RequestError, match="placeholders for 1 image"):
        engine.validate(GenerationRequest("two", ids, SamplingParams(), stop, images=[image, image]))


def test_vit_and_hand_over_carry_the_grid(served: Served) -> None:
    """A VIT's embeddings come with the image's grid (the backend's M-RoPE needs it) and give the same
    tokens as the backend's own tower; a PD hand-over header carries the grids to the decode side, whose
    sequence then decodes at index + the same delta."""
    data = png_bytes(140, 84, seed=1)
    ids = served.prompt(data)
    own = served.image(data)

    async def via_vit() -> list[ImageInput]:
        port = free_port()
        server, _ = await start_grpc_server(VitServicer(served.tower), "127.0.0.1", port, "t")
        try:
            client = VitClient((f"127.0.0.1:{port}",), "t", served.vision, served.config.hidden_size, torch.float32,
                               torch.device("cpu"))
            return await client.prompt_images("r", [data])
        finally:
            await server.stop(None)

    vit = asyncio.run(via_vit())
    assert vit[0].grid == own.grid == (1, 6, 10) and vit[0].pixels is None and vit[0].embeds is not None
    tokens_own, _, _ = engine_run(served.engine(), "own", ids, [own])
    tokens_vit, _, _ = engine_run(served.engine(), "vit", ids, vit)
    assert tokens_vit == tokens_own

    header = pb.KVTransferHeaderPB(request_id="pd", prompt_ids=ids, first_token=7, image_digests=[own.digest],
                                   image_grids=[1, 6, 10])
    req = handover_request_from_pb(header, frozenset(), 512)
    seq = Sequence("pd", req.prompt_ids, req.stop)
    salt_images([seq], req.images, served.vision, 8)
    rope = seq.feature(MropePositions)
    assert rope is not None and rope.delta == 5 - 15 and rope.flat(len(ids) + 1, 1) == [len(ids) + 1 - 10]
