"""The pooling routes end to end: a FRONTEND serving a (mock) chat model and the embedded all-MiniLM-L6-v2,
whose own backend process runs the real encoder; the official openai client's embeddings.create."""
from __future__ import annotations

import base64
import concurrent.futures
import math
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from kvyard.errors import RequestError
from kvyard.pooling_model import EMBEDDED_EMBEDDING_NAME, embedded_embedding_path
from tests.support.procs import RoleProcess, free_port_block

pytestmark = pytest.mark.slow
EMB = EMBEDDED_EMBEDDING_NAME


@dataclass
class Stack:
    url: str
    logs: Path
    encoder_http: str  # the encoder backend's own HTTP app (worker_status)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("embeddings")
    chat, encoder, frontend = free_port_block(), free_port_block(), free_port_block()
    procs = [
        RoleProcess({"ROLE_TYPE": "MOCK_BACKEND", "START_PORT": str(chat), "MOCK_TOKEN_IDS": "[1, 2]"},
                    logs / "chat.log"),
        RoleProcess({"ROLE_TYPE": "PDFUSION", "FRONTEND_SERVER_COUNT": "0", "START_PORT": str(encoder),
                     "CHECKPOINT_PATH": str(embedded_embedding_path()), "MAX_NUM_SEQS": "16"}, logs / "encoder.log"),
        RoleProcess({"ROLE_TYPE": "FRONTEND", "START_PORT": str(frontend), "MODEL_NAME": "chat", "MAX_SEQ_LEN": "1024",
                     "BACKEND_ADDRESS": f"127.0.0.1:{chat + 1}", "EMBEDDING_MODEL_PATH": "embedded",
                     "EMBEDDING_BACKEND_ADDRESS": f"127.0.0.1:{encoder + 1}"}, logs / "frontend.log"),
    ]
    try:
        procs[1].wait_healthy(f"http://127.0.0.1:{encoder + 5}/health", timeout_s=180)
        procs[2].wait_healthy(f"http://127.0.0.1:{frontend}/health", timeout_s=120)
        yield Stack(f"http://127.0.0.1:{frontend}", logs, f"http://127.0.0.1:{encoder + 5}")
    finally:
        for p in procs:
            p.stop()


def _post(stack: Stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(stack.url + path, json=body, timeout=60)


def _error(resp: httpx.Response, status: int, param: str | None, *words: str) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and all(w in err["message"] for w in words), err


def _cos(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_openai_client_embeddings_create(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=60)
    texts = ["A man is eating food.", "A man is eating a piece of bread.", "The stock market fell today."]
    resp = client.embeddings.create(model=EMB, input=texts)  # the client asks for base64 and decodes it
    vecs = [d.embedding for d in resp.data]
    assert [d.index for d in resp.data] == [0, 1, 2] and all(len(v) == 384 for v in vecs)
    assert abs(math.sqrt(sum(x * x for x in vecs[0])) - 1) < 1e-4  # normalised, as the model's modules.json says
    assert _cos(vecs[0], vecs[1]) > _cos(vecs[0], vecs[2])
    assert resp.usage.prompt_tokens == resp.usage.total_tokens > 3 * 3
    floats = client.embeddings.create(model=EMB, input=texts[0], encoding_format="float").data[0].embedding
    assert max(abs(a - b) for a, b in zip(floats, vecs[0])) < 1e-6


def test_langchain_openai_embeddings(stack: Stack) -> None:
    """LangChain's OpenAIEmbeddings, configured as its docs say for an OpenAI-compatible server (without
    check_embedding_ctx_length=False it counts tokens with tiktoken, whose encodings it downloads): the
    vectors /v1/embeddings gives (test_encoder.py checks those against sentence-transformers)."""
    from langchain_openai import OpenAIEmbeddings
    texts, query = ["A man is eating food.", "The stock market fell today."], "A man is eating a piece of bread."
    lc = OpenAIEmbeddings(model=EMB, base_url=f"{stack.url}/v1", api_key="x", check_embedding_ctx_length=False,
                          max_retries=0)
    ours = lc.embed_documents(texts) + [lc.embed_query(query)]
    theirs = [d["embedding"] for d in _post(stack, "/v1/embeddings", {"input": texts + [query]}).json()["data"]]
    assert [len(v) for v in ours] == [384] * 3
    assert min(_cos(a, b) for a, b in zip(ours, theirs)) >= 0.9999


def test_input_forms_and_shapes(stack: Stack) -> None:
    ids = httpx.post(f"{stack.url}/v1/embeddings", json={"input": "hello world"}).json()
    one = ids["data"][0]["embedding"]
    as_ids = _post(stack, "/v1/embeddings", {"input": [101, 7592, 2088, 102], "model": EMB}).json()
    assert max(abs(a - b) for a, b in zip(as_ids["data"][0]["embedding"], one)) < 1e-5  # [CLS] hello world [SEP]
    many_ids = _post(stack, "/v1/embeddings/dense", {"input": [[101, 7592, 102], [101, 2088, 102]]}).json()
    assert len(many_ids["data"]) == 2 and many_ids["usage"]["prompt_tokens"] == 6
    b64 = _post(stack, "/v1/embeddings", {"input": "hello world", "encoding_format": "base64"}).json()
    decoded = struct.unpack("<384f", base64.b64decode(b64["data"][0]["embedding"]))
    assert max(abs(a - b) for a, b in zip(decoded, one)) < 1e-6
    same = _post(stack, "/v1/embeddings", {"input": "hello world", "dimensions": 384}).json()
    assert len(same["data"][0]["embedding"]) == 384
    sim = _post(stack, "/v1/embeddings/similarity", {"left": ["A man eats food."],
                                                     "right": ["A man is eating.", "Stocks fell."]}).json()
    assert len(sim["data"]) == 1 and sim["data"][0][0] > sim["data"][0][1] and sim["data"][0][0] <= 1.0001


def test_context_length_and_truncation(stack: Stack) -> None:
    long = "word " * 300  # 302 tokens with [CLS] and [SEP]; the model takes 256
    _error(_post(stack, "/v1/embeddings", {"input": long}), 400, "input", "256")
    cut = _post(stack, "/v1/embeddings", {"input": long, "truncate_prompt_tokens": 256}).json()
    assert cut["usage"]["prompt_tokens"] == 256
    cut = _post(stack, "/v1/embeddings", {"input": long, "truncate_prompt_tokens": -1}).json()
    assert cut["usage"]["prompt_tokens"] == 256
    # 8 MB, refused (or cut) from its words before tokenizing: tests/frontend/test_pooling_tokenize.py
    huge = "word " * 1_600_000
    _error(_post(stack, "/v1/embeddings", {"input": huge}), 400, "input", "has more than 512 tokens", "256")
    cut = _post(stack, "/v1/embeddings", {"input": huge, "truncate_prompt_tokens": -1}).json()
    short = _post(stack, "/v1/embeddings", {"input": long, "truncate_prompt_tokens": -1}).json()  # the same 256 ids
    assert cut["usage"]["prompt_tokens"] == 256
    assert max(abs(a - b) for a, b in zip(cut["data"][0]["embedding"], short["data"][0]["embedding"])) < 1e-6
    _error(_post(stack, "/v1/embeddings", {"input": long, "truncate_prompt_tokens": 1000}), 400,
           "truncate_prompt_tokens")
    for body, param in (({"left": "x", "right": ["y", long]}, "right"), ({"left": long, "right": "y"}, "left"),
                        ({"left": ["x"] * 1500, "right": ["y"] * 1000}, "left")):  # similarity's own fields
        _error(_post(stack, "/v1/embeddings/similarity", body), 400, param)
    # a cut the model's own [CLS] and [SEP] do not fit, or one that keeps nothing: the cut is what is wrong
    for cut, body in ((1, {"input": "x"}), (0, {"input": "x"}), (0, {"input": [101, 102]})):
        _error(_post(stack, "/v1/embeddings", {**body, "truncate_prompt_tokens": cut}), 400, "truncate_prompt_tokens",
               f"truncate_prompt_tokens {cut}")


def test_routes_the_model_cannot_answer(stack: Stack) -> None:
    for path in ("/v1/embeddings/sparse", "/v1/embeddings/colbert"):
        _error(_post(stack, path, {"input": "x"}), 400, "model", "embed", "heads: dense")
    for path in ("/v1/rerank", "/rerank", "/v1/reranker"):
        _error(_post(stack, path, {"query": "q", "documents": ["d"]}), 400, "model", "embed")
    for path in ("/v1/classifier", "/classify"):
        _error(_post(stack, path, {"input": "x"}), 400, "model", "embed")
    _error(_post(stack, "/v1/chat/completions", {"model": EMB, "messages": [{"role": "user", "content": "hi"}]}),
           400, "model", "embed", "cannot generate")
    _error(_post(stack, "/v1/completions", {"model": EMB, "prompt": "hi"}), 400, "model", "embed")
    _error(_post(stack, "/v1/embeddings", {"model": "chat", "input": "hi"}), 400, "model", "generate")
    _error(_post(stack, "/v1/embeddings", {"model": "nope", "input": "hi"}), 404, "model")


def test_bad_fields(stack: Stack) -> None:
    _error(_post(stack, "/v1/embeddings", {"input": "x", "dimensions": 128}), 400, "dimensions", "Matryoshka")
    _error(_post(stack, "/v1/embeddings", {"input": []}), 400, "input", "empty")
    _error(_post(stack, "/v1/embeddings", {"input": [10**7]}), 400, "input", "token ids")
    for ids in ([True, False], [[101, True, 102]], [1.0, 2.0]):  # not ids: JSON's true is no token 1
        assert _post(stack, "/v1/embeddings", {"input": ids}).status_code == 400, ids
    _error(_post(stack, "/v1/embeddings", {"input": "x", "prompt_name": "query"}), 400, "prompt_name")
    assert _post(stack, "/v1/embeddings", {"input": "x", "encoding_format": "int8"}).status_code == 400
    assert _post(stack, "/v1/embeddings", {"input": "x", "frobnicate": 1}).status_code == 400
    assert _post(stack, "/v1/embeddings", {}).status_code == 400


def test_models_and_metrics(stack: Stack) -> None:
    models = httpx.get(f"{stack.url}/v1/models").json()["data"]
    assert {m["id"]: m.get("kind") for m in models} == {"chat": None, EMB: "embed"}
    _post(stack, "/v1/embeddings", {"input": "metrics"})
    text = httpx.get(f"{stack.url}/metrics").text
    assert 'path="/v1/embeddings"' in text or "/v1/embeddings" in text


def test_lone_surrogates_are_a_400(stack: Stack) -> None:
    """JSON's \\ud800 parses but is not text: a 400 naming the field, never the tokenizer's 500."""
    for path, raw, param in (("/v1/embeddings", '{"input": "\\ud800"}', "input"),
                             ("/v1/embeddings", '{"input": ["ok", "a\\udfffb"]}', "input"),
                             ("/v1/embeddings/similarity", '{"left": "\\ud800", "right": "x"}', "left"),
                             ("/v1/embeddings/similarity", '{"left": "x", "right": ["y", "\\ud800"]}', "right")):
        resp = httpx.post(stack.url + path, content=raw, timeout=60)
        _error(resp, 400, param, "surrogate")


def test_a_client_that_leaves_cancels_its_inputs(stack: Stack) -> None:
    """A client that disconnects before its answer (here: its read timeout) cancels the pooling call, so
    the backend drops the inputs not yet run instead of computing minutes of embeddings nobody reads."""
    body = {"input": [[101, *[7592 + i % 100] * 254, 102] for i in range(2048)]}  # ids: no tokenizing to wait for
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack.url + "/v1/embeddings", json=body, timeout=3)
    deadline, status = time.monotonic() + 10, {}
    while time.monotonic() < deadline:
        status = httpx.get(f"{stack.encoder_http}/worker_status", timeout=5).json()
        if status["running"] == status["waiting"] == 0:
            break
        time.sleep(0.2)
    assert status["running"] == status["waiting"] == 0, status
    assert len(_post(stack, "/v1/embeddings", {"input": "still serving"}).json()["data"]) == 1


def test_a_large_similarity_keeps_the_frontend_responsive(stack: Stack) -> None:
    """1024 x 1024 cosines (a request's most) were summed in Python on the event loop: ~100 s on a 2-core
    machine in which the frontend answered nobody, /health included."""
    body = {"left": [f"left text {i}" for i in range(1024)], "right": [f"right text {i}" for i in range(1024)]}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        big = pool.submit(_post, stack, "/v1/embeddings/similarity", body)
        slowest = 0.0
        while not big.done():
            t = time.monotonic()
            assert httpx.get(f"{stack.url}/health", timeout=30).status_code == 200
            slowest = max(slowest, time.monotonic() - t)
            time.sleep(0.2)
        resp = big.result()
    assert resp.status_code == 200 and slowest < 2, (resp.status_code, slowest)
    data = resp.json()["data"]
    assert len(data) == 1024 and {len(row) for row in data} == {1024}
    one = _post(stack, "/v1/embeddings", {"input": [body["left"][3], body["right"][7]]}).json()["data"]
    assert abs(data[3][7] - _cos(one[0]["embedding"], one[1]["embedding"])) < 1e-5


def test_matryoshka_sizes_in_the_error_include_the_full_one() -> None:
    """A Matryoshka model naming its truncations: those and its full size are taken, and a refusal lists all
    of them (it left the full size out)."""
    from types import SimpleNamespace

    from frontend.embeddings import _dimensions
    model = SimpleNamespace(name="m", spec=SimpleNamespace(dimensions=32, matryoshka_dimensions=(8, 16)))
    assert _dimensions(model, 32) is None and _dimensions(model, 16) == 16  # type: ignore[arg-type]
    with pytest.raises(RequestError, match="dimensions 12 is not one of 8, 16, 32") as caught:
        _dimensions(model, 12)  # type: ignore[arg-type]
    assert caught.value.param == "dimensions"
