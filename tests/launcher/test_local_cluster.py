"""`kvyard cluster --backends 2` as a user runs it (what `make cluster` starts): chat is served through the
master by both backends, repeated prefixes hit their caches, the dashboard shows it live (its JSON and SSE
feed with a real HTTP client, the page in headless Chromium, screenshot kept in tests/artifacts/), and
SIGTERM stops every process."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.browser import Browser, chromium_path
from tests.support.procs import REPO, free_port_block, stop_groups

# Loading two backends takes ~30 s on an idle 2-core machine; a shared, loaded one has taken 4 minutes.
READY_TIMEOUT_S = 480
pytestmark = [pytest.mark.slow, pytest.mark.timeout(READY_TIMEOUT_S + 120)]

ARTIFACTS = REPO / "tests" / "artifacts"
SYSTEM = ("You are a patient assistant for a museum of printing. Visitors ask about presses, type, ink and "
          "paper; answer in one short sentence. ") * 4
# A second long prefix: the master keeps each prefix with the backend that holds it (a shared one goes to
# one backend however concurrent the requests), so two prefixes are what makes both backends serve.
SYSTEM_2 = ("You are a cheerful guide in a museum of weaving. Visitors ask about looms, yarn, dyes and "
            "patterns; answer in one short sentence. ") * 4


@dataclass
class RunningCluster:
    proc: subprocess.Popen[bytes]
    log: Path
    frontend: str    # http://127.0.0.1:PORT
    master: str      # http://127.0.0.1:PORT+10
    ports: list[int]

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    base = free_port_block(36)  # frontend base, master base+10, backends base+20.. and base+30..
    log = tmp_path_factory.mktemp("local_cluster") / "cluster.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLUSTER_TOKEN", "ROLE_TYPE", "START_PORT"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvyard", "cluster", "--backends", "2", "--port", str(base),
                                 "--kv-cache-mb", "64", "--drain-grace-s", "5", "--ready-timeout-s", str(READY_TIMEOUT_S)],
                                env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    running = RunningCluster(proc, log, f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 10}",
                             [base, base + 10, base + 21, base + 25, base + 31, base + 35])
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S + 20
        while "kvyard cluster is serving" not in running.output():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not come up (exit {proc.poll()}):\n{running.output()[-4000:]}")
            time.sleep(0.5)
        yield running
    finally:
        stop_groups([proc], grace_s=60)


def chat(frontend: str, question: str, system: str = SYSTEM) -> str:
    resp = httpx.post(f"{frontend}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 4, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["message"]["content"])


def state(cluster: RunningCluster) -> dict:
    resp = httpx.get(f"{cluster.master}/dashboard/state")
    assert resp.status_code == 200
    return resp.json()


def test_it_prints_where_each_part_listens(cluster: RunningCluster) -> None:
    out = cluster.output()
    for needle in (f"frontend-1   {cluster.frontend}", f"master       {cluster.master}",
                   f"{cluster.master}/dashboard", "backend-1", "backend-2", f"curl {cluster.frontend}/v1/chat/completions",
                   "cluster token generated for this launch"):
        assert needle in out, needle
    assert "CLUSTER_TOKEN=" not in out  # the token itself is never printed


def test_chat_goes_through_the_master_to_both_backends_and_prefixes_hit(cluster: RunningCluster) -> None:
    questions = [(f"Question {i}: what did {name} make?", SYSTEM if i < 3 else SYSTEM_2) for i, name in
                 enumerate(["Gutenberg", "Caxton", "Aldus", "Jacquard", "Arkwright", "Morris"])]
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda q: chat(cluster.frontend, *q), questions))
    assert all(answers)
    view = state(cluster)
    backends = {b["name"]: b for b in view["backends"]}
    assert len(backends) == 2 and all(b["healthy"] for b in backends.values()), backends
    assert all(b["routed_requests"] >= 1 for b in backends.values()), backends  # both served chat
    assert view["totals"]["routed"] >= len(questions)
    assert view["totals"]["hit_tokens"] > 0  # a system prompt came from a cache
    assert sum(view["decisions"].values()) >= len(questions)
    # Only the master can say which backend: the frontend asked it for every request.
    metrics = httpx.get(f"{cluster.master}/metrics").text
    assert 'kvyard:backend_routed_requests_total{backend="127.0.0.1:' in metrics


def test_dashboard_feed_streams_live_state(cluster: RunningCluster) -> None:
    before = state(cluster)["totals"]["routed"]
    events = []
    with httpx.stream("GET", f"{cluster.master}/dashboard/events", timeout=10) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        chat(cluster.frontend, "Question 99: who made paper?")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
                if events[-1]["totals"]["routed"] > before:
                    break
    assert events[-1]["totals"]["routed"] == before + 1
    assert {b["role"] for b in events[-1]["backends"]} == {"PDFUSION"}
    page = httpx.get(f"{cluster.master}/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "http://" not in page.text and "https://" not in page.text  # self-contained: nothing from elsewhere
    link = httpx.get(f"{cluster.frontend}/dashboard")
    assert link.status_code == 307 and link.headers["location"] == f"{cluster.master}/dashboard"


@pytest.mark.skipif(chromium_path() is None, reason="needs Debian's chromium: `make test-dashboard` installs it")
def test_dashboard_in_headless_chromium(cluster: RunningCluster) -> None:
    with Browser(f"{cluster.master}/dashboard") as browser:
        names = browser.wait_for("""(() => { const rows = document.querySelectorAll('tr[data-backend]');
            return rows.length === 2 && [...rows].every(r => r.className === 'up')
                && [...rows].map(r => r.dataset.backend); })()""")
        assert sorted(names) == sorted(b["name"] for b in state(cluster)["backends"])
        routed = int(browser.evaluate("document.getElementById('routed-total').textContent"))
        for i in range(2):
            chat(cluster.frontend, f"Question {100 + i}: what is a platen?")
        moved = browser.wait_for(f"(() => {{ const n = +document.getElementById('routed-total').textContent;"
                                 f" return n >= {routed + 2} && n; }})()")
        assert moved >= routed + 2
        hits = browser.evaluate("[...document.querySelectorAll('tr[data-backend] td.hit-rate')]"
                                ".map(td => td.textContent)")
        assert len(hits) == 2 and any(not h.startswith("0.0 %") for h in hits), hits  # prefix hits shown
        assert browser.evaluate("document.getElementById('live').className") == "ok"
        assert browser.wait_for("document.querySelectorAll('#legend span').length")  # decisions charted
        browser.screenshot(ARTIFACTS / "dashboard.png")
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000


def test_sigterm_stops_every_part(cluster: RunningCluster) -> None:
    os.killpg(cluster.proc.pid, signal.SIGTERM)  # as a terminal's Ctrl-C or `kill` would reach it
    assert cluster.proc.wait(timeout=60) == 0, cluster.output()[-3000:]
    out = cluster.output()
    frontend_drained = out.index("frontend-1 | ", out.index("stopping the cluster"))
    assert frontend_drained < out.index("draining: NOT_SERVING")  # the frontends drain before the backends
    for port in cluster.ports:
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
