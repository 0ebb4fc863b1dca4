"""MODEL_NAME (`--served-model-name`) with aliases: the frontend answers to every name, lists them, and
refuses other names; the backend is asked under the first."""
from __future__ import annotations

import httpx

from kvyard.tokenizer import TextTokenizer
from tests.support.stub_backend import stub_frontend


def test_every_alias_is_served_and_listed(tokenizer: TextTokenizer) -> None:
    ids = [*tokenizer.encode("Hi!"), 2]
    with stub_frontend(tokenizer, lambda _req: ids, model="small,tiny") as stub:
        for name in ("small", "tiny"):
            resp = httpx.post(f"{stub.url}/v1/chat/completions",
                              json={"model": name, "messages": [{"role": "user", "content": "Hi"}]})
            assert resp.status_code == 200 and resp.json()["model"] == name, resp.text
            assert httpx.post(f"{stub.url}/generate?model={name}", content="Hello").status_code == 200
        resp = httpx.post(f"{stub.url}/v1/chat/completions",
                          json={"model": "large", "messages": [{"role": "user", "content": "Hi"}]})
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
        assert [m["id"] for m in httpx.get(f"{stub.url}/v1/models").json()["data"]] == ["small", "tiny"]
