"""The mock master (master/mock_master.py): MOCK_MASTER_PORT, and PREFILL + DECODE pairs that a frontend follows
to the mock backend (which gets the decode address), so the PD path is debuggable without weights."""
from __future__ import annotations

import httpx
from fastapi.testclient import TestClient

from kvyard.roles import Role
from kvyard.tokenizer import TextTokenizer
from master.mock_master import MockMasterConfig, create_mock_master_app
from tests.support.app_thread import AppThread
from tests.support.mock_stack import MockBackendThread, mock_frontend, script

SCHEDULE = {"model": "m", "block_cache_keys": [], "seq_len": 4}


def test_mock_master_port_wins_over_start_port() -> None:
    env = {"MOCK_MASTER_BACKENDS": "127.0.0.1:9001", "START_PORT": "9000"}
    assert MockMasterConfig.from_env(env).port == 9000
    assert MockMasterConfig.from_env({**env, "MOCK_MASTER_PORT": "16000"}).port == 16000


def test_pairs_prefill_with_decode_round_robin() -> None:
    cfg = MockMasterConfig.from_env({"MOCK_MASTER_BACKENDS": "127.0.0.1:26001",
                                     "MOCK_MASTER_DECODE_BACKENDS": "127.0.0.1:27001,127.0.0.1:28001"})
    client = TestClient(create_mock_master_app(cfg))
    answers = [client.post("/rtp_llm/schedule", json=SCHEDULE).json()["server_status"] for _ in range(2)]
    for servers, decode_port in zip(answers, (27001, 28001)):
        assert [s["role"] for s in servers] == [Role.PREFILL.rtp_type, Role.DECODE.rtp_type]
        assert servers[0]["grpc_port"] == 26001 and servers[1]["grpc_port"] == decode_port
        assert servers[1]["http_port"] == decode_port + 4


def test_a_frontend_follows_the_pair_to_the_prefill_backend(tokenizer: TextTokenizer) -> None:
    with MockBackendThread(script(tokenizer, "Hi")) as prefill:
        cfg = MockMasterConfig.from_env({"MOCK_MASTER_BACKENDS": prefill.address,
                                         "MOCK_MASTER_DECODE_BACKENDS": "127.0.0.1:27001"})
        with AppThread(create_mock_master_app(cfg)) as master, \
                mock_frontend(tokenizer, prefill.address, MASTER_ADDRESS=master.url.removeprefix("http://")) as front:
            resp = httpx.post(f"{front.url}/v1/chat/completions", timeout=10,
                              json={"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
            assert resp.status_code == 200, resp.text
    assert prefill.servicer.requests[-1].decode_address == "127.0.0.1:27001"
