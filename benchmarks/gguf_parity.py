"""kvyard's GGUF pooling models against llama.cpp's own server on the same files (a check, not a speed test):
tiny random ones written as llama.cpp's converter writes them (tests/support), served by both.

    .venv/bin/python benchmarks/gguf_parity.py

- a Qwen3 last-token embedder (F32, `add_eos_token`): the token ids of each input (llama-server's /tokenize
  against kvyard's pooling tokenizer) and the vectors' cosine, kvyard with `WEIGHT_FORMAT=dense` (exact) and by
  default (the F32 matrices served as Q8_0 blocks);
- the embedded all-MiniLM-L6-v2 as a BERT GGUF: the vectors' cosine;
- a tiny BERT cross-encoder (rank; its head scaled so the logits are far from 0): llama.cpp's /v1/rerank score
  is the raw logit, kvyard's its sigmoid; llama.cpp gives every token segment type 0 (its BERT graph adds
  the type embedding's first row), kvyard the document segment 1 as transformers does, so they differ by what
  that row changes;
- a tiny Nomic BERT embedder (nomic-embed-text's kind: `nomic-bert`, rotary positions, SwiGLU): the cosine;
- a tiny ModernBERT embedder (`modern-bert`: byte-level BPE, windowed layers, GeGLU): the token ids, the cosine;
- a tiny EmbeddingGemma (`gemma-embedding`: bidirectional Gemma 3 layers, a symmetric window, norms as 1 + w, the
  Dense matrices dense_2 / dense_3): the token ids, the cosine;
- a tiny XLM-RoBERTa embedder and cross-encoder (BGE-M3's and bge-reranker's kind: a SentencePiece Unigram
  vocabulary, `t5`): the token ids, single and paired, then the vectors' cosine and the scores;
- a tiny Qwen3-Reranker (rank, the head's yes/no rows): both scores are P(yes).
llama-server is the benchmarks' build (benchmarks/peer_servers.py)."""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import httpx
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gguf  # noqa: E402

from peer_servers import llama_binary  # noqa: E402
from kvyard.pooling_model import embedded_embedding_path  # noqa: E402
from kvyard.ports import free_port_block  # noqa: E402
from kvyard.tokenizer import pooling_tokenizer  # noqa: E402
from tests.backend.test_gguf_pooling import yes_no  # noqa: E402
from tests.support.procs import pdfusion, stop_groups, wait_healthy  # noqa: E402
from tests.support.tiny_embedding_gemma import tiny_embedding_gemma, write_embedding_gemma_gguf  # noqa: E402
from tests.support.tiny_encoders import tiny_encoder, write_bert_gguf  # noqa: E402
from tests.support.tiny_models import EXACT_TYPES, tiny_model, write_gguf  # noqa: E402

TEXTS = ["A man is eating food.", "short", "The capital of France is Paris, and it sits on the Seine river."]
# For the Unigram vocabulary: spaces to trim and collapse, NFKC's full-width letters and ligature, an unknown letter.
XLMR_TEXTS = [*TEXTS, "  Berlin ist   die Hauptstadt 𝔘𝔘 ", "Ｆｕｌｌ width ① ﬁne, 東京は日本の首都です。"]
QUERY = "what is the capital of france?"
F32 = {role: "F32" for role in EXACT_TYPES}


def llama_answers(path: Path, flag: str, requests: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    port = free_port_block()
    proc = subprocess.Popen([str(llama_binary("llama-server")), "-m", str(path), "--host", "127.0.0.1", "--port",
                             str(port), "-t", "2", "-c", "4096", "-b", "4096", "-ub", "4096", flag],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc, 120)
        return [httpx.post(f"http://127.0.0.1:{port}{route}", json=body, timeout=120).json() for route, body in requests]
    finally:
        stop_groups([proc], 30)


def kvyard_answer(path: Path, route: str, body: dict[str, Any], log: Path, env: dict[str, str] | None = None) -> Any:
    with pdfusion(path, "m", log, env=env) as url:
        return httpx.post(url + route, json={**body, "model": "m"}, timeout=120).json()


def vectors(answer: Any) -> torch.Tensor:
    return torch.tensor([d["embedding"] for d in sorted(answer["data"], key=lambda d: d["index"])])


def scores(answer: Any) -> torch.Tensor:
    return torch.tensor([r["relevance_score"] for r in sorted(answer["results"], key=lambda r: r["index"])])


def show(name: str, ours: torch.Tensor, theirs: torch.Tensor, how: Callable[[torch.Tensor, torch.Tensor], str]) -> None:
    print(f"{name:55} {how(ours, theirs)}")


def cosines(ours: torch.Tensor, theirs: torch.Tensor) -> str:
    return "cosine " + " ".join(f"{c:.7f}" for c in F.cosine_similarity(ours, theirs).tolist())


def cross_encoder(path: Path, arch: str) -> Path:
    """A tiny random cross-encoder whose one-logit head is scaled up: a random head's logits sit near 0, where
    any two scores look alike after a sigmoid."""
    from safetensors.torch import load_file, save_file
    hf = tiny_encoder(path, arch=arch, num_labels=1, unigram=arch.startswith("XLMRoberta"))
    weights = load_file(str(hf / "model.safetensors"))
    head = "classifier.out_proj.weight" if arch.startswith("XLMRoberta") else "classifier.weight"
    weights[head] = weights[head] * 300
    save_file(weights, str(hf / "model.safetensors"), metadata={"format": "pt"})
    return hf


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="kvyard-gguf-parity-"))
    embed = {"input": TEXTS}

    tiny = tiny_model("qwen3", max_positions=256)
    path = write_gguf(tiny, root / "qwen3-embedding.gguf", F32, pooling=gguf.PoolingType.LAST, add_eos=True)
    answers = llama_answers(path, "--embedding", [("/tokenize", {"content": t, "add_special": True}) for t in TEXTS]
                            + [("/v1/embeddings", embed)])
    same = all(a["tokens"] == pooling_tokenizer(path).encode(t).ids for a, t in zip(answers, TEXTS))
    print(f"{'Qwen3 embedder: token ids equal to llama-server /tokenize':55} {same}")
    for env, label in (({"WEIGHT_FORMAT": "dense"}, "dense"), (None, "default: F32 served as Q8_0")):
        ours = vectors(kvyard_answer(path, "/v1/embeddings", embed, root / "q3.log", env))
        show(f"Qwen3 embedder (last token, eos), {label}", ours, vectors(answers[-1]), cosines)

    path = write_bert_gguf(embedded_embedding_path(), root / "all-MiniLM-L6-v2.gguf")
    theirs = vectors(llama_answers(path, "--embedding", [("/v1/embeddings", embed)])[0])
    show("all-MiniLM-L6-v2 as a BERT GGUF (mean)", vectors(kvyard_answer(path, "/v1/embeddings", embed,
                                                                          root / "minilm.log")), theirs, cosines)

    path = write_bert_gguf(tiny_encoder(root / "nomic", arch="NomicBertModel"), root / "nomic-embed-tiny.gguf")
    theirs = vectors(llama_answers(path, "--embedding", [("/v1/embeddings", embed)])[0])
    show("Nomic BERT embedder (mean)", vectors(kvyard_answer(path, "/v1/embeddings", embed, root / "nomic.log")),
         theirs, cosines)

    path = write_bert_gguf(tiny_encoder(root / "modernbert", arch="ModernBertModel"), root / "modernbert-tiny.gguf")
    long = [*TEXTS, " ".join(TEXTS * 2)]  # past the window of 4: the local layers' band shows
    answers = llama_answers(path, "--embedding", [("/tokenize", {"content": t, "add_special": True}) for t in long]
                            + [("/v1/embeddings", {"input": long})])
    same = all(a["tokens"] == pooling_tokenizer(path).encode(t).ids for a, t in zip(answers, long))
    print(f"{'ModernBERT: token ids equal to llama-server /tokenize':55} {same}")
    show("ModernBERT embedder (mean)", vectors(kvyard_answer(path, "/v1/embeddings", {"input": long},
                                                             root / "modernbert.log")), vectors(answers[-1]), cosines)

    gemma = tiny_embedding_gemma(root / "embeddinggemma-tiny")
    path = write_embedding_gemma_gguf(gemma, root / "embeddinggemma-tiny.gguf")
    answers = llama_answers(path, "--embedding", [("/tokenize", {"content": t, "add_special": True}) for t in long]
                            + [("/v1/embeddings", {"input": long})])
    same = all(a["tokens"] == pooling_tokenizer(path).encode(t).ids for a, t in zip(answers, long))
    print(f"{'EmbeddingGemma: token ids equal to llama-server /tokenize':55} {same}")
    show("EmbeddingGemma (mean, dense_2, dense_3)", vectors(kvyard_answer(path, "/v1/embeddings", {"input": long},
                                                                          root / "gemma.log")), vectors(answers[-1]), cosines)

    rerank = {"query": QUERY, "documents": TEXTS}
    path = write_bert_gguf(cross_encoder(root / "ce", "BertForSequenceClassification"), root / "cross-encoder.gguf")
    theirs = scores(llama_answers(path, "--reranking", [("/v1/rerank", rerank)])[0])
    show("BERT cross-encoder: kvyard vs sigmoid(llama.cpp's logit)", scores(kvyard_answer(
        path, "/v1/rerank", rerank, root / "ce.log")), theirs,
        lambda a, b: f"largest difference {(a - torch.sigmoid(b)).abs().max():.2e} (llama.cpp's logits "
                     f"{[round(x, 4) for x in b.tolist()]})")

    path = write_bert_gguf(tiny_encoder(root / "xlmr", arch="XLMRobertaModel", unigram=True), root / "xlmr.gguf")
    xembed = {"input": XLMR_TEXTS}
    answers = llama_answers(path, "--embedding", [("/tokenize", {"content": t, "add_special": True})
                                                  for t in XLMR_TEXTS] + [("/v1/embeddings", xembed)])
    tok = pooling_tokenizer(path)
    same = [a["tokens"] == tok.encode(t).ids for a, t in zip(answers, XLMR_TEXTS)]
    print(f"{'XLM-R (Unigram): token ids equal to llama-server /tokenize':55} {all(same)} {same}")
    show("XLM-R embedder (mean)", vectors(kvyard_answer(path, "/v1/embeddings", xembed, root / "xlmr.log")),
         vectors(answers[-1]), cosines)
    path = write_bert_gguf(cross_encoder(root / "xce", "XLMRobertaForSequenceClassification"),
                           root / "xlmr-cross-encoder.gguf")
    xrerank = {"query": QUERY, "documents": XLMR_TEXTS}
    theirs = scores(llama_answers(path, "--reranking", [("/v1/rerank", xrerank)])[0])
    show("XLM-R cross-encoder: kvyard vs sigmoid(llama.cpp's logit)", scores(kvyard_answer(
        path, "/v1/rerank", xrerank, root / "xce.log")), theirs,
        lambda a, b: f"largest difference {(a - torch.sigmoid(b)).abs().max():.2e} (llama.cpp's logits "
                     f"{[round(x, 4) for x in b.tolist()]})")

    tiny = tiny_model("qwen3", max_positions=1024)
    path = write_gguf(tiny, root / "qwen3-reranker.gguf", F32, rerank=yes_no(tiny))
    theirs = scores(llama_answers(path, "--reranking", [("/v1/rerank", rerank)])[0])
    show("Qwen3-Reranker: P(yes), WEIGHT_FORMAT=dense", scores(kvyard_answer(
        path, "/v1/rerank", rerank, root / "rr.log", {"WEIGHT_FORMAT": "dense"})), theirs,
        lambda a, b: f"largest difference {(a - b).abs().max():.2e} (llama.cpp {b.tolist()})")


if __name__ == "__main__":
    main()
