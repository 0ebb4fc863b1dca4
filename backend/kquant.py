"""The GGUF's K-quant blocks (Q4_K, Q5_K, Q6_K; Q5_K8 / Q6_K8: Q5_K's and Q6_K's codes widened to a byte each)
as arrays: their bytes in the file, the n16 layout the kernels read (backend/csrc/qlinear_kquant.h) and back,
the float32 they encode, and Q4_K's conversion to Q4_1 blocks. numpy in, numpy out: backend/quant.py wraps the
results in QuantWeight (this module never sees one)."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

QK = 32  # weights per block: Q4_1, Q8_0, and a K-quant's sub-block (backend.quant re-exports it)

Q4_K_BYTES, QK_K = 144, 256  # per 256 weights: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 of nibbles


K_KINDS = ("q4_k", "q5_k", "q6_k", "q5_k8", "q6_k8")  # served in the n16 layout; *8: codes widened to bytes
K_CODE_ROWS = {"q4_k": 16, "q5_k": 20, "q6_k": 24, "q5_k8": 32, "q6_k8": 32}  # n16 code bytes a block and 16 rows / 16
K_FILE_KIND = {"q5_k8": "q5_k", "q6_k8": "q6_k"}  # a served kind → the GGUF type its blocks come from (else its own)
Q5_K_BYTES = 176         # per 256 weights: Q4_K's d, dmin and 12 scale bytes, 32 of top bits, 128 of nibbles
Q6_K_BYTES = 210         # per 256 weights: 128 bytes of low nibbles, 64 of top bits, 16 int8 scales, f16 d


# KQUANTS (backend/config.py) → for each GGUF K-quant type served with its own numbers, the kind it is served in;
# the others are converted (Q4_K to Q4_1, Q5_K and Q6_K requantized to Q8_0). mixed: what AVX2 CPUs run fastest
# without a requantizing step: Q4_K converted, Q5_K's and Q6_K's codes widened to bytes (q5_k8, q6_k8).
KQUANT_CHOICES: dict[str, dict[str, str]] = {
    "native": {"q4_k": "q4_k", "q5_k": "q5_k", "q6_k": "q6_k"},
    "mixed": {"q5_k": "q5_k8", "q6_k": "q6_k8"},
    "convert": {},
}

Blocks = tuple[np.ndarray, np.ndarray, np.ndarray]  # codes, scales, sub-scales (or minimums)


def native_kind(gguf_type: str, kept: Mapping[str, str]) -> str | None:
    """The K-quant kind a GGUF tensor type is served in with its own numbers, or None (converted). kept: one of
    KQUANT_CHOICES (the n16 layout, AVX-512 or AVX2)."""
    return kept.get(gguf_type)


def k_blocks_from_gguf(gguf_type: str, raw: np.ndarray, k: int) -> Blocks:
    """raw: [n, row bytes] uint8 rows of a Q4_K, Q5_K or Q6_K tensor → the same blocks (codes, d, sub-scales),
    "rows" layout (to be laid out n16): Q4_K codes [n, k/2] in Q4_1's nibble order, d [n, k/256, 2] float16
    (d, dmin), sub-scales [n, k/32, 2] uint8 (sc, mn); Q5_K codes [n, k] uint8 (0..31, in order), d and
    sub-scales as Q4_K's; Q6_K codes [n, k] uint8 (0..63, in order), d [n, k/256], scales [n, k/32, 2] int8
    (weights 0-15 and 16-31 of each block)."""
    n, nsb = raw.shape[0], k // QK_K
    if gguf_type in ("q4_k", "q5_k"):
        q5 = gguf_type == "q5_k"
        blocks = np.ascontiguousarray(raw).reshape(n, nsb, Q5_K_BYTES if q5 else Q4_K_BYTES)
        d = blocks[..., 0:4].copy().view(np.float16).reshape(n, nsb, 2)
        sc, mn = _q4_k_scales(blocks[..., 4:16])
        sub = np.stack([sc, mn], axis=-1).astype(np.uint8).reshape(n, nsb * 8, 2)
        if q5:  # nibbles as Q4_K's (after the 32 top-bit bytes); top bits: byte i bit r = run r's weight i
            lo = _q4_k_codes(blocks).reshape(n, nsb * 8, 16)
            tops = (blocks[..., 16:48].reshape(n, nsb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
            q = np.concatenate([lo & 0x0F, lo >> 4], axis=-1) | (tops.reshape(n, nsb * 8, 32) << 4)
            codes = q.astype(np.uint8).reshape(n, k)
        else:
            codes = _q4_k_codes(blocks)
        return codes, d, sub
    if gguf_type == "q6_k":
        blocks = np.ascontiguousarray(raw).reshape(n, nsb, Q6_K_BYTES)
        # Low nibbles: bytes [h*64 + i] hold weight h*128 + i (low half) and h*128 + 64 + i (high half); top
        # bits: bytes [h*32 + i] hold weights h*128 + 32 t + i in bits 2t.
        ql = blocks[..., 0:128].reshape(n, nsb, 2, 1, 64)
        lo = (ql >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
        qh = blocks[..., 128:192].reshape(n, nsb, 2, 1, 32)
        hi = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 0x03
        q = (lo.reshape(n, nsb * 256) | (hi.reshape(n, nsb * 256) << 4)).astype(np.uint8)
        scales = blocks[..., 192:208].copy().view(np.int8).reshape(n, nsb * 8, 2)
        d = blocks[..., 208:210].copy().view(np.float16).reshape(n, nsb)
        return q, d, scales
    raise ValueError(f"{gguf_type} is not a served K-quant")


def _q4_k_scales(sc_raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 packed bytes → the 8 runs' 6-bit scales and minimums: run j < 4 from the low six bits of
    bytes j and j + 4; j ≥ 4 from the nibbles of byte j + 4 plus the top two bits of bytes j − 4 and j."""
    sc_raw = sc_raw.astype(np.uint8)
    sc = np.empty((*sc_raw.shape[:-1], 8), dtype=np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = sc_raw[..., 0:4] & 63
    mn[..., :4] = sc_raw[..., 4:8] & 63
    sc[..., 4:] = (sc_raw[..., 8:12] & 0x0F) | ((sc_raw[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (sc_raw[..., 8:12] >> 4) | ((sc_raw[..., 4:8] >> 6) << 4)
    return sc, mn


def _q4_k_codes(blocks: np.ndarray) -> np.ndarray:
    """[n, nsb, 144] Q4_K blocks (their last 128 bytes the nibbles) → codes [n, k/2] in Q4_1's order (byte j
    of a run: weights j | j+16 << 4). Run 2i is the low nibbles of pair i's 32 bytes, run 2i + 1 the high ones."""
    n, nsb = blocks.shape[:2]
    q = blocks[..., -128:].reshape(n, nsb, 4, 32)
    codes = np.stack([q & 0x0F, q >> 4], axis=3).reshape(n, nsb, 8, 32)
    return (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8).reshape(n, nsb * 8 * 16)


def _groups(t: np.ndarray) -> np.ndarray:
    """[N, ...rest] → [N/16, ...rest, 16]: the output row becomes the innermost (vector lane) axis."""
    g = t.reshape(t.shape[0] // 16, 16, *t.shape[1:])
    return np.ascontiguousarray(np.moveaxis(g, 1, -1))


def _rows_of(t: np.ndarray) -> np.ndarray:
    """_groups undone."""
    r = np.moveaxis(t, -1, 1)
    return np.ascontiguousarray(r).reshape(t.shape[0] * 16, *r.shape[2:])


def k_to_n16(kind: str, qs: np.ndarray, d: np.ndarray, sub: np.ndarray, n: int, k: int) -> Blocks:
    """K-quant "rows" blocks ([n, k]) → n16 (backend/csrc/qlinear_kquant.h): Q4_K codes as Q4_1's n16 [G, nb, 16 j,
    16 n], d [G, nsb, 2, 16], sub-scales [G, nb, 2, 16]; Q5_K codes [G, nb, 20, 16]: Q4_K's nibbles, then 16
    little-endian uint32 words, word n = row n's top bits (bit k: weight k of the block); Q6_K codes
    [G, nb, 24, 16] (rows 0-15: step j, low nibbles of weights 2j | 2j+1 << 4; rows 16-23: pair i, top bits of
    weights 4i..4i+3, 2 bits each), d [G, nsb, 16], scales [G, nb, 2, 16]; Q5_K8 and Q6_K8 (kinds "q5_k8",
    "q6_k8": Q5_K's and Q6_K's "rows" blocks) codes [G, nb, 32, 16]: step j's 32 bytes, row after row, the pair
    of codes k=j, j+16 (uint8) and the int8 pair (q - 32) of k=2j, 2j+1."""
    nb = k // QK
    if kind == "q4_k":
        codes = _groups(qs.reshape(n, nb, 16))                                  # [G, nb, 16 j, 16 n]
    elif kind == "q5_k":
        q = qs.reshape(n, nb, QK)
        nibbles = _groups((q[..., :16] & 0x0F) | ((q[..., 16:] & 0x0F) << 4))  # [G, nb, 16 j, 16 n]
        words = ((q >> 4).astype(np.uint32) << np.arange(QK, dtype=np.uint32)).sum(axis=-1, dtype=np.uint32)
        tops = np.ascontiguousarray(_groups(words)).view(np.uint8).reshape(n // 16, nb, 4, 16)  # words' bytes
        codes = np.concatenate([nibbles, tops], axis=2)
    elif kind == "q5_k8":  # step j: for each row n the codes of k=j and k=j+16
        q = _groups(qs.reshape(n, nb, QK))                                      # [G, nb, 32 k, 16 n]
        codes = np.ascontiguousarray(np.stack([q[:, :, :16], q[:, :, 16:]], axis=-1)).reshape(n // 16, nb, 32, 16)
    elif kind == "q6_k8":  # step j: for each row n the int8 pair (q - 32) of k=2j, 2j+1
        q = _groups(qs.reshape(n, nb, QK)).astype(np.int16) - 32                # [G, nb, 32 k, 16 n]
        pairs = q.reshape(n // 16, nb, 16, 2, 16).transpose(0, 1, 2, 4, 3)    # [G, nb, 16 j, 16 n, 2]
        codes = np.ascontiguousarray(pairs.astype(np.int8)).view(np.uint8).reshape(n // 16, nb, 32, 16)
    else:
        q = _groups(qs.reshape(n, nb, QK))                                      # [G, nb, 32 k, 16 n]
        lows = (q[:, :, 0::2] & 0x0F) | ((q[:, :, 1::2] & 0x0F) << 4)
        tops = (q >> 4).reshape(q.shape[0], nb, 8, 4, 16)
        highs = tops[:, :, :, 0] | (tops[:, :, :, 1] << 2) | (tops[:, :, :, 2] << 4) | (tops[:, :, :, 3] << 6)
        codes = np.concatenate([lows, highs], axis=2).astype(np.uint8)
    return codes, _groups(d), _groups(sub)


def k_to_rows(kind: str, codes: np.ndarray, d: np.ndarray, sub: np.ndarray, n: int, k: int) -> Blocks:
    """k_to_n16 undone."""
    if kind == "q4_k":
        qs = _rows_of(codes).reshape(n, k // 2)
    elif kind == "q5_k":
        g, nb = codes.shape[:2]
        nibbles = codes[:, :, :16]
        words = np.ascontiguousarray(codes[:, :, 16:]).view(np.uint32).reshape(g, nb, 16)     # [G, nb, 16 n]
        tops = ((words[:, :, None, :] >> np.arange(QK, dtype=np.uint32).reshape(1, 1, QK, 1)) & 1).astype(np.uint8)
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=2) | (tops << 4)               # [G, nb, 32 k, 16 n]
        qs = _rows_of(q).reshape(n, k)
    elif kind == "q5_k8":
        g, nb = codes.shape[:2]
        pairs = codes.reshape(g, nb, 16, 16, 2)                                 # [G, nb, 16 j, 16 n, 2]
        qs = _rows_of(np.concatenate([pairs[..., 0], pairs[..., 1]], axis=2)).reshape(n, k)
    elif kind == "q6_k8":
        g, nb = codes.shape[:2]
        pairs = codes.view(np.int8).reshape(g, nb, 16, 16, 2).transpose(0, 1, 2, 4, 3)  # [G, nb, 16 j, 2, 16 n]
        q = (pairs.reshape(g, nb, QK, 16).astype(np.int16) + 32).astype(np.uint8)
        qs = _rows_of(q).reshape(n, k)
    else:
        g, nb = codes.shape[:2]
        q = np.empty((g, nb, QK, 16), dtype=np.uint8)
        q[:, :, 0::2] = codes[:, :, :16] & 0x0F
        q[:, :, 1::2] = codes[:, :, :16] >> 4
        tops = np.stack([(codes[:, :, 16:] >> (2 * t)) & 0x03 for t in range(4)], axis=3).reshape(g, nb, QK, 16)
        qs = _rows_of(q | (tops << 4)).reshape(n, k)
    return qs, _rows_of(d), _rows_of(sub)


def k_dequantize(kind: str, qs: np.ndarray, d: np.ndarray, sub: np.ndarray, n: int, k: int) -> np.ndarray:
    """The float32 [n, k] K-quant "rows" blocks encode, with gguf's reference arithmetic: (d sc) q -
    (dmin mn) for Q4_K and Q5_K, (d sc) (q - 32) for Q6_K."""
    nb = k // QK
    sub = sub.astype(np.float32)  # [n, nb, 2]
    d = np.repeat(d.astype(np.float32), 8, axis=1)   # [n, nb(, 2)]: each super-block's 8 blocks
    if kind in ("q4_k", "q5_k", "q5_k8"):
        if kind == "q4_k":
            qs = qs.reshape(n, nb, 16)
            q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)  # [n, nb, 32]
        else:
            q = qs.reshape(n, nb, QK).astype(np.float32)
        out = (d[..., 0] * sub[..., 0])[..., None] * q - (d[..., 1] * sub[..., 1])[..., None]
    else:
        q = qs.reshape(n, nb, 2, 16).astype(np.float32) - np.float32(32)
        out = (d[..., None] * sub)[..., None] * q
    return np.ascontiguousarray(out, dtype=np.float32).reshape(n, k)


def q4_1_from_q4_k(raw: np.ndarray, n: int, k: int) -> Blocks:
    """Q4_K: each 256 weights are 8 runs of 32 with 6-bit scale sc and minimum m: w = d·sc·q − dmin·m.
    A run is a Q4_1 block with scale d·sc and minimum −dmin·m (rounded to float16 as Q4_1 stores them).
    Returns its codes, scales and minimums."""
    nsb = k // QK_K
    blocks = np.ascontiguousarray(raw).reshape(n, nsb, Q4_K_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)        # [n, nsb, 1]
    dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = _q4_k_scales(blocks[..., 4:16])                                # [n, nsb, 8]
    scale = (d * sc).astype(np.float16).reshape(n, nsb * 8)
    minimum = (-(dmin * mn)).astype(np.float16).reshape(n, nsb * 8)
    return _q4_k_codes(blocks), scale, minimum
