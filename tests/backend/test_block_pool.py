"""BlockPool: ref counts, prefix hits, eviction order, cache-status events."""
from __future__ import annotations

import pytest

from backend.block_pool import BlockPool
from backend.sequence import Sequence, StopConditions
from kvyard.block_keys import block_cache_keys

BS = 4


def seq_of(ids: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, ids, StopConditions(max_new_tokens=8))


def compute_all(pool: BlockPool, seq: Sequence) -> None:
    """What one step computing every remaining token does to the pool."""
    seq.num_computed_tokens = len(seq.token_ids)
    pool.cache_computed_blocks(seq)


def assert_all_free(pool: BlockPool) -> None:
    assert pool.num_free_blocks == pool.num_total_blocks
    assert all(b.ref_count == 0 for b in pool.blocks)
    assert pool.usage == 0.0


def test_allocate_fresh_and_free() -> None:
    pool = BlockPool(8, BS)
    seq = seq_of(list(range(10)))
    assert pool.can_allocate(seq)
    pool.allocate(seq)
    assert len(seq.block_table) == 3
    assert [pool.blocks[b].ref_count for b in seq.block_table] == [1, 1, 1]
    assert seq.num_computed_tokens == 0 and seq.num_cached_tokens == 0
    assert pool.num_free_blocks == 5
    assert pool.usage == pytest.approx(3 / 8)
    with pytest.raises(ValueError):
        pool.allocate(seq)  # already holds blocks
    pool.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert_all_free(pool)


def test_cache_computed_blocks_registers_full_blocks_only() -> None:
    pool = BlockPool(8, BS)
    seq = seq_of(list(range(10)))
    pool.allocate(seq)
    seq.num_computed_tokens = 5  # one chunk: only block 0 is full of computed tokens
    pool.cache_computed_blocks(seq)
    keys = block_cache_keys(seq.token_ids, BS)
    assert pool.cached_keys() == keys[:1]
    assert pool.cache_version == 1
    compute_all(pool, seq)  # block 2 holds 2 tokens: not full, no key
    assert pool.cached_keys() == keys
    assert pool.blocks[seq.block_table[2]].key is None
    assert pool.cache_version == 2
    pool.cache_computed_blocks(seq)  # idempotent
    assert pool.cache_version == 2


def test_prefix_hit_shares_blocks() -> None:
    pool = BlockPool(8, BS)
    a = seq_of(list(range(10)))
    pool.allocate(a)
    compute_all(pool, a)
    b = seq_of(list(range(8)) + [50, 51, 52])
    pool.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert [pool.blocks[x].ref_count for x in a.block_table[:2]] == [2, 2]
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert pool.num_free_blocks == 8 - 3 - 1
    pool.free(a)
    assert [pool.blocks[x].ref_count for x in b.block_table[:2]] == [1, 1]
    pool.free(b)
    assert_all_free(pool)
    assert len(pool.cached_keys()) == 2  # freed blocks keep their keys


def test_hit_on_freed_cached_block_revives_it() -> None:
    pool = BlockPool(4, BS)
    a = seq_of(list(range(9)))
    pool.allocate(a)
    compute_all(pool, a)
    cached_blocks = a.block_table[:2]
    pool.free(a)
    assert pool.num_free_blocks == 4
    b = seq_of(list(range(8)) + [99])
    version = pool.cache_version
    assert pool.can_allocate(b)
    pool.allocate(b)
    assert b.block_table[:2] == cached_blocks
    assert [pool.blocks[x].ref_count for x in cached_blocks] == [1, 1]
    assert pool.num_free_blocks == 1  # revived blocks left the free list
    assert b.num_cached_tokens == 8
    assert pool.cache_version == version  # the fresh block came from the uncached list: nothing evicted
    # Nothing can evict a revived block now: a 2-block request does not fit.
    assert not pool.can_allocate(seq_of(list(range(100, 106))))


def test_can_allocate_counts_revived_blocks() -> None:
    pool = BlockPool(3, BS)
    a = seq_of(list(range(9)))  # 3 blocks, the first two get cached
    pool.allocate(a)
    compute_all(pool, a)
    pool.free(a)
    # Hits 2 free cached blocks and needs 2 fresh ones: 4 > 3 free.
    assert not pool.can_allocate(seq_of(list(range(8)) + [1, 2, 3, 4, 5]))
    assert pool.can_allocate(seq_of(list(range(8)) + [1, 2, 3, 4]))


def test_hit_never_covers_last_token() -> None:
    pool = BlockPool(8, BS)
    a = seq_of(list(range(8)))
    pool.allocate(a)
    compute_all(pool, a)
    assert len(pool.cached_keys()) == 2
    b = seq_of(list(range(8)))  # identical, length a multiple of the block size
    pool.allocate(b)
    assert b.num_cached_tokens == 4 and b.num_computed_tokens == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    c = seq_of(list(range(4)))
    pool.allocate(c)
    assert c.num_cached_tokens == 0


def test_duplicate_computation_keeps_existing_key() -> None:
    pool = BlockPool(8, BS)
    a, b = seq_of(list(range(8))), seq_of(list(range(8)))
    pool.allocate(a)
    pool.allocate(b)  # admitted before a computed anything: no hit
    compute_all(pool, a)
    compute_all(pool, b)
    assert sorted(pool.cached.values()) == sorted(a.block_table)
    assert all(pool.blocks[x].key is None for x in b.block_table)
    pool.free(b)
    pool.free(a)
    assert_all_free(pool)
    assert len(pool.cached_keys()) == 2


def test_eviction_prefers_uncached_then_lru() -> None:
    pool = BlockPool(6, BS)
    a = seq_of(list(range(8)) + [7])      # blocks: cached, cached, partial
    b = seq_of(list(range(100, 108)))     # blocks: cached, cached
    pool.allocate(a)
    pool.allocate(b)
    compute_all(pool, a)
    compute_all(pool, b)
    ka = block_cache_keys(a.token_ids, BS)
    kb = block_cache_keys(b.token_ids, BS)
    pool.free(a)  # free order: a2 (uncached), a1, a0
    pool.free(b)  # then b1, b0
    version = pool.cache_version
    # 1 never-used block + a2 are uncached: the first two allocations evict nothing.
    c = seq_of(list(range(200, 208)))
    pool.allocate(c)
    assert pool.cache_version == version
    assert a.block_table == [] and set(pool.cached_keys()) == set(ka + kb)
    # The next ones evict least recently freed first: a's tail block, then a's head, then b's tail.
    singles = []
    for expected_gone in (ka[1], ka[0], kb[1]):
        before = set(pool.cached_keys())
        single = seq_of([1000 + len(singles)])
        pool.allocate(single)
        singles.append(single)
        assert before - set(pool.cached_keys()) == {expected_gone}
    assert pool.cached_keys() == [kb[0]]
    assert pool.cache_version == version + 3
    assert sorted(pool.cache_diff(version)[2]) == sorted([ka[1], ka[0], kb[1]])
    assert pool.num_free_blocks == 1
    for seq in [c, *singles]:
        pool.free(seq)
    assert_all_free(pool)


def test_append_slots_grows_table() -> None:
    pool = BlockPool(3, BS)
    seq = seq_of([1, 2, 3, 4])
    pool.allocate(seq)
    compute_all(pool, seq)
    assert len(seq.block_table) == 1
    seq.append_token(5)
    assert pool.can_append(seq, 1)
    pool.append_slots(seq, 1)
    assert len(seq.block_table) == 2
    pool.append_slots(seq, 1)  # fits the same block
    assert len(seq.block_table) == 2
    assert pool.can_append(seq, 8) and not pool.can_append(seq, 9)
    with pytest.raises(ValueError):
        pool.append_slots(seq, 9)
    pool.free(seq)
    assert_all_free(pool)


def test_cache_diff_events() -> None:
    pool = BlockPool(2, BS, max_events=4)
    assert pool.cache_diff(0) == (0, [], [])
    a = seq_of(list(range(4)) + [9])
    pool.allocate(a)
    compute_all(pool, a)
    key_a = block_cache_keys(a.token_ids, BS)[0]
    assert pool.cache_diff(0) == (1, [key_a], [])
    pool.free(a)
    b = seq_of(list(range(50, 58)))  # needs both blocks: evicts a's cached block
    pool.allocate(b)
    assert pool.cache_diff(1) == (2, [], [key_a])
    assert pool.cache_diff(0) == (2, [], [])  # added then removed: no net change
    compute_all(pool, b)
    kb = block_cache_keys(b.token_ids, BS)
    assert pool.cache_version == 4
    version, added, removed = pool.cache_diff(0)
    assert version == 4 and sorted(added) == sorted(kb) and removed == []
    pool.free(b)
    pool.allocate(seq_of(list(range(70, 78))))  # evicts both of b's keys: 6 events, 4 kept
    assert pool.cache_version == 6
    assert pool.cache_diff(1) is None  # history too short: caller asks for cached_keys()
    assert pool.cache_diff(2) == (6, [], [])
    assert pool.cache_diff(7) is None and pool.cache_diff(-1) is None
    assert pool.cached_keys() == []
