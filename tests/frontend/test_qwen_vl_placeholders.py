"""Qwen-VL prompts without a model: each image's <|image_pad|> becomes as many tokens as its size makes
(smart_resize to multiples of 28 within the pixel budget, 2×2 patches a token), and a picture too long and
thin to resize is a 400 naming the part."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from frontend.images import LoadedImage, with_images
from kvyard.errors import RequestError
from kvyard.qwen_vl_config import QwenVisionConfig, load_qwen_vision, smart_resize
from kvyard.vision_config import image_spans
from renderers.base import RenderedPrompt

PAD, START, END = 90, 91, 92


def qwen_vision(path: Path) -> QwenVisionConfig:
    """A Qwen2.5-VL image side with a budget of 4 to 64 image tokens."""
    (path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": 28 * 28 * 64}))
    return load_qwen_vision(path, {"model_type": "qwen2_5_vl", "image_token_id": PAD, "vision_start_token_id": START,
                                   "vision_end_token_id": END, "vision_config": {"hidden_size": 64, "num_heads": 2}})


@pytest.fixture()
def vision(tmp_path: Path) -> QwenVisionConfig:
    return qwen_vision(tmp_path)


def image(width: int, height: int) -> LoadedImage:
    return LoadedImage(b"x", hashlib.sha256(b"x").digest(), width, height)


def test_smart_resize() -> None:
    assert smart_resize(84, 140, 28, 3136, 50176) == (84, 140)
    assert smart_resize(10, 10, 28, 3136, 50176) == (56, 56)            # up to the minimum area
    h, w = smart_resize(1000, 2000, 28, 3136, 50176)                    # down to the maximum area
    assert h % 28 == w % 28 == 0 and h * w <= 50176 and abs(w / h - 2) < 0.25
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2500, 28, 3136, 50176)


def test_each_image_takes_its_own_size(vision: QwenVisionConfig) -> None:
    ids = [1, START, PAD, END, 2, START, PAD, END, 3]
    rendered = RenderedPrompt("p", ids, [], "test", "model")
    out = with_images(rendered, [image(140, 84), image(56, 56)], vision, "messages").input_ids
    assert out == [1, START, *[PAD] * 15, END, 2, START, *[PAD] * 4, END, 3]
    assert image_spans(out, vision) == [(2, 15), (20, 4)]
    with pytest.raises(RequestError, match="aspect ratio") as info:
        with_images(rendered, [image(140, 84), image(3000, 14)], vision, "messages")
    assert info.value.param == "messages"
