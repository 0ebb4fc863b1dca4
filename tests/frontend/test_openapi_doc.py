"""The OpenAPI document matches what the frontend answers: 400 (never 422) with the OpenAI error object,
the error table's statuses, and text/event-stream for the streaming routes."""
from __future__ import annotations

import json

from frontend.app import create_app
from frontend.config import FrontendConfig
from kvyard.http_errors import ERROR_TABLE
from kvyard.tokenizer import TextTokenizer


def test_openapi_says_400_and_sse(tokenizer: TextTokenizer) -> None:
    app = create_app(FrontendConfig.from_env({"BACKEND_ADDRESS": "127.0.0.1:1", "MODEL_NAME": "m"}), tokenizer)
    doc = app.openapi()
    assert '"422"' not in json.dumps(doc) and "HTTPValidationError" not in json.dumps(doc)
    statuses = {str(status) for status, _ in ERROR_TABLE.values()}
    for path in ("/v1/chat/completions", "/v1/completions", "/", "/v1/chat/render", "/tokenize"):
        responses = doc["paths"][path]["post"]["responses"]
        assert statuses <= set(responses), (path, sorted(responses))
        assert responses["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}
    for path in ("/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions", "/",
                 "/generate", "/v1/responses", "/responses"):   # every dialect frontend/dialect.py registers
        assert "text/event-stream" in doc["paths"][path]["post"]["responses"]["200"]["content"], path
    query = {p["name"] for p in doc["paths"]["/generate"]["post"]["parameters"] if p["in"] == "query"}
    assert query == {"max_tokens", "temperature", "top_p", "top_k", "seed", "model"}   # /generate's options
    assert "text/event-stream" not in doc["paths"]["/v1/chat/render"]["post"]["responses"]["200"].get("content", {})
    ids = [op["operationId"] for methods in doc["paths"].values() for op in methods.values()]
    assert len(ids) == len(set(ids)), "duplicate operation ids"
    error = doc["components"]["schemas"]["ErrorResponse"]["properties"]["error"]
    assert set(error["properties"]) == {"message", "type", "param", "code"}
