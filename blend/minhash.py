"""MinHash over token shingles: the donor index's estimate of how much of a chunk's token sequence two
chunks share (:mod:`blend.donors`). Deterministic across processes and machines (a fixed splitmix64
hash family, no Python ``hash``), so a signature saved by one process matches another's.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

SHINGLE = 5  # token ids per shingle
NUM_HASHES = 128  # MinHash signature length: std. error of the estimate ~ sqrt(J(1-J)/128) <= 0.045
MINHASH_BLOCK = 4096  # shingles hashed at once: bounds minhash's working set to (H, 4096) uint64 = 4 MiB
_SEED_BASE = 0x6B76626C656E6421  # b"kvblend!": the fixed seed of the hash family
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, element-wise over uint64 (wraps mod 2**64)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


_SEEDS = _mix(np.arange(NUM_HASHES, dtype=np.uint64) + np.uint64(_SEED_BASE))  # (H,)


def shingle_hashes(token_ids: Sequence[int], shingle: int = SHINGLE) -> np.ndarray:
    """One uint64 per window of ``shingle`` consecutive token ids (the whole chunk if shorter).

    Args:
        token_ids: the chunk's tokens.
        shingle: ids per window.

    Returns:
        (S,) uint64, S = max(1, n - shingle + 1); empty for an empty chunk.
    """
    ids = np.asarray(token_ids, dtype=np.uint64)  # (n,)
    if ids.size == 0:
        return np.zeros(0, dtype=np.uint64)
    w = min(shingle, ids.size)
    s = ids.size - w + 1
    h = np.full(s, np.uint64(w), dtype=np.uint64)  # (S,)
    for t in range(w):  # h = mix(h ^ id) chained over the window: order-sensitive
        h = _mix(h ^ ids[t:t + s])
    return h


def minhash(token_ids: Sequence[int], shingle: int = SHINGLE) -> np.ndarray:
    """MinHash signature of a chunk's shingle set.

    Args:
        token_ids: the chunk's tokens.
        shingle: ids per shingle.

    Returns:
        (NUM_HASHES,) uint64; all-ones for an empty chunk (similar to nothing).
    """
    sh = shingle_hashes(token_ids, shingle)  # (S,)
    sig = np.full(NUM_HASHES, _M64, dtype=np.uint64)  # (H,)
    for b in range(0, sh.size, MINHASH_BLOCK):
        block = sh[b : b + MINHASH_BLOCK]  # (<=B,)
        np.minimum(sig, _mix(block[None, :] ^ _SEEDS[:, None]).min(axis=1), out=sig)  # (H,)
    return sig


def jaccard_estimate(a: np.ndarray, b: np.ndarray) -> float:
    """Estimated Jaccard similarity of two signatures.

    Args:
        a, b: (NUM_HASHES,) signatures from :func:`minhash`.

    Returns:
        The share of equal minima, in [0, 1].
    """
    return float(np.mean(a == b))
