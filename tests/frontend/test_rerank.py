"""Rerank and classify end to end: a FRONTEND serving tiny random cross-encoders (one logit, three labels)
through their backend processes, scores checked against transformers and sentence-transformers on the same
weights; RTP-LLM's /v1/reranker shape beside Cohere/Jina's /v1/rerank."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import math

import httpx
import pytest
import torch

from tests.support.procs import RoleProcess, free_port_block
from tests.support.tiny_encoders import tiny_encoder

pytestmark = pytest.mark.slow
QUERY = "what is the capital of france?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "France is in Europe.", "The sky is blue."]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def _serve(path: Path, logs: Path, name: str) -> tuple[str, list[RoleProcess]]:
    chat, encoder, frontend = free_port_block(), free_port_block(), free_port_block()
    procs = [
        RoleProcess({"ROLE_TYPE": "MOCK_BACKEND", "START_PORT": str(chat), "MOCK_TOKEN_IDS": "[1, 2]"},
                    logs / f"{name}-chat.log"),
        RoleProcess({"ROLE_TYPE": "PDFUSION", "FRONTEND_SERVER_COUNT": "0", "START_PORT": str(encoder),
                     "CHECKPOINT_PATH": str(path)}, logs / f"{name}-encoder.log"),
        RoleProcess({"ROLE_TYPE": "FRONTEND", "START_PORT": str(frontend), "MODEL_NAME": "chat", "MAX_SEQ_LEN": "1024",
                     "BACKEND_ADDRESS": f"127.0.0.1:{chat + 1}", "EMBEDDING_MODEL_PATH": str(path),
                     "EMBEDDING_MODEL_NAME": name, "EMBEDDING_BACKEND_ADDRESS": f"127.0.0.1:{encoder + 1}"},
                    logs / f"{name}-frontend.log"),
    ]
    return f"http://127.0.0.1:{frontend}", procs


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[str, Path]]]:
    logs = tmp_path_factory.mktemp("rerank")
    reranker = tiny_encoder(logs / "reranker", arch="BertForSequenceClassification", num_labels=1, seed=1)
    classifier = tiny_encoder(logs / "classifier", arch="XLMRobertaForSequenceClassification", num_labels=3, seed=2,
                              id2label=LABELS)
    (url_r, procs_r), (url_c, procs_c) = _serve(reranker, logs, "reranker"), _serve(classifier, logs, "classifier")
    procs = procs_r + procs_c
    try:
        for url, frontend in ((url_r, procs_r[-1]), (url_c, procs_c[-1])):
            frontend.wait_healthy(f"{url}/health", timeout_s=180)  # its own process: an exit fails at once, with its log
        yield {"reranker": (url_r, reranker), "classifier": (url_c, classifier)}
    finally:
        for p in procs:
            p.stop()


def _reference(path: Path, arch: str, pairs: list[tuple[str, str]]) -> torch.Tensor:
    import transformers
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    batch = tok([q for q, _ in pairs], [d for _, d in pairs], padding=True, return_tensors="pt")
    if arch.startswith("XLM"):
        batch.pop("token_type_ids", None)
    with torch.no_grad():
        return getattr(transformers, arch).from_pretrained(path).eval()(**batch).logits


def test_rerank_orders_by_relevance(servers: dict[str, tuple[str, Path]]) -> None:
    url, path = servers["reranker"]
    expected = torch.sigmoid(_reference(path, "BertForSequenceClassification", [(QUERY, d) for d in DOCS])[:, 0])
    for route in ("/v1/rerank", "/rerank"):  # /v1/reranker is RTP-LLM's shape: test_rtp_llm_reranker_*
        body = httpx.post(url + route, json={"query": QUERY, "documents": DOCS, "top_n": 3}, timeout=60).json()
        results = body["results"]
        assert [r["index"] for r in results] == expected.argsort(descending=True)[:3].tolist()
        assert all(abs(r["relevance_score"] - float(expected[r["index"]])) < 1e-4 for r in results)
        assert all(r["document"]["text"] == DOCS[r["index"]] for r in results) and body["model"] == "reranker"
    bare = httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": [{"text": d} for d in DOCS],
                                                "return_documents": False}).json()["results"]
    assert len(bare) == 4 and "document" not in bare[0]
    bad = httpx.post(url + "/v1/embeddings", json={"input": "x"})
    assert bad.status_code == 400 and "classify" in bad.json()["error"]["message"]
    assert httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": []}).status_code == 400
    for body in ({"query": QUERY, "documents": ["d"] * 2049}, {"query": QUERY, "documents": ["d", "word " * 100]}):
        resp = httpx.post(url + "/v1/rerank", json=body, timeout=60)  # errors name rerank's field, not "input"
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "documents", resp.text
    short = httpx.post(url + "/v1/rerank", json={"query": "q", "documents": ["d"], "truncate_prompt_tokens": 2})
    assert short.status_code == 400 and short.json()["error"]["param"] == "truncate_prompt_tokens", short.text  # [CLS] [SEP] [SEP]


def test_classify_label_probabilities(servers: dict[str, tuple[str, Path]]) -> None:
    url, path = servers["classifier"]
    body = httpx.post(url + "/v1/classifier", json={"input": [[QUERY, DOCS[0]], [QUERY, DOCS[1]]]}, timeout=60).json()
    probs = torch.softmax(_reference(path, "XLMRobertaForSequenceClassification",
                                     [(QUERY, DOCS[0]), (QUERY, DOCS[1])]), dim=-1)
    for i, item in enumerate(body["data"]):
        assert item["num_classes"] == 3 and item["labels"] == list(LABELS.values())
        assert max(abs(a - b) for a, b in zip(item["probs"], probs[i].tolist())) < 1e-4
        assert item["label"] == LABELS[int(probs[i].argmax())]
    single = httpx.post(url + "/classify", json={"input": "just one text"}).json()
    assert len(single["data"]) == 1 and abs(sum(single["data"][0]["probs"]) - 1) < 1e-5
    bad = httpx.post(url + "/classify", json={"input": [["a", "b", "c"]]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"


def test_lone_surrogates_are_a_400(servers: dict[str, tuple[str, Path]]) -> None:
    """JSON's \\ud800 parses but is not text: a 400 naming the field, never the tokenizer's 500."""
    for name, path, raw, param in (
            ("reranker", "/v1/rerank", '{"query": "\\ud800", "documents": ["d"]}', "query"),
            ("reranker", "/v1/rerank", '{"query": "q", "documents": ["d", {"text": "\\udfff"}]}', "documents"),
            ("classifier", "/v1/classifier", '{"input": ["ok", "\\udfff"]}', "input"),
            ("classifier", "/classify", '{"input": [["ok", "\\ud800"]]}', "input")):
        resp = httpx.post(servers[name][0] + path, content=raw, timeout=60)
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == param and "surrogate" in err["message"], err


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def test_rtp_llm_reranker_raw_logits_and_options(servers: dict[str, tuple[str, Path]]) -> None:
    """POST /v1/reranker speaks RTP-LLM's VoyageRerankerRequest / VoyageRerankerResponse: raw relevance logits by
    default (sentence-transformers' CrossEncoder with an identity activation), /v1/rerank's score with normalize,
    top_k, sorted, return_documents, truncation; Cohere's fields are unknown there."""
    from sentence_transformers import CrossEncoder
    url, path = servers["reranker"]
    ref = CrossEncoder(str(path), activation_fn=torch.nn.Identity(), device="cpu").predict(
        [(QUERY, d) for d in DOCS]).tolist()
    best = sorted(range(len(DOCS)), key=lambda i: -ref[i])
    cohere = httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": DOCS}, timeout=60).json()
    prob = {r["index"]: r["relevance_score"] for r in cohere["results"]}

    def post(**fields: object) -> httpx.Response:
        return httpx.post(url + "/v1/reranker", json={"query": QUERY, "documents": DOCS, **fields}, timeout=60)

    body = post().json()
    assert set(body) == {"results", "total_tokens", "model"} and body["model"] == "reranker"
    assert body["total_tokens"] == cohere["usage"]["total_tokens"] > 0
    assert [r["index"] for r in body["results"]] == best
    for r in body["results"]:
        assert list(r) == ["index", "document", "relevance_score"] and r["document"] == DOCS[r["index"]]
        # the raw logit, not sigmoid's ~0.5: the tiny model's logits are ~3e-4 apart by ~1e-5, so a tight bound
        assert abs(r["relevance_score"] - ref[r["index"]]) < 1e-7, (r, ref)
        assert abs(r["relevance_score"] - _logit(prob[r["index"]])) < 1e-9, (r, prob)
    normal = post(normalize=True).json()["results"]
    assert [r["index"] for r in normal] == best
    assert all(r["relevance_score"] == prob[r["index"]] for r in normal)  # /v1/rerank's very score
    assert [r["index"] for r in post(top_k=2).json()["results"]] == best[:2]
    assert [r["index"] for r in post(sorted=False).json()["results"]] == [0, 1, 2, 3]
    assert [r["index"] for r in post(sorted=False, top_k=3).json()["results"]] == sorted(best[:3])
    bare = post(return_documents=False, top_k=1).json()["results"]
    assert len(bare) == 1 and set(bare[0]) == {"index", "relevance_score"} and bare[0]["index"] == best[0]

    long = ["word " * 100, DOCS[0]]  # the first past the tiny model's 64 tokens: cut to them, as -1 does on Cohere's
    cut = httpx.post(url + "/v1/reranker", json={"query": QUERY, "documents": long}, timeout=60)
    assert cut.status_code == 200, cut.text
    as_cohere = httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": long, "truncate_prompt_tokens": -1},
                           timeout=60).json()
    assert cut.json()["total_tokens"] == as_cohere["usage"]["total_tokens"] > 64
    assert {r["index"]: r["relevance_score"] for r in cut.json()["results"]} == pytest.approx(
        {r["index"]: _logit(r["relevance_score"]) for r in as_cohere["results"]}, abs=1e-5)
    refused = httpx.post(url + "/v1/reranker", json={"query": QUERY, "documents": long, "truncation": False})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "documents" and "truncation" in refused.json()["error"]["message"]

    for fields, param in (({"top_n": 1}, "top_n"), ({"truncate_prompt_tokens": -1}, "truncate_prompt_tokens"),
                          ({"frobnicate": 1}, "frobnicate"), ({"top_k": 0}, "top_k"),
                          ({"documents": [{"text": DOCS[0]}]}, "documents"),
                          ({"instruction": "rank"}, "instruction")):  # a cross-encoder's prompt has no instruction
        resp = post(**fields)
        assert resp.status_code == 400 and resp.json()["error"]["param"].split(".")[0] == param, (fields, resp.text)
    cohere_refuses = httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_k": 1})
    assert cohere_refuses.status_code == 400 and cohere_refuses.json()["error"]["param"] == "top_k"  # still Cohere's


def test_rtp_llm_reranker_of_several_labels(servers: dict[str, tuple[str, Path]]) -> None:
    """Three labels: the raw score is the last label's log-odds (sigmoid of it: /v1/rerank's softmax probability),
    so raw and normalised rank alike."""
    url, path = servers["classifier"]
    logits = _reference(path, "XLMRobertaForSequenceClassification", [(QUERY, d) for d in DOCS])
    expected = (logits[:, -1] - torch.logsumexp(logits[:, :-1], dim=-1)).tolist()
    cohere = httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": DOCS}, timeout=60).json()["results"]
    raw = httpx.post(url + "/v1/reranker", json={"query": QUERY, "documents": DOCS}, timeout=60).json()["results"]
    normal = httpx.post(url + "/v1/reranker", json={"query": QUERY, "documents": DOCS, "normalize": True},
                        timeout=60).json()["results"]
    assert [r["index"] for r in raw] == [r["index"] for r in normal] == [r["index"] for r in cohere]
    assert [r["relevance_score"] for r in normal] == [r["relevance_score"] for r in cohere]
    for r, c in zip(raw, cohere):
        assert abs(r["relevance_score"] - expected[r["index"]]) < 1e-4, (r, expected)
        assert abs(r["relevance_score"] - _logit(c["relevance_score"])) < 1e-5, (r, c)
