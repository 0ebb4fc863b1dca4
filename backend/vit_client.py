"""A backend's side of the VIT split (VIT_ADDRESSES): a request's image files go to a ROLE_TYPE=VIT process,
which answers their embeddings; the engine puts those in place of the placeholders as it would its own
tower's. Embeddings are kept by the SHA-256 of the image's bytes (most recent first, up to the tower's
budget), so an image seen again costs no call. A VIT that cannot be reached is the request's UNAVAILABLE
error (503), never a wait: calls do not wait for a connection, and each has a deadline."""
from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict

import grpc
import torch

from backend.engine_types import ImageInput
from backend.image_preprocess import image_size
from backend.pb_convert import embedding_from_pb
from backend.image_tower import EMBED_CACHE_BYTES
from kvyard.cluster_auth import client_interceptors
from kvyard.errors import ErrorCode, RequestError
from kvyard.grpc_keepalive import CLIENT_OPTIONS
from kvyard.pb_errors import error_from_pb
from kvyard.qwen_vl_config import QwenVisionConfig
from kvyard.vision_config import ImageSide
from proto import model_rpc_pb2 as pb
from proto import model_rpc_pb2_grpc as pb_grpc

log = logging.getLogger("kvyard.backend")
VIT_CALL_TIMEOUT_S = 120.0  # one EmbedImages call (a big tower on a busy CPU takes seconds an image)


class VitClient:
    """Owned by the backend's event loop (the gRPC edge calls `prompt_images`)."""

    def __init__(self, addresses: tuple[str, ...], token: str, vision: ImageSide, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, cache_bytes: int = EMBED_CACHE_BYTES) -> None:
        self.addresses = addresses
        self.vision = vision
        self.hidden_size = hidden_size
        self.dtype, self.device = dtype, device
        options = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20),
                   *CLIENT_OPTIONS]
        self._stubs = {a: pb_grpc.ModelRpcServiceStub(grpc.aio.insecure_channel(
            a, interceptors=client_interceptors(token), options=options)) for a in addresses}
        self._next = 0  # round robin over the VITs
        self.cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.cache_bytes = cache_bytes
        self.cached_bytes = 0
        self.calls = 0  # EmbedImages calls made (the rest came from the cache)

    async def prompt_images(self, request_id: str, files: list[bytes]) -> list[ImageInput]:
        digests = [hashlib.sha256(data).digest() for data in files]
        shapes = await asyncio.to_thread(self._shapes, files)
        found = {d: self.cache[d] for d in digests if d in self.cache}
        for d in found:
            self.cache.move_to_end(d)
        missing = {d: data for d, data in zip(digests, files) if d not in found}
        if missing:
            for d, t in zip(missing, await self._embed(request_id, list(missing.values()))):
                found[d] = t
                self._keep(d, t)
        for d, (_, rows) in zip(digests, shapes):
            if tuple(found[d].shape) != (rows, self.hidden_size):
                raise RequestError(ErrorCode.INTERNAL, f"the VIT sent an embedding of shape {list(found[d].shape)}, this "
                                   f"model takes {[rows, self.hidden_size]} (is it serving the same checkpoint?)")
        return [ImageInput(d, None, found[d], grid) for d, (grid, _) in zip(digests, shapes)]

    def _shapes(self, files: list[bytes]) -> list[tuple[tuple[int, int, int] | None, int]]:
        """Each image's patch grid (Qwen-VL, from its size: M-RoPE's positions need it; None for LLaVA) and
        the embedding rows it takes."""
        vision = self.vision
        if not isinstance(vision, QwenVisionConfig):
            return [(None, vision.num_image_tokens)] * len(files)
        out: list[tuple[tuple[int, int, int] | None, int]] = []
        for i, data in enumerate(files):
            width, height = image_size(data, f"images[{i}]")  # the header: a bad file is the VIT's 400
            try:
                out.append((vision.grid(width, height), vision.num_tokens(width, height)))
            except ValueError as exc:
                raise RequestError(ErrorCode.INVALID_ARGUMENT, f"images[{i}]: {exc}", f"images[{i}]") from None
        return out

    async def _embed(self, request_id: str, files: list[bytes]) -> list[torch.Tensor]:
        """One VIT's answer; the next VIT when one cannot be reached; UNAVAILABLE when none can."""
        request = pb.EmbedImagesInputPB(request_id=request_id, images=[pb.ImagePB(data=f) for f in files])
        failures = []
        for _ in range(len(self.addresses)):
            address = self.addresses[self._next % len(self.addresses)]
            self._next += 1
            try:
                reply = await self._stubs[address].EmbedImages(request, timeout=VIT_CALL_TIMEOUT_S, wait_for_ready=False)
            except grpc.aio.AioRpcError as exc:
                log.warning("VIT %s failed for request %s: %s %s", address, request_id, exc.code().name, exc.details())
                failures.append(f"{address}: {exc.code().name}")
                continue
            self.calls += 1
            if reply.HasField("error"):
                raise error_from_pb(reply.error)
            if len(reply.embeddings) != len(files):
                raise RequestError(ErrorCode.INTERNAL, f"the VIT answered {len(reply.embeddings)} embeddings for "
                                   f"{len(files)} images")
            return [self._tensor(m) for m in reply.embeddings]
        raise RequestError(ErrorCode.UNAVAILABLE, "the vision encoder (ROLE_TYPE=VIT) could not embed the images: "
                           + "; ".join(failures) + " (VIT_ADDRESSES)")

    def _tensor(self, m: pb.ImageEmbeddingPB) -> torch.Tensor:
        return embedding_from_pb(m).to(device=self.device, dtype=self.dtype)

    def _keep(self, digest: bytes, t: torch.Tensor) -> None:
        self.cache[digest] = t
        self.cached_bytes += t.numel() * t.element_size()
        while self.cached_bytes > self.cache_bytes and len(self.cache) > 1:
            old = self.cache.popitem(last=False)[1]
            self.cached_bytes -= old.numel() * old.element_size()
