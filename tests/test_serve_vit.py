"""The vision split end to end, on the tiny random LLaVA: a master, a ROLE_TYPE=VIT process, a PREFILL
backend that sends its images to the VIT (VIT_ADDRESSES, no tower of its own), a DECODE backend and a
frontend. An image chat's greedy answer is transformers' (the answer a PDFUSION backend running its own
tower gives: tests/test_serve_vision.py); another picture behind the same tokens gets its own answer (the
DECODE side's block keys carry the image digest, so it does not reuse the first picture's KV); the master
lists the VIT; a PREFILL backend running its own tower keys the same image as the VIT-fed one does (the
DECODE backend skips the blocks it holds); a VIT that is gone is a 503 saying so."""
from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from proto import model_rpc_pb2 as pb
from proto import model_rpc_pb2_grpc as pb_grpc
from tests.support.procs import RoleProcess, cluster_metadata, free_port_block
from tests.support.tiny_vision import TinyLlava, png_bytes, reference_greedy, save_llava_dir, tiny_llava

STEPS = 5


@dataclass
class Cluster:
    tiny: TinyLlava
    path: Path
    url: str            # the frontend
    master: str
    vit: RoleProcess
    vit_http: str       # the VIT's health and /worker_status
    own_tower: str      # gRPC of a PREFILL backend with its own tower (not registered; hands over to the DECODE one)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tiny, root, base = tiny_llava(), tmp_path_factory.mktemp("llava-vit"), free_port_block(51)
    path = save_llava_dir(tiny, root / "tiny-llava")
    master, vit, prefill, decode, frontend, own = base, base + 10, base + 20, base + 30, base + 40, base + 50
    common = {"CHECKPOINT_PATH": str(path), "KV_CACHE_MB": "16", "TORCH_NUM_THREADS": "1",
              "MASTER_ADDRESS": f"127.0.0.1:{master}"}
    procs: list[RoleProcess] = []
    try:
        procs.append(RoleProcess({"ROLE_TYPE": "MASTER", "START_PORT": str(master)}, root / "master.log"))
        procs.append(RoleProcess({**common, "ROLE_TYPE": "VIT", "START_PORT": str(vit)}, root / "vit.log"))
        procs.append(RoleProcess({**common, "ROLE_TYPE": "PREFILL", "START_PORT": str(prefill),
                                  "VIT_ADDRESSES": f"127.0.0.1:{vit + 1}", "DECODE_ADDRESS": f"127.0.0.1:{decode + 1}"},
                                 root / "prefill.log"))
        procs.append(RoleProcess({**common, "ROLE_TYPE": "DECODE", "START_PORT": str(decode)}, root / "decode.log"))
        procs.append(RoleProcess({**common, "ROLE_TYPE": "FRONTEND", "START_PORT": str(frontend),
                                  "BACKEND_ADDRESS": f"127.0.0.1:{prefill + 1}"}, root / "frontend.log"))
        procs.append(RoleProcess({**common, "ROLE_TYPE": "PREFILL", "START_PORT": str(own), "MASTER_ADDRESS": "",
                                  "DECODE_ADDRESS": f"127.0.0.1:{decode + 1}"}, root / "own-tower.log"))
        for proc, port in zip([*procs[1:4], procs[5]], (vit, prefill, decode, own)):
            proc.wait_healthy(f"http://127.0.0.1:{port + 5}/health", timeout_s=180)
        procs[4].wait_healthy(f"http://127.0.0.1:{frontend}/health", timeout_s=120)
        procs[0].wait_healthy(f"http://127.0.0.1:{master}/health", timeout_s=30)
        yield Cluster(tiny, path, f"http://127.0.0.1:{frontend}", f"http://127.0.0.1:{master}", procs[1],
                      f"http://127.0.0.1:{vit + 5}", f"127.0.0.1:{own + 1}")
    finally:
        for p in reversed(procs):
            p.stop()


def chat(cluster: Cluster, image: bytes) -> httpx.Response:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    content = [{"type": "text", "text": "What is in the picture?"}, {"type": "image_url", "image_url": {"url": url}}]
    return httpx.post(f"{cluster.url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": STEPS,
        "ignore_eos": True, "debug_info": True, "aux_info": True})


def reference_tokens(cluster: Cluster, ids: list[int], image: bytes) -> list[int]:
    return reference_greedy(cluster.tiny, cluster.path, ids, image, STEPS)


def test_image_chat_over_vit_prefill_decode_matches_transformers(cluster: Cluster) -> None:
    first, other = png_bytes(80, 60, seed=1), png_bytes(80, 60, seed=2)
    r = chat(cluster, first)
    assert r.status_code == 200, r.text
    body = r.json()
    ids = body["debug_info"]["input_ids"]
    assert body["debug_info"]["output_ids"][0] == reference_tokens(cluster, ids, first)
    assert body["aux_info"]["kv_blocks_sent"] > 0  # the answer came from the DECODE backend
    r = chat(cluster, other)  # the same tokens, another picture: no block past the image is the first one's
    assert r.status_code == 200, r.text
    again = r.json()
    assert again["debug_info"]["output_ids"][0] == reference_tokens(cluster, ids, other)
    first_image_block = ids.index(cluster.tiny.image_token_id) // 16
    assert again["aux_info"]["kv_blocks_skipped"] == first_image_block
    view = httpx.get(f"{cluster.master}/backends", timeout=10).json()["backends"]
    assert sorted(b["role"] for b in view) == ["DECODE", "PREFILL", "VIT"], view
    assert 'role="VIT"' in httpx.get(f"{cluster.master}/metrics", timeout=10).text
    work = httpx.get(f"{cluster.vit_http}/worker_status", timeout=10).json()  # RTP-LLM's WorkStatus
    assert work["role"] == "VIT" and len(work["finished_task_list"]) == 2, work  # one call per new image
    models = httpx.get(f"{cluster.master}/v1/models", timeout=10).json()["data"]
    assert [m["healthy_backends"] for m in models] == [2], models  # PREFILL and DECODE; a VIT serves nothing


def test_a_prefill_backend_with_its_own_tower_keys_the_image_alike(cluster: Cluster) -> None:
    image = png_bytes(64, 64, seed=3)
    r = chat(cluster, image)  # through the VIT: the DECODE backend now holds this prompt's blocks
    assert r.status_code == 200, r.text
    ids = r.json()["debug_info"]["input_ids"]
    with grpc.insecure_channel(cluster.own_tower) as channel:
        outs = list(pb_grpc.ModelRpcServiceStub(channel).GenerateStreamCall(pb.GenerateInputPB(
            request_id="own-tower", token_ids=ids, images=[pb.ImagePB(data=image)],
            generate_config=pb.GenerateConfigPB(max_new_tokens=STEPS, ignore_eos=True)), metadata=cluster_metadata()))
    assert not any(o.HasField("error") for o in outs), outs[-1].error
    assert [t for o in outs for g in o.generate_outputs for t in g.output_ids] == reference_tokens(cluster, ids, image)
    image_end = ids.index(cluster.tiny.image_token_id) + cluster.tiny.image_tokens
    assert outs[-1].generate_outputs[-1].aux_info.kv_blocks_skipped >= image_end // 16


def test_vit_gone_is_a_503_saying_so(cluster: Cluster) -> None:
    cluster.vit.stop()
    r = chat(cluster, png_bytes(50, 50, seed=7))  # an image the backend has no embeddings of
    assert r.status_code == 503, r.text
    assert "ROLE_TYPE=VIT" in r.json()["error"]["message"]
