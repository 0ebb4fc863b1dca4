"""Prefix-cache block keys: fixed wire values, chaining, partial blocks, process independence."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from kvyard.block_keys import block_cache_keys, hash_block

REPO = Path(__file__).resolve().parents[2]


def reference_hash(parent: int | None, ids: list[int], extra: bytes = b"") -> int:
    """The documented byte layout, written out independently of the module."""
    p = 0xFFFF_FFFF_FFFF_FFFF if parent is None else parent
    data = (p.to_bytes(8, "big") + len(ids).to_bytes(4, "little")
            + b"".join(i.to_bytes(4, "little", signed=True) for i in ids) + extra)
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big") & (2**63 - 1)


def test_fixed_values() -> None:
    # Frozen: if these change, every deployed frontend/master disagrees with the backends.
    assert hash_block(None, [1, 2, 3]) == 518594323323076373
    assert block_cache_keys(list(range(40)), 16) == [5204775919338302762, 5155835417733978706]
    assert block_cache_keys([5, 6, 7, 8, 9, 10, 11, 12], 4, b"tenant-a") == [2331747693564931459, 7516748379421805919]
    assert block_cache_keys([0, -1, 2**31 - 1, 151643], 2) == [7193575026320235898, 5146772266058128715]


@given(st.lists(st.integers(-2**31, 2**31 - 1), max_size=40), st.integers(1, 8), st.binary(max_size=8))
def test_matches_documented_layout(ids: list[int], block_size: int, extra: bytes) -> None:
    expected: list[int] = []
    parent = None
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = reference_hash(parent, ids[start:start + block_size], extra)
        expected.append(parent)
    keys = block_cache_keys(ids, block_size, extra)
    assert keys == expected
    assert all(0 <= k < 2**63 for k in keys)


def test_chaining() -> None:
    block = list(range(100, 116))
    a = block_cache_keys(list(range(16)) + block, 16)
    b = block_cache_keys(list(range(1, 17)) + block, 16)
    assert a[1] != b[1]  # same block after a different prefix
    assert a[1] == hash_block(a[0], block)
    # A shared prefix gives shared leading keys.
    c = block_cache_keys(list(range(16)) + list(range(200, 216)), 16)
    assert c[0] == a[0] and c[1] != a[1]


def test_partial_block_ignored() -> None:
    ids = list(range(37))
    keys = block_cache_keys(ids, 16)
    assert len(keys) == 2
    assert keys == block_cache_keys(ids[:32], 16)
    assert block_cache_keys(ids[:15], 16) == []
    assert block_cache_keys([], 16) == []


def test_extra_key_and_block_boundary_matter() -> None:
    ids = list(range(16))
    assert block_cache_keys(ids, 16, b"x") != block_cache_keys(ids, 16)
    # The token count is hashed, so ids cannot bleed into extra_key.
    assert hash_block(None, [1, 2]) != hash_block(None, [1], (2).to_bytes(4, "little"))


def test_bad_inputs() -> None:
    with pytest.raises(ValueError):
        block_cache_keys([1, 2], 0)
    with pytest.raises(ValueError):
        hash_block(None, [2**31])  # ids are int32 on the wire
    with pytest.raises(ValueError):
        hash_block(-1, [1])


def test_independent_of_hash_seed() -> None:
    code = ("import json; from kvyard.block_keys import block_cache_keys; "
            "print(json.dumps(block_cache_keys(list(range(64)), 16, b'salt')))")
    outputs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
        result = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO,
                                capture_output=True, text=True, check=True)
        outputs.append(json.loads(result.stdout))
    assert outputs[0] == outputs[1] == block_cache_keys(list(range(64)), 16, b"salt")
