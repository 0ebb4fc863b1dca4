"""End to end, as a user runs it: CHECKPOINT_PATH at a tiny random LLaVA directory, the real cluster on free
loopback ports, the official openai client sending an image part. The answer is transformers' greedy
continuation on the same picture and prompt; the same image again is a prefix-cache hit; /v1/chat/render
shows the placeholders; RTP-LLM's `POST /` takes `urls`; bad images are 400s naming the part."""
from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.image_server import PNG, image_server
from tests.support.procs import RoleProcess, free_port_block
from tests.support.tiny_vision import IMAGE_TOKEN, TinyLlava, png_bytes, reference_greedy, save_llava_dir, tiny_llava

STEPS = 6
QUESTION = "What is in the picture?"


@dataclass
class Server:
    tiny: TinyLlava
    path: Path
    url: str
    images_url: str                  # the loopback image server (on IMAGE_URL_ALLOW_HOSTS)
    file_root: Path
    client: openai.OpenAI
    model: str


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("llava-serve")
    tiny = tiny_llava()
    path = save_llava_dir(tiny, root / "tiny-llava")
    files = root / "files"
    files.mkdir()
    (files / "cat.png").write_bytes(png_bytes(64, 48, seed=3))
    port = free_port_block()
    with image_server() as images_url:
        env = {"CHECKPOINT_PATH": str(path), "START_PORT": str(port), "KV_CACHE_MB": "16",
               "IMAGE_URL_ALLOW_HOSTS": "127.0.0.1", "IMAGE_FILE_ROOT": str(files), "IMAGE_MAX_COUNT": "2",
               "IMAGE_MAX_BYTES": "100000"}
        proc = RoleProcess(env, root / "server.log")
        try:
            proc.wait_healthy(f"http://127.0.0.1:{port}/health", timeout_s=180)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
            yield Server(tiny, path, f"http://127.0.0.1:{port}", images_url, files, client,
                         client.models.list().data[0].id)
        finally:
            proc.stop()


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def messages(*urls: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": QUESTION}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": parts}]


def chat(server: Server, *urls: str) -> dict[str, Any]:
    resp = server.client.chat.completions.create(
        model=server.model, messages=messages(*urls), temperature=0, max_tokens=STEPS,  # type: ignore[arg-type]
        extra_body={"debug_info": True, "aux_info": True, "ignore_eos": True})
    return resp.to_dict()


def reference_tokens(server: Server, ids: list[int], image: bytes) -> list[int]:
    return reference_greedy(server.tiny, server.path, ids, image, STEPS)


def test_openai_client_image_part_matches_transformers_then_hits_the_cache(server: Server) -> None:
    image = png_bytes(80, 60, seed=1)
    body = chat(server, data_uri(image))
    debug = body["debug_info"]
    token = server.tiny.image_token_id
    assert debug["input_prompt"].count(IMAGE_TOKEN) == 1
    ids = debug["input_ids"]
    assert ids.count(token) == server.tiny.image_tokens
    assert debug["output_ids"][0] == reference_tokens(server, ids, image)
    assert body["aux_info"]["reuse_len"] == 0
    again = chat(server, data_uri(image))
    assert again["debug_info"]["output_ids"] == debug["output_ids"]
    assert again["aux_info"]["reuse_len"] == (len(ids) - 1) // 16 * 16 > 0
    other = chat(server, data_uri(png_bytes(80, 60, seed=2)))  # the same tokens, another picture
    first_image_block = ids.index(token) // 16
    assert other["aux_info"]["reuse_len"] == first_image_block * 16


def test_url_and_local_file_sources(server: Server) -> None:
    by_url = chat(server, f"{server.images_url}/ok.png")
    by_data = chat(server, data_uri(PNG))
    assert by_url["debug_info"]["output_ids"] == by_data["debug_info"]["output_ids"]
    assert by_url["debug_info"]["input_urls"] == [f"{server.images_url}/ok.png"]
    local = chat(server, str(server.file_root / "cat.png"))
    assert len(local["debug_info"]["output_ids"][0]) == STEPS


def test_render_shows_the_placeholders(server: Server) -> None:
    r = httpx.post(f"{server.url}/v1/chat/render", json={"messages": messages(data_uri(PNG), data_uri(PNG))}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["input_prompt"].count(IMAGE_TOKEN) == 2
    assert body["input_ids"].count(server.tiny.image_token_id) == 2 * server.tiny.image_tokens
    assert [u.startswith("data:image/png;base64,") for u in body["input_urls"]] == [True, True]


def test_tokenize_counts_each_image_as_the_request_is_billed(server: Server) -> None:
    """/tokenize of a chat with an image part: the ids the request sends (the image's whole run of
    placeholders, as usage counts them), and a bad image is the same 400 as in chat. It used to give one
    placeholder per image without looking at the image."""
    r = httpx.post(f"{server.url}/tokenize", json={"messages": messages(data_uri(PNG))}, timeout=30)
    assert r.status_code == 200, r.text
    ids = r.json()["token_ids"]
    assert ids.count(server.tiny.image_token_id) == server.tiny.image_tokens
    resp = server.client.chat.completions.create(model=server.model, messages=messages(data_uri(PNG)),  # type: ignore[arg-type]
                                                 max_tokens=1)
    assert resp.usage is not None and resp.usage.prompt_tokens == len(ids)
    r = httpx.post(f"{server.url}/tokenize", json={"messages": messages(data_uri(b"garbage"))}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[1]", r.text


def test_rtp_llm_urls(server: Server) -> None:
    r = httpx.post(f"{server.url}/", json={"prompt": QUESTION, "urls": [data_uri(PNG)],
                                          "generate_config": {"max_new_tokens": 3, "return_input_ids": True}},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["input_ids"][0].count(server.tiny.image_token_id) == server.tiny.image_tokens
    r = httpx.post(f"{server.url}/", json={"prompt": [QUESTION, QUESTION], "urls": [data_uri(PNG)]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "urls"


@pytest.mark.parametrize("url,param,needle", [
    (data_uri(b"garbage"), "messages[0].content[1]", "not a readable image"),
    ("http://10.1.2.3/x.png", "messages[0].content[1]", "internal address"),
    ("/etc/passwd", "messages[0].content[1]", "no such image file under IMAGE_FILE_ROOT"),
    # each of these was a 500 before: a URL that cannot be fetched is the client's, never an internal error
    ("http://127.0.0.1:1/x.png", "messages[0].content[1]", "cannot fetch it (ConnectError"),
    ("http://127.0.0.1:99999/x.png", "messages[0].content[1]", "the port is not a number"),
    ("{images}/short.png", "messages[0].content[1]", "cannot fetch it (RemoteProtocolError"),
    ("{images}/redirect-ftp", "messages[0].content[1]", "only http and https URLs are fetched"),
    ("{root}/\x00cat.png", "messages[0].content[1]", "no such image file under IMAGE_FILE_ROOT"),
])
def test_bad_images_are_400s_naming_the_part(server: Server, url: str, param: str, needle: str) -> None:
    url = url.format(images=server.images_url, root=server.file_root)
    with pytest.raises(openai.BadRequestError) as info:
        chat(server, url)
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == param and needle in error["message"], error
    assert "object at 0x" not in error["message"], error  # no Python reprs of the server's own objects


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"What does {IMAGE_TOKEN} mean?"}],
                              "max_tokens": 2}, "messages"),
    ("/v1/completions", {"prompt": f"What does {IMAGE_TOKEN} mean?", "max_tokens": 2}, "prompt"),
    ("/", {"prompt": f"What does {IMAGE_TOKEN} mean?", "generate_config": {"max_new_tokens": 2}}, "prompt"),
])
def test_a_placeholder_in_the_text_without_an_image_is_a_400_naming_the_field(server: Server, path: str,
                                                                             body: dict[str, Any], param: str) -> None:
    """It reached the backend, whose 400 had no param and spoke of '1 image placeholder tokens at position
    13: not a multiple of 16'."""
    r = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "1 image placeholder(s) for 0 image(s)" in r.json()["error"]["message"], r.text


def test_too_many_and_too_large(server: Server) -> None:
    with pytest.raises(openai.BadRequestError, match="3 images; at most 2"):
        chat(server, data_uri(PNG), data_uri(PNG), data_uri(PNG))
    with pytest.raises(openai.BadRequestError, match="larger than 100000"):
        chat(server, f"{server.images_url}/big.png")


def test_responses_api_input_image_answers_as_chat_does(server: Server) -> None:
    image = png_bytes(80, 60, seed=4)
    content = [{"type": "input_text", "text": QUESTION}, {"type": "input_image", "image_url": data_uri(image)}]
    resp = server.client.responses.create(model=server.model, input=[{"role": "user", "content": content}],
                                          temperature=0, max_output_tokens=STEPS)  # type: ignore[list-item]
    as_chat = server.client.chat.completions.create(model=server.model, messages=messages(data_uri(image)),
                                                    temperature=0, max_tokens=STEPS)  # type: ignore[arg-type]
    assert resp.output_text == as_chat.choices[0].message.content
    assert resp.usage is not None and resp.usage.input_tokens == as_chat.usage.prompt_tokens  # type: ignore[union-attr]
    for part, needle in [({"type": "input_image", "file_id": "file-1"}, "uploaded files are not served"),
                         ({"type": "input_image", "image_url": data_uri(b"garbage")}, "not a readable image")]:
        with pytest.raises(openai.BadRequestError, match=needle):
            server.client.responses.create(model=server.model, max_output_tokens=2,
                                           input=[{"role": "user", "content": [part]}])  # type: ignore[list-item]
