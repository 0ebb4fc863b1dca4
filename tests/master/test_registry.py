"""The master's registry fed by hand-made poll results and a fake clock: expiry, recovery, cache diffs,
burst accounting, membership. No processes."""
from __future__ import annotations

from dataclasses import replace

import pytest

from master.backend_poller import CacheUpdate, StatusError, cache_update_from_pb, worker_status_from_pb
from master.config import BackendEndpoint, MasterConfig
from master.registry import SOURCE_REGISTERED, SOURCE_STATIC, Registry
from proto import model_rpc_pb2 as pb
from tests.support.stub_backend import sane_status

CFG = MasterConfig.from_env({})
A = BackendEndpoint("10.0.0.1", 8089, 8093, "m")
B = BackendEndpoint("10.0.0.2", 8089, 8093, "m")
LOAD = worker_status_from_pb(sane_status(cache_version=0))


def registry_with(*endpoints: BackendEndpoint) -> Registry:
    reg = Registry(CFG)
    for e in endpoints:
        reg.add(e, SOURCE_STATIC, 0.0)
    return reg


def load_of(reg: Registry, name: str, now: float):  # type: ignore[no-untyped-def]
    return next(b for b in reg.loads(now) if b.name == name)


def test_silent_backend_expires_after_3s_and_comes_back_when_it_answers() -> None:
    reg = registry_with(A)
    assert not load_of(reg, A.name, 0.0).healthy  # never polled yet
    reg.apply_status(A.name, LOAD, 0.9, 1.0)
    assert load_of(reg, A.name, 3.9).healthy
    reg.mark_failed(A.name, "DEADLINE_EXCEEDED", definitive=False)  # a slow poll alone is not fatal
    assert load_of(reg, A.name, 3.9).healthy
    assert not load_of(reg, A.name, 4.0).healthy  # 3 s of silence
    reg.apply_status(A.name, LOAD, 4.4, 4.5)
    assert load_of(reg, A.name, 4.5).healthy


def test_refused_or_garbage_status_is_unhealthy_at_once() -> None:
    reg = registry_with(A)
    reg.apply_status(A.name, LOAD, 0.0, 0.0)
    reg.mark_failed(A.name, "UNAVAILABLE: connection refused", definitive=True)
    assert not load_of(reg, A.name, 0.1).healthy
    assert reg.view(0.1)["backends"][0]["error"].startswith("UNAVAILABLE")
    reg.apply_status(A.name, replace(LOAD, alive=False), 0.2, 0.2)
    assert not load_of(reg, A.name, 0.2).healthy  # answers, but its engine thread is dead
    reg.apply_status(A.name, LOAD, 0.3, 0.3)
    assert load_of(reg, A.name, 0.3).healthy


@pytest.mark.parametrize("fields", [dict(role="CHEF"), dict(total_blocks=0), dict(free_blocks=5000),
                                    dict(step_latency_ms=float("nan")), dict(running=-1),
                                    dict(prefill_tokens_per_s=float("inf")), dict(block_size=0)])
def test_garbage_worker_status_is_rejected(fields: dict[str, object]) -> None:
    with pytest.raises(StatusError) as exc:
        worker_status_from_pb(sane_status(**fields))
    assert exc.value.definitive and "garbage" in str(exc.value)


def test_garbage_cache_status_is_rejected() -> None:
    with pytest.raises(StatusError):
        cache_update_from_pb(pb.CacheStatusPB(version=1, cached_keys=[-5], block_size=16), -1)
    with pytest.raises(StatusError):
        cache_update_from_pb(pb.CacheStatusPB(version=1, block_size=0), -1)
    with pytest.raises(StatusError):
        cache_update_from_pb(pb.CacheStatusPB(version=1, is_diff=True, block_size=16), -1)


def test_cache_full_set_then_diffs() -> None:
    reg = registry_with(A)
    reg.apply_status(A.name, replace(LOAD, cache_version=3), 0.0, 0.0)
    assert reg.needs_cache(A.name) == -1
    reg.apply_cache(A.name, CacheUpdate(3, False, frozenset({1, 2, 3}), frozenset(), frozenset(), 16))
    assert reg.needs_cache(A.name) is None
    reg.apply_status(A.name, replace(LOAD, cache_version=5), 0.1, 0.1)
    assert reg.needs_cache(A.name) == 3
    reg.apply_cache(A.name, CacheUpdate(5, True, frozenset(), frozenset({4}), frozenset({1}), 16))
    assert set(load_of(reg, A.name, 0.1).cached_keys) == {2, 3, 4}


def test_restarted_backend_drops_its_old_keys() -> None:
    reg = registry_with(A)
    reg.apply_status(A.name, replace(LOAD, cache_version=7, iterate_count=500), 0.0, 0.0)
    reg.apply_cache(A.name, CacheUpdate(7, False, frozenset({1, 2}), frozenset(), frozenset(), 16))
    reg.apply_status(A.name, replace(LOAD, cache_version=7, iterate_count=3), 0.1, 0.1)  # same version, new process
    assert not load_of(reg, A.name, 0.1).cached_keys and reg.needs_cache(A.name) == -1


def test_routed_requests_count_until_a_later_poll_and_keys_are_pending() -> None:
    reg = registry_with(A)
    reg.apply_status(A.name, LOAD, 0.0, 0.0)
    reg.record_choice(A.name, [11, 12], seq_len=40, hit=0, now=1.0)
    b = load_of(reg, A.name, 1.0)
    assert (b.routed_requests, b.routed_prefill_tokens) == (1, 40)
    assert {11, 12} <= set(b.pending_keys)
    reg.apply_status(A.name, LOAD, 1.05, 1.06)  # sent within the grace: the request may not be in it yet
    assert load_of(reg, A.name, 1.06).routed_requests == 1
    reg.apply_status(A.name, LOAD, 1.2, 1.21)
    assert load_of(reg, A.name, 1.21).routed_requests == 0
    reg.apply_cache(A.name, CacheUpdate(1, False, frozenset({11}), frozenset(), frozenset(), 16))
    assert set(load_of(reg, A.name, 1.3).pending_keys) == {12}
    reg.apply_status(A.name, LOAD, 9.0, 9.0)  # pending keys expire
    assert not load_of(reg, A.name, 9.0).pending_keys
    assert reg.stats.requests == 1 and reg.stats.hit_requests == 0


def test_routed_keys_are_the_working_set_for_working_set_s_cached_or_not() -> None:
    reg = registry_with(A)
    reg.apply_status(A.name, LOAD, 0.0, 0.0)
    reg.record_choice(A.name, [11, 12], seq_len=40, hit=0, now=1.0)
    reg.apply_cache(A.name, CacheUpdate(1, False, frozenset({11, 12}), frozenset(), frozenset(), 16))
    reg.record_choice(A.name, [11, 13], seq_len=40, hit=16, now=5.0)  # 11 routed again: kept from 5.0 on
    assert set(load_of(reg, A.name, 5.0).recent_keys) == {11, 12, 13}
    # The backend evicted 12 (a diff): it stays in the working set, the prompt's home, until the window ends.
    reg.apply_cache(A.name, CacheUpdate(2, True, frozenset(), frozenset(), frozenset({12}), 16))
    assert 12 not in load_of(reg, A.name, 5.0).cached_keys and 12 in load_of(reg, A.name, 5.0).recent_keys
    reg.apply_status(A.name, LOAD, 1.0 + CFG.working_set_s, 1.0 + CFG.working_set_s)
    assert set(load_of(reg, A.name, 1.0 + CFG.working_set_s).recent_keys) == {11, 13}
    reg.apply_status(A.name, LOAD, 5.0 + CFG.working_set_s, 5.0 + CFG.working_set_s)
    assert not load_of(reg, A.name, 5.0 + CFG.working_set_s).recent_keys


def test_dns_sync_adds_and_drops_and_registration_is_forgotten_when_silent() -> None:
    reg = registry_with(A)
    reg.sync_source("dns:svc:8089", [A, B], 0.0)
    assert set(reg.backends) == {A.name, B.name}
    reg.sync_source("dns:svc:8089", [A], 1.0)
    assert set(reg.backends) == {A.name}  # A is still static
    c = BackendEndpoint("10.0.0.3", 8089, 8093, "m")
    reg.add(c, SOURCE_REGISTERED, 2.0)
    reg.forget_stale(2.0 + CFG.forget_s - 1)
    assert c.name in reg.backends
    reg.forget_stale(2.0 + CFG.forget_s + 1)
    assert c.name not in reg.backends and A.name in reg.backends


def test_a_backend_found_by_dns_takes_the_role_its_polls_report() -> None:
    """DNS (a k8s headless Service over PREFILL and DECODE pools) knows addresses, not roles: the poll says."""
    reg = Registry(CFG)
    source = "dns:kvyard-backends:8089"
    reg.sync_source(source, [A, B], 0.0)
    reg.apply_status(A.name, replace(LOAD, role="DECODE"), 0.0, 0.1)
    reg.apply_status(B.name, replace(LOAD, role="PREFILL"), 0.0, 0.1)
    assert {b.name: b.role for b in reg.loads(0.2)} == {A.name: "DECODE", B.name: "PREFILL"}
    reg.sync_source(source, [A, B], 5.0)  # the next resolution does not make them PDFUSION again
    assert {b.name: b.role for b in reg.loads(5.0)} == {A.name: "DECODE", B.name: "PREFILL"}
    reg.add(replace(A, role="PDFUSION"), SOURCE_REGISTERED, 5.1)  # a registration names the role itself
    assert load_of(reg, A.name, 5.1).role == "PDFUSION"


def test_per_backend_routing_counts_and_poll_latency() -> None:
    reg = registry_with(A)
    reg.apply_status(A.name, LOAD, 1.0, 1.004)
    reg.record_choice(A.name, [1, 2], 40, 32, 1.1)
    reg.record_choice(A.name, [3], 20, 0, 1.2)
    (summary,) = reg.summaries(1.2)
    assert (summary.routed_requests, summary.routed_prompt_tokens, summary.routed_hit_tokens) == (2, 60, 32)
    assert summary.poll_latency_ms == pytest.approx(4.0)


def test_a_prefill_decode_pair_is_one_routed_request() -> None:
    """The master records both halves of a PD choice; the totals (dashboard, /backends) count the request
    and its prompt once, so the hit rate is the prefill side's, not halved by the decode hand-over."""
    reg = registry_with(replace(A, role="PREFILL"), replace(B, role="DECODE"))
    reg.record_choice(A.name, [1, 2], 40, 32, 1.0)
    reg.record_choice(B.name, [], 40, 0, 1.0)
    assert (reg.stats.requests, reg.stats.hit_requests, reg.stats.prompt_tokens, reg.stats.hit_tokens) == (1, 1, 40, 32)
    prefill, decode = reg.summaries(1.0)
    assert (prefill.routed_requests, prefill.routed_prompt_tokens, prefill.routed_hit_tokens) == (1, 40, 32)
    assert (decode.routed_requests, decode.routed_prompt_tokens, decode.routed_hit_tokens) == (1, 0, 0)
