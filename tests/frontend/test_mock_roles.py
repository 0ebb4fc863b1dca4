"""The debugging setup docs/development.md describes, as real processes: ROLE_TYPE=MOCK_BACKEND (scripted tokens
from a file) + ROLE_TYPE=MOCK_MASTER + ROLE_TYPE=FRONTEND with only a tokenizer, driven with the official
client; SIGTERM drains the frontend; bad mock configuration fails fast."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from kvyard.tokenizer import TextTokenizer
from tests.support.procs import REPO, RoleProcess, free_port_block

ANSWER = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
HI = [{"role": "user", "content": "Weather in Paris?"}]
DELAY_MS = 40


@dataclass
class Roles:
    backend_port: int   # START_PORT of the mock backend (gRPC on +1)
    master_url: str
    frontend_url: str
    logs: Path


@pytest.fixture(scope="module")
def roles(tokenizer: TextTokenizer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Roles]:
    logs = tmp_path_factory.mktemp("mock_roles")
    script = logs / "script.json"
    script.write_text(json.dumps([*tokenizer.encode(ANSWER), 2]))
    backend, master, frontend = free_port_block(), free_port_block(), free_port_block()
    procs = [
        RoleProcess({"ROLE_TYPE": "MOCK_BACKEND", "START_PORT": str(backend), "MOCK_TOKEN_FILE": str(script),
                     "MOCK_DELAY_MS": str(DELAY_MS)}, logs / "backend.log"),
        RoleProcess({"ROLE_TYPE": "MOCK_MASTER", "START_PORT": str(master),
                     "MOCK_MASTER_BACKENDS": f"127.0.0.1:{backend + 1}"}, logs / "master.log"),
        # Its own BACKEND_ADDRESS has nothing listening: answers can only come through the master.
        RoleProcess({"ROLE_TYPE": "FRONTEND", "START_PORT": str(frontend), "MODEL_NAME": "debug",
                     "MAX_SEQ_LEN": "1024", "BACKEND_ADDRESS": f"127.0.0.1:{free_port_block(1)}",
                     "MODEL_SERVICE_CONFIG": json.dumps({"master_endpoint": {"address": f"127.0.0.1:{master}"}})},
                    logs / "frontend.log"),
    ]
    try:
        procs[1].wait_healthy(f"http://127.0.0.1:{master}/health", timeout_s=60)
        procs[2].wait_healthy(f"http://127.0.0.1:{frontend}/health", timeout_s=60)
        yield Roles(backend, f"http://127.0.0.1:{master}", f"http://127.0.0.1:{frontend}", logs)
    finally:
        for p in procs:
            p.stop()


def test_tool_call_through_mock_master_and_mock_backend(roles: Roles) -> None:
    client = openai.OpenAI(base_url=f"{roles.frontend_url}/v1", api_key="x", max_retries=0, timeout=20)
    resp = client.chat.completions.create(model="debug", messages=HI, tools=[TOOL])
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    chunks = list(client.chat.completions.create(model="debug", messages=HI, tools=[TOOL], stream=True))
    names = [tc.function.name for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []
             if tc.function and tc.function.name]
    assert names == ["get_weather"]
    # The mock master answers RTP-LLM's schedule call itself.
    sched = httpx.post(f"{roles.master_url}/rtp_llm/schedule", json={"model": "debug", "block_cache_keys": [],
                                                                      "seq_len": 3}).json()
    assert sched["server_status"][0]["grpc_port"] == roles.backend_port + 1


def test_sigterm_drains_the_frontend(roles: Roles) -> None:
    port = free_port_block()
    url = f"http://127.0.0.1:{port}"
    proc = RoleProcess({"ROLE_TYPE": "FRONTEND", "START_PORT": str(port), "MAX_SEQ_LEN": "1024",
                        "BACKEND_ADDRESS": f"127.0.0.1:{roles.backend_port + 1}"}, roles.logs / "drain.log")
    try:
        proc.wait_healthy(f"{url}/health", timeout_s=60)
        lines: list[str] = []
        first = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json={"messages": HI, "stream": True},
                              timeout=30) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        first.set()
        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(20)
        os.kill(proc.proc.pid, signal.SIGTERM)
        time.sleep(0.3)
        refused = httpx.post(f"{url}/v1/chat/completions", json={"messages": HI}, timeout=5)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "draining" in refused.json()["error"]["message"]
        assert httpx.get(f"{url}/health", timeout=5).status_code == 503
        t.join(30)
        assert lines[-1] == "data: [DONE]"   # the request in flight finished
        content = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                          for line in lines[:-1])
        assert content == ANSWER
        assert proc.proc.wait(timeout=15) == 0
    finally:
        proc.stop()


@pytest.mark.parametrize(("env", "needle"), [
    ({"ROLE_TYPE": "MOCK_BACKEND"}, "MOCK_TOKEN_IDS"),
    ({"ROLE_TYPE": "MOCK_BACKEND", "MOCK_TOKEN_IDS": "[1, 2]", "MOCK_ERROR": "EXPLODE"}, "MOCK_ERROR"),
    ({"ROLE_TYPE": "MOCK_BACKEND", "MOCK_TOKEN_IDS": "hello"}, "MOCK_TOKEN_IDS"),
    ({"ROLE_TYPE": "MOCK_MASTER"}, "MOCK_MASTER_BACKENDS"),
    ({"ROLE_TYPE": "MOCK_MASTER", "MOCK_MASTER_BACKENDS": "a:1", "MOCK_MASTER_ERROR": "nope"}, "MOCK_MASTER_ERROR"),
    ({"ROLE_TYPE": "FRONTEND", "TOOL_CALL_PARSER": "nope"}, "hermes"),
])
def test_bad_mock_configuration_exits_2(env: dict[str, str], needle: str) -> None:
    full = {k: v for k, v in os.environ.items() if not k.startswith("MOCK_")}
    full["PYTHONPATH"] = str(REPO) + os.pathsep + full.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "kvyard"], env={**full, **env}, cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvyard: error:") and needle in lines[0], proc.stderr
