"""Prefill/decode pairing in the pure policy: prefill by TTFT with prefix hits, decode by KV room and load."""
from __future__ import annotations

from master.policy import BackendLoad, RouteRequest, choose_backend, choose_decode
from kvyard.errors import ErrorCode


def load(name: str, role: str, **fields: object) -> BackendLoad:
    base = dict(model="m", healthy=True, role=role, free_blocks=100, total_blocks=100, block_size=16,
                prefill_tokens_per_s=1000.0)
    return BackendLoad(name=name, **{**base, **fields})  # type: ignore[arg-type]


REQ = RouteRequest("m", [11, 12, 13], 64)


def test_pairs_prefill_with_a_decode_backend() -> None:
    d = choose_backend(REQ, [load("p1", "PREFILL"), load("d1", "DECODE")])
    assert (d.chosen, d.decode) == ("p1", "d1")


def test_prefill_side_uses_prefix_hits_and_never_picks_decode() -> None:
    backends = [load("p1", "PREFILL"), load("p2", "PREFILL", cached_keys=frozenset({11, 12, 13})),
                load("d1", "DECODE", cached_keys=frozenset({11, 12, 13})), load("f1", "PDFUSION")]
    d = choose_backend(REQ, backends)
    assert d.chosen == "p2" and d.reason == "prefix_hit" and d.decode == "d1"
    assert {c.name for c in d.candidates} == {"p1", "p2", "f1"}


def test_a_mixed_pool_routes_to_pdfusion_too_and_pairs_only_prefill() -> None:
    """PDFUSION beside a PREFILL + DECODE pair (a migration, or tests/multihost/): the PDFUSION backend is a
    first-stage candidate like the PREFILL one (it used to get nothing) and is never given a decode side."""
    cached = frozenset({11, 12, 13})
    d = choose_backend(REQ, [load("p1", "PREFILL"), load("d1", "DECODE"), load("f1", "PDFUSION", cached_keys=cached)])
    assert (d.chosen, d.decode) == ("f1", None)
    d = choose_backend(REQ, [load("p1", "PREFILL", cached_keys=cached), load("d1", "DECODE"), load("f1", "PDFUSION")])
    assert (d.chosen, d.decode) == ("p1", "d1")


def test_no_decode_room_falls_back_to_pdfusion() -> None:
    cached = frozenset({11, 12, 13})
    d = choose_backend(REQ, [load("p1", "PREFILL", cached_keys=cached), load("d1", "DECODE", free_blocks=1),
                             load("f1", "PDFUSION", running=3)])
    assert (d.chosen, d.decode) == ("f1", None)


def test_decode_choice_skips_unhealthy_and_full_then_prefers_least_loaded() -> None:
    decoders = [load("d1", "DECODE", healthy=False), load("d2", "DECODE", free_blocks=3),
                load("d3", "DECODE", running=5), load("d4", "DECODE", running=1, free_blocks=40),
                load("d5", "DECODE", running=1, free_blocks=90)]
    assert choose_decode(REQ, decoders) == "d5"  # same load as d4, less KV used
    assert choose_decode(REQ, decoders[:2]) is None


def test_routed_kv_counts_against_decode_room() -> None:
    assert choose_decode(REQ, [load("d1", "DECODE", free_blocks=5, routed_kv_tokens=40)]) is None


def test_no_decode_room_is_overloaded_not_a_crash() -> None:
    d = choose_backend(REQ, [load("p1", "PREFILL"), load("d1", "DECODE", free_blocks=1)])
    assert d.chosen is None and d.error is ErrorCode.OVERLOADED and d.reason == "no_decode"


def test_without_prefill_backends_decode_only_backends_are_not_first_choice() -> None:
    d = choose_backend(REQ, [load("f1", "PDFUSION", running=3), load("d1", "DECODE")])
    assert d.chosen == "f1" and d.decode is None


def test_a_vit_is_never_chosen() -> None:
    """ROLE_TYPE=VIT registers under the model's name and looks idle and roomy: still no request goes there."""
    d = choose_backend(REQ, [load("v1", "VIT", cached_keys=frozenset({11, 12, 13})), load("p1", "PREFILL"),
                             load("d1", "DECODE")])
    assert (d.chosen, d.decode) == ("p1", "d1") and {c.name for c in d.candidates} == {"p1"}
    d = choose_backend(REQ, [load("v1", "VIT")])
    assert d.chosen is None and d.error is ErrorCode.UNAVAILABLE
