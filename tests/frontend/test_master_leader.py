"""Leader discovery (frontend/master_leader.py): a frontend configured with a follower master asks it
POST /rtp_llm/master and routes through the `real_master_host` it names, as RTP-LLM's frontend does."""
from __future__ import annotations

from typing import Any

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from kvyard.tokenizer import TextTokenizer
from master.mock_master import MockMasterConfig, create_mock_master_app
from tests.support.app_thread import AppThread
from tests.support.mock_stack import MockBackendThread, mock_frontend, script

CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


def follower(leader: str) -> FastAPI:
    """A master that is not the leader: it names the leader and routes nothing itself."""
    app = FastAPI()

    @app.post("/rtp_llm/master")
    async def master() -> dict[str, str]:
        return {"real_master_host": leader}

    @app.post("/rtp_llm/schedule")
    async def schedule() -> Any:
        return JSONResponse({"error": {"message": "not the leader", "type": "service_unavailable",
                                       "param": None, "code": "unavailable"}}, 503)
    return app


def test_the_frontend_routes_through_the_leader_its_master_names(tokenizer: TextTokenizer) -> None:
    with MockBackendThread(script(tokenizer, "Hi")) as routed, MockBackendThread(script(tokenizer, "Hi")) as direct:
        leader_cfg = MockMasterConfig.from_env({"MOCK_MASTER_BACKENDS": routed.address})
        with AppThread(create_mock_master_app(leader_cfg)) as leader, \
                AppThread(follower(leader.url.removeprefix("http://"))) as configured, \
                mock_frontend(tokenizer, direct.address,
                              MASTER_ADDRESS=configured.url.removeprefix("http://")) as front:
            for _ in range(2):
                assert httpx.post(f"{front.url}/v1/chat/completions", json=CHAT, timeout=10).status_code == 200
        assert len(routed.servicer.requests) == 2 and not direct.servicer.requests
