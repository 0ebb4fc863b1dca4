"""Prefix-cache block keys: the backend registers KV blocks under them and the frontend/master routes by them.

A prompt is cut into blocks of `block_size` token ids; only FULL blocks get a key (a trailing
partial block has none). Keys are chained, so a key names the block *and everything before it*:

    key_0 = hash_block(None,    ids[0:B],   extra_key)
    key_i = hash_block(key_i-1, ids[iB:(i+1)B], extra_key)

Byte layout hashed for one block (this is the wire contract; other-language clients reimplement it):

    offset  size      field
    0       8         parent key, unsigned 64-bit BIG-endian; for the first block the root
                      sentinel 0xFFFFFFFFFFFFFFFF (never a real key: keys have the top bit clear)
    8       4         n = number of token ids in the block, unsigned 32-bit LITTLE-endian
    12      4*n       the token ids, each signed 32-bit LITTLE-endian, in order
    12+4n   len(x)    extra_key bytes, verbatim (may be empty; the length prefix above makes the
                      token/extra boundary unambiguous)

    digest = SHA-256(those bytes)
    key    = int.from_bytes(digest[0:8], "big") & 0x7FFF_FFFF_FFFF_FFFF

Images: a block holding any of an image's placeholder tokens appends, after extra_key, the image's
32-byte SHA-256 digest (of the image file's bytes), for each such image in prompt order
(`image_block_salts`). Chaining carries it into every later block, so the same placeholder tokens with a
different image never share a key.

The mask keeps keys non-negative and within int64, so they travel unchanged through protobuf
int64 and JSON (as integers below 2**63). Python's hash() is never used: keys must agree across
processes, machines and PYTHONHASHSEED values.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence

# Parent value hashed for the first block. It has the top bit set, which a real key never has,
# so "no parent" cannot collide with any parent key.
ROOT_PARENT = 0xFFFF_FFFF_FFFF_FFFF
KEY_MASK = 0x7FFF_FFFF_FFFF_FFFF


def hash_block(parent: int | None, token_ids: Sequence[int], extra_key: bytes = b"") -> int:
    """Key of one block given its parent block's key (None for the first block of a sequence)."""
    if parent is not None and not 0 <= parent <= KEY_MASK:
        raise ValueError(f"parent key out of range: {parent!r}")
    parent_value = ROOT_PARENT if parent is None else parent
    n = len(token_ids)
    # struct with an explicit '<' / '>' is endianness-independent of the host; it also range-checks
    # every id into int32, which is what the protocol carries anyway.
    try:
        data = struct.pack(">Q", parent_value) + struct.pack(f"<I{n}i", n, *token_ids) + bytes(extra_key)
    except struct.error as e:
        raise ValueError(f"token ids must be int32: {e}") from None
    digest = hashlib.sha256(data).digest()
    return int.from_bytes(digest[:8], "big") & KEY_MASK


def block_cache_keys(token_ids: Sequence[int], block_size: int, extra_key: bytes = b"",
                     salts: Mapping[int, bytes] | None = None) -> list[int]:
    """Chained keys of every full block of `token_ids`; a trailing partial block gets no key. salts: block
    index → bytes appended to extra_key for that block (image_block_salts)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    keys: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        salt = salts.get(start // block_size, b"") if salts else b""
        parent = hash_block(parent, token_ids[start:start + block_size], extra_key + salt)
        keys.append(parent)
    return keys


def image_block_salts(spans: Sequence[tuple[int, int]], digests: Sequence[bytes], block_size: int) -> dict[int, bytes]:
    """Block index → the digests of the images whose placeholders [start, start + length) it holds
    (spans: each image's (start, length), kvyard.vision_config.image_spans)."""
    salts: dict[int, bytes] = {}
    for (start, length), digest in zip(spans, digests):
        for block in range(start // block_size, (start + length - 1) // block_size + 1):
            salts[block] = salts.get(block, b"") + digest
    return salts
