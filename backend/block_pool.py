"""KV block allocator with prefix caching: the scheduler asks it for blocks, the master reads its cache keys.

Free-list policy: a free block either has no key (its KV is garbage to everyone) or is still
cached (full, computed, registered under its key, reusable by a prefix hit). New blocks come from
the uncached free blocks first; only when there are none is a cached block evicted, least recently
freed first. So the cache is kept as long as it costs nothing. `free` releases a sequence's blocks
tail first, which makes a sequence's deepest blocks the first evicted and keeps shared prefixes
(the blocks most likely to hit again) longest.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from backend.sequence import Sequence
from kvyard.block_keys import hash_block


@dataclass
class Block:
    block_id: int           # index into the KV cache tensors
    ref_count: int = 0      # sequences whose block_table holds it; 0 = free
    key: int | None = None  # prefix-cache key while registered (full and computed); None otherwise


@dataclass(frozen=True)
class CacheEvent:
    version: int  # cache_version right after this change
    key: int      # the key that appeared or disappeared
    added: bool   # True: registered; False: evicted


class BlockPool:
    """Fixed-size KV blocks with ref counts, a key -> block map of cached blocks and an eviction order."""

    def __init__(self, num_blocks: int, block_size: int = 16, max_events: int = 65536) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.block_size: int = block_size                             # tokens per block
        self.blocks: list[Block] = [Block(i) for i in range(num_blocks)]
        self.cached: dict[int, int] = {}                              # key -> block id, registered blocks only
        # Free blocks in reuse order (dicts as ordered sets: O(1) removal when a prefix hit revives one).
        self._free_uncached: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()     # least recently freed first
        self.cache_version: int = 0                                   # +1 per key added or removed
        self._events: deque[CacheEvent] = deque(maxlen=max_events)    # recent key changes, for cache_diff
        self._num_registered: dict[int, int] = {}                     # seq_id -> leading blocks already registered/checked

    # ---- sizes --------------------------------------------------------------------------------

    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds, cached or not (a cached free block is reusable at any time)."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences."""
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- keys ---------------------------------------------------------------------------------

    def _full_block_keys(self, seq: Sequence, num_blocks: int) -> list[int]:
        """seq.block_keys extended to at least `num_blocks` keys (token_ids only grow, so old keys stay valid)."""
        keys = seq.block_keys
        bs = self.block_size
        while len(keys) < num_blocks:
            i = len(keys)
            keys.append(hash_block(keys[-1] if keys else None, seq.token_ids[i * bs:(i + 1) * bs],
                                   seq.extra_key + seq.block_salts.get(i, b"")))
        return keys

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of seq, never covering its last token."""
        # (len - 1) // bs full blocks end strictly before the last token: at least one token is
        # always left to compute, so the model has logits to sample from.
        max_hits = (len(seq.token_ids) - 1) // self.block_size
        if seq.max_cached_tokens is not None:
            max_hits = min(max_hits, seq.max_cached_tokens // self.block_size)
        hits: list[int] = []
        for key in self._full_block_keys(seq, max_hits)[:max_hits]:
            block_id = self.cached.get(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _record(self, key: int, added: bool) -> None:
        self.cache_version += 1
        self._events.append(CacheEvent(self.cache_version, key, added))

    # ---- allocation ---------------------------------------------------------------------------

    def _take_free_block(self) -> int:
        if self._free_uncached:
            block_id, _ = self._free_uncached.popitem(last=False)
        else:
            block_id, _ = self._free_cached.popitem(last=False)
            block = self.blocks[block_id]
            # Evicted for reuse: its KV is about to be overwritten, so its key must go.
            assert block.key is not None and self.cached.get(block.key) == block_id
            del self.cached[block.key]
            self._record(block.key, added=False)
            block.key = None
        block = self.blocks[block_id]
        assert block.ref_count == 0
        block.ref_count = 1
        return block_id

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether admitting seq (blocks for all of its tokens, prefix hits shared) fits now."""
        hits = self._prefix_hits(seq)
        # A hit on a free cached block still consumes a free block.
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        fresh = self.blocks_needed(len(seq.token_ids)) - len(hits)
        return fresh + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Admit seq: share the cached prefix, fresh blocks for the rest; sets num_computed/num_cached_tokens."""
        if seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"{seq!r} already holds blocks")
        if not self.can_allocate(seq):
            raise ValueError(f"not enough free blocks for {seq!r}")
        hits = self._prefix_hits(seq)
        # Revive hit blocks before taking fresh ones, so eviction can never pick a block we hit.
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free_cached[block_id]
            block.ref_count += 1
        table = list(hits)
        for _ in range(self.blocks_needed(len(seq.token_ids)) - len(hits)):
            table.append(self._take_free_block())
        seq.block_table = table
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens
        self._num_registered[seq.seq_id] = len(hits)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return need <= len(self._free_uncached) + len(self._free_cached)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq.block_table so positions [0, num_computed + num_new_tokens) all have a slot."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > self.num_free_blocks:
            raise ValueError(f"not enough free blocks to grow {seq!r} by {num_new_tokens}")
        for _ in range(need):
            seq.block_table.append(self._take_free_block())

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register every block of seq that is now full of computed tokens under its chained key."""
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        start = self._num_registered.get(seq.seq_id, 0)
        if num_full <= start:
            return
        keys = self._full_block_keys(seq, num_full)
        for i in range(start, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.key is not None:
                continue  # a prefix hit: already registered
            if keys[i] in self.cached:
                # Same content computed twice (two identical prompts in flight): keep the existing
                # block; this one stays unkeyed and is recycled first when freed.
                continue
            block.key = keys[i]
            self.cached[keys[i]] = block.block_id
            self._record(keys[i], added=True)
        self._num_registered[seq.seq_id] = num_full

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks (tail first); blocks reaching ref 0 keep their key until reused."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.key is not None:
                    self._free_cached[block_id] = None
                else:
                    self._free_uncached[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        self._num_registered.pop(seq.seq_id, None)

    # ---- cache status for the router ----------------------------------------------------------

    def cached_keys(self) -> list[int]:
        return list(self.cached)

    def cache_diff(self, since_version: int) -> tuple[int, list[int], list[int]] | None:
        """(current version, keys added, keys removed) since `since_version`; None when history is too short."""
        if since_version == self.cache_version:
            return self.cache_version, [], []
        oldest_kept = self.cache_version - len(self._events) + 1
        if since_version < 0 or since_version > self.cache_version or oldest_kept > since_version + 1:
            return None
        # Net effect per key: the first event says whether it was present at since_version, the
        # last whether it is present now; a key added then removed in between is no change.
        first: dict[int, bool] = {}
        last: dict[int, bool] = {}
        for event in reversed(self._events):
            if event.version <= since_version:
                break
            first[event.key] = event.added  # iterating backwards: the earliest event wins
            last.setdefault(event.key, event.added)
        added = [k for k, now in last.items() if now and first[k]]
        removed = [k for k, now in last.items() if not now and not first[k]]
        return self.cache_version, added, removed
