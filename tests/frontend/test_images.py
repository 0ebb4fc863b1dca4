"""frontend/images.py: where a request's images may come from and what is refused, each refusal a 400
naming the request part; fetched from a loopback server that the operator's allow-list names."""
from __future__ import annotations

import asyncio
import base64
import hashlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from frontend import images
from frontend.images import CheckedImages, ImageLimits, load_images
from kvyard.errors import ErrorCode, RequestError
from tests.support.image_server import BIG, PNG, image_server

PART = "messages[0].content[1]"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with image_server() as url:
        yield url


def limits(**kw: object) -> ImageLimits:
    base: dict[str, object] = dict(max_bytes=50_000, max_count=2, fetch_timeout_s=2.0, allow_hosts=("127.0.0.1",))
    return ImageLimits(**{**base, **kw})  # type: ignore[arg-type]


def load(url: str, lim: ImageLimits | None = None) -> bytes:
    return asyncio.run(load_images([(PART, url)], lim or limits()))[0].data


def refused(url: str, needle: str, lim: ImageLimits | None = None) -> None:
    with pytest.raises(RequestError) as info:
        load(url, lim)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT and info.value.param == PART
    assert PART in info.value.message and needle in info.value.message, info.value.message


def data_uri(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


def test_data_uri() -> None:
    out = asyncio.run(load_images([(PART, data_uri(PNG))], limits()))[0]
    assert out.data == PNG and out.digest == hashlib.sha256(PNG).digest() and (out.width, out.height) == (40, 30)
    refused(data_uri(b"not a picture"), "not a readable image")
    refused(data_uri(PNG[: len(PNG) // 2]), "not a readable image")  # truncated
    refused("data:image/png;base64,@@@", "not valid base64")
    refused("data:text/plain;base64,aGk=", "data:image/")
    refused(data_uri(BIG), "larger than 50000 bytes")
    refused("ftp://example.com/x.png", "data: URI, an http(s) URL or a local file")


def test_an_image_seen_lately_is_only_hashed(monkeypatch: pytest.MonkeyPatch) -> None:
    checked = CheckedImages(capacity=1)
    first = asyncio.run(load_images([(PART, data_uri(PNG))], limits(), checked))[0]
    monkeypatch.setattr(images, "check_image", lambda *a: pytest.fail("decoded an image seen lately"))
    again = asyncio.run(load_images([(PART, data_uri(PNG))], limits(), checked))[0]
    assert again == first and (again.width, again.height) == (40, 30)
    monkeypatch.undo()
    refused_twice = data_uri(PNG[: len(PNG) // 2])  # a refused file is not remembered: refused again
    for _ in range(2):
        with pytest.raises(RequestError, match="not a readable image"):
            asyncio.run(load_images([(PART, refused_twice)], limits(), checked))


def test_loopback_fetch_on_the_allow_list(server: str) -> None:
    assert load(f"{server}/ok.png") == PNG
    refused(f"{server}/page", "content type 'text/html' is not an image")
    refused(f"{server}/big.png", "larger than 50000")
    refused(f"{server}/missing", "HTTP 404")
    refused(f"{server}/slow.png", "longer than 1 s", limits(fetch_timeout_s=1.0))
    refused(f"{server}/redirect-private", "10.1.2.3, an internal address")


def test_internal_addresses_refused_unless_allowed(server: str) -> None:
    closed = limits(allow_hosts=())
    refused(f"{server}/ok.png", "127.0.0.1, an internal address", closed)
    for url in ("http://10.0.0.1/x.png", "http://192.168.1.1/x.png", "http://169.254.169.254/latest",
                "http://[::1]/x.png", "http://0.0.0.0/x.png"):
        refused(url, "an internal address", closed)
    assert load(f"{server}/ok.png", limits(allow_hosts=("127.0.0.0/8",))) == PNG


def test_local_files_only_under_the_root(tmp_path: Path) -> None:
    root = tmp_path / "images"
    root.mkdir()
    (root / "a.png").write_bytes(PNG)
    (tmp_path / "outside.png").write_bytes(PNG)
    lim = limits(file_root=root.resolve())
    assert load(str(root / "a.png"), lim) == PNG
    assert load(f"file://{root / 'a.png'}", lim) == PNG
    refused(str(tmp_path / "outside.png"), "no such image file under IMAGE_FILE_ROOT", lim)
    refused(str(root / ".." / "outside.png"), "no such image file", lim)
    refused(str(root / "a.png"), "operator sets IMAGE_FILE_ROOT", limits())


def test_too_many_images() -> None:
    with pytest.raises(RequestError, match="3 images; at most 2") as info:
        asyncio.run(load_images([(f"urls[{i}]", data_uri(PNG)) for i in range(3)], limits()))
    assert info.value.param == "urls[2]"


def test_limits_from_env(tmp_path: Path) -> None:
    lim = ImageLimits.from_env({"IMAGE_MAX_BYTES": "1000", "IMAGE_MAX_COUNT": "3", "IMAGE_FETCH_TIMEOUT_S": "4",
                                "IMAGE_URL_ALLOW_HOSTS": "127.0.0.1, images.internal,10.0.0.0/8",
                                "IMAGE_FILE_ROOT": str(tmp_path)})
    assert (lim.max_bytes, lim.max_count, lim.fetch_timeout_s) == (1000, 3, 4.0)
    assert lim.allow_hosts == ("127.0.0.1", "images.internal", "10.0.0.0/8") and lim.file_root == tmp_path.resolve()
    with pytest.raises(ValueError, match="not a directory"):
        ImageLimits.from_env({"IMAGE_FILE_ROOT": str(tmp_path / "nope")})
    with pytest.raises(ValueError, match="not a network"):
        ImageLimits.from_env({"IMAGE_URL_ALLOW_HOSTS": "10.0.0.0/99"})


def test_a_text_only_model_refuses_images(client: openai.OpenAI, http: httpx.Client) -> None:
    image = {"type": "image_url", "image_url": {"url": data_uri(PNG)}}
    with pytest.raises(openai.BadRequestError, match="takes no images") as info:
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": [image]}])  # type: ignore[list-item]
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "messages[0].content[0]"
    r = http.post("/v1/chat/render", json={"messages": [{"role": "user", "content": [image]}]})
    assert r.status_code == 400 and "takes no images" in r.json()["error"]["message"]
    r = http.post("/", json={"prompt": "hi", "urls": [data_uri(PNG)]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "urls[0]"
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {}}]}]})
    assert r.status_code == 400, r.text


def test_detail_low_is_refused_not_ignored(http: httpx.Client) -> None:
    """A LLaVA tower has one resolution: `auto`/`high` are what it does, `low` cannot be honoured."""
    for detail, status in (("low", 400), ("auto", None), ("high", None)):
        part = {"type": "image_url", "image_url": {"url": data_uri(PNG), "detail": detail}}
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [part]}]})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        # low: refused at parsing, naming the field; auto/high parse and reach the text-only model's refusal
        assert ("detail" in message) == (status == 400), message
