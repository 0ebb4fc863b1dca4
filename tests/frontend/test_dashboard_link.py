"""The frontend links to the master's dashboard; without a master it says where the dashboard lives."""
from __future__ import annotations

from fastapi.testclient import TestClient

from frontend.app import create_app
from frontend.config import FrontendConfig
from kvyard.tokenizer import TextTokenizer


def test_dashboard_link(tokenizer: TextTokenizer) -> None:
    routed = TestClient(create_app(FrontendConfig.from_env({"MASTER_ADDRESS": "127.0.0.1:9010"}), tokenizer))
    resp = routed.get("/dashboard", follow_redirects=False)
    assert resp.status_code == 307 and resp.headers["location"] == "http://127.0.0.1:9010/dashboard"
    alone = TestClient(create_app(FrontendConfig.from_env({}), tokenizer))
    resp = alone.get("/dashboard")
    assert resp.status_code == 404 and "master" in resp.json()["error"]["message"]
