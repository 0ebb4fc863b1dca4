"""ROLE_TYPE=VIT in process: its EmbedImages call (behind the cluster token), through the backend's VitClient,
answers the same embeddings as the tower run in process; a repeated image is the client's cache hit; an
unreachable VIT is UNAVAILABLE at once; the load report is one the master accepts as a VIT."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from backend.config import BackendConfig
from backend.grpc_server import start_grpc_server
from backend.image_preprocess import decode_image, pixels
from backend.vision_tower import load_vision_tower
from backend.vit_client import VitClient
from backend.vit_server import VitServicer
from kvyard.errors import ErrorCode, RequestError
from kvyard.model_config import load_model_config
from kvyard.ports import free_port_block as free_port
from kvyard.roles import Role
from master.backend_poller import worker_status_from_pb
from proto import model_rpc_pb2 as pb
from tests.support.tiny_vision import png_bytes, save_llava_dir, tiny_llava

CPU = torch.device("cpu")
TOKEN = "vit-test-token"


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llava_dir(tiny_llava(), tmp_path_factory.mktemp("llava-vit"))


def test_embed_images_matches_the_tower_in_process_and_caches(llava: Path) -> None:
    config = load_model_config(llava)
    assert config.vision is not None
    reference = load_vision_tower(llava, config, torch.float32, CPU)
    images = [png_bytes(80, 60, seed=1), png_bytes(40, 70, seed=2)]

    async def run() -> tuple[list[torch.Tensor], int, pb.WorkerStatusPB]:
        servicer = VitServicer(load_vision_tower(llava, config, torch.float32, CPU))
        port = free_port()
        server, _ = await start_grpc_server(servicer, "127.0.0.1", port, TOKEN)
        try:
            client = VitClient((f"127.0.0.1:{port}",), TOKEN, config.vision, config.hidden_size, torch.float32, CPU)
            first = await client.prompt_images("r1", images)
            again = await client.prompt_images("r2", images[1:])  # no second call: the client's cache
            assert again[0].embeds is first[1].embeds
            stranger = VitClient((f"127.0.0.1:{port}",), "wrong", config.vision, config.hidden_size,
                                 torch.float32, CPU)
            with pytest.raises(RequestError) as refused:
                await stranger.prompt_images("r3", images[:1])
            assert refused.value.code is ErrorCode.UNAVAILABLE and "UNAUTHENTICATED" in refused.value.message
            status = await servicer.GetWorkerStatus(pb.WorkerStatusRequestPB(), None)  # type: ignore[arg-type]
            return [im.embeds for im in first], client.calls, status
        finally:
            await server.stop(None)

    got, calls, status = asyncio.run(run())
    assert calls == 1
    for data, rows in zip(images, got):
        want = reference.forward(pixels(decode_image(data), config.vision.preprocess)[None])[0]
        assert rows is not None and rows.shape == want.shape == (config.vision.num_image_tokens, config.hidden_size)
        torch.testing.assert_close(rows, want, rtol=0, atol=1e-6)
    assert worker_status_from_pb(status).role is Role.VIT  # the master's poll takes it


def test_unreachable_vit_is_unavailable_at_once(llava: Path) -> None:
    config = load_model_config(llava)
    assert config.vision is not None
    dead = f"127.0.0.1:{free_port()}"

    async def run() -> RequestError:
        client = VitClient((dead,), TOKEN, config.vision, config.hidden_size, torch.float32, CPU)
        with pytest.raises(RequestError) as info:
            await client.prompt_images("r", [png_bytes(20, 20)])
        return info.value

    start = time.monotonic()
    error = asyncio.run(run())
    assert time.monotonic() - start < 10
    assert error.code is ErrorCode.UNAVAILABLE and dead in error.message and "VIT" in error.message


def test_vit_addresses_only_where_images_go(llava: Path) -> None:
    base = {"CHECKPOINT_PATH": str(llava), "START_PORT": "20000"}
    assert BackendConfig.from_env({**base, "VIT_ADDRESSES": "a:1, b:2"}).vit_addresses == ("a:1", "b:2")
    assert BackendConfig.from_env({**base, "ROLE_TYPE": "3"}).role is Role.VIT
    with pytest.raises(ValueError, match="DECODE backend never sees the images"):
        BackendConfig.from_env({**base, "ROLE_TYPE": "DECODE", "VIT_ADDRESSES": "a:1"})
