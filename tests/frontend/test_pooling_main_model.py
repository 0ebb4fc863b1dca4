"""A pooling model as the main CHECKPOINT_PATH of a PDFUSION launch (backend + frontend): a tiny random
Qwen3-Embedding-style decoder embedder. Healthy means it serves: /v1/embeddings answers what
sentence-transformers computes on the same weights (its query prompt too); chat and completions are a 400
naming the model's kind, with or without `model`."""
from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.procs import pdfusion
from tests.support.tiny_decoder_poolers import tiny_decoder_pooler

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("pooling-main")
    path = tiny_decoder_pooler(tmp / "qwen3-emb")
    with pdfusion(path, "emb,emb-alias", tmp / "pdfusion.log") as url:
        yield url, path


def test_embeddings_match_sentence_transformers(served: tuple[str, Path]) -> None:
    from sentence_transformers import SentenceTransformer
    url, path = served
    st = SentenceTransformer(str(path), device="cpu")
    texts = ["A man is eating food.", "short"]
    for body, prompt_name in (({"input": texts}, None), ({"input": texts, "model": "emb-alias", "prompt_name": "query"},
                                                         "query")):
        resp = httpx.post(f"{url}/v1/embeddings", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        ours = [d["embedding"] for d in resp.json()["data"]]
        theirs = st.encode(texts, prompt_name=prompt_name)
        assert len(ours[0]) == 128
        assert max(abs(a - b) for o, t in zip(ours, theirs) for a, b in zip(o, t.tolist())) < 2e-3
        assert abs(math.sqrt(sum(x * x for x in ours[0])) - 1) < 1e-4


def test_chat_is_a_400_naming_the_kind(served: tuple[str, Path]) -> None:
    url, _ = served
    for route, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                        ("/v1/chat/completions", {"model": "emb", "messages": [{"role": "user", "content": "hi"}]}),
                        ("/v1/completions", {"model": "emb-alias", "prompt": "hi"})):
        resp = httpx.post(url + route, json=body, timeout=60)
        assert resp.status_code == 400, resp.text
        assert "embed model" in resp.json()["error"]["message"], resp.text
    models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m.get("kind")) for m in models] == [("emb", "embed")]


def test_prompt_name_with_token_ids_is_a_400(served: tuple[str, Path]) -> None:
    """Token ids are pooled as given, so a prompt named for them would be ignored: refused, naming it."""
    url, _ = served
    for ids in ([1, 2, 3], [[1, 2, 3], [4, 5]]):
        resp = httpx.post(f"{url}/v1/embeddings", json={"input": ids, "prompt_name": "query"}, timeout=60)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt_name", resp.text
    assert httpx.post(f"{url}/v1/embeddings", json={"input": [1, 2, 3]}, timeout=60).status_code == 200
