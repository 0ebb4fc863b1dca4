"""The cluster across hosts (tests/multihost/cluster.py: every role in a network namespace of its own, wired as
deploy/kubernetes wires it): routing through each frontend, prefix locality, the PD hand-over between hosts,
a backend's and the master's link cut and restored, a host without the token, a wrong advertised address.
Every request each check sends is answered or errored, never lost (tests/multihost/traffic.py)."""
from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from kvyard.grpc_keepalive import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS
from kvyard.tokenizer import TextTokenizer
from proto import model_rpc_pb2 as pb
from proto import model_rpc_pb2_grpc as pb_grpc
from tests.multihost.cluster import (BACKEND_GRPC, BACKENDS, BACKENDS_DNS, MANIFEST_ENV, MASTER_DNS, MASTER_PORT,
                                     MultiHostCluster)
from tests.multihost.traffic import Stream, Tally, chat
from tests.support.procs import REPO, cluster_metadata

pytestmark = [pytest.mark.slow, pytest.mark.multihost, pytest.mark.timeout(900)]

MASTER_EXPIRE_S = 3.0     # MASTER_EXPIRE_MS's default: a silent backend leaves routing after it
HEALTH_PERIOD_S = MASTER_EXPIRE_S + 2.0  # ... plus a poll and scheduling slack on a loaded machine
KEEPALIVE_S = (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000  # a stream to a cut-off peer fails within it
TOPICS = ["lighthouses", "bees", "volcanoes", "glaciers", "owls", "canals", "deserts", "comets"]


def system_prompt(topic: str) -> str:
    """Several KV blocks long, so a prefix hit is worth routing for."""
    return (f"You are a patient guide to {topic}. Visitors ask short questions about {topic}; answer in one "
            "friendly sentence, without lists, and never mention that you are a guide. ") * 3


def story_prompt(topic: str) -> str:
    """A stream's own system prompt, several KV blocks long: only the backend that ran the stream caches it."""
    return (f"You tell long, calm stories about {topic}, full of small details about {topic}, in plain words, "
            "one paragraph after another, and you never stop to ask the listener anything. ") * 3


def routed(cluster: MultiHostCluster) -> dict[str, int]:
    return {name: b["routed_requests"] for name, b in cluster.backends_view().items()}


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {name: after[name] - before.get(name, 0) for name in after if after[name] != before.get(name, 0)}


def test_chat_through_each_frontend_reaches_both_backends(cluster: MultiHostCluster) -> None:
    tally = Tally()
    before = routed(cluster)
    jobs = [(fe, topic) for topic in TOPICS[:6] for fe in ("fe1", "fe2")]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda job: chat(tally, cluster.frontend_url(job[0]), "What is special here?",
                                                 system_prompt(job[1])), jobs))
    tally.assert_none_lost(len(jobs))
    assert tally.answered == len(jobs), tally.errored
    assert all(a is not None and a["choices"][0]["message"]["content"] for a in answers)
    moved = delta(before, routed(cluster))
    assert moved.get("pd1", 0) >= 1 and moved.get("pd2", 0) >= 1, moved
    assert sum(moved.values()) == len(jobs) + moved.get("decode", 0), moved  # each routed once (+ its decode side)


def test_a_shared_prefix_lands_where_it_is_cached(cluster: MultiHostCluster) -> None:
    tally = Tally()
    system = system_prompt("harbours")
    before = routed(cluster)
    first = chat(tally, cluster.frontend_url("fe1"), "Why are harbours sheltered?", system, aux_info=True)
    assert first is not None
    home = [n for n in delta(before, routed(cluster)) if n != "decode"]
    assert len(home) == 1, home
    hits_before = cluster.backends_view()[home[0]]["prefix_hits"]
    questions = ["What is a breakwater?", "Who runs a harbour?", "Are harbours deep?", "What is a quay?"]
    before = routed(cluster)
    answers = [chat(tally, cluster.frontend_url(fe), q, system, aux_info=True)
               for q, fe in zip(questions, ["fe2", "fe1", "fe2", "fe1"])]
    tally.assert_none_lost(1 + len(questions))
    assert tally.answered == 1 + len(questions), tally.errored
    landed = {n for n in delta(before, routed(cluster)) if n != "decode"}
    assert landed == set(home), (landed, home)
    assert cluster.backends_view()[home[0]]["prefix_hits"] > hits_before
    assert all(a is not None and a["aux_info"]["reuse_len"] > 0 for a in answers), [a and a["aux_info"] for a in answers]


def grpc_generate(address: str, ids: list[int], request_id: str, decode_address: str = "") -> list[pb.GenerateOutputsPB]:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.ModelRpcServiceStub(channel)
        cfg = pb.GenerateConfigPB(max_new_tokens=12, ignore_eos=True)
        return list(stub.GenerateStreamCall(pb.GenerateInputPB(request_id=request_id, token_ids=ids, generate_config=cfg,
                                                               decode_address=decode_address),
                                            metadata=cluster_metadata(), timeout=120))


def tokens(outs: list[pb.GenerateOutputsPB]) -> list[int]:
    assert not any(o.HasField("error") for o in outs), outs[-1].error
    return [t for o in outs for g in o.generate_outputs for t in g.output_ids]


def assert_blocks_back(cluster: MultiHostCluster, *names: str) -> None:
    for name in names:
        cluster.wait_for(f"{name}: no request running and every KV block free", lambda: (
            (st := cluster.worker_status(name))["running"] == 0 and st["free_blocks"] == st["total_blocks"]), 10)


def test_pd_hand_over_across_hosts_equals_pdfusion(cluster: MultiHostCluster, tokenizer: TextTokenizer) -> None:
    """PREFILL on one host hands its KV to DECODE on another (over the bridge, by the address the master
    would give); the tokens equal a PDFUSION backend's, greedy, and every block is back on both sides."""
    decode = cluster.backend_grpc("decode")
    prompts = [tokenizer.encode(f"<|im_start|>user\nTell a child {i + 2} facts about {t}.<|im_end|>\n"
                                "<|im_start|>assistant\n", parse_special=True) for i, t in enumerate(TOPICS[:3])]
    for i, ids in enumerate(prompts):
        reference = tokens(grpc_generate(cluster.backend_grpc("pd1"), ids, f"ref-{i}"))
        outs = grpc_generate(cluster.backend_grpc("prefill"), ids, f"pd-{i}", decode)
        assert tokens(outs) == reference, i
        aux = outs[-1].generate_outputs[-1].aux_info
        assert aux.kv_blocks_sent + aux.kv_blocks_skipped == -(-len(ids) // 16) and aux.kv_transfer_bytes > 0
    assert_blocks_back(cluster, "prefill", "decode", "pd1")
    # And through a frontend and the master, which pairs them itself (its answer equals pd1's too).
    tally = Tally()
    via = chat(tally, cluster.frontend_url("fe2"), "Name three colours.", max_tokens=12, aux_info=True)
    tally.assert_none_lost(1)
    assert via is not None


def test_a_host_without_the_token_can_do_nothing(cluster: MultiHostCluster) -> None:
    """From the `intruder` host (same network, DNS names resolve, no token): registering, scheduling and
    calling a backend (gRPC and HTTP) are all refused as unauthenticated, with or without a wrong token."""
    before = set(cluster.backends_view())
    for token in ("", "wrong-token-0123456789abcdef"):
        argv = cluster.host("intruder").argv(sys.executable, "-m", "tests.multihost.intruder",
                                             f"{MASTER_DNS}:{MASTER_PORT}", f"{BACKENDS_DNS}:{BACKEND_GRPC}", token)
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO,
                             env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
        assert out.returncode == 0, out.stderr[-3000:]
        results = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.strip())
        assert results == {"register": "401", "schedule": "401", "generate": "UNAUTHENTICATED",
                           "worker_status": "UNAUTHENTICATED", "backend_http": "401"}, (token, out.stdout)
    assert set(cluster.backends_view()) == before  # nothing registered


def test_a_wrong_advertised_address_is_detected_not_black_holed(cluster: MultiHostCluster) -> None:
    """A backend that registers an address nobody holds: the master lists it unhealthy (its polls fail),
    routes nothing there, and tells the backend, which says so in its log; every request is answered."""
    nobody = cluster.net.address(25)
    env = {**MANIFEST_ENV["kvyard-backend"], "MASTER_ADDRESS": f"{MASTER_DNS}:{MASTER_PORT}", "ADVERTISE_HOST": nobody}
    liar = cluster.start("liar", env)
    try:
        liar.wait_healthy(f"{cluster.backend_http('liar')}/health", 300)
        cluster.wait_for("the liar registered", lambda: nobody in cluster.backends_view(), 30)
        entry = cluster.backends_view()[nobody]
        assert not entry["healthy"]
        tally = Tally()
        for i, topic in enumerate(TOPICS):
            chat(tally, cluster.frontend_url(("fe1", "fe2")[i % 2]), f"Say something about {topic}.")
        tally.assert_none_lost(len(TOPICS))
        assert tally.answered == len(TOPICS), tally.errored
        assert cluster.worker_status("liar")["iterate_count"] == 0  # nothing reached it
        assert cluster.backends_view()[nobody]["routed_requests"] == 0
        assert not cluster.backends_view()[nobody]["healthy"] and cluster.backends_view()[nobody]["error"]
        liar.wait_for_log("the master cannot reach this backend", timeout_s=30)
    finally:
        cluster.stop("liar")


def test_cutting_a_backends_link(cluster: MultiHostCluster) -> None:
    """pd1 drops off the network mid-stream: its streams end with an error chunk and [DONE], the others
    finish; new requests go around it within the health period; it rejoins once its link is back."""
    tally = Tally()
    streams = [Stream(tally, cluster.frontend_url(("fe1", "fe2")[i % 2]), f"Tell a long story about {t}.",
                      story_prompt(t)).start() for i, t in enumerate(TOPICS[:6])]
    cluster.wait_for("pd1 is streaming", lambda: cluster.worker_status("pd1")["running"] > 0, 60)
    for s in streams:
        s.first.wait(60)
    cut_at = time.monotonic()
    cluster.net.cut(cluster.host("pd1"))
    try:
        took = cluster.wait_for("the master takes pd1 out", lambda: not cluster.backends_view()["pd1"]["healthy"], 30)
        assert took <= HEALTH_PERIOD_S, took
        after = Tally()
        before = routed(cluster)
        for i, topic in enumerate(TOPICS):
            chat(after, cluster.frontend_url(("fe1", "fe2")[i % 2]), f"One fact about {topic}?")
        after.assert_none_lost(len(TOPICS))
        assert after.answered == len(TOPICS), after.errored
        assert "pd1" not in delta(before, routed(cluster))
        for s in streams:
            s.join()
        tally.assert_none_lost(len(streams))
        assert tally.errored and tally.answered, (tally.errored, tally.answered)  # pd1's failed, the rest ran on
        ended = [s.ended_at - cut_at for s in streams if s.outcome == "errored"]
        assert all("unreachable" in e for e in tally.errored), tally.errored
        assert max(ended) <= KEEPALIVE_S + 5, ended  # noticed by gRPC keepalive, not TCP's retransmission timeout
    finally:
        cluster.net.restore(cluster.host("pd1"))
    cluster.wait_for("pd1 rejoins", lambda: cluster.backends_view()["pd1"]["healthy"], 30)
    assert_blocks_back(cluster, "pd1")  # its cut streams were cancelled there too (gRPC keepalive)
    # The prompts of the streams cut on pd1 are cached there and nowhere else (each stream was routed once, with
    # a system prompt of its own): they bring their follow-ups back to it.
    cut_on_pd1 = [s for s in streams if s.outcome == "errored"]
    back = Tally()
    before = routed(cluster)
    for s in cut_on_pd1:
        chat(back, cluster.frontend_url("fe1"), "And what happened next?", s.system)
    back.assert_none_lost(len(cut_on_pd1))
    moved = delta(before, routed(cluster))
    assert back.answered == len(cut_on_pd1) and moved.get("pd1", 0) >= 1, moved


def test_cutting_the_masters_link(cluster: MultiHostCluster) -> None:
    """The master drops off the network: frontends call the backends' DNS name directly (README: Frontend
    side) and stay healthy; once it is back they route through it again."""
    steps = {name: cluster.worker_status(name)["iterate_count"] for name in BACKENDS}
    cluster.net.cut(cluster.host("master"))
    try:
        tally = Tally()
        for i, topic in enumerate(TOPICS):
            chat(tally, cluster.frontend_url(("fe1", "fe2")[i % 2]), f"Is {topic} a good topic?")
        tally.assert_none_lost(len(TOPICS))
        assert tally.answered == len(TOPICS), tally.errored
        served = {n for n in BACKENDS if cluster.worker_status(n)["iterate_count"] > steps[n]}
        assert len(served) >= 2, served  # spread over the name's addresses (gRPC round_robin), not pinned
        for fe in ("fe1", "fe2"):
            assert httpx.get(f"{cluster.frontend_url(fe)}/health", timeout=10).status_code == 200
    finally:
        cluster.net.restore(cluster.host("master"))
    # The cluster's own backends: the liar of the wrong-address test stays listed (unhealthy) until the master
    # forgets it, MASTER_FORGET_S (60 s) after it stopped, so on a fast machine it is still there now.
    cluster.wait_for("every backend healthy again in the master's view",
                     lambda: all(cluster.backends_view()[name]["healthy"] for name in BACKENDS), 30)
    before = sum(routed(cluster).values())
    back = Tally()
    for i in range(10):  # a frontend asks the master again a second after its last failure
        chat(back, cluster.frontend_url(("fe1", "fe2")[i % 2]), f"Say {i}.")
        if sum(routed(cluster).values()) > before:
            break
    back.assert_none_lost(i + 1)
    assert back.answered == i + 1 and sum(routed(cluster).values()) > before
