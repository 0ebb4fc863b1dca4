"""The pooling routes, each a thin dialect over frontend/pooling.py: OpenAI's /v1/embeddings (RTP-LLM's
/v1/embeddings/dense, /sparse, /colbert), RTP-LLM's /v1/embeddings/similarity, Cohere/Jina's rerank
(/v1/rerank, /rerank), RTP-LLM's reranker (/v1/reranker) and the classifier (/v1/classifier, /classify).
docs/embeddings.md has every shape."""
from __future__ import annotations

import base64
import math
import struct
import time
import uuid
from typing import Any

import numpy as np
from fastapi import APIRouter
from starlette.requests import Request

from frontend.pooling import PoolingModel, PoolingPipeline, sigmoid, softmax
from frontend.pooling_protocol import (ClassifyRequest, EmbeddingRequest, RerankRequest, RtpRerankRequest,
                                       SimilarityRequest)
from kvyard.errors import ErrorCode, RequestError
from kvyard.limits import MAX_POOL_ITEMS
from kvyard.pooling_model import ModelKind

EMBED = (ModelKind.EMBED,)
CLASSIFY = (ModelKind.CLASSIFY,)


def embedding_routes(pooling: PoolingPipeline) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/embeddings")
    @router.post("/v1/embeddings/dense")
    async def embeddings(req: EmbeddingRequest, request: Request) -> dict[str, Any]:
        return await _embed(pooling, request, req, "dense")

    @router.post("/v1/embeddings/sparse")
    async def sparse(req: EmbeddingRequest, request: Request) -> dict[str, Any]:
        return await _embed(pooling, request, req, "sparse")

    @router.post("/v1/embeddings/colbert")
    async def colbert(req: EmbeddingRequest, request: Request) -> dict[str, Any]:
        return await _embed(pooling, request, req, "colbert")

    @router.post("/v1/embeddings/similarity")
    async def similarity(req: SimilarityRequest, request: Request) -> dict[str, Any]:
        model = pooling.resolve(req.model, "/v1/embeddings/similarity", EMBED)
        left = [req.left] if isinstance(req.left, str) else req.left
        right = [req.right] if isinstance(req.right, str) else req.right
        if not left or not right:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "left and right must each hold at least one text",
                               "left" if not left else "right")
        if len(left) + len(right) > MAX_POOL_ITEMS:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"at most {MAX_POOL_ITEMS} texts per request, left and "
                               f"right together; got {len(left)} + {len(right)}",
                               "left" if len(left) >= len(right) else "right")
        prompt = _prompt(model, req.prompt_name)
        inputs = [*await pooling.tokenize(model, left, req.truncate_prompt_tokens, prompt, "left"),
                  *await pooling.tokenize(model, right, req.truncate_prompt_tokens, prompt, "right")]
        out = await pooling.run(request, model, inputs, "embed")
        vecs = np.array([o.values for o in out.outputs], dtype=np.float64)  # [L + R, D]
        vecs /= np.maximum(np.linalg.norm(vecs, axis=1, keepdims=True), 1e-12)
        # one matrix product: up to 1024 x 1024 dot products summed in Python held the event loop ~100 s
        scores = (vecs[:len(left)] @ vecs[len(left):].T).tolist()  # [L, R]
        return {"object": "list", "model": model.name, "data": scores, "usage": _usage(out.input_len)}

    @router.post("/v1/rerank")
    @router.post("/rerank")
    async def rerank(req: RerankRequest, request: Request) -> dict[str, Any]:
        model = pooling.resolve(req.model, "/v1/rerank", CLASSIFY)
        docs = [d if isinstance(d, str) else _doc_text(d, i) for i, d in enumerate(req.documents)]
        inputs = await pooling.tokenize(model, [(req.query, d) for d in docs], req.truncate_prompt_tokens,
                                        param="documents")
        out = await pooling.run(request, model, inputs, "classify")
        scores = [_relevance(o.values) for o in out.outputs]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": docs[i]}} if req.return_documents else {})}
                   for i in _most_relevant(scores, req.top_n)]
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": model.name, "results": results,
                "usage": {"total_tokens": out.input_len}}

    @router.post("/v1/reranker")
    async def rtp_reranker(req: RtpRerankRequest, request: Request) -> dict[str, Any]:
        """RTP-LLM's reranker: /v1/rerank's scoring in its Voyage-style shape, the raw logit unless normalize."""
        model = pooling.resolve(req.model, "/v1/reranker", CLASSIFY)
        inputs = await pooling.tokenize(model, [(req.query, d) for d in req.documents], -1 if req.truncation else None,
                                        param="documents", cut_with="truncation: true", instruction=req.instruction)
        out = await pooling.run(request, model, inputs, "classify")
        scores = [_relevance(o.values) if req.normalize else _relevance_logit(o.values) for o in out.outputs]
        kept = _most_relevant(scores, req.top_k)
        # RTP-LLM dumps its response with exclude_none: no document key rather than "document": null
        results = [{"index": i, **({"document": req.documents[i]} if req.return_documents else {}),
                    "relevance_score": scores[i]} for i in (kept if req.sorted else sorted(kept))]
        return {"results": results, "total_tokens": out.input_len, "model": model.name}

    @router.post("/v1/classifier")
    @router.post("/classify")
    async def classify(req: ClassifyRequest, request: Request) -> dict[str, Any]:
        model = pooling.resolve(req.model, "/v1/classifier", CLASSIFY)
        texts: list[Any] = [req.input] if isinstance(req.input, str) else list(req.input)
        for i, t in enumerate(texts):
            if isinstance(t, list):
                if len(t) != 2:
                    raise RequestError(ErrorCode.INVALID_ARGUMENT, f"input {i}: a pair is two texts, got {len(t)}",
                                       "input")
                texts[i] = (t[0], t[1])
        inputs = await pooling.tokenize(model, texts, req.truncate_prompt_tokens)
        out = await pooling.run(request, model, inputs, "classify")
        labels = model.spec.labels
        data = []
        for i, o in enumerate(out.outputs):
            probs = _probabilities(model, o.values)
            best = max(range(len(probs)), key=lambda k: probs[k])
            data.append({"index": i, "label": labels[best] if best < len(labels) else str(best), "probs": probs,
                         "labels": list(labels), "num_classes": len(probs)})
        return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": model.name, "data": data, "usage": _usage(out.input_len)}

    return router


async def _embed(pooling: PoolingPipeline, request: Request, req: EmbeddingRequest, head: str) -> dict[str, Any]:
    route = "/v1/embeddings" if head == "dense" else f"/v1/embeddings/{head}"
    model = pooling.resolve(req.model, route, EMBED, head)
    if head != "dense" and req.encoding_format != "float":
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{route} answers floats only", "encoding_format")
    dims = _dimensions(model, req.dimensions) if head == "dense" else None
    if head != "dense" and req.dimensions is not None:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{route} takes no dimensions", "dimensions")
    texts = _inputs(req.input)
    if req.prompt_name is not None and isinstance(texts[0] if texts else None, list):
        raise RequestError(ErrorCode.INVALID_ARGUMENT, "prompt_name puts a prompt before texts; token ids are pooled "
                           "as given (put the prompt's ids before them)", "prompt_name")
    inputs = await pooling.tokenize(model, texts, req.truncate_prompt_tokens, _prompt(model, req.prompt_name))
    out = await pooling.run(request, model, inputs, {"dense": "embed"}.get(head, head))
    data = []
    for i, o in enumerate(out.outputs):
        if head == "sparse":
            special = set(model.tokenizer.encode("", add_special_tokens=True).ids)
            embedding: Any = {str(t): w for t, w in zip(o.token_ids, o.values) if t not in special}
        elif head == "colbert":
            width = len(o.values) // max(1, o.rows)
            embedding = [o.values[r * width:(r + 1) * width] for r in range(o.rows)]
        else:
            vec = o.values
            if dims is not None and dims < len(vec):
                vec = _unit(vec[:dims]) if model.spec.normalize else vec[:dims]
            embedding = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode() \
                if req.encoding_format == "base64" else vec
        data.append({"object": "embedding", "index": i, "embedding": embedding})
    return {"object": "list", "data": data, "model": req.model or model.name, "usage": _usage(out.input_len)}


def _inputs(value: Any) -> list[str | list[int]]:
    """OpenAI's input forms → a list of texts or token-id lists."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(v, int) for v in value):
        return [list(value)]
    return list(value)


def _dimensions(model: PoolingModel, dims: int | None) -> int | None:
    """`dimensions`: the full size always; a shorter one only from a Matryoshka model (its sizes if it names
    them); else a 400."""
    full = model.spec.dimensions
    if dims is None or dims == full:
        return None
    allowed = model.spec.matryoshka_dimensions
    if allowed is None:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"model {model.name!r} does not support dimensions other "
                           f"than its own {full} (it is not a Matryoshka model)", "dimensions")
    if dims > full or (allowed and dims not in allowed):
        sizes = ", ".join(map(str, sorted({*allowed, full}))) if allowed else f"1..{full}"
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"dimensions {dims} is not one of {sizes}", "dimensions")
    return dims


def _prompt(model: PoolingModel, name: str | None) -> str:
    """The sentence-transformers prompt named (else the model's default one) to put before each text."""
    prompts = model.spec.prompts
    if name is None:
        name = model.spec.default_prompt_name
        return prompts.get(name, "") if name else ""
    if name not in prompts:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"prompt_name {name!r} is not one of this model's prompts "
                           f"({', '.join(prompts) or 'none'})", "prompt_name")
    return prompts[name]


def _doc_text(doc: dict[str, str], i: int) -> str:
    if set(doc) != {"text"} or not isinstance(doc["text"], str):
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"documents[{i}] must be a string or {{\"text\": ...}}",
                           "documents")
    return doc["text"]


def _relevance(logits: list[float]) -> float:
    """One logit: its sigmoid (sentence-transformers' CrossEncoder); several: the last label's probability."""
    return sigmoid(logits[0]) if len(logits) == 1 else softmax(logits)[-1]


def _relevance_logit(logits: list[float]) -> float:
    """_relevance before its squashing, so that sigmoid of this is _relevance and both rank alike: one logit as it
    is (Qwen3-Reranker's: yes minus no); several: the last label's log-odds against the rest (two: last minus
    first). A lone label's logit would not do: softmax ignores a shift common to all of them."""
    if len(logits) == 1:
        return logits[0]
    rest = logits[:-1]
    top = max(rest)
    return logits[-1] - top - math.log(sum(math.exp(x - top) for x in rest))


def _most_relevant(scores: list[float], k: int | None) -> list[int]:
    """The indices of the k highest scores (all without k), highest first."""
    return sorted(range(len(scores)), key=lambda i: -scores[i])[:k or len(scores)]


def _probabilities(model: PoolingModel, logits: list[float]) -> list[float]:
    if len(logits) == 1 or model.spec.problem_type == "multi_label_classification":
        return [sigmoid(x) for x in logits]
    return softmax(logits)


def _unit(vec: list[float]) -> list[float]:
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [v / norm for v in vec]


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": tokens, "total_tokens": tokens}
