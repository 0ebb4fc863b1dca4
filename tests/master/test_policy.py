"""The master's routing policy on hand-made loads: no processes, no model."""
from __future__ import annotations

from dataclasses import replace

from kvyard.block_keys import block_cache_keys
from kvyard.errors import ErrorCode
from master.policy import (SKIP_KV_FULL, SKIP_QUEUE_FULL, SKIP_TOO_LONG, SKIP_UNHEALTHY, BackendLoad,
                           PolicyConfig, RouteRequest, ServerLoad, cache_local, choose_backend, choose_server,
                           evicted_tokens, hit_tokens)

MODEL = "m"
PROMPT = list(range(1000, 1400))          # 400 tokens = 25 full blocks of 16
KEYS = block_cache_keys(PROMPT, 16)
CFG = PolicyConfig()


def backend(name: str, **fields: object) -> BackendLoad:
    base: dict[str, object] = dict(model=MODEL, healthy=True, step_latency_ms=20.0, prefill_tokens_per_s=2000.0,
                                   free_blocks=1000, total_blocks=1000, block_size=16)
    return BackendLoad(name=name, **{**base, **fields})  # type: ignore[arg-type]


def request(ids: list[int] = PROMPT, model: str = MODEL) -> RouteRequest:
    return RouteRequest(model, block_cache_keys(ids, 16), len(ids))


def test_prefix_hit_wins_over_an_idle_backend() -> None:
    a = backend("a", running=2, queued_prefill_tokens=32)
    b = backend("b", cached_keys=frozenset(KEYS))
    c = backend("c")
    d = choose_backend(request(), [a, c, b])
    assert d.chosen == "b" and d.reason == "prefix_hit"
    assert d.candidate("b").hit_cache_len == 399  # 25 blocks, capped below the prompt length
    assert d.candidate("b").prefill_tokens == 1
    assert d.candidate("b").estimate_ttft_ms < d.candidate("c").estimate_ttft_ms


def test_hit_is_the_leading_run_of_keys_only() -> None:
    holes = frozenset(KEYS[:5] + KEYS[6:])
    assert hit_tokens(KEYS, backend("x", cached_keys=holes), len(PROMPT)) == 5 * 16
    assert hit_tokens(KEYS, backend("x", cached_keys=frozenset(KEYS[1:])), len(PROMPT)) == 0
    # The keys chain: another prompt's block with the same tokens but another parent is no hit.
    other = block_cache_keys([7] * 16 + PROMPT[16:], 16)
    assert hit_tokens(other, backend("x", cached_keys=frozenset(KEYS)), len(PROMPT)) == 0


def test_a_long_queue_outweighs_a_cache_hit() -> None:
    # Cached on "a", but "a" has 20k prompt tokens queued (10 s at 2k tok/s): "b" answers sooner.
    a = backend("a", cached_keys=frozenset(KEYS), queued_prefill_tokens=20_000, waiting=3)
    b = backend("b")
    d = choose_backend(request(), [a, b])
    assert d.chosen == "b" and d.reason == "shortest_ttft"


def test_imbalance_guard_sends_to_the_least_loaded_even_without_a_hit() -> None:
    # "a" holds the prefix and its queue estimate looks fine, but it runs 30 sequences against 2.
    a = backend("a", cached_keys=frozenset(KEYS), running=30)
    b = backend("b", running=2)
    d = choose_backend(request(), [a, b])
    assert d.chosen == "b" and d.reason == "imbalance"
    # Below the guard's thresholds the hit wins again.
    d = choose_backend(request(), [replace(a, running=9), b])
    assert d.chosen == "a" and d.reason == "prefix_hit"


def test_backend_without_kv_room_is_skipped() -> None:
    full = backend("full", cached_keys=frozenset(KEYS[:3]), free_blocks=10)  # 160 tokens free < 352 to compute
    roomy = backend("roomy", running=5)
    d = choose_backend(request(), [full, roomy])
    assert d.chosen == "roomy"
    assert d.candidate("full").skipped == SKIP_KV_FULL
    # A full hit needs almost no new KV: then the same backend qualifies.
    d = choose_backend(request(), [replace(full, cached_keys=frozenset(KEYS)), roomy])
    assert d.chosen == "full"


def test_everyone_full_is_overloaded_and_too_long_is_out_of_kv() -> None:
    d = choose_backend(request(), [backend("a", free_blocks=0), backend("b", waiting=64)])
    assert d.chosen is None and d.error is ErrorCode.OVERLOADED
    assert [c.skipped for c in d.candidates] == [SKIP_KV_FULL, SKIP_QUEUE_FULL]
    d = choose_backend(request(), [backend("a", total_blocks=10, free_blocks=10), backend("b", healthy=False)])
    assert d.error is ErrorCode.OUT_OF_KV_CACHE and d.candidate("a").skipped == SKIP_TOO_LONG


def test_unhealthy_unknown_model_and_empty_cluster() -> None:
    d = choose_backend(request(), [backend("a", healthy=False)])
    assert d.error is ErrorCode.UNAVAILABLE and d.candidate("a").skipped == SKIP_UNHEALTHY
    d = choose_backend(request(), [backend("a", healthy=False, cached_keys=frozenset(KEYS)), backend("b")])
    assert d.chosen == "b"
    d = choose_backend(request(model="nope"), [backend("a"), backend("b", model="other")])
    assert d.error is ErrorCode.MODEL_NOT_FOUND and "m, other" in d.message
    assert choose_backend(request(), []).error is ErrorCode.UNAVAILABLE


def test_only_backends_of_the_requested_model_are_candidates() -> None:
    d = choose_backend(request(model="other"), [backend("a", cached_keys=frozenset(KEYS)),
                                                backend("b", model="other", running=5)])
    assert d.chosen == "b" and [c.name for c in d.candidates] == ["b"]


def test_burst_spreads_over_equal_backends() -> None:
    """Requests routed since the last poll count as load at once, so a burst does not pile onto
    whichever backend looked best at the last poll."""
    loads = {"a": backend("a"), "b": backend("b"), "c": backend("c")}
    chosen = []
    for i in range(6):
        ids = [i * 7 + t for t in range(300)]  # distinct prompts, nothing cached anywhere
        d = choose_backend(request(ids), list(loads.values()))
        assert d.chosen is not None
        chosen.append(d.chosen)
        b = loads[d.chosen]
        loads[d.chosen] = replace(b, routed_requests=b.routed_requests + 1,
                                  routed_prefill_tokens=b.routed_prefill_tokens + 300, last_chosen=i + 1.0)
    assert sorted(chosen) == ["a", "a", "b", "b", "c", "c"]


def test_routed_prompt_counts_as_cached_before_the_poll_confirms_it() -> None:
    # "a" was just sent this prompt (its keys pending) and others; the next request sharing the
    # prefix follows it once "a" has computed them... but while "a" still has 1,600 tokens to compute
    # (more than copying the 400-token prefix to "b" costs, stickiness included), the idle "b" is sooner.
    a = backend("a", pending_keys=frozenset(KEYS), routed_requests=4, routed_prefill_tokens=1600)
    b = backend("b")
    assert choose_backend(request(), [a, b]).chosen == "b"
    a_done = replace(a, routed_requests=0, routed_prefill_tokens=0)
    d = choose_backend(request(), [a_done, b])
    assert d.chosen == "a" and d.candidate("a").hit_cache_len == 399


def test_ties_go_to_the_least_recently_chosen() -> None:
    a, b = backend("a", last_chosen=5.0), backend("b", last_chosen=3.0)
    assert choose_backend(request(), [a, b]).chosen == "b"
    assert choose_backend(request(), [a, replace(b, last_chosen=9.0)]).chosen == "a"


def test_unmeasured_prefill_rate_borrows_the_measured_ones() -> None:
    cfg = PolicyConfig(default_prefill_tokens_per_s=1000.0)
    fresh = backend("fresh", prefill_tokens_per_s=0.0)
    assert choose_backend(request(), [fresh], cfg).candidate("fresh").estimate_ttft_ms == 400.0  # the default
    # Next to measured backends (100 and 300 tok/s) a fresh one is assumed as fast as their mean, not
    # as fast as the default: otherwise every new backend would look 10x faster than a warm one.
    d = choose_backend(request(), [fresh, backend("x", prefill_tokens_per_s=100.0),
                                   backend("y", prefill_tokens_per_s=300.0)], cfg)
    assert d.candidate("fresh").estimate_ttft_ms == 2000.0
    warm = backend("warm", prefill_tokens_per_s=200.0, cached_keys=frozenset(KEYS))
    assert choose_backend(request(), [fresh, warm], cfg).chosen == "warm"


def test_a_running_decode_does_not_outweigh_a_hit() -> None:
    # A status one poll old may still show the previous request running: the hit must still win.
    holder = backend("holder", cached_keys=frozenset(KEYS), running=1, step_latency_ms=700.0)
    assert choose_backend(request(), [holder, backend("idle")]).chosen == "holder"


# ---- under KV pressure: what a placement costs later requests ----------------------------------------

SMALL_POOL = dict(free_blocks=60, total_blocks=60)  # 960 tokens: two 400-token prompts, not three


def other_keys(n: int, start: int = 50_000) -> frozenset[int]:
    """The block keys of n other 400-token prompts (25 blocks each)."""
    return frozenset(k for i in range(n) for k in block_cache_keys(list(range(start + 1000 * i, start + 1000 * i + 400)), 16))


def test_a_prefix_stays_with_its_backend_when_copying_it_costs_more_than_its_queue() -> None:
    # "a" holds the prompt but has 600 tokens queued (300 ms); "b" is idle. Greedy TTFT says "b"
    # (200 ms vs 300 ms), but computing the 399-token prefix there again costs another ~200 ms later.
    a = backend("a", cached_keys=frozenset(KEYS), queued_prefill_tokens=600)
    b = backend("b")
    d = choose_backend(request(), [a, b])
    assert d.candidate("b").estimate_ttft_ms < d.candidate("a").estimate_ttft_ms
    assert d.chosen == "a" and d.reason == "prefix_hit"
    assert choose_backend(request(), [a, b], PolicyConfig(stickiness=0.0)).chosen == "b"  # greedy
    # Once the queue costs more than recomputing the prefix twice, it moves.
    assert choose_backend(request(), [replace(a, queued_prefill_tokens=900), b]).chosen == "b"


def test_evicted_tokens_count_only_the_overflow_of_the_working_set() -> None:
    req = request()  # 25 blocks
    assert evicted_tokens(req, backend("x", **SMALL_POOL)) == 0  # empty working set
    assert evicted_tokens(req, backend("x", **SMALL_POOL, recent_keys=other_keys(1))) == 0  # 50 of 60 blocks
    assert evicted_tokens(req, backend("x", **SMALL_POOL, recent_keys=other_keys(2))) == 15 * 16  # 75 of 60
    assert evicted_tokens(req, backend("x", **SMALL_POOL, recent_keys=other_keys(4))) == 25 * 16  # at most the prompt
    # The prompt's own blocks are no new demand: a backend whose working set already has them evicts nothing.
    home = backend("x", **SMALL_POOL, recent_keys=other_keys(3) | frozenset(KEYS))
    assert evicted_tokens(req, home) == 0


def test_a_new_prefix_goes_where_its_working_set_has_room() -> None:
    # Nothing caches the prompt. "a" starts it a little sooner, but its working set (two other prompts)
    # already fills its pool: the prompt would evict a prefix "a" will be asked for again. "b" has room.
    a = backend("a", **SMALL_POOL, recent_keys=other_keys(2))
    b = backend("b", **SMALL_POOL, recent_keys=other_keys(1, start=90_000), queued_prefill_tokens=100)
    d = choose_backend(request(), [a, b])
    assert d.candidate("a").estimate_ttft_ms < d.candidate("b").estimate_ttft_ms
    assert d.chosen == "b" and d.reason == "shortest_ttft"
    assert choose_backend(request(), [replace(a, recent_keys=frozenset()), b]).chosen == "a"  # no working set: greedy


def test_an_evicted_prefix_goes_back_to_its_home() -> None:
    # The prompt was routed to "a" lately but "a" evicted it (in a's working set, not in its cache). Both
    # working sets are full; "b" is idle and "a" has a short queue: recomputing it at home keeps one copy.
    a = backend("a", **SMALL_POOL, recent_keys=other_keys(2) | frozenset(KEYS), queued_prefill_tokens=100)
    b = backend("b", **SMALL_POOL, recent_keys=other_keys(3, start=90_000))
    d = choose_backend(request(), [a, b])
    assert d.candidate("a").hit_cache_len == 0 and d.chosen == "a"
    # Not at any price: a home whose queue costs more than recomputing the prefix twice loses it.
    assert choose_backend(request(), [replace(a, queued_prefill_tokens=1000), b]).chosen == "b"


def test_prefixes_spread_over_the_backends_under_pressure() -> None:
    """Six prompts, two backends whose pools hold three each, the registry's bookkeeping replayed by hand:
    each backend becomes the home of three, however the queues look when each first arrives."""
    loads = {n: backend(n, **SMALL_POOL) for n in ("a", "b")}
    loads["a"] = replace(loads["a"], queued_prefill_tokens=50)  # "b" always starts a little later...
    loads["b"] = replace(loads["b"], queued_prefill_tokens=80)
    homes: dict[str, list[int]] = {"a": [], "b": []}
    for i in range(6):
        ids = list(range(200_000 + 1000 * i, 200_000 + 1000 * i + 300))  # 18 full blocks of 16 = 288 tokens
        d = choose_backend(request(ids), list(loads.values()))
        assert d.chosen is not None
        homes[d.chosen].append(i)
        b = loads[d.chosen]
        loads[d.chosen] = replace(b, recent_keys=frozenset(b.recent_keys) | frozenset(block_cache_keys(ids, 16)),
                                  last_chosen=i + 1.0)
    assert sorted(map(len, homes.values())) == [3, 3], homes


def test_cache_local_says_whether_the_chosen_backend_holds_the_prefix() -> None:
    """RTP-LLM's ScheduleMeta.cache_local: 0 LOCAL, 1 REMOTE (another backend holds more of it)."""
    hit = choose_backend(request(), [backend("a"), backend("b", cached_keys=frozenset(KEYS))])
    assert hit.chosen == "b" and cache_local(hit) == 0
    assert cache_local(choose_backend(request(), [backend("a"), backend("b")])) == 0  # nobody holds it
    away = choose_backend(request(), [backend("a", cached_keys=frozenset(KEYS), queued_prefill_tokens=20_000,
                                              waiting=3), backend("b")])
    assert away.chosen == "b" and cache_local(away) == 1


# ---- servers that report nothing (the gateway's upstreams) ------------------------------------------

def server(name: str, **fields: object) -> ServerLoad:
    base: dict[str, object] = dict(model=MODEL, in_flight=0, queued_work=0, block_size=64)
    return ServerLoad(name=name, **{**base, **fields})  # type: ignore[arg-type]


TEXT_KEYS = list(range(50))  # a 3,200-byte text as 50 blocks of 64 bytes


def test_a_server_without_kv_reports_takes_any_size_and_never_counts_evictions() -> None:
    huge = 1 << 30  # bytes: no KV pool to outgrow, whatever the size
    d = choose_server(MODEL, TEXT_KEYS, huge, [server("a"), server("b", in_flight=1, queued_work=10)])
    assert d.chosen == "a" and d.reason == "shortest_ttft"
    assert all(c.skipped is None for c in d.candidates)
    load = BackendLoad("x", MODEL, True, block_size=64, kv_reported=False)
    assert evicted_tokens(RouteRequest(MODEL, TEXT_KEYS, 3200), load) == 0


def test_servers_compare_queued_work_and_prefix_in_the_callers_unit() -> None:
    # No hit anywhere: least work wins, whichever has fewer requests.
    d = choose_server(MODEL, TEXT_KEYS, 3200, [server("a", in_flight=1, queued_work=5000),
                                               server("b", in_flight=2, queued_work=100)])
    assert d.chosen == "b" and d.reason == "shortest_ttft"
    # A long shared prefix wins over a slightly busier queue; a much busier one loses it.
    cached = frozenset(TEXT_KEYS)
    d = choose_server(MODEL, TEXT_KEYS, 3200, [server("a", cached_keys=cached, in_flight=1, queued_work=500),
                                               server("b")])
    assert d.chosen == "a" and d.reason == "prefix_hit" and d.candidate("a").hit_cache_len == 3199
    d = choose_server(MODEL, TEXT_KEYS, 3200, [server("a", cached_keys=cached, in_flight=1, queued_work=50_000),
                                               server("b")])
    assert d.chosen == "b"


def test_the_imbalance_guard_and_the_queue_limit_hold_for_servers() -> None:
    cached = frozenset(TEXT_KEYS)
    d = choose_server(MODEL, TEXT_KEYS, 3200, [server("a", cached_keys=cached, in_flight=12), server("b", in_flight=1)])
    assert d.chosen == "b" and d.reason == "imbalance"
    d = choose_server(MODEL, TEXT_KEYS, 3200, [server("a", in_flight=4)], PolicyConfig(max_waiting=4))
    assert d.chosen is None and d.candidates[0].skipped == SKIP_QUEUE_FULL
