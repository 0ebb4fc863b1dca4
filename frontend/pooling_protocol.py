"""Request bodies of the pooling routes (frontend/embeddings.py): OpenAI's embeddings, RTP-LLM's similarity,
Cohere/Jina's rerank, RTP-LLM's reranker and the classifier. Strict: a field we do not honour is a 400 naming it."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator

from frontend.generate_config import valid_text

TokenIds = list[StrictInt]  # JSON's true or 1.0 is not a token id (lax int would take them as 1)
# OpenAI's `input`: a string, a list of strings, token ids, or a list of token-id lists.
EmbeddingInput = str | list[str] | TokenIds | list[TokenIds]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("input", "left", "right", "query", "documents", check_fields=False)
    @classmethod
    def _texts(cls, v: Any, info: ValidationInfo) -> Any:
        valid_text(list(_strings(v)), str(info.field_name))  # else the tokenizer's TypeError: a 500
        return v


def _strings(v: Any) -> Iterator[str]:
    """Every text in an input: strings, pairs, {"text": ...} documents (token ids hold none)."""
    if isinstance(v, str):
        yield v
    elif isinstance(v, (list, tuple, dict)):
        for item in v.values() if isinstance(v, dict) else v:
            yield from _strings(item)


class _Truncation(_Strict):
    model: str | None = None
    # Keep at most this many tokens of each input (from the start); -1 = the model's context. Unset: an input
    # longer than the context is a 400.
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    user: str | None = None  # OpenAI's end-user id: accepted, logged nowhere


class EmbeddingRequest(_Truncation):
    """POST /v1/embeddings (and /v1/embeddings/dense, /sparse, /colbert)."""
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)  # Matryoshka truncation, where the model allows it
    prompt_name: str | None = None  # one of the model's sentence-transformers prompts, put before each input


class SimilarityRequest(_Truncation):
    """POST /v1/embeddings/similarity: cosine similarity of every left input with every right one."""
    left: str | list[str]
    right: str | list[str]
    prompt_name: str | None = None


class RerankRequest(_Truncation):
    """POST /v1/rerank, /rerank (Cohere / Jina shape)."""
    query: str
    documents: list[str | dict[str, str]]  # strings, or {"text": ...} objects (Cohere)
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True


class RtpRerankRequest(_Strict):
    """POST /v1/reranker: RTP-LLM's reranker request (its VoyageRerankerRequest's fields)."""
    query: str
    documents: list[str]
    model: str | None = None
    top_k: int | None = Field(default=None, ge=1)  # keep the k most relevant documents
    sorted: bool = True             # most relevant first; false: the kept documents in the order sent
    truncation: bool = True         # cut pairs longer than the context to it; false: too long is a 400
    return_documents: bool = True   # each result's `document`: the text sent
    normalize: bool = False         # false: the relevance logit; true: its probability, as /v1/rerank scores
    instruction: str | None = None  # Qwen3-Reranker's <Instruct> (default: its card's); other models: a 400


class ClassifyRequest(_Truncation):
    """POST /v1/classifier, /classify: label probabilities of each input (a text, or a [text, text] pair)."""
    input: str | list[str | list[str]]
