"""An original Qwen3-Reranker (a causal LM scored by its last token's "yes" and "no" logits, configured by
vLLM's --hf-overrides keys in config.json) as the main CHECKPOINT_PATH of a PDFUSION launch: /v1/rerank,
/rerank, /v1/reranker and /v1/classifier answer what transformers' causal LM computes on the same weights
with the model card's prompt and formula (softmax over [no, yes] of the last logits → yes; RTP-LLM's
/v1/reranker by default the logit that is the sigmoid of: yes minus no)."""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from kvyard.pooling_model import QWEN3_RERANKER, ModelKind, load_pooling_spec
from tests.support.procs import pdfusion
from tests.support.tiny_decoder_poolers import tiny_qwen3_reranker

os.environ.setdefault("HF_HUB_OFFLINE", "1")
QUERY = "what is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "France borders Spain and Italy; its capital "
        "city, Paris, lies on the Seine."]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    path = tiny_qwen3_reranker(tmp_path_factory.mktemp("qwen3-reranker") / "reranker")
    # One torch thread: test_rerank_matches_transformers_yes_no compares two requests' scores bit for bit, and
    # a pooling step's float32 GEMMs may round differently on 1 and 2 threads (MKL's AVX2 code did, make
    # test-avx2), which the pooling engine picks step by step (backend/step_threads.py).
    with pdfusion(path, "rr", path.parent / "pdfusion.log", env={"TORCH_NUM_THREADS": "1"}) as url:
        yield url, path


def reference_scores(path: Path, query: str, docs: list[str], max_length: int = 512) -> list[float]:
    """The model card's code: prefix + tokenizer(pair, truncated) + suffix, the last position's logits,
    log-softmax over [no, yes], exp of yes."""
    return [torch.log_softmax(no_yes, dim=-1)[1].exp().item() for no_yes in _no_yes(path, query, docs, max_length)]


def reference_logits(path: Path, query: str, docs: list[str], max_length: int = 512,
                     instruction: str = QWEN3_RERANKER["instruction"]) -> list[float]:
    """What the card's probability is the sigmoid of: the last position's yes logit minus its no logit."""
    return [(no_yes[1] - no_yes[0]).item() for no_yes in _no_yes(path, query, docs, max_length, instruction)]


def _no_yes(path: Path, query: str, docs: list[str], max_length: int,
            instruction: str = QWEN3_RERANKER["instruction"]) -> list[torch.Tensor]:
    import transformers
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    model = transformers.Qwen3ForCausalLM.from_pretrained(path).eval()
    prefix = tok.encode(QWEN3_RERANKER["prefix"], add_special_tokens=False)
    suffix = tok.encode(QWEN3_RERANKER["suffix"], add_special_tokens=False)
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    out = []
    for doc in docs:
        pair = QWEN3_RERANKER["pair"].format(instruction=instruction, query=query, document=doc)
        ids = tok(pair, truncation="longest_first", max_length=max_length - len(prefix) - len(suffix))["input_ids"]
        with torch.no_grad():
            out.append(model(torch.tensor([prefix + ids + suffix])).logits[0, -1, [no, yes]])
    return out


def test_spec_from_the_checkpoint(served: tuple[str, Path]) -> None:
    spec = load_pooling_spec(served[1])
    assert (spec.kind, spec.template, spec.two_way, spec.labels) == (ModelKind.CLASSIFY, "qwen3-reranker", True,
                                                                     ("yes",))


def test_rerank_matches_transformers_yes_no(served: tuple[str, Path]) -> None:
    url, path = served
    ref = reference_scores(path, QUERY, DOCS)
    cohere: dict[int, float] = {}
    for route in ("/v1/rerank", "/rerank"):
        r = httpx.post(url + route, json={"query": QUERY, "documents": DOCS}, timeout=60)
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == sorted(range(3), key=lambda i: -ref[i])
        for x in results:
            assert abs(x["relevance_score"] - ref[x["index"]]) < 1e-4, (x, ref)
        cohere = {x["index"]: x["relevance_score"] for x in results}
    # RTP-LLM's /v1/reranker: the yes-minus-no logit by default, the card's probability with normalize
    logits = reference_logits(path, QUERY, DOCS)
    for normalize, expected in ((False, logits), (True, ref)):
        r = httpx.post(url + "/v1/reranker", json={"query": QUERY, "documents": DOCS, "normalize": normalize},
                       timeout=60)
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == sorted(range(3), key=lambda i: -ref[i])
        for x in results:
            assert abs(x["relevance_score"] - expected[x["index"]]) < 1e-4, (x, expected)
            assert x["document"] == DOCS[x["index"]]
            if normalize:
                assert x["relevance_score"] == cohere[x["index"]]
    r = httpx.post(url + "/v1/classifier", json={"input": [[QUERY, d] for d in DOCS]}, timeout=60)
    assert r.status_code == 200, r.text
    assert [d["labels"] for d in r.json()["data"]] == [["yes"]] * 3
    assert [round(d["probs"][0], 4) for d in r.json()["data"]] == [round(s, 4) for s in ref]


def test_rtp_llm_reranker_takes_an_instruction(served: tuple[str, Path]) -> None:
    """RTP-LLM's `instruction` replaces the card's default <Instruct> text: the scores are transformers' on the
    prompt with that instruction (and differ from the default's)."""
    url, path = served
    instruction = "Given a question about a city, find the passage that names its country"
    want, default = reference_logits(path, QUERY, DOCS, instruction=instruction), reference_logits(path, QUERY, DOCS)
    assert max(abs(a - b) for a, b in zip(want, default)) > 1e-3
    r = httpx.post(url + "/v1/reranker", json={"query": QUERY, "documents": DOCS, "instruction": instruction,
                                                "sorted": False}, timeout=60)
    assert r.status_code == 200, r.text
    assert [x["index"] for x in r.json()["results"]] == [0, 1, 2]
    for x in r.json()["results"]:
        assert abs(x["relevance_score"] - want[x["index"]]) < 1e-4, (x, want)


def test_truncation_cuts_the_pair_text_and_a_lone_text_is_a_400(served: tuple[str, Path]) -> None:
    url, path = served
    long_doc = "Paris " * 400
    r = httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": [long_doc]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents", r.text  # the field rerank has
    r = httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": [long_doc], "truncate_prompt_tokens": 300},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert abs(r.json()["results"][0]["relevance_score"] - reference_scores(path, QUERY, [long_doc], 300)[0]) < 1e-4
    context = load_pooling_spec(path).max_len
    r = httpx.post(url + "/v1/reranker", json={"query": QUERY, "documents": [long_doc]}, timeout=60)
    assert r.status_code == 200, r.text  # RTP-LLM's truncation defaults to true: cut at the context
    assert r.json()["total_tokens"] == context
    assert abs(r.json()["results"][0]["relevance_score"] - reference_logits(path, QUERY, [long_doc], context)[0]) < 1e-4
    r = httpx.post(url + "/v1/reranker", json={"query": QUERY, "documents": [long_doc], "truncation": False},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents", r.text
    r = httpx.post(url + "/v1/classifier", json={"input": "just one text"}, timeout=60)
    assert r.status_code == 400 and "pairs" in r.json()["error"]["message"], r.text
