"""Per-request limits that the frontend checks at the edge and the backend checks again for direct
gRPC callers: one number each, shared by both."""
from __future__ import annotations

MAX_N = 16              # sequences one request may ask for (OpenAI `n`, RTP-LLM `num_return_sequences`)
MAX_TOP_LOGPROBS = 20   # alternatives per position (`top_logprobs`, completions' `logprobs`)
MAX_POOL_ITEMS = 2048   # inputs one pooling request may carry (/v1/embeddings' list, a reranker's documents)
# A repetition penalty outside this range overflows or vanishes the penalised logits (checked by the frontend
# at the edge, so that a stream is a 400 rather than an error chunk after a 200, and by the backend's sampler).
REPETITION_PENALTY_RANGE = (0.01, 100.0)
PENALTY_BOUND = 2.0          # presence_penalty and frequency_penalty lie in [-2, 2] (OpenAI's bounds)
LOGIT_BIAS_BOUND = 100.0     # a logit_bias value lies in [-100, 100] (OpenAI's bound)
TEMPERATURE_MAX = 2.0        # the OpenAI dialects' upper bound (OpenAI's own)

# Grammars (kvyard/constraint.py): llguidance compiles them recursively, so one deep enough overflows the
# native stack and kills the process, frontend or backend (an 8 MB stack ran out near 900 objects that
# each $ref the next, and near 2,600 Lark rules that each use the next). Checked by loops, before
# llguidance sees the text, with a wide margin.
MAX_SCHEMA_DEPTH = 200   # JSON levels a schema nests, each local `$ref` continuing into its target
GRAMMAR_BUDGET_S = 10.0  # seconds a grammar may take to check (frontend) or compile (backend) before its request fails
MAX_GRAMMAR_DEPTH = 400  # Lark rules (and terminals) nested through one another: a uses b uses c ...
