"""Per-request limits that the frontend checks at the edge and the backend checks again for direct
gRPC callers: one number each, shared by both."""
from __future__ import annotations

MAX_N = 16              # sequences one request may ask for (OpenAI `n`, RTP-LLM `num_return_sequences`)
MAX_TOP_LOGPROBS = 20   # alternatives per position (`top_logprobs`, completions' `logprobs`)
MAX_POOL_ITEMS = 2048   # inputs one pooling request may carry (/v1/embeddings' list, a reranker's documents)
