"""A request's images → their bytes, checked, before the prompt is prepared: `data:` URIs, http(s) URLs
(size cap, timeout, an image content type, and never a private, loopback or link-local address unless the
operator's allow-list names it) and local files under the operator's directory only. Each failure is a 400
naming the request part it came from (docs/vision.md)."""
from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import ipaddress
import socket
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx
from PIL import Image, UnidentifiedImageError

from kvyard.env import env_int
from kvyard.errors import ErrorCode, RequestError
from kvyard.vision_config import ImageSide
from renderers import RenderedPrompt

MAX_PIXELS = 64 << 20          # the backend's decoder refuses more too (backend/image_preprocess.py)
_MAX_REDIRECTS = 3


@dataclass(frozen=True)
class ImageLimits:
    """The operator's rules for images (FrontendConfig.images)."""
    max_bytes: int = 20 << 20               # IMAGE_MAX_BYTES: one image's encoded size
    max_count: int = 8                      # IMAGE_MAX_COUNT: images in one request
    fetch_timeout_s: float = 10.0           # IMAGE_FETCH_TIMEOUT_S: one URL's whole download
    allow_hosts: tuple[str, ...] = ()       # IMAGE_URL_ALLOW_HOSTS: hosts, addresses or networks (CIDR) that may
                                            # be fetched although private, loopback or link-local
    file_root: Path | None = None           # IMAGE_FILE_ROOT: local files below it may be named; unset: none

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ImageLimits:
        root = env.get("IMAGE_FILE_ROOT", "")
        if root and not Path(root).is_dir():
            raise ValueError(f"IMAGE_FILE_ROOT {root!r} is not a directory")
        hosts = tuple(h.strip().lower() for h in env.get("IMAGE_URL_ALLOW_HOSTS", "").split(",") if h.strip())
        for h in hosts:
            if "/" in h:
                try:
                    ipaddress.ip_network(h, strict=False)
                except ValueError:
                    raise ValueError(f"IMAGE_URL_ALLOW_HOSTS: {h!r} is not a network (CIDR)") from None
        return cls(max_bytes=env_int(env, "IMAGE_MAX_BYTES", 20 << 20, minimum=1),
                   max_count=env_int(env, "IMAGE_MAX_COUNT", 8, minimum=0),
                   fetch_timeout_s=float(env_int(env, "IMAGE_FETCH_TIMEOUT_S", 10, minimum=1)),
                   allow_hosts=hosts, file_root=Path(root).resolve() if root else None)


@dataclass(frozen=True)
class LoadedImage:
    data: bytes          # the file's bytes, as the backend decodes them
    digest: bytes        # SHA-256 of data: the embedding cache's and the block keys' name for it
    width: int
    height: int
    part: str = ""       # the request part it came from (messages[0].content[1], urls[0]): errors name it


class CheckedImages:
    """The sizes of the images checked lately, by digest (LRU): the same file again is only hashed, not
    decoded. Owned by the frontend's event loop (Pipeline)."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._sizes: OrderedDict[bytes, tuple[int, int]] = OrderedDict()

    def check(self, part: str, data: bytes) -> LoadedImage:
        digest = hashlib.sha256(data).digest()
        size = self._sizes.get(digest)
        if size is not None:
            self._sizes.move_to_end(digest)
            return LoadedImage(data, digest, *size, part)
        image = check_image(part, data, digest)
        self._sizes[digest] = (image.width, image.height)
        if len(self._sizes) > self.capacity:
            self._sizes.popitem(last=False)
        return image


async def load_images(sources: list[tuple[str, str]], limits: ImageLimits,
                      checked: CheckedImages | None = None) -> list[LoadedImage]:
    """sources: (the request part, e.g. "messages[0].content[1]", its URL) in prompt order."""
    if len(sources) > limits.max_count:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{len(sources)} images; at most {limits.max_count} per "
                           "request", sources[limits.max_count][0])
    files = await asyncio.gather(*(_load(part, url, limits) for part, url in sources))
    check = checked.check if checked is not None else check_image
    return [check(part, data) for (part, _), data in zip(sources, files)]


async def _load(part: str, url: str, limits: ImageLimits) -> bytes:
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _data_uri(part, url, limits)
    elif scheme in ("http", "https"):
        try:
            data = await asyncio.wait_for(_fetch(part, url, limits), limits.fetch_timeout_s)
        except asyncio.TimeoutError:
            raise _bad(part, f"fetching {url} took longer than {limits.fetch_timeout_s:g} s") from None
        except httpx.HTTPError as exc:  # refused, reset, cut short, a bad TLS or content encoding: the URL's fault
            raise _bad(part, f"{url}: cannot fetch it ({type(exc).__name__}: {exc})") from None
    elif scheme == "file" or url.startswith("/"):
        data = _local_file(part, url, limits)
    else:
        raise _bad(part, "an image must be a data: URI, an http(s) URL or a local file path")
    return data


def check_image(part: str, data: bytes, digest: bytes | None = None) -> LoadedImage:
    """The bytes decode as a picture of a sane size (decoded fully: a truncated file fails here, not later)."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.width * img.height > MAX_PIXELS:
                raise _bad(part, f"{img.width}x{img.height} pixels is more than {MAX_PIXELS} allowed")
            img.load()
            width, height = img.width, img.height
    except UnidentifiedImageError:  # its message names a BytesIO object, nothing the client sent
        raise _bad(part, "not a readable image (not a picture format Pillow reads)") from None
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as exc:
        raise _bad(part, f"not a readable image ({type(exc).__name__}: {exc})") from None
    return LoadedImage(data, digest or hashlib.sha256(data).digest(), width, height, part)


def _data_uri(part: str, url: str, limits: ImageLimits) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.lower().startswith("data:image/") or not head.lower().endswith(";base64"):
        raise _bad(part, "a data: URI must be data:image/<type>;base64,<data>")
    if len(payload) * 3 // 4 > limits.max_bytes:
        raise _bad(part, f"the image is larger than {limits.max_bytes} bytes (IMAGE_MAX_BYTES)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(part, "the data: URI is not valid base64") from None


def _local_file(part: str, url: str, limits: ImageLimits) -> bytes:
    if limits.file_root is None:
        raise _bad(part, "local image files are not served here (the operator sets IMAGE_FILE_ROOT)")
    raw = unquote(urlsplit(url).path) if url.lower().startswith("file:") else url
    try:  # ValueError: a NUL in the path; OSError: a file it may not read
        path = Path(raw).resolve()
        if not path.is_relative_to(limits.file_root) or not path.is_file():
            raise _bad(part, "no such image file under IMAGE_FILE_ROOT")
        if path.stat().st_size > limits.max_bytes:
            raise _bad(part, f"the image is larger than {limits.max_bytes} bytes (IMAGE_MAX_BYTES)")
        return path.read_bytes()
    except (ValueError, OSError) as exc:
        raise _bad(part, f"no such image file under IMAGE_FILE_ROOT ({type(exc).__name__})") from None


async def _fetch(part: str, url: str, limits: ImageLimits) -> bytes:
    """GET the URL, following up to 3 redirects, each hop's address checked, and connecting to the very
    address checked (the Host header and TLS name stay the URL's), so a DNS answer cannot change in between."""
    async with httpx.AsyncClient(timeout=limits.fetch_timeout_s, follow_redirects=False, trust_env=False) as client:
        for _ in range(_MAX_REDIRECTS + 1):
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https"):  # a redirect's target is checked as the URL was
                raise _bad(part, f"{url}: only http and https URLs are fetched")
            host = parts.hostname
            if not host:
                raise _bad(part, f"{url}: no host")
            try:
                port = parts.port or (443 if parts.scheme == "https" else 80)
            except ValueError:
                raise _bad(part, f"{url}: the port is not a number from 0 to 65535") from None
            address = await _allowed_address(part, host, port, limits)
            netloc = f"[{address}]" if ":" in address else address
            target = parts._replace(netloc=f"{netloc}:{port}").geturl()
            headers = {"Host": parts.netloc.rsplit("@", 1)[-1], "Accept": "image/*"}
            extensions = {"sni_hostname": host} if parts.scheme == "https" else {}
            async with client.stream("GET", target, headers=headers, extensions=extensions) as resp:
                if resp.is_redirect and "location" in resp.headers:
                    url = str(httpx.URL(url).join(resp.headers["location"]))
                    continue
                if resp.status_code != 200:
                    raise _bad(part, f"{url}: HTTP {resp.status_code}")
                kind = resp.headers.get("content-type", "").split(";")[0].strip().lower()
                if not kind.startswith("image/"):
                    raise _bad(part, f"{url}: content type {kind or 'none'!r} is not an image")
                length = resp.headers.get("content-length")
                if length is not None and length.isdigit() and int(length) > limits.max_bytes:
                    raise _bad(part, f"{url}: {length} bytes is larger than {limits.max_bytes} (IMAGE_MAX_BYTES)")
                body = bytearray()
                async for chunk in resp.aiter_bytes():
                    body += chunk
                    if len(body) > limits.max_bytes:
                        raise _bad(part, f"{url}: larger than {limits.max_bytes} bytes (IMAGE_MAX_BYTES)")
                return bytes(body)
        raise _bad(part, f"{url}: more than {_MAX_REDIRECTS} redirects")
    raise AssertionError("unreachable")


async def _allowed_address(part: str, host: str, port: int, limits: ImageLimits) -> str:
    """The address to connect to: the host's first, refused when any is private, loopback, link-local,
    multicast or reserved and the allow-list names neither the host nor that address."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise _bad(part, f"cannot resolve {host} ({exc.strerror})") from None
    addresses = [str(info[4][0]) for info in infos]
    if not addresses:
        raise _bad(part, f"cannot resolve {host}")
    for a in addresses:
        ip = ipaddress.ip_address(a.split("%")[0])
        internal = (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_reserved
                    or ip.is_unspecified)
        if internal and not _allow_listed(host, ip, limits.allow_hosts):
            raise _bad(part, f"{host} resolves to {a}, an internal address; the operator may allow it "
                       "(IMAGE_URL_ALLOW_HOSTS)")
    return addresses[0]


def _allow_listed(host: str, ip: ipaddress.IPv4Address | ipaddress.IPv6Address, allowed: tuple[str, ...]) -> bool:
    for entry in allowed:
        if entry == host.lower():
            return True
        try:
            if ip in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:
            continue
    return False


def _bad(part: str, message: str) -> RequestError:
    return RequestError(ErrorCode.INVALID_ARGUMENT, f"{part}: {message}", part)


def with_images(rendered: RenderedPrompt, images: Sequence[LoadedImage], vision: ImageSide | None,
                param: str) -> RenderedPrompt:
    """Each image's one placeholder token, as the template wrote it, becomes the model's run of them
    (LLaVA: one per patch feature; Qwen-VL: one per 2×2 patches at the image's resized size); the prompt
    text keeps one placeholder per image (/v1/chat/render)."""
    if not images and (vision is None or vision.image_token_id not in rendered.input_ids):
        return rendered
    if vision is None:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, "this model takes no images (a text-only model)", param)
    token = vision.image_token_id
    found = rendered.input_ids.count(token)
    if found != len(images):  # also a placeholder typed into the text, with no image for it
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"the prompt has {found} image placeholder(s) for "
                           f"{len(images)} image(s); a placeholder written in the text counts too (send each "
                           "picture as an image part, or urls on POST /)", param)
    ids: list[int] = []
    pending = iter(images)
    for t in rendered.input_ids:
        if t == token:
            image = next(pending)
            try:
                ids.extend([t] * vision.num_tokens(image.width, image.height))
            except ValueError as exc:  # Qwen-VL: too long and thin a picture to resize
                where = image.part or param
                raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{where}: {exc}", where) from None
        else:
            ids.append(t)
    return replace(rendered, input_ids=ids)
