"""End to end with a Qwen2.5-VL directory: the real cluster on free loopback ports, the official openai client
sending an image part. The prompt holds <|vision_start|><|image_pad|>×N<|vision_end|> with N from the
image's size, the answer is transformers' greedy continuation (M-RoPE and all), the same image again is a
prefix-cache hit, /v1/chat/render shows one placeholder per image, and RTP-LLM's `POST /` takes `urls`."""
from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.support.procs import RoleProcess, free_port_block
from tests.support.tiny_qwen_vl import TinyQwenVL, save_qwen_vl_dir, tiny_qwen_vl
from tests.support.tiny_vision import png_bytes

STEPS = 6
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


@dataclass
class Server:
    tiny: TinyQwenVL
    url: str
    client: openai.OpenAI

    @property
    def model(self) -> str:
        return self.client.models.list().data[0].id


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("qwen-vl-serve")
    tiny = tiny_qwen_vl()
    path = save_qwen_vl_dir(tiny, root / "tiny-qwen2.5-vl")
    port = free_port_block()
    proc = RoleProcess({"CHECKPOINT_PATH": str(path), "START_PORT": str(port), "KV_CACHE_MB": "16"}, root / "server.log")
    try:
        proc.wait_healthy(f"http://127.0.0.1:{port}/health", timeout_s=180)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        yield Server(tiny, f"http://127.0.0.1:{port}", client)
    finally:
        proc.stop()


def messages(image: bytes) -> list[dict[str, Any]]:
    uri = "data:image/png;base64," + base64.b64encode(image).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                         {"type": "text", "text": "What is in the picture?"}]}]


def reference_tokens(tiny: TinyQwenVL, ids: list[int], image: bytes) -> list[int]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from backend.image_preprocess import decode_image
    inputs: Any = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)(
        images=[decode_image(image)], return_tensors="pt")
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(STEPS):
            tiny.hf_model.model.rope_deltas = None
            full = torch.tensor([ids + out])
            logits = tiny.hf_model(input_ids=full, mm_token_type_ids=(full == tiny.id("<|image_pad|>")).int(),
                                   pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]).logits
            out.append(int(logits[0, -1].argmax()))
    return out


def test_openai_client_image_part_matches_transformers_then_hits_the_cache(server: Server) -> None:
    image = png_bytes(140, 84, seed=1)  # resized to 140×84: 6×10 patches, 15 image tokens
    kwargs: Any = {"model": server.model, "messages": messages(image), "temperature": 0, "max_tokens": STEPS,
                   "extra_body": {"debug_info": True, "aux_info": True, "ignore_eos": True}}
    body = server.client.chat.completions.create(**kwargs).to_dict()
    debug = body["debug_info"]
    ids = debug["input_ids"]
    pad = server.tiny.id("<|image_pad|>")
    assert ids.count(pad) == 15
    start = ids.index(pad)
    assert ids[start - 1] == server.tiny.id("<|vision_start|>") and ids[start + 15] == server.tiny.id("<|vision_end|>")
    assert debug["output_ids"][0] == reference_tokens(server.tiny, ids, image)
    again = server.client.chat.completions.create(**kwargs).to_dict()
    assert again["debug_info"]["output_ids"] == debug["output_ids"]
    assert again["aux_info"]["reuse_len"] == (len(ids) - 1) // 16 * 16 > 0

    r = httpx.post(f"{server.url}/v1/chat/render", json={"messages": messages(image)}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["input_prompt"].count(PLACEHOLDER) == 1
    assert r.json()["input_ids"] == ids

    # RTP-LLM's POST / with urls and a prompt that names no image: the placeholder goes in front
    uri = messages(image)[0]["content"][0]["image_url"]["url"]
    r = httpx.post(f"{server.url}/", json={"prompt": "Describe it.", "urls": [uri],
                                          "generate_config": {"max_new_tokens": 2, "return_input_ids": True}}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["input_ids"][0].count(pad) == 15


@pytest.mark.parametrize("width,height,ok", [(1, 200, True), (1, 201, False), (3000, 14, False)])
def test_a_too_thin_picture_is_a_400_naming_its_part(server: Server, width: int, height: int, ok: bool) -> None:
    """Past 200:1 Qwen-VL's resize has no answer: a 400 whose param is the image part (it named
    "messages", and said "under 200" while 200 itself is taken)."""
    body = {"messages": messages(png_bytes(width, height)), "max_tokens": 1}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    if ok:
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0]", r.text
    assert "more than 200 times longer than wide" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/", json={"prompt": "?", "urls": [messages(png_bytes(width, height))[0]["content"][0]
                                                                   ["image_url"]["url"]]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "urls[0]", r.text
